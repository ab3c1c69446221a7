"""Tree-masked verify attention, one pass over each request's prefix: the default kernel.

The same semantics as triton_verify.py (TARGET_VERIFY: node i of request b attends to
the request's cached prefix, positions 0 .. seq_len - n - 1 through ``req_to_token``,
and to the tree nodes ``tree_mask[b, i]`` marks, each key subject to the sliding window
``k_pos > q_pos - window``, in one softmax), without its width invariance: that kernel
walks decode's split schedule for every node, so that a verify row rounds as a decode
row, which only pays where the matmuls are width-invariant too (``--batch-invariant``,
``AttentionSpec.width_invariant``). With the default matmuls a verify row's logits
differ from decode's in the last bits anyway, and decode's schedule costs verify dearly:
16 splits of a 512-key prefix for every node's partial (at 64 requests x 5 nodes, 42 MB
of partials a layer written and read back against 33 MB of K/V), the prefix read again
for every two nodes, and one online-softmax step per node for the blocks holding the
tree (H200, bench/attention_layer.py: 133 us a layer against decode's 24 at 64 requests).

Here a program serves up to NODES tree nodes of one request (their G heads each:
``BLOCK_G`` = NODES x G rows, up to ``MAX_TILE`` float32 accumulators, so one program
takes a whole 5-node chain of Gemma 4's 8 heads at head_dim 256 and 512 in bfloat16),
walks its share of the prefix once for all of them, and the tree's n keys as one more
block whose visibility per row is the tree mask. A request's prefix is cut into
contiguous splits, one a program along the splits: as many programs as bring the launch
to ``TARGET_PROGRAMS``, and a request at most one split for every ``split_blocks``
blocks of its prefix (and the scratch's split count); the tree block goes to the first.
Each split's partial and log-sum-exp go to decode's scratch, and decode's combine
(triton_decode.py) merges them, a row's count in ``partial_splits``.

Capture-safe: the launches read only device tensors and host shapes, never sync,
allocate nothing, and their grids depend on B, n, the head counts and the scratch's
shape alone: an eager run and a graph replay of the same inputs are bitwise equal. A
request's splits depend on its prefix and on the batch size, so a padded graph batch
may cut a request's prefix into fewer splits than its eager twin, as the default
matmuls round its rows differently: only width-invariant runs (``triton_verify``)
promise those bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphrt.devices.cuda.triton_decode import (
    MIN_DOT,
    _attend_block,
    _load_kv_block,
    _store_partial,
    combine_splits,
    dot_precision,
)
from graphrt.devices.cuda.triton_verify import (
    _program_queries,
    _program_request,
    block_and_window,
    check_tree_inputs,
    tree_kernel_args,
)

# Measured on the H200 (bench/attention_layer.py: Gemma 4's 8 heads on one KV head,
# prefix 512, 5-node chains, one layer; 2026-12-04), this kernel at stop 44 (one split a
# program, with this MAX_TILE): us at 1 / 8 / 64 requests, head_dim 256: 11.4 / 12.4 /
# 33.3 against the width-invariant kernel's 12.8 / 21.4 / 132.6 and decode's 8.6 / 9.1 /
# 23.6; head_dim 512: 18.6 / 21.2 / 63.7 against 18.5 / 43.9 / 269.4 and decode's 11.8 /
# 12.5 / 49.2. Programs looping over a request's splits (cut by its prefix alone, then by
# the batch's fill) took 13.1 / 14.3 / 40.4 and 21.9 / 28.3 / 95.8 (stop 45).
#
# The most float32 accumulators (rows x padded head_dim) a program holds: 128 rows at
# head_dim 256, 64 at 512: a 5-node chain of 8 heads in one program either way. Half
# that (32 rows at 512: two programs a chain, the prefix read twice) took 134 us at 64
# requests against 63.7. A program at the limit runs 8 warps, under it 4.
MAX_TILE = 32768
# The most bytes of a program's query tile in the cache's dtype (rows x padded head_dim):
# shared memory holds tiles of that size several times over (the compiler's layout
# changes). bfloat16 at MAX_TILE asks 128 KiB at head_dim 512; float32 there asked
# 264 KiB (a loop over splits, stop 44), past an H200 block's 227, and takes half the rows.
MAX_QUERY_BYTES = 64 * 1024
# Programs a launch aims at (requests x node groups x KV heads x programs along the
# splits; an H200 has 132 SMs), the last a power of two. Not more: splitting 64 requests'
# 512-token prefixes 16 ways took 77 us a layer against 42 four ways (head_dim 256, an
# earlier MAX_TILE), the partials' traffic growing with the splits.
TARGET_PROGRAMS = 256


@triton.jit
def _onepass_partial_kernel(
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
    PartialSplits,  # (>= B*n,) int32: each row's split count, for the combine
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
    max_splits,  # S: the scratch's splits
    KV_GROUP: tl.constexpr,  # query heads per KV head
    NODES: tl.constexpr,  # tree nodes a program serves
    BLOCK_G: tl.constexpr,  # NODES * KV_GROUP padded to a power of two >= MIN_DOT
    SPLIT_BLOCKS: tl.constexpr,  # a request's splits: one at most for this many blocks
    BLOCK_N: tl.constexpr,  # prefix keys a loop step
    BLOCK_T: tl.constexpr,  # n padded to a power of two >= MIN_DOT
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM padded to a power of two >= MIN_DOT
    DOT_PRECISION: tl.constexpr,
):
    kv_h = tl.program_id(1)
    split = tl.program_id(2)
    # (Not "_" for the unused first node: Triton types a name once, and "_" is a row
    # vector in the branch below.)
    b, _first_node, prefix = _program_request(SeqLens, num_nodes, NODES)
    # The request's first key any of its nodes sees, whichever program serves them (every
    # program of a request cuts its prefix alike): its root's (node 0, the least position).
    # One scalar: the minimum of the tree's positions as a vector cost 0.6 KB more spills
    # a thread at head_dim 512 (a version that looped over splits).
    root_pos = tl.load(Positions + b * num_nodes).to(tl.int32)
    lo = tl.where(window > 0, tl.maximum(root_pos + 1 - window, 0), 0)

    # The request's splits: one a program along the splits (P of them), contiguous runs of
    # per_split blocks (the last may be shorter), at most cdiv(blocks, SPLIT_BLOCKS) of
    # them, one at least, at most the scratch's, none empty. They depend on the request's
    # tree and prefix and on P (the batch's fill).
    first_block = tl.minimum(lo, prefix) // BLOCK_N
    end_block = tl.cdiv(prefix, BLOCK_N)
    blocks = tl.maximum(end_block - first_block, 0)
    wanted = tl.minimum(tl.cdiv(blocks, SPLIT_BLOCKS), tl.num_programs(2))
    per_split = tl.cdiv(blocks, tl.minimum(tl.maximum(wanted, 1), max_splits))
    num_splits = tl.maximum(tl.cdiv(blocks, tl.maximum(per_split, 1)), 1)
    # One split a program, no loop over splits: a loop keeps the query tile and a split's
    # state live across its iterations, which spilled 1.4 KB a thread at head_dim 512
    # against 0.4 without (8 warps, Triton 3.6) and took 192 KiB of shared memory, not 128.
    # Programs past the request's splits (P is the batch's, the splits the request's) load
    # nothing more.
    if split < num_splits:
        _, req, _, _, _, node, mask_g, rows, heads, offs_d, mask_d, q = _program_queries(
            Q, ReqPoolIndices, SeqLens, num_nodes, stride_qt, stride_qh, K.dtype.element_ty,
            KV_GROUP, NODES, BLOCK_G, HEAD_DIM, BLOCK_D,
        )  # fmt: skip
        if (kv_h == 0) & (split == 0):
            tl.store(PartialSplits + rows, num_splits, mask=mask_g)
        q_pos = tl.load(Positions + rows, mask=mask_g, other=0).to(tl.int32)
        # Key position k is visible to a row iff k >= row_lo (k > q_pos - window).
        row_lo = tl.where(window > 0, tl.maximum(q_pos + 1 - window, 0), 0)
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)  # running max of each row's scores
        l_sum = tl.zeros([BLOCK_G], tl.float32)  # running sum of exp(score - m)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        start = first_block + split * per_split
        for j in range(start, tl.minimum(start + per_split, end_block)):
            offs_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
            cached = (offs_n >= lo) & (offs_n < prefix)
            slots = tl.load(ReqToToken + req * stride_req + offs_n, mask=cached, other=0)
            k, v = _load_kv_block(
                K, V, slots.to(tl.int64), cached, kv_h, offs_d, mask_d, stride_kt, stride_kh,
                stride_vt, stride_vh,
            )  # fmt: skip
            visible = cached[None, :] & (offs_n[None, :] >= row_lo[:, None])
            m, l_sum, acc = _attend_block(q, k, v, visible, m, l_sum, acc, sm_scale, DOT_PRECISION)
        if split == 0:
            # The tree's n keys, visible by the mask's row. In split 0: a node sees itself,
            # so a real row's first split is never empty, and the combine (a row's first
            # split alone, then the others in chunks) starts from its true maximum; from
            # an empty one (lse -inf, taken as 0) scores below about -87 underflowed.
            offs_t = tl.arange(0, BLOCK_T)
            mask_t = offs_t < num_nodes
            tree_rows = b * num_nodes + offs_t
            k_pos = tl.load(Positions + tree_rows, mask=mask_t, other=0).to(tl.int32)
            slots = tl.load(OutCacheLoc + tree_rows, mask=mask_t, other=0).to(tl.int64)
            k, v = _load_kv_block(
                K, V, slots, mask_t, kv_h, offs_d, mask_d, stride_kt, stride_kh, stride_vt,
                stride_vh,
            )  # fmt: skip
            marked = tl.load(
                TreeMask + b * stride_mb + node[:, None] * stride_mi + offs_t[None, :],
                mask=mask_g[:, None] & mask_t[None, :],
                other=0,
            )  # (BLOCK_G, BLOCK_T)
            visible = (marked != 0) & (k_pos[None, :] >= row_lo[:, None])
            m, l_sum, acc = _attend_block(q, k, v, visible, m, l_sum, acc, sm_scale, DOT_PRECISION)
        _store_partial(
            PartialOut, PartialLse, rows, split, heads, mask_g, offs_d, mask_d, m, l_sum, acc,
            stride_pot, stride_poh, stride_pos, stride_plt, stride_plh,
        )  # fmt: skip


def split_blocks(block_d: int) -> int:
    """A request takes at most one split for every this many prefix blocks: one up to
    head_dim 256 (more splits fill the GPU at small batches: 11.8 against 13.6 us a layer
    at one request), two at 512, whose partials cost twice as much to write and combine
    (26 against 36 us at 8 requests; H200, stop 44's first one-pass version)."""
    return max(1, block_d // 256)


def program_nodes(group: int, num_nodes: int, block_d: int, element_size: int) -> tuple[int, int]:
    """(tree nodes a program serves, BLOCK_G) for KV groups of ``group`` query heads,
    trees of ``num_nodes``, head_dim padded to ``block_d`` and a cache of
    ``element_size``-byte values: as many nodes as fit in ``MAX_TILE`` accumulators and
    ``MAX_QUERY_BYTES``, one at least."""
    rows = min(MAX_TILE // block_d, MAX_QUERY_BYTES // (block_d * element_size))
    nodes = max(1, min(num_nodes, rows // group))
    return nodes, max(triton.next_power_of_2(nodes * group), MIN_DOT)


def onepass_verify_attention(
    q: torch.Tensor,  # (B*n, H, D), any float dtype
    k_buffer: torch.Tensor,  # (num_slots + 1, Hkv, D)
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,  # (max_reqs + 1, max_ctx) int64
    req_pool_indices: torch.Tensor,  # (B,) int64
    seq_lens: torch.Tensor,  # (B,) int32: prefix + n
    positions: torch.Tensor,  # (B*n,) int64; a request's node 0 (its root) the least
    out_cache_loc: torch.Tensor,  # (B*n,) int64, the nodes' K/V already stored there
    tree_mask: torch.Tensor,  # (B, n, n) bool: node j is node i or its ancestor
    out: torch.Tensor,  # (B*n, H, D), written, q's dtype
    partial_out: torch.Tensor,  # (>= B*n, H, S, D) float32 scratch
    partial_lse: torch.Tensor,  # (>= B*n, H, S) float32 scratch
    partial_splits: torch.Tensor,  # (>= B*n,) int32 scratch
    sm_scale: float,
    sliding_window: int | None = None,
    block_n: int | None = None,  # prefix keys a loop step (>= 16); None: decode's default
    programs: int | None = None,  # programs along the splits (<= S); None: TARGET_PROGRAMS'
) -> torch.Tensor:
    """Each tree node's attention over its prefix and its tree ancestors; returns ``out``.
    The scratch's third dimension S bounds a request's splits, the programs along the
    splits too (a split each). Shapes are checked on the host only (no device sync), so
    this may be captured."""
    bs, num_nodes = tree_mask.shape[:2]
    num_rows, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    max_splits = partial_out.shape[2]
    check_tree_inputs(
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, positions,
        out_cache_loc, tree_mask, out, partial_out, partial_lse, partial_splits,
    )  # fmt: skip
    if num_rows == 0:
        return out

    block_d = max(triton.next_power_of_2(head_dim), MIN_DOT)
    block_n, window = block_and_window(head_dim, k_buffer, block_n, sliding_window)
    group = num_heads // num_kv_heads
    nodes, block_g = program_nodes(group, num_nodes, block_d, k_buffer.element_size())
    node_programs = bs * triton.cdiv(num_nodes, nodes)
    if programs is None:
        wanted = triton.cdiv(TARGET_PROGRAMS, node_programs * num_kv_heads)
        programs = triton.next_power_of_2(wanted)
    programs = max(1, min(programs, max_splits))

    args = tree_kernel_args(
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, positions,
        out_cache_loc, tree_mask, partial_out, partial_lse, partial_splits, sm_scale, window,
    )  # fmt: skip
    _onepass_partial_kernel[(node_programs, num_kv_heads, programs)](
        *args,
        max_splits,
        KV_GROUP=group,
        NODES=nodes,
        BLOCK_G=block_g,
        SPLIT_BLOCKS=split_blocks(block_d),
        BLOCK_N=block_n,
        BLOCK_T=max(triton.next_power_of_2(num_nodes), MIN_DOT),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        DOT_PRECISION=dot_precision(k_buffer.dtype),
        num_warps=8 if block_g * block_d >= MAX_TILE else 4,
        num_stages=2,
    )
    # A row has one split at least: the combine takes the first alone, the others in
    # chunks (a first pass over a fixed count, as decode's 16, would need empty partials
    # stored up to it, which at 64 requests cost more than they save).
    return combine_splits(partial_out, partial_lse, partial_splits, out, short_splits=1)
