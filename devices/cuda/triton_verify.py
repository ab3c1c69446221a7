"""Tree-masked verify attention in Triton: speculative decoding's TARGET_VERIFY step.

Each of B requests carries a tree of n draft nodes (node 0 the root), flattened
request-major into rows r = b * n + i. Their K/V are already in the token pool
at ``out_cache_loc``. Node i attends to its request's cached prefix (positions
0 .. seq_len - n - 1, slots from ``req_to_token``) and to the tree nodes j that
``tree_mask[b, i, j]`` marks (itself and its ancestors), each key subject to
the sliding window ``k_pos > q_pos - window``, in one softmax.

Width invariance: node i's token is computed exactly as decode would compute it once
its path were accepted. Stage 1 runs decode's grid, one program per (node row, KV
head, split), B*n x Hkv x S, over the keys decode would see, positions
[lo, q_pos], split into decode's S chunks and walked in decode's BLOCK_N blocks with
triton_decode.py's building blocks (q loading, K/V blocks, the online-softmax step,
the partial store). Only where a key's slot comes from differs: the token table below
the tree, the node's path (its ancestor at that depth, found through the tree-mask
row) from the tree on. Stage 2 is decode's log-sum-exp combine. So a verify row's
output equals decode's bit for bit, and greedy speculative output equals plain
decoding's wherever the matmuls are width-invariant too (--batch-invariant,
ops.INVARIANT_OPS). The n nodes of a request each re-read the shared prefix, mostly
from L2 at n <= 16.

Capture-safe: the launches read only device tensors and host shapes, never
sync, allocate nothing (the caller owns ``out`` and the scratch), and their
grids depend on B, n, the head counts and the scratch's fixed split count
alone, so an eager run and a graph replay of the same inputs are bitwise equal.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphrt.devices.cuda.triton_decode import (
    MIN_DOT,
    _attend_block,
    _load_kv_block,
    _load_q_group,
    _store_partial,
    check_paged_inputs,
    combine_splits,
    default_block_n,
)


@triton.jit
def _verify_partial_kernel(
    Q,  # (B*n, H, D)
    K,  # (num_slots + 1, Hkv, D)
    V,
    ReqToToken,  # (max_reqs + 1, max_ctx)
    ReqPoolIndices,  # (B,)
    SeqLens,  # (B,) prefix + n
    Positions,  # (B*n,)
    OutCacheLoc,  # (B*n,) the tree nodes' slots
    TreeMask,  # (B, n, n) uint8 view of the bool mask
    PartialOut,  # (>= B*n, H, S, D) float32
    PartialLse,  # (>= B*n, H, S) float32
    sm_scale,
    window,  # 0 = no sliding window
    num_nodes,  # n
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_req,
    stride_mb,
    stride_mi,
    stride_pot,
    stride_poh,
    stride_pos,
    stride_plt,
    stride_plh,
    KV_GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_G: tl.constexpr,  # KV_GROUP padded to a power of two >= MIN_DOT
    NUM_KV_SPLITS: tl.constexpr,  # S, decode's
    BLOCK_N: tl.constexpr,  # keys per loop step, decode's
    BLOCK_T: tl.constexpr,  # n padded to a power of two
    HEAD_DIM: tl.constexpr,  # constant, so K/V rows load as 16-byte vectors
    BLOCK_D: tl.constexpr,  # HEAD_DIM padded to a power of two >= MIN_DOT
    DOT_PRECISION: tl.constexpr,
):
    row = tl.program_id(0)
    kv_h = tl.program_id(1)
    split = tl.program_id(2)
    b = row // num_nodes
    node = row - b * num_nodes

    req = tl.load(ReqPoolIndices + b).to(tl.int64)
    # Padding rows may carry seq_len < n: their prefix is empty, not negative.
    prefix = tl.maximum(tl.load(SeqLens + b).to(tl.int32) - num_nodes, 0)
    q_pos = tl.load(Positions + row).to(tl.int32)
    # The keys decode would see for this token: positions [lo, q_pos], split as decode
    # splits a sequence of q_pos + 1 tokens (key j is visible iff j > q_pos - window).
    seq_len = q_pos + 1
    lo = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    chunk = tl.cdiv(seq_len - lo, NUM_KV_SPLITS)
    start = lo + split * chunk
    end = tl.minimum(start + chunk, seq_len)

    # Position p >= prefix is the node's ancestor at depth p - prefix (or the node itself):
    # the tree node j with tree_mask[b, node, j] whose position is p.
    node_rows = b * num_nodes  # row of the request's root
    offs_t = tl.arange(0, BLOCK_T)
    mask_t = offs_t < num_nodes
    tree_slots = tl.load(OutCacheLoc + node_rows + offs_t, mask=mask_t, other=0).to(tl.int64)
    tree_pos = tl.load(Positions + node_rows + offs_t, mask=mask_t, other=-1).to(tl.int32)
    in_tree = tl.load(TreeMask + b * stride_mb + node * stride_mi + offs_t, mask=mask_t, other=0)
    tree_pos = tl.where(in_tree != 0, tree_pos, -1)  # (BLOCK_T,) -1: not on the path

    q, heads, mask_g, offs_d, mask_d = _load_q_group(
        Q, row, kv_h, stride_qt, stride_qh, K.dtype.element_ty, KV_GROUP, BLOCK_G, HEAD_DIM, BLOCK_D
    )  # (BLOCK_G, BLOCK_D)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)  # running max of each head's scores
    l_sum = tl.zeros([BLOCK_G], tl.float32)  # running sum of exp(score - m)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    # Decode's loop (triton_decode._attend_cached), but a key's slot comes from the token
    # table before the tree and from the node's path after it: the same blocks in the same
    # order, so a node's output equals decode's for that token bit for bit.
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        cached = tl.load(
            ReqToToken + req * stride_req + offs_n, mask=mask_n & (offs_n < prefix), other=0
        ).to(tl.int64)
        on_path = offs_n[:, None] == tree_pos[None, :]  # (BLOCK_N, BLOCK_T): one match at most
        path = tl.max(tl.where(on_path, tree_slots[None, :], 0), axis=1)
        # Trees whose positions skip (tests' gapped trees) leave positions with no ancestor:
        # not visible. MTP trees have one at every depth, so this is decode's mask there.
        visible = mask_n & ((offs_n < prefix) | (tl.max(on_path.to(tl.int32), axis=1) > 0))
        slots = tl.where(offs_n < prefix, cached, path)
        k, v = _load_kv_block(
            K, V, slots, visible, kv_h, offs_d, mask_d, stride_kt, stride_kh, stride_vt, stride_vh
        )
        m, l_sum, acc = _attend_block(q, k, v, visible, m, l_sum, acc, sm_scale, DOT_PRECISION)
    _store_partial(
        PartialOut, PartialLse, row, split, heads, mask_g, offs_d, mask_d, m, l_sum, acc,
        stride_pot, stride_poh, stride_pos, stride_plt, stride_plh,
    )  # fmt: skip


def tree_verify_attention(
    q: torch.Tensor,  # (B*n, H, D), any float dtype
    k_buffer: torch.Tensor,  # (num_slots + 1, Hkv, D)
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,  # (max_reqs + 1, max_ctx) int64
    req_pool_indices: torch.Tensor,  # (B,) int64
    seq_lens: torch.Tensor,  # (B,) int32: prefix + n
    positions: torch.Tensor,  # (B*n,) int64
    out_cache_loc: torch.Tensor,  # (B*n,) int64, the nodes' K/V already stored there
    tree_mask: torch.Tensor,  # (B, n, n) bool: node j is node i or its ancestor
    out: torch.Tensor,  # (B*n, H, D), written, q's dtype
    partial_out: torch.Tensor,  # (>= B*n, H, S, D) float32 scratch
    partial_lse: torch.Tensor,  # (>= B*n, H, S) float32 scratch
    sm_scale: float,
    sliding_window: int | None = None,
    block_n: int | None = None,  # keys per loop step (>= 16); None: decode's default_block_n
) -> torch.Tensor:
    """Each tree node's attention over its prefix and its tree ancestors; returns ``out``.

    The split count S is the scratch's third dimension, decode's. Shapes are checked on
    the host only (no device sync), so this may be captured.
    """
    bs, num_nodes = tree_mask.shape[:2]
    num_rows, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    num_splits = partial_out.shape[2]
    assert tree_mask.shape == (bs, num_nodes, num_nodes) and tree_mask.dtype == torch.bool
    assert num_rows == bs * num_nodes, f"{num_rows} query rows for {bs} trees of {num_nodes}"
    assert req_pool_indices.shape == seq_lens.shape == (bs,)
    assert positions.shape == out_cache_loc.shape == (num_rows,)
    check_paged_inputs(q, k_buffer, v_buffer, req_to_token, out, partial_out, partial_lse)
    assert tree_mask.stride(2) == 1
    for t in (req_pool_indices, seq_lens, positions, out_cache_loc):
        assert t.stride(0) == 1
    if num_rows == 0:
        return out

    block_d = max(triton.next_power_of_2(head_dim), MIN_DOT)
    if block_n is None:
        block_n = default_block_n(head_dim, k_buffer.element_size())
    assert block_n >= MIN_DOT and block_n == triton.next_power_of_2(block_n), block_n
    window = 0 if sliding_window is None else int(sliding_window)
    assert window >= 0, f"sliding_window must be positive, got {sliding_window}"
    group = num_heads // num_kv_heads

    _verify_partial_kernel[(num_rows, num_kv_heads, num_splits)](
        q,
        k_buffer,
        v_buffer,
        req_to_token,
        req_pool_indices,
        seq_lens,
        positions,
        out_cache_loc,
        tree_mask.view(torch.uint8),  # same bytes; sidesteps Triton's 1-bit pointers
        partial_out,
        partial_lse,
        float(sm_scale),
        window,
        num_nodes,
        q.stride(0),
        q.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        req_to_token.stride(0),
        tree_mask.stride(0),
        tree_mask.stride(1),
        partial_out.stride(0),
        partial_out.stride(1),
        partial_out.stride(2),
        partial_lse.stride(0),
        partial_lse.stride(1),
        KV_GROUP=group,
        BLOCK_G=max(triton.next_power_of_2(group), MIN_DOT),
        NUM_KV_SPLITS=num_splits,
        BLOCK_N=block_n,
        BLOCK_T=triton.next_power_of_2(num_nodes),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        # float32 caches keep float32 products (tf32 would cost ~1e-3 relative);
        # the precision only applies to float32 operands, so 16-bit caches ignore it.
        DOT_PRECISION="ieee" if k_buffer.dtype == torch.float32 else "tf32",
        num_warps=4,
        num_stages=2,
    )
    return combine_splits(partial_out, partial_lse, out)
