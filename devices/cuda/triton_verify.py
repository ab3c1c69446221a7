"""Tree-masked verify attention in Triton: speculative decoding's TARGET_VERIFY step.

Each of B requests carries a tree of n draft nodes (node 0 the root), flattened
request-major into rows r = b * n + i. Their K/V are already in the token pool
at ``out_cache_loc``. Node i attends to its request's cached prefix (positions
0 .. seq_len - n - 1, slots from ``req_to_token``) and to the tree nodes j that
``tree_mask[b, i, j]`` marks (itself and its ancestors), each key subject to
the sliding window ``k_pos > q_pos - window``, in one softmax.

Width invariance: node i's token is computed exactly as decode would compute it once
its path were accepted. Stage 1 runs decode's split schedule: BLOCK_N blocks aligned
to absolute positions, dealt to the S splits cyclically (triton_decode.py), S being
decode's count for the node's token (a program whose nodes straddle a length where
splits double walks each schedule for its own rows), walked with decode's building
blocks (K/V blocks, the online-softmax step, the partial store). Only where a key's
slot comes from differs: the token table below the tree, the node's path (its
ancestor at that depth, found through the tree-mask row) from the tree on. Stage 2 is
decode's log-sum-exp combine. So a verify row's output equals decode's bit for bit,
and greedy speculative output equals plain decoding's wherever the matmuls are
width-invariant too (--batch-invariant, ops.INVARIANT_OPS).

Work decomposition: one program per (group of NODES tree nodes of a request, KV head,
p < P), serving splits p, p + P, ... as decode's programs do. Decode pads a KV head's
G query heads to 16 rows for the tensor cores; a verify program fills those rows
with the G heads of NODES = 16 // G nodes (2 for
Gemma 4's 8; PACK_MIN_PROGRAMS may keep small batches at one node a program), so a
prefix block is read once for them where each node read it (at 64 requests x 5
nodes, the prefix re-reads made verify attention 8.6x decode's time a layer). Wider
programs (64 rows, wgmma) were measured on the H200: slower, and their rows did not
round as decode's. Each row is still computed as decode computes it: a key visible to
another row of the program but not to this one scores -inf (weight exactly 0), and a
block none of a row's keys fall in leaves its running state as it was. Blocks holding
tree positions take one step per node, with that node's own path keys (a tree's
nodes at one depth differ), the other rows kept.

Capture-safe: the launches read only device tensors and host shapes, never
sync, allocate nothing (the caller owns ``out`` and the scratch), and their
grids depend on B, n, the head counts and the scratch's shape alone, so an eager
run and a graph replay of the same inputs are bitwise equal.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphrt.devices.cuda.triton_decode import (
    MIN_DOT,
    NUM_KV_SPLITS,
    _attend_block,
    _first_block,
    _load_kv_block,
    _row_splits,
    _store_partial,
    check_paged_inputs,
    combine_splits,
    default_block_n,
    dot_precision,
    min_splits,
    split_constants,
    split_programs,
)

# Programs one node a program would launch (rows x KV heads x splits) from which
# programs serve several nodes; each row is computed as decode computes it either way, so
# the choice may follow the batch. Measured on the H200 (bench/attention_layer.py, 5-node
# chains, Gemma 4's 8 heads on one KV head, prefix 512, one layer, us, one node a program
# / packed; 2026-12-03): head_dim 256: 11.1 / 14.9 at 1 request (80 programs), 15.5 / 16.8
# at 4 (320), 23.7 / 17.9 at 8 (640), 157.9 / 111.9 at 64; head_dim 512: 18.2 / 26.9,
# 25.9 / 27.8, 41.1 / 31.7, 296.5 / 218.6. Few programs leave SMs idle, and packing halves
# them again: one node a program below 640.
PACK_MIN_PROGRAMS = 640


@triton.jit
def _node_kv(
    K, V, OutCacheLoc, Positions, TreeMask, b, node, cached, offs_n, in_range, in_prefix,
    num_nodes, kv_h, offs_d, mask_d, stride_kt, stride_kh, stride_vt, stride_vh, stride_mb,
    stride_mi, BLOCK_T: tl.constexpr,
):  # fmt: skip
    """The K/V block ``node`` sees at keys ``offs_n``: below the prefix the token table's
    slots (``cached``), from the tree on its path's (its ancestor at that position, or
    itself). -> (k, v, known): ``known`` marks keys that exist for the node."""
    node_rows = b * num_nodes  # row of the request's root
    offs_t = tl.arange(0, BLOCK_T)
    mask_t = offs_t < num_nodes
    tree_slots = tl.load(OutCacheLoc + node_rows + offs_t, mask=mask_t, other=0).to(tl.int64)
    tree_pos = tl.load(Positions + node_rows + offs_t, mask=mask_t, other=-1).to(tl.int32)
    in_tree = tl.load(TreeMask + b * stride_mb + node * stride_mi + offs_t, mask=mask_t, other=0)
    tree_pos = tl.where(in_tree != 0, tree_pos, -1)  # (BLOCK_T,) -1: not on the path
    on_path = offs_n[:, None] == tree_pos[None, :]  # (BLOCK_N, BLOCK_T): one match at most
    path = tl.max(tl.where(on_path, tree_slots[None, :], 0), axis=1)
    # Trees whose positions skip (tests' gapped trees) leave positions with no ancestor:
    # not visible. MTP trees have one at every depth, so this is decode's mask there.
    known = in_range & (in_prefix | (tl.max(on_path.to(tl.int32), axis=1) > 0))
    slots = tl.where(in_prefix, cached, path)
    k, v = _load_kv_block(
        K, V, slots, known, kv_h, offs_d, mask_d, stride_kt, stride_kh, stride_vt, stride_vh
    )
    return k, v, known


@triton.jit
def _keep_unseen(visible, step, m, l_sum, acc):
    """``step`` (the block's new m, l_sum, acc) for rows that see a key of the block, the
    old state for rows that see none: decode never walks a block its row sees nothing
    of, so such a row's state must not pass through the step's arithmetic (exact as
    that would be wherever exp(0) is exactly 1)."""
    seen = tl.max(visible.to(tl.int32), 1) > 0  # (BLOCK_G,)
    m_new, l_new, acc_new = step
    return (
        tl.where(seen, m_new, m),
        tl.where(seen, l_new, l_sum),
        tl.where(seen[:, None], acc_new, acc),
    )


@triton.jit
def _program_request(SeqLens, num_nodes, NODES: tl.constexpr):
    """A verify program's request b and its first node (grid: B x node groups, ...), and
    the request's cached prefix (its seq_len less the tree's n nodes)."""
    groups = tl.cdiv(num_nodes, NODES)
    b = tl.program_id(0) // groups
    first_node = (tl.program_id(0) % groups) * NODES
    # Padding rows may carry seq_len < n: their prefix is empty, not negative.
    prefix = tl.maximum(tl.load(SeqLens + b).to(tl.int32) - num_nodes, 0)
    return b, first_node, prefix


@triton.jit
def _program_queries(
    Q, ReqPoolIndices, SeqLens, num_nodes, stride_qt, stride_qh, dtype: tl.constexpr,
    KV_GROUP: tl.constexpr, NODES: tl.constexpr, BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """A verify program's request and rows, grid (B x node groups, KV heads, ...): row g is
    head g % G of node first_node + g // G. -> (b, req, prefix, first_node, row_node,
    node (clamped to the tree), mask_g, rows, heads, offs_d, mask_d, q (BLOCK_G, BLOCK_D)
    in ``dtype``, as decode's ``_load_q_group``; rows past the program's nodes are zero
    queries, never stored)."""
    b, first_node, prefix = _program_request(SeqLens, num_nodes, NODES)
    kv_h = tl.program_id(1)
    req = tl.load(ReqPoolIndices + b).to(tl.int64)
    offs_g = tl.arange(0, BLOCK_G)
    row_node = offs_g // KV_GROUP  # the row's node within the program
    node = first_node + row_node
    mask_g = (row_node < NODES) & (node < num_nodes)
    node = tl.minimum(node, num_nodes - 1)
    rows = b * num_nodes + node  # (BLOCK_G,) query rows
    heads = kv_h * KV_GROUP + offs_g % KV_GROUP
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q = tl.load(
        Q + rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask_g[:, None] & mask_d[None, :],
        other=0.0,
    ).to(dtype)
    return b, req, prefix, first_node, row_node, node, mask_g, rows, heads, offs_d, mask_d, q


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
    KV_GROUP: tl.constexpr,  # query heads per KV head
    NODES: tl.constexpr,  # tree nodes a program serves
    BLOCK_G: tl.constexpr,  # NODES * KV_GROUP padded to a power of two >= MIN_DOT
    MIN_SPLITS: tl.constexpr,  # decode's row splits (_row_splits)
    DOUBLINGS: tl.constexpr,
    SPLIT_KEYS: tl.constexpr,
    BLOCK_N: tl.constexpr,  # keys per loop step, decode's
    BLOCK_T: tl.constexpr,  # n padded to a power of two
    HEAD_DIM: tl.constexpr,  # constant, so K/V rows load as 16-byte vectors
    BLOCK_D: tl.constexpr,  # HEAD_DIM padded to a power of two >= MIN_DOT
    DOT_PRECISION: tl.constexpr,
):
    kv_h = tl.program_id(1)
    b, req, prefix, first_node, row_node, _, mask_g, rows, heads, offs_d, mask_d, q = (
        _program_queries(
            Q, ReqPoolIndices, SeqLens, num_nodes, stride_qt, stride_qh, K.dtype.element_ty,
            KV_GROUP, NODES, BLOCK_G, HEAD_DIM, BLOCK_D,
        )
    )  # fmt: skip
    # Each row's keys are decode's for its token: positions [lo, q_pos]; the program walks
    # the blocks of the union, which for one row are decode's blocks plus blocks it sees
    # nothing of (its state is kept through them).
    q_pos = tl.load(Positions + rows, mask=mask_g, other=0).to(tl.int32)
    row_end = tl.where(mask_g, q_pos + 1, 0)
    row_lo = tl.where(window > 0, tl.maximum(row_end - window, 0), 0)
    # Decode's split count for each row's token; a program's rows differ only where
    # their tree crosses a length at which splits double: they then take two passes.
    row_splits = _row_splits(row_end - row_lo, MIN_SPLITS, DOUBLINGS, SPLIT_KEYS)
    if (kv_h == 0) & (tl.program_id(2) == 0):
        tl.store(PartialSplits + rows, row_splits, mask=mask_g)
    few_splits = tl.min(tl.where(mask_g, row_splits, 2147483647), 0)
    most_splits = tl.max(tl.where(mask_g, row_splits, 0), 0)
    row_lo = tl.where(mask_g, row_lo, 2147483647)
    lo, end = tl.min(row_lo, 0), tl.max(row_end, 0)
    prefix_blocks = prefix // BLOCK_N

    # Splits p, p + P, ... of the program's rows: each its own partial, whatever P is.
    for split in range(tl.program_id(2), most_splits, tl.num_programs(2)):
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)  # running max of each row's scores
        l_sum = tl.zeros([BLOCK_G], tl.float32)  # running sum of exp(score - m)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for schedule in range(0, 1 + (most_splits != few_splits).to(tl.int32)):
            num_splits = tl.where(schedule == 0, few_splits, most_splits)
            if split < num_splits:
                walking = row_splits == num_splits  # (BLOCK_G,) rows of this schedule
                m, l_sum, acc = _attend_split(
                    q, m, l_sum, acc, K, V, ReqToToken, OutCacheLoc, Positions, TreeMask,
                    req, b, first_node, row_node, walking, row_lo, row_end, lo, end, prefix,
                    prefix_blocks, split, num_splits, num_nodes, kv_h, offs_d, mask_d, sm_scale,
                    stride_kt, stride_kh, stride_vt, stride_vh, stride_req, stride_mb, stride_mi,
                    NODES, BLOCK_N, BLOCK_T, DOT_PRECISION,
                )  # fmt: skip
        _store_partial(
            PartialOut, PartialLse, rows, split, heads, mask_g & (split < row_splits), offs_d,
            mask_d, m, l_sum, acc, stride_pot, stride_poh, stride_pos, stride_plt, stride_plh,
        )  # fmt: skip


@triton.jit
def _attend_split(
    q, m, l_sum, acc, K, V, ReqToToken, OutCacheLoc, Positions, TreeMask, req, b, first_node,
    row_node, walking, row_lo, row_end, lo, end, prefix, prefix_blocks, split, num_splits,
    num_nodes, kv_h, offs_d, mask_d, sm_scale, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_req, stride_mb, stride_mi,
    NODES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Split ``split`` of ``num_splits`` for the program's ``walking`` rows: online softmax
    over its blocks, the other rows kept. -> (m, l_sum, acc)."""
    # Blocks below the tree: one K/V read serves every node (slots from the token table).
    first = _first_block(lo, split, num_splits, BLOCK_N)
    for j in range(first, tl.minimum(prefix_blocks, tl.cdiv(end, BLOCK_N)), num_splits):
        offs_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
        any_row = (offs_n >= lo) & (offs_n < end)
        slots = tl.load(ReqToToken + req * stride_req + offs_n, mask=any_row, other=0).to(tl.int64)
        k, v = _load_kv_block(
            K, V, slots, any_row, kv_h, offs_d, mask_d, stride_kt, stride_kh, stride_vt, stride_vh
        )
        visible = (offs_n[None, :] >= row_lo[:, None]) & (offs_n[None, :] < row_end[:, None])
        visible &= walking[:, None]
        step = _attend_block(q, k, v, visible, m, l_sum, acc, sm_scale, DOT_PRECISION)
        m, l_sum, acc = _keep_unseen(visible, step, m, l_sum, acc)
    # Blocks reaching the tree: each node's keys past the prefix are its own path's. One
    # online-softmax step per (block, node): the node's rows against its own keys, the
    # other rows kept; one flat loop, so one K/V tile is live (registers stay decode's).
    first = _first_block(tl.maximum(lo, prefix_blocks * BLOCK_N), split, num_splits, BLOCK_N)
    blocks = tl.cdiv(tl.maximum(tl.cdiv(end, BLOCK_N) - first, 0), num_splits)
    for step_index in range(0, blocks * NODES):
        t = step_index % NODES
        offs_n = (first + (step_index // NODES) * num_splits) * BLOCK_N + tl.arange(0, BLOCK_N)
        in_range = (offs_n >= lo) & (offs_n < end)
        in_prefix = offs_n < prefix
        cached = tl.load(
            ReqToToken + req * stride_req + offs_n, mask=in_range & in_prefix, other=0
        ).to(tl.int64)
        k, v, known = _node_kv(
            K, V, OutCacheLoc, Positions, TreeMask, b, tl.minimum(first_node + t, num_nodes - 1),
            cached, offs_n, in_range, in_prefix, num_nodes, kv_h, offs_d, mask_d, stride_kt,
            stride_kh, stride_vt, stride_vh, stride_mb, stride_mi, BLOCK_T,
        )  # fmt: skip
        row_range = (offs_n[None, :] >= row_lo[:, None]) & (offs_n[None, :] < row_end[:, None])
        visible = ((row_node == t) & walking)[:, None] & known[None, :] & row_range
        step = _attend_block(q, k, v, visible, m, l_sum, acc, sm_scale, DOT_PRECISION)
        m, l_sum, acc = _keep_unseen(visible, step, m, l_sum, acc)
    return m, l_sum, acc


def program_shape(group: int, num_nodes: int, programs: int) -> tuple[int, int]:
    """(tree nodes a program serves, BLOCK_G) for KV groups of ``group`` query heads, trees
    of ``num_nodes`` and ``programs`` programs at one node each: decode's BLOCK_G rows,
    filled with as many nodes' heads as fit where the batch is large enough."""
    block_g = max(triton.next_power_of_2(group), MIN_DOT)  # decode's
    if programs < PACK_MIN_PROGRAMS:
        return 1, block_g
    return max(1, min(block_g // group, num_nodes)), block_g


def check_tree_inputs(
    q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, positions, out_cache_loc,
    tree_mask, out, partial_out, partial_lse, partial_splits,
) -> None:  # fmt: skip
    """Host-side checks of a TARGET_VERIFY launch (no sync): B trees of n nodes, their
    B * n query rows, the paged inputs and the per-split scratch."""
    bs, num_nodes = tree_mask.shape[:2]
    num_rows = q.shape[0]
    assert tree_mask.shape == (bs, num_nodes, num_nodes) and tree_mask.dtype == torch.bool
    assert num_rows == bs * num_nodes, f"{num_rows} query rows for {bs} trees of {num_nodes}"
    assert req_pool_indices.shape == seq_lens.shape == (bs,)
    assert positions.shape == out_cache_loc.shape == (num_rows,)
    check_paged_inputs(q, k_buffer, v_buffer, req_to_token, out, partial_out, partial_lse,
                       partial_splits)  # fmt: skip
    assert tree_mask.stride(2) == 1
    for t in (req_pool_indices, seq_lens, positions, out_cache_loc):
        assert t.stride(0) == 1


def tree_kernel_args(
    q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, positions, out_cache_loc,
    tree_mask, partial_out, partial_lse, partial_splits, sm_scale: float, window: int,
) -> tuple:  # fmt: skip
    """The positional arguments both verify kernels begin with: the inputs, the scratch,
    sm_scale, the window, n and the strides, in their signatures' order."""
    return (
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, positions,
        out_cache_loc,
        tree_mask.view(torch.uint8),  # same bytes; sidesteps Triton's 1-bit pointers
        partial_out, partial_lse, partial_splits, float(sm_scale), window, tree_mask.shape[1],
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0),
        v_buffer.stride(1), req_to_token.stride(0), tree_mask.stride(0), tree_mask.stride(1),
        partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
        partial_lse.stride(0), partial_lse.stride(1),
    )  # fmt: skip


def block_and_window(
    head_dim: int, k_buffer: torch.Tensor, block_n: int | None, sliding_window: int | None
) -> tuple[int, int]:
    """(keys a loop step: ``block_n`` or decode's default, the window: 0 for none)."""
    if block_n is None:
        block_n = default_block_n(head_dim, k_buffer.element_size())
    assert block_n >= MIN_DOT and block_n == triton.next_power_of_2(block_n), block_n
    window = 0 if sliding_window is None else int(sliding_window)
    assert window >= 0, f"sliding_window must be positive, got {sliding_window}"
    return block_n, window


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
    partial_splits: torch.Tensor,  # (>= B*n,) int32 scratch
    sm_scale: float,
    sliding_window: int | None = None,
    block_n: int | None = None,  # keys per loop step (>= 16); None: decode's default_block_n
    programs: int | None = None,  # stage 1's programs along the splits; None: split_programs
    short_splits: int = NUM_KV_SPLITS,  # a short row's splits, decode's
) -> torch.Tensor:
    """Each tree node's attention over its prefix and its tree ancestors; returns ``out``.

    Each node gets the splits decode would give its token (the scratch's third dimension
    bounds them, as decode's). Shapes are checked on the host only (no device sync), so
    this may be captured.
    """
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
    # Packing is decided at a short row's split count, as measured (PACK_MIN_PROGRAMS).
    nodes, block_g = program_shape(
        group, num_nodes, num_rows * num_kv_heads * min_splits(max_splits, short_splits)
    )
    node_programs = bs * triton.cdiv(num_nodes, nodes)
    programs = programs or split_programs(node_programs * num_kv_heads, max_splits, short_splits)

    grid = (node_programs, num_kv_heads, programs)
    args = tree_kernel_args(
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, positions,
        out_cache_loc, tree_mask, partial_out, partial_lse, partial_splits, sm_scale, window,
    )  # fmt: skip
    _verify_partial_kernel[grid](
        *args,
        KV_GROUP=group,
        NODES=nodes,
        BLOCK_G=block_g,
        **split_constants(max_splits, short_splits),
        BLOCK_N=block_n,
        BLOCK_T=triton.next_power_of_2(num_nodes),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        DOT_PRECISION=dot_precision(k_buffer.dtype),
        num_warps=4,
        num_stages=2,
    )
    return combine_splits(partial_out, partial_lse, partial_splits, out, short_splits)
