"""Paged decode attention in Triton: GQA-grouped flash-decoding, KV splits by row length.

One query token per request attends over that request's cached tokens, which
live at scattered slots of the token KV pool (``req_to_token`` maps position
-> slot). Work decomposition: stage 1 runs one program per (request, KV head,
split), grid B x Hkv x S. Each program loads a K/V tile once and serves all G
query heads that share it: the scores are one ``tl.dot`` of q (G padded to 16
rows, the tensor-core minimum) by K^T, and the values one ``tl.dot`` of the
probabilities by V, with an online softmax per head in float32. A grid over
query heads instead re-reads every K/V tile G times and runs a short
latency-bound loop per head; decode is bandwidth-bound, so reading each tile
once is the win, and the padded rows cost idle tensor-core lanes only
(float32 caches take exact FMA dots instead of tf32 ones). The S
splits of a row's visible range exist so that batch 1 still fills the GPU.
S is a function of the row's own visible length (``row_splits``): a short row's
count (``short_splits``, 16 by default) up to 8,191 keys, then doubling with every
doubling of the length, up to the scratch's split dimension (``max_kv_splits`` of the
engine's context). At 32k keys one request with 8 KV heads was read at 0.73 TB/s with
16 splits and 2.7 TB/s with 128 on an H200 (bench/decode_splits.py). The short count is
the launch's: at 16, rows of a few hundred keys in a launch of many (row, KV head) pairs
ran as programs of a block or less each, so a backend may lower it there
(``batch_short_splits``), where a row's bits may depend on its batch. Width-invariant
models keep 16 at every batch: their verify rows must round as decode rows.
Splits are block-cyclic: keys are walked in BLOCK_N blocks aligned to absolute positions
(block j holds positions [j * BLOCK_N, (j + 1) * BLOCK_N)), and split s walks
the blocks j = s (mod S) of the row's visible range, in order. So the partition
of a token's keys depends on its own range alone, and tokens of one request
share their blocks: tree-verify attention (triton_verify.py) reads each shared
block once for several tree nodes and still computes each node as decode
would. Stage 1's grid is B x Hkv x P: program p computes splits p, p + P, ... of its
row, each into its own partial, so P (``split_programs``: more at small
batches) moves work between programs without changing any row's arithmetic. Or
(``decode_attention``'s work_list) the grid is P x Hkv over one list of every row's splits,
program p computing items p, p + P, ...: the same splits, the same arithmetic.
Stage 2 combines the S partials of each (request, query head) by their
log-sum-exps (grid B x H): the 16 every row has at once, a long row's others in
chunks, in split order. A third, tiny kernel stores the step's new K/V rows into
the pool before stage 1 runs, so every split sees them.

Capture-safe: the launches read only device tensors and host shapes, never
sync, allocate nothing (the caller owns ``out`` and the scratch), and their
grids depend on the batch size, head counts and scratch shape alone. Each
row's split count is derived on the device from its own length and the launch's
short count, so an eager run and a graph replay of the same padded batch are bitwise
identical, and at one short count a row's output does not depend on the batch around it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphrt.devices.cuda import pdl

# Splits of a row shorter than 2 * NUM_KV_SPLITS * SPLIT_KEYS keys. Never tuned per
# batch: the split count sets the float summation order. 16 fills an H200 at batch 1
# with 8 KV heads at short contexts; at large batches the partials cost
# B * H * S * D * 8 bytes of scratch traffic, small next to the KV. A split walks every
# S-th block, so rows under S blocks leave splits empty.
NUM_KV_SPLITS = 16
# Longer rows double their splits with every doubling of their length: at least
# SPLIT_KEYS keys a split (H200, bench/decode_splits.py, llama-1b's 8 KV heads, one
# request, us a layer at 16 / 32 / 64 / 128 splits: 8k keys 15.2 / 10.9 / 8.9 / 9.1,
# 32k keys 91.9 / 50.8 / 31.7 / 25.0; at 8 requests 16 splits stay within 6% of best).
SPLIT_KEYS = 256
# Stage 1's work as one list (decode_attention's work_list); the same bits either way. On the
# H200 (stop 89, bench/decode_mixed.py's :w variants, us a layer by rows / listed, 2 short
# splits) it wins where a long row shares a batch with short ones (llama-1b 63 x 512 + 1 x 32k
# 140.6 / 71.9, Gemma 4's full layers 225.8 / 53.8): by rows its 128 splits queue on its own
# 16 programs. It loses where no row's splits queue (llama-1b 64 x 512 39.3 / 44.9, 64 x 2k
# 125.7 / 133.9; Gemma 4's full layers 8 x 8k 50.1 / 52.3): an item still finds its row by a
# reduction (_listed_row). So it runs only in batches with a row of LISTED_ROW_KEYS keys or
# more (more than NUM_KV_SPLITS splits, which queue by rows once rows x KV heads reach 64),
# on their decode graphs of their own (CudaAttentionBackend.long_row_keys), in layers that
# see such rows and take no long rows' blocks, where LIST_LONG_ROWS. The step (graphrt bench
# --long-row 32768, gemma4-e2b at prompt 512, ms listed / by rows, twice): batch 64 4.416,
# 4.454 / 5.708, 5.487; batch 8 3.047, 3.059 / 3.019, 2.933 (3% slower listed; by rows'
# two runs are 3% apart).
LIST_LONG_ROWS = True
LISTED_ROW_KEYS = 2 * NUM_KV_SPLITS * SPLIT_KEYS
# Work lists over more rows than this keep the grid by rows (a row's index is found by a
# reduction over BLOCK_B of them each item).
MOST_LISTED_ROWS = 1024
# The most splits a row gets (from 32,768 keys): the scratch is rows * H * S * D float32
# (256 MiB for llama-1b's 32 heads x 64 at 256 rows; 768 MiB for Gemma 4's full layers,
# 8 heads x 512, at 384 verify rows), and longer rows read more blocks a split instead.
MAX_KV_SPLITS = 128
# Stage-1 programs a launch aims for (split_programs): 128 a KV head at batch 1.
TARGET_PROGRAMS = 1024
# Where a row's bits may depend on its batch (``batch_short_splits``: models without width
# invariance), short rows take fewer splits in launches of many (row, KV head) pairs: their
# splits were a block or less of keys each, and the partials' programs, not the KV, set the
# time. One layer, 512 keys a row, us at 2 / 4 / 8 / 16 splits (H100, bench/decode_splits.py,
# BENCHMARKS.md stop 83): llama-1b's 8 KV heads, 64 rows 38.0 / 39.1 / 37.2 / 46.7, 32 rows
# 15.3 / 18.4 / 18.5 / 23.5, 8 rows 9.5 / 7.4 / 6.8 / 8.0; Gemma 4's sliding layers (one KV
# head, D 256), 64 rows 17.5 / 13.9 / 18.7 / 25.3, 32 rows 16.1 / 11.3 / 9.5 / 12.3, 8 rows
# 15.1 / 10.0 / 7.2 / 6.8; at one row 16 splits (or 8: equal) were best in every shape.
SHORT_SPLIT_PROGRAMS = 256
FEWEST_SHORT_SPLITS = 2
# tl.dot on NVIDIA GPUs needs an inner dimension >= 16, and before triton 3.7 M, N >= 16.
MIN_DOT = 16
# A row class's upper bound when it has none (visible keys are int32).
ALL_KEYS = 2**31 - 1
# One K tile plus one V tile per loop step stays within this many bytes, so two
# pipeline stages fit shared memory with room for a second program per SM.
TILE_BYTES = 32 * 1024


@triton.jit
def _store_kv_kernel(
    K,  # (T, Hkv, D), the step's new keys
    V,
    KBuffer,  # (num_slots + 1, Hkv, D), the pool's dtype
    VBuffer,
    Loc,  # (T,) token slot of each row
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kbt,
    stride_kbh,
    stride_vbt,
    stride_vbh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    LAUNCH_DEPENDENTS: tl.constexpr,  # decode attention's stage 1 may start (pdl.py)
):
    if LAUNCH_DEPENDENTS:
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0)
    h = tl.program_id(1)
    loc = tl.load(Loc + t).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    k = tl.load(K + t * stride_kt + h * stride_kh + offs_d, mask=mask_d)
    v = tl.load(V + t * stride_vt + h * stride_vh + offs_d, mask=mask_d)
    kb = KBuffer + loc * stride_kbt + h * stride_kbh + offs_d
    vb = VBuffer + loc * stride_vbt + h * stride_vbh + offs_d
    tl.store(kb, k.to(KBuffer.dtype.element_ty), mask=mask_d)
    tl.store(vb, v.to(VBuffer.dtype.element_ty), mask=mask_d)


@triton.jit
def _load_q_group(
    Q, row, kv_h, stride_qb, stride_qh, dtype: tl.constexpr,
    KV_GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """The G query heads of KV head ``kv_h`` in query row ``row`` -> (q, heads, masks).

    q is (BLOCK_G, BLOCK_D) in the cache's dtype, as the torch reference casts it: the
    dots then take native operands and accumulate in float32. Rows past the group are
    zero queries, never stored.
    """
    offs_g = tl.arange(0, BLOCK_G)
    mask_g = offs_g < KV_GROUP
    heads = kv_h * KV_GROUP + offs_g
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q = tl.load(
        Q + row * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask_g[:, None] & mask_d[None, :],
        other=0.0,
    ).to(dtype)
    return q, heads, mask_g, offs_d, mask_d


@triton.jit
def _load_kv_block(
    K, V, slots, mask_n, kv_h, offs_d, mask_d, stride_kt, stride_kh, stride_vt, stride_vh
):
    """K of the given token slots transposed (BLOCK_D, BLOCK_N) for the dot, and V (BLOCK_N, BLOCK_D)."""
    k = tl.load(
        K + slots[None, :] * stride_kt + kv_h * stride_kh + offs_d[:, None],
        mask=mask_d[:, None] & mask_n[None, :],
        other=0.0,
    )
    v = tl.load(
        V + slots[:, None] * stride_vt + kv_h * stride_vh + offs_d[None, :],
        mask=mask_n[:, None] & mask_d[None, :],
        other=0.0,
    )
    return k, v


@triton.jit
def _online_softmax(scores, visible, m, l_sum):
    """The online softmax's step over one block's scores (BLOCK_G, BLOCK_K), ``visible``
    broadcast to them: -> (m_new, alpha, p, l_sum_new). The caller adds ``p @ V`` as
    ``acc * alpha[:, None] + pv``."""
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, 1))
    # A block can hold no visible key (a tree block under the window, padding rows, a
    # block another node of a verify program needs): m_new stays m, or -inf, and
    # shifting by 0 instead makes every exp 0 rather than NaN. Such a block leaves
    # (m, l_sum, acc) bitwise as they were (alpha = exp(0) = 1 or acc = 0; p = 0).
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - shift)
    p = tl.exp(scores - shift[:, None])
    return m_new, alpha, p, l_sum * alpha + tl.sum(p, 1)


@triton.jit
def _attend_block(q, k, v, visible, m, l_sum, acc, sm_scale, DOT_PRECISION: tl.constexpr):
    """One online-softmax step over a block of keys; returns the new (m, l_sum, acc).

    q (BLOCK_G, BLOCK_D), k (BLOCK_D, BLOCK_K), v (BLOCK_K, BLOCK_D), visible
    broadcastable to (BLOCK_G, BLOCK_K).
    """
    scores = tl.dot(q, k, input_precision=DOT_PRECISION) * sm_scale  # (BLOCK_G, BLOCK_K)
    m_new, alpha, p, l_sum = _online_softmax(scores, visible, m, l_sum)
    pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)  # (BLOCK_G, BLOCK_D)
    return m_new, l_sum, acc * alpha[:, None] + pv


@triton.jit
def _first_block(lo, split, num_splits, BLOCK_N: tl.constexpr):
    """The first block of ``split`` at or after position ``lo``'s block: blocks are
    dealt to splits cyclically, block j to split j % num_splits."""
    first = lo // BLOCK_N
    return first + (split - first % num_splits + num_splits) % num_splits


@triton.jit
def _row_splits(
    visible_len, MIN_SPLITS: tl.constexpr, DOUBLINGS: tl.constexpr, SPLIT_KEYS: tl.constexpr
):
    """Splits of rows with ``visible_len`` keys (scalar or vector): ``row_splits`` on
    the device."""
    splits = visible_len * 0 + MIN_SPLITS
    for _ in tl.static_range(DOUBLINGS):
        splits = tl.where(visible_len >= 2 * splits * SPLIT_KEYS, 2 * splits, splits)
    return splits


@triton.jit
def _attend_cached(
    q, m, l_sum, acc, K, V, ReqToToken, req, lo, end, split, num_splits, kv_h, offs_d, mask_d,
    sm_scale, stride_req, stride_kt, stride_kh, stride_vt, stride_vh, TreeLoc, prefix,
    tree_row, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, CHAIN: tl.constexpr,
):  # fmt: skip
    """Online softmax over split ``split``'s blocks (of ``num_splits``) of the cached
    positions [lo, end) of request row ``req``; with ``CHAIN``, positions from ``prefix``
    on are a chain's nodes, their slots ``TreeLoc[tree_row + position - prefix]``."""
    first = _first_block(lo, split, num_splits, BLOCK_N)
    for j in range(first, tl.cdiv(end, BLOCK_N), num_splits):
        offs_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = (offs_n >= lo) & (offs_n < end)
        if CHAIN:  # one gather: each key's slot from the token table or the chain's nodes
            from_table = ReqToToken + req * stride_req + offs_n
            from_tree = TreeLoc + tree_row + tl.maximum(offs_n - prefix, 0)
            where = tl.where(offs_n < prefix, from_table, from_tree)
            slots = tl.load(where, mask=mask_n, other=0).to(tl.int64)
        else:
            slots = tl.load(ReqToToken + req * stride_req + offs_n, mask=mask_n, other=0).to(
                tl.int64
            )
        k, v = _load_kv_block(
            K, V, slots, mask_n, kv_h, offs_d, mask_d, stride_kt, stride_kh, stride_vt, stride_vh
        )
        m, l_sum, acc = _attend_block(
            q, k, v, mask_n[None, :], m, l_sum, acc, sm_scale, DOT_PRECISION
        )
    return m, l_sum, acc


@triton.jit
def _store_partial(
    PartialOut, PartialLse, rows, split, heads, mask_g, offs_d, mask_d, m, l_sum, acc,
    stride_pob, stride_poh, stride_pos, stride_plb, stride_plh,
):  # fmt: skip
    """One split's normalised output and log-sum-exp for each of BLOCK_G (query row,
    head) pairs: ``rows`` and ``heads`` (BLOCK_G,). An empty split (short or windowed
    rows) writes zeros and lse = -inf, so the combine gives it weight 0 without reading
    uninitialised scratch."""
    nonempty = l_sum > 0
    safe_sum = tl.where(nonempty, l_sum, 1.0)
    out = acc / safe_sum[:, None]
    lse = tl.where(nonempty, m + tl.log(safe_sum), float("-inf"))
    rows = rows.to(tl.int64)  # rows x H x S x D passes 2**31 at 4,096 verify rows (S 128, D 512)
    po = PartialOut + rows[:, None] * stride_pob + heads[:, None] * stride_poh + split * stride_pos
    tl.store(po + offs_d[None, :], out, mask=mask_g[:, None] & mask_d[None, :])
    tl.store(PartialLse + rows * stride_plb + heads * stride_plh + split, lse, mask=mask_g)


@triton.jit
def _decode_partial_kernel(
    Q,  # (B, H, D)
    K,  # (num_slots + 1, Hkv, D)
    V,
    ReqToToken,  # (max_reqs + 1, max_ctx)
    ReqPoolIndices,  # (B,); chains: (B / CHAIN_NODES,), a request's
    SeqLens,  # (B,); chains: a request's, its prefix and all its nodes
    TreeLoc,  # chains: (B,) the nodes' slots, request-major; otherwise unread
    PartialOut,  # (>= B, H, S, D) float32
    PartialLse,  # (>= B, H, S) float32
    PartialSplits,  # (>= B,) int32: each row's split count, for the combine
    sm_scale,
    window,  # 0 = no sliding window
    min_keys,  # this launch's rows: min_keys <= visible keys < max_keys (the others'
    max_keys,  # programs return at once: another launch, of another BLOCK_N, serves them)
    num_rows,  # B; 0 by rows (unread there: an int of 1 or 16k would compile its own kernel)
    stride_qb,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_req,
    stride_pob,
    stride_poh,
    stride_pos,
    stride_plb,
    stride_plh,
    KV_GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_G: tl.constexpr,  # KV_GROUP padded to a power of two >= MIN_DOT
    MIN_SPLITS: tl.constexpr,  # a short row's splits; longer rows double them (_row_splits)
    DOUBLINGS: tl.constexpr,
    SPLIT_KEYS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    # A constant head_dim lets the compiler prove the D mask uniform over 16-byte
    # chunks, so K/V rows load as vectors through cp.async; a runtime one leaves
    # one 2-byte load per element.
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM padded to a power of two >= MIN_DOT
    DOT_PRECISION: tl.constexpr,
    CHAIN_NODES: tl.constexpr,  # 0: decode rows; n: rows are n-node chains (decode_attention)
    USE_PDL: tl.constexpr,  # launched with PDL: griddepcontrol.wait before q (pdl.py)
    # 0: grid (rows, KV heads, P), program p computing splits p, p + P, ... of its row.
    # n >= B: grid (P, KV heads), every (row, split) of the launch's rows one item of a list
    # (row-major), program p computing items p, p + P, ... (decode_attention's work_list).
    BLOCK_B: tl.constexpr,
):
    if BLOCK_B > 0:
        tl.static_assert(CHAIN_NODES == 0)
        kv_h = tl.program_id(1)
        step = tl.num_programs(0)
        # Before the wait (step inputs only, as below): each row's items, where in the list
        # each row's items end, and this program's first item's row (its length and
        # request slot), as the grid by rows reads its row's.
        rows = tl.arange(0, BLOCK_B)
        lens = tl.load(SeqLens + rows, mask=rows < num_rows, other=0).to(tl.int32)
        los = tl.where(window > 0, tl.maximum(lens - window, 0), 0)
        listed = (rows < num_rows) & (lens - los >= min_keys) & (lens - los < max_keys)
        items = tl.where(listed, _row_splits(lens - los, MIN_SPLITS, DOUBLINGS, SPLIT_KEYS), 0)
        ends = tl.cumsum(items, 0)  # (BLOCK_B,)
        total = tl.sum(items, 0)
        # A program past the list's items (as many programs as the grid by rows: many at
        # short rows) skips the lookup and, after the wait, the loop.
        b = tl.full([], BLOCK_B, tl.int32)  # as _listed_row gives past the list's end
        start = tl.full([], 0, tl.int32)
        seq_len = tl.full([], 0, tl.int32)
        req = tl.full([], 0, tl.int64)
        if tl.program_id(0) < total:
            b, start, seq_len, req = _listed_row(
                tl.program_id(0), ends, rows, lens, ReqPoolIndices, num_rows, BLOCK_B
            )
        if USE_PDL:
            pdl.wait_for_predecessor()  # q and this step's K/V are written
        if (kv_h == 0) & (tl.program_id(0) == 0):
            tl.store(PartialSplits + rows, items, mask=listed)
        for item in range(tl.program_id(0), total, step):
            # The next item's row first, where there is one: its request slot's load flies
            # while this one attends.
            next_b, next_start, next_len, next_req = b, start, seq_len, req
            if item + step < total:
                next_b, next_start, next_len, next_req = _listed_row(
                    item + step, ends, rows, lens, ReqPoolIndices, num_rows, BLOCK_B
                )
            lo = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
            q, heads, mask_g, offs_d, mask_d = _load_q_group(
                Q, b, kv_h, stride_qb, stride_qh, K.dtype.element_ty, KV_GROUP, BLOCK_G,
                HEAD_DIM, BLOCK_D,
            )  # fmt: skip
            _partial_of_split(
                q, heads, mask_g, offs_d, mask_d, K, V, ReqToToken, TreeLoc, PartialOut,
                PartialLse, b, kv_h, item - start,
                _row_splits(seq_len - lo, MIN_SPLITS, DOUBLINGS, SPLIT_KEYS), req, lo,
                seq_len, seq_len, 0, sm_scale, stride_kt, stride_kh, stride_vt, stride_vh,
                stride_req, stride_pob, stride_poh, stride_pos, stride_plb, stride_plh, BLOCK_G,
                BLOCK_N, BLOCK_D, DOT_PRECISION, False,
            )  # fmt: skip
            b, start, seq_len, req = next_b, next_start, next_len, next_req
        return

    b = tl.program_id(0)
    kv_h = tl.program_id(1)

    # HAZARD (PDL): up to the wait this program may run beside the kernels before it, which
    # are still writing q, this step's key and value, the residual stream and the scratch.
    # It reads only the step's inputs, final before its first kernel ran (pdl.py): the
    # row's length and request slot; it stores nothing.
    if CHAIN_NODES > 0:
        # Row b is node b % n of request b // n's chain: the request's prefix, then nodes
        # 0 .. b % n (a graph's padding request has length n: no prefix; the clamp keeps
        # any shorter length from reaching before it).
        tree_row = (b // CHAIN_NODES) * CHAIN_NODES
        prefix = tl.maximum(tl.load(SeqLens + b // CHAIN_NODES).to(tl.int32) - CHAIN_NODES, 0)
        seq_len = prefix + b % CHAIN_NODES + 1
        req = tl.load(ReqPoolIndices + b // CHAIN_NODES).to(tl.int64)
    else:
        tree_row = 0
        seq_len = tl.load(SeqLens + b).to(tl.int32)
        prefix = seq_len
        req = tl.load(ReqPoolIndices + b).to(tl.int64)
    # Key j is visible to the query at p = seq_len - 1 iff j > p - window.
    lo = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    in_class = (seq_len - lo >= min_keys) & (seq_len - lo < max_keys)
    num_splits = _row_splits(seq_len - lo, MIN_SPLITS, DOUBLINGS, SPLIT_KEYS)
    if USE_PDL:
        pdl.wait_for_predecessor()  # q and this step's K/V are written
    if not in_class:
        return
    if (kv_h == 0) & (tl.program_id(2) == 0):
        tl.store(PartialSplits + b, num_splits)

    q, heads, mask_g, offs_d, mask_d = _load_q_group(
        Q, b, kv_h, stride_qb, stride_qh, K.dtype.element_ty, KV_GROUP, BLOCK_G, HEAD_DIM, BLOCK_D
    )  # (BLOCK_G, BLOCK_D)
    # Splits p, p + P, ... of the row: each its own partial, whatever P is.
    for split in range(tl.program_id(2), num_splits, tl.num_programs(2)):
        _partial_of_split(
            q, heads, mask_g, offs_d, mask_d, K, V, ReqToToken, TreeLoc, PartialOut,
            PartialLse, b, kv_h, split, num_splits, req, lo, seq_len, prefix, tree_row,
            sm_scale, stride_kt, stride_kh, stride_vt, stride_vh, stride_req, stride_pob,
            stride_poh, stride_pos, stride_plb, stride_plh, BLOCK_G, BLOCK_N, BLOCK_D,
            DOT_PRECISION, CHAIN_NODES > 0,
        )  # fmt: skip


@triton.jit
def _first_after(start_a, first_a, len_a, start_b, first_b, len_b):
    """_listed_row's reduction: the latest end at or before the item, and the first row
    (and its length) whose items end after it."""
    a_first = first_a < first_b
    return (
        tl.maximum(start_a, start_b),
        tl.minimum(first_a, first_b),
        tl.where(a_first, len_a, len_b),
    )


@triton.jit
def _listed_row(item, ends, rows, lens, ReqPoolIndices, num_rows, BLOCK_B: tl.constexpr):
    """Work list item ``item``'s row b, where b's items start in the list, b's length and
    its request slot: one reduction over the launch's rows (their items' cumulative
    ``ends``; each cross-warp reduction costs the short items' programs barriers). Past the
    list's end b is BLOCK_B, its length 0 and its slot the last row's: never used."""
    before = ends <= item  # rows whose items all come before it
    start, b, seq_len = tl.reduce(
        (tl.where(before, ends, 0), tl.where(before, BLOCK_B, rows), tl.where(before, 0, lens)),
        0,
        _first_after,
    )
    req = tl.load(ReqPoolIndices + tl.minimum(b, num_rows - 1)).to(tl.int64)
    return b, start, seq_len, req


@triton.jit
def _partial_of_split(
    q, heads, mask_g, offs_d, mask_d, K, V, ReqToToken, TreeLoc, PartialOut, PartialLse, b,
    kv_h, split, num_splits, req, lo, seq_len, prefix, tree_row, sm_scale, stride_kt,
    stride_kh, stride_vt, stride_vh, stride_req, stride_pob, stride_poh, stride_pos,
    stride_plb, stride_plh, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr, CHAIN: tl.constexpr,
):  # fmt: skip
    """Split ``split`` (of ``num_splits``) of row b's KV head ``kv_h`` (its query group q,
    ``_load_q_group``'s) into its partial: the same work, so the same bits, whichever
    program of whichever grid computes it."""
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)  # running max of each head's scores
    l_sum = tl.zeros([BLOCK_G], tl.float32)  # running sum of exp(score - m)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    m, l_sum, acc = _attend_cached(
        q, m, l_sum, acc, K, V, ReqToToken, req, lo, seq_len, split, num_splits, kv_h, offs_d,
        mask_d, sm_scale, stride_req, stride_kt, stride_kh, stride_vt, stride_vh, TreeLoc,
        prefix, tree_row, BLOCK_N, DOT_PRECISION, CHAIN,
    )  # fmt: skip
    _store_partial(
        PartialOut, PartialLse, heads * 0 + b, split, heads, mask_g, offs_d, mask_d, m, l_sum,
        acc, stride_pob, stride_poh, stride_pos, stride_plb, stride_plh,
    )  # fmt: skip


@triton.jit
def _decode_combine_kernel(
    PartialOut,
    PartialLse,
    PartialSplits,  # (>= B,) int32: each row's split count
    Out,  # (B, H, D), q's dtype
    stride_pob,
    stride_poh,
    stride_pos,
    stride_plb,
    stride_plh,
    stride_ob,
    stride_oh,
    MIN_SPLITS: tl.constexpr,  # a short row's splits
    BLOCK_S: tl.constexpr,  # MIN_SPLITS padded to a power of two
    BLOCK_REST: tl.constexpr,  # a long row's further splits combined a step
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    LAUNCH_DEPENDENTS: tl.constexpr,  # the o projection's GEMV may start reading its weight
):
    if LAUNCH_DEPENDENTS:
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0).to(tl.int64)  # a row's offset: see _store_partial
    h = tl.program_id(1)
    num_splits = tl.load(PartialSplits + b)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    lse_row = PartialLse + b * stride_plb + h * stride_plh
    out_row = PartialOut + b * stride_pob + h * stride_poh + offs_d[None, :]

    # A short row's MIN_SPLITS, which every row has: max, weights, weighted sum. Their
    # loads do not wait for the row's split count.
    offs_s = tl.arange(0, BLOCK_S)
    mask_s = offs_s < MIN_SPLITS
    lse = tl.load(lse_row + offs_s, mask=mask_s, other=float("-inf"))  # (BLOCK_S,)
    lse_max = tl.max(lse, 0)
    # Every split empty (seq_len 0) would make lse_max -inf; keep it NaN-free.
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weight = tl.exp(lse - lse_max)  # 0 for empty splits
    partial = tl.load(
        out_row + offs_s[:, None] * stride_pos, mask=mask_s[:, None] & mask_d[None, :], other=0.0
    )  # (BLOCK_S, BLOCK_D)
    total = tl.sum(weight, 0)
    acc = tl.sum(weight[:, None] * partial, 0)
    # A long row's further splits, BLOCK_REST at a time, rescaled as an online softmax.
    offs_r = tl.arange(0, BLOCK_REST)
    for first in range(MIN_SPLITS, num_splits, BLOCK_REST):
        mask_r = first + offs_r < num_splits
        lse_r = tl.load(lse_row + first + offs_r, mask=mask_r, other=float("-inf"))
        new_max = tl.maximum(lse_max, tl.max(lse_r, 0))
        alpha = tl.exp(lse_max - new_max)
        weight_r = tl.exp(lse_r - new_max)
        partial_r = tl.load(
            out_row + (first + offs_r[:, None]) * stride_pos,
            mask=mask_r[:, None] & mask_d[None, :],
            other=0.0,
        )
        total = total * alpha + tl.sum(weight_r, 0)
        acc = acc * alpha + tl.sum(weight_r[:, None] * partial_r, 0)
        lse_max = new_max
    out = acc / tl.where(total > 0, total, 1.0)
    tl.store(
        Out + b * stride_ob + h * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=mask_d
    )


def row_splits(visible_len: int, max_splits: int, short: int = NUM_KV_SPLITS) -> int:
    """Splits of a row with ``visible_len`` keys when the scratch holds ``max_splits``:
    a short row's (``min_splits``), doubled while the row has at least SPLIT_KEYS keys
    for each of twice as many splits and the scratch holds them (``_row_splits``)."""
    splits = min_splits(max_splits, short)
    while 2 * splits <= max_splits and visible_len >= 2 * splits * SPLIT_KEYS:
        splits *= 2
    return splits


def batch_short_splits(pairs: int, most: int = NUM_KV_SPLITS) -> int:
    """A short row's splits in a launch of ``pairs`` (row, KV head) pairs, where a row's bits
    may depend on its batch (models without width invariance): ``most``, halved while the
    short rows' programs would exceed SHORT_SPLIT_PROGRAMS, FEWEST_SHORT_SPLITS at least.
    Longer rows double from there (``row_splits``)."""
    splits = most
    while splits > FEWEST_SHORT_SPLITS and pairs * splits > SHORT_SPLIT_PROGRAMS:
        splits //= 2
    return splits


def min_splits(max_splits: int, short: int = NUM_KV_SPLITS) -> int:
    """A short row's splits: ``short``, or all the scratch holds if fewer."""
    return min(short, max_splits)


def max_kv_splits(context_len: int, short: int = NUM_KV_SPLITS) -> int:
    """The scratch's split dimension for rows of up to ``context_len`` keys, when short
    rows get ``short``: what the longest row gets, at most MAX_KV_SPLITS (or ``short``
    if more)."""
    return row_splits(context_len, max(MAX_KV_SPLITS, short), short)


def split_programs(programs_per_split: int, max_splits: int, short: int = NUM_KV_SPLITS) -> int:
    """Stage 1's programs along the splits (P): enough for TARGET_PROGRAMS in all, at
    least a short row's splits and NUM_KV_SPLITS, at most the scratch's. Any P gives the
    same bits. HAZARD: the floor stays NUM_KV_SPLITS where short rows take fewer
    (``batch_short_splits``): a long row among them walks its splits on P programs, and
    one 32k row's 128 splits on 2 programs a KV head would cost it about 0.7 ms a layer
    (stop 83); short rows' programs past their splits return at once."""
    wanted = triton.next_power_of_2(triton.cdiv(TARGET_PROGRAMS, max(programs_per_split, 1)))
    return max(min_splits(max_splits, max(short, NUM_KV_SPLITS)), min(wanted, max_splits))


def work_programs(rows: int, num_kv_heads: int, max_splits: int, short: int = NUM_KV_SPLITS) -> int:
    """A work list's programs a KV head (``decode_attention``'s work_list): as many as the
    grid by rows launches, rows x ``split_programs``' P. With fewer, rows whose splits
    fill the grid by rows queue on the list: stop 88 (H200) gave the list one row's P
    (128) at Gemma 4's 8 rows of 8k keys, 256 items, and its layer took 74 us against
    49 by rows. A long row among short ones takes the programs of theirs that finished."""
    return rows * split_programs(rows * num_kv_heads, max_splits, short)


def split_constants(max_splits: int, short: int = NUM_KV_SPLITS) -> dict[str, int]:
    """The stage-1 kernels' constants of ``_row_splits`` for a scratch of ``max_splits``
    and short rows of ``short`` splits."""
    splits, doublings = min_splits(max_splits, short), 0
    while 2 * splits <= max_splits:
        splits, doublings = 2 * splits, doublings + 1
    return dict(
        MIN_SPLITS=min_splits(max_splits, short), DOUBLINGS=doublings, SPLIT_KEYS=SPLIT_KEYS
    )


def allocate_decode_scratch(
    max_bs: int,
    num_heads: int,
    head_dim: int,
    device: torch.device,
    num_kv_splits: int = NUM_KV_SPLITS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Partial outputs (max_bs, H, S, D) and log-sum-exps (max_bs, H, S), float32, and
    each row's split count (max_bs,) int32. S = ``num_kv_splits`` is the most splits a
    row gets (``max_kv_splits``).

    One set serves every layer of that (H, D): layers run one after another.
    """
    partial_out = torch.empty(
        (max_bs, num_heads, num_kv_splits, head_dim), dtype=torch.float32, device=device
    )
    partial_lse = torch.empty(
        (max_bs, num_heads, num_kv_splits), dtype=torch.float32, device=device
    )
    partial_splits = torch.empty(max_bs, dtype=torch.int32, device=device)
    return partial_out, partial_lse, partial_splits


def store_kv(
    k: torch.Tensor,  # (T, Hkv, D), any row stride
    v: torch.Tensor,
    k_buffer: torch.Tensor,  # (num_slots + 1, Hkv, D), written
    v_buffer: torch.Tensor,
    loc: torch.Tensor,  # (T,) int64 token slots
) -> None:
    """``k_buffer[loc] = k``, ``v_buffer[loc] = v`` (cast to the pool's dtype) in one launch.

    Rows sharing a slot (padding rows all write slot 0) leave one of them there,
    which one undefined. Capture-safe: no sync, no allocation.
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    assert v.shape == k.shape and loc.shape == (num_tokens,)
    assert k_buffer.shape[1:] == (num_kv_heads, head_dim) and v_buffer.shape == k_buffer.shape
    for name, t in (("k", k), ("v", v), ("k_buffer", k_buffer), ("v_buffer", v_buffer)):
        assert t.stride(-1) == 1, f"{name} must be contiguous in head_dim"
    assert loc.stride(0) == 1
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens, num_kv_heads)](
        k,
        v,
        k_buffer,
        v_buffer,
        loc,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        LAUNCH_DEPENDENTS=pdl.ENABLED,
        num_warps=1,
    )


def default_block_n(head_dim: int, element_size: int) -> int:
    """Keys per loop step: 64 (32 when a K plus a V tile would pass TILE_BYTES).

    bf16/fp16 with D <= 128 and float32 with D <= 64 get 64; D = 256, or float32
    with D = 128, get 32.
    """
    block_d = max(triton.next_power_of_2(head_dim), MIN_DOT)
    return 64 if 2 * 64 * block_d * element_size <= TILE_BYTES else 32


# Rows of this many visible keys and more attend on larger blocks where ``long_block_n``
# gives one (decode_attention's ``long_rows``; the engine's decode graphs for batches with
# such a row). Measured on an H100: llama-1b's shape (head_dim 64), 128-key blocks
# 15-21% less than 64 from 2k keys, equal or more below (stops 57-58), and its step 1.55
# -> 1.28-1.36x the floor at 8 requests of 32k (stop 59). Not taken (stop 59): head_dim
# 128, whose default 64-key blocks on three stages already read 2.6-2.8 TB/s in Llama 3
# 8B's step (stage 1 at 8 x 32k: 12.43 ms a step, 12.12 on 128-key blocks; the second
# launch cost 1% at batch 1), and Gemma 4's full layers (512), twice as slow on 64-key
# blocks as on 32 at four warps, 2-10% slower at eight.
LONG_ROW_KEYS = 2048


def long_block_n(head_dim: int, element_size: int) -> int | None:
    """The block size of rows of LONG_ROW_KEYS keys and more, where one was measured to
    pay: twice the default for 16-bit caches of head_dim <= 64 (llama-1b's); None for
    the others (one block size for all rows)."""
    block_d = max(triton.next_power_of_2(head_dim), MIN_DOT)
    if element_size != 2 or block_d > 64:
        return None
    return 2 * default_block_n(head_dim, element_size)


def default_stages(block_n: int, head_dim: int, element_size: int) -> int:
    """Stage 1's software-pipeline stages: 3 for 16-bit K plus V tiles of TILE_BYTES and
    more (Gemma 4's head_dim 256 and 512, head_dim 128 as Llama 3 8B's, llama-1b's long
    rows' 128-key blocks), else 2. The stages change no bit.

    A block's gather takes its address from a load (the token table): at two stages
    its K and V are plain loads the loop waits for, at three they are cp.async copies
    issued a block ahead (the PTX, tests/test_triton_attention.py). Measured on an H100
    (bench/decode_splits.py --launches, us a layer at 2 / 3 stages): Gemma 4's sliding
    layers 7.4 / 6.6, 8.5 / 7.9 and 32.5 / 26.6 at 1, 8 and 64 requests of 512 keys
    (their window); its full layers 36.0 / 26.4 at one request of 8k keys, 259 / 231 at 8
    of 32k, 12.1 / 12.6 at 8 of 512. llama-1b's 16 KB tiles gain as much at long rows
    (75.3 / 68.2 at 8 requests of 8k) but lose at short ones (8.6 / 10.3 at 8 of 512,
    51.9 / 64.4 at 64), so they keep two. 32-bit caches (exact, not fast) keep two."""
    block_d = max(triton.next_power_of_2(head_dim), MIN_DOT)
    wide = 2 * block_n * block_d * element_size >= TILE_BYTES
    return 3 if wide and element_size == 2 else 2


def decode_attention(
    q: torch.Tensor,  # (B, H, D)
    k_buffer: torch.Tensor,  # (num_slots + 1, Hkv, D)
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,  # (max_reqs + 1, max_ctx) int64
    req_pool_indices: torch.Tensor,  # (B,) int64
    seq_lens: torch.Tensor,  # (B,) int32
    out: torch.Tensor,  # (B, H, D), written
    partial_out: torch.Tensor,  # (>= B, H, S, D) float32 scratch
    partial_lse: torch.Tensor,  # (>= B, H, S) float32 scratch
    partial_splits: torch.Tensor,  # (>= B,) int32 scratch
    sm_scale: float,
    sliding_window: int | None = None,
    block_n: int | None = None,  # keys per loop step (>= 16); None: default_block_n
    # Stage 1's programs along the splits (None: split_programs'); a work list's a KV head
    # (None: work_programs').
    programs: int | None = None,
    short_splits: int = NUM_KV_SPLITS,  # a short row's splits (at most the scratch's)
    rest_chunk: int | None = None,  # the combine's step over a long row's splits
    num_warps: int = 4,  # stage 1's launch (bench/decode_splits.py --launches sweeps them)
    num_stages: int | None = None,  # None: default_stages
    long_rows: tuple[int, int] | None = None,  # (from keys, BLOCK_N): see below
    chain: tuple[torch.Tensor, int] | None = None,  # (the nodes' slots, n): see below
    work_list: bool = False,  # stage 1's work as one list (see below)
) -> torch.Tensor:
    """Attention of each row's one query over its visible cached keys; returns ``out``.

    The scratch's third dimension S is the most splits a row gets (``row_splits``).
    Shapes are checked on the host only (no device sync), so this may be called inside
    a graph capture.

    ``long_rows`` = (from_keys, block_n): rows of at least from_keys visible keys run in
    a second stage-1 launch on blocks of block_n keys, the others as without; a row's
    bits are those of one launch at its class's block size. Measured on an H100 (stop
    58, BENCHMARKS.md "Long context"): 128-key blocks from 2,048 keys take llama-1b's
    attention 12-20% down at 8k and 32k keys, but the second launch costs 1.8-6.6 us a
    layer where no row is long, so the engine launches it only in decode graphs of
    batches with a long row (``PlainDecode.long_runner``, ``long_block_n``).

    ``chain`` = (tree_loc, n): the rows are a verify batch's n-node chains, request-major
    (row r is node r % n of request r // n; ``req_pool_indices`` and ``seq_lens`` are the
    requests', a length counting the prefix and all n nodes). Node i is decode's row of
    length prefix + i + 1 whose keys past the prefix are the chain's nodes 0 .. i, their
    slots ``tree_loc[r - i ..]`` (they need not be in the token table yet). So a chain's
    node rounds exactly as decode rounds that token once its path is accepted.

    ``work_list``: stage 1's grid is (P, KV heads) over one list of every row's (row, split)
    items, program p computing items p, p + P, ... (``work_programs``), instead of (rows, KV
    heads, P) with each row's splits on its own P programs. The list has as many programs
    as the grid by rows, and a long row's splits spread over all of them instead of
    queueing on its own P (16 at batch 64). Each split is computed as by rows,
    so the bits are the same. Decode rows only (chains keep the grid by rows), and at most
    MOST_LISTED_ROWS rows.
    """
    bs, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    max_splits = partial_out.shape[2]
    check_paged_inputs(q, k_buffer, v_buffer, req_to_token, out, partial_out, partial_lse,
                       partial_splits)  # fmt: skip
    assert req_pool_indices.stride(0) == 1 and seq_lens.stride(0) == 1
    tree_loc, chain_nodes = seq_lens, 0  # not a chain: the kernel never reads tree_loc
    if chain is not None:
        tree_loc, chain_nodes = chain
        assert chain_nodes >= 1 and req_pool_indices.shape[0] * chain_nodes == bs, (
            f"{bs} rows are not chains of {chain_nodes} for {req_pool_indices.shape[0]} requests"
        )
        assert tree_loc.shape == (bs,) and tree_loc.stride(0) == 1, tree_loc.shape
    if bs == 0:
        return out

    block_d = max(triton.next_power_of_2(head_dim), MIN_DOT)
    size = k_buffer.element_size()
    if block_n is None:
        block_n = default_block_n(head_dim, size)
    window = 0 if sliding_window is None else int(sliding_window)
    assert window >= 0, f"sliding_window must be positive, got {sliding_window}"
    group = num_heads // num_kv_heads
    listed = work_list and chain is None and bs <= MOST_LISTED_ROWS
    block_b = triton.next_power_of_2(bs) if listed else 0
    if listed:
        programs = programs or work_programs(bs, num_kv_heads, max_splits, short_splits)
        grid = (programs, num_kv_heads, 1)
    else:
        programs = programs or split_programs(bs * num_kv_heads, max_splits, short_splits)
        grid = (bs, num_kv_heads, programs)
    # Row classes by visible keys: [lo, hi) and their block size. One class unless
    # ``long_rows`` = (from_keys, block_n) gives rows of from_keys keys and more larger
    # blocks in a second launch (each launch's programs skip the other class's rows).
    classes = [(0, ALL_KEYS, block_n)]
    if long_rows is not None:
        classes = [(0, long_rows[0], block_n), (long_rows[0], ALL_KEYS, long_rows[1])]
    for min_keys, max_keys, class_block_n in classes:
        assert class_block_n >= MIN_DOT, class_block_n
        assert class_block_n == triton.next_power_of_2(class_block_n), class_block_n
        stages = num_stages or default_stages(class_block_n, head_dim, size)
        _decode_partial_kernel[grid](
            q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, tree_loc,
            partial_out, partial_lse, partial_splits, float(sm_scale), window, min_keys, max_keys,
            bs if listed else 0, q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
            v_buffer.stride(0), v_buffer.stride(1), req_to_token.stride(0),
            partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
            partial_lse.stride(0), partial_lse.stride(1),
            KV_GROUP=group, BLOCK_G=max(triton.next_power_of_2(group), MIN_DOT),
            **split_constants(max_splits, short_splits), BLOCK_N=class_block_n,
            HEAD_DIM=head_dim, BLOCK_D=block_d, DOT_PRECISION=dot_precision(k_buffer.dtype),
            CHAIN_NODES=chain_nodes, BLOCK_B=block_b, num_warps=num_warps, num_stages=stages,
            **pdl.launch_options(),
        )  # fmt: skip
    return combine_splits(partial_out, partial_lse, partial_splits, out, short_splits, rest_chunk)


def check_kv_inputs(q, k_buffer, v_buffer, req_to_token, out) -> None:
    """Host-side checks shared by the paged attention launchers (decode, tree verify,
    prefill; no sync): q and out (rows, H, D), the paged K/V buffers, the token table."""
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_buffer.shape[1]
    assert num_heads % num_kv_heads == 0, f"{num_heads} query heads, {num_kv_heads} KV heads"
    assert k_buffer.shape[2] == head_dim and v_buffer.shape[1:] == k_buffer.shape[1:]
    assert k_buffer.dtype == v_buffer.dtype
    assert out.shape == q.shape
    # The kernels index the last dimension (and the 1-D inputs) with unit stride.
    for name, t in (("q", q), ("k", k_buffer), ("v", v_buffer), ("out", out)):
        assert t.stride(-1) == 1, f"{name} must be contiguous in head_dim"
    assert req_to_token.stride(1) == 1


def check_paged_inputs(
    q, k_buffer, v_buffer, req_to_token, out, partial_out, partial_lse, partial_splits
) -> None:
    """``check_kv_inputs``, and the per-split float32 scratch of decode and tree verify."""
    check_kv_inputs(q, k_buffer, v_buffer, req_to_token, out)
    rows, num_heads, head_dim = q.shape
    num_splits = partial_out.shape[2]
    assert partial_out.shape[0] >= rows
    assert partial_out.shape[1:] == (num_heads, num_splits, head_dim)
    assert partial_lse.shape[0] >= rows and partial_lse.shape[1:] == (num_heads, num_splits)
    assert partial_out.dtype == partial_lse.dtype == torch.float32
    assert partial_splits.shape[0] >= rows and partial_splits.dtype == torch.int32
    assert partial_out.stride(-1) == 1 and partial_lse.stride(-1) == 1
    assert partial_splits.stride(0) == 1


def dot_precision(cache_dtype: torch.dtype) -> str:
    """The attention kernels' DOT_PRECISION: float32 caches keep float32 products (tf32
    would cost ~1e-3 relative); the precision only applies to float32 operands, so
    16-bit caches ignore it."""
    return "ieee" if cache_dtype == torch.float32 else "tf32"


def rest_splits(short: int, max_splits: int, block_d: int) -> int:
    """A long row's further splits the combine takes a step: up to 8,192 partial elements
    (a short row's 16 at head_dim 512). HAZARD: the kernel's registers are its widest
    tile's, for short rows too: at head_dim 64, 128 splits a step take 163 registers a
    thread against 56 at 16 (sm_90, bench/kernel_resources.py), so an SM holds a third
    as many combine programs. Measured on an H200 (bench/decode_splits.py --rest-chunk 16,
    llama-1b's shape): the same 1.7 us at 8 rows of 512 keys, 1 us more at 64, and 5.6 us
    less at one row of 32k keys, where 16 a step takes 8.1 us."""
    return max(
        triton.next_power_of_2(short), min(triton.next_power_of_2(max_splits), 8192 // block_d)
    )


def combine_splits(
    partial_out: torch.Tensor,
    partial_lse: torch.Tensor,
    partial_splits: torch.Tensor,
    out: torch.Tensor,
    short_splits: int = NUM_KV_SPLITS,
    rest_chunk: int | None = None,  # a long row's splits combined a step; None: rest_splits
) -> torch.Tensor:
    """``out`` (rows, H, D) from each row's splits' partial outputs and log-sum-exps: one
    launch."""
    rows, num_heads, head_dim = out.shape
    max_splits = partial_out.shape[2]
    short = min_splits(max_splits, short_splits)
    block_d = triton.next_power_of_2(head_dim)
    _decode_combine_kernel[(rows, num_heads)](
        partial_out,
        partial_lse,
        partial_splits,
        out,
        partial_out.stride(0),
        partial_out.stride(1),
        partial_out.stride(2),
        partial_lse.stride(0),
        partial_lse.stride(1),
        out.stride(0),
        out.stride(1),
        MIN_SPLITS=short,
        BLOCK_S=triton.next_power_of_2(short),
        # Chunks of at most 8,192 partial elements (a short row's at head_dim 512).
        BLOCK_REST=rest_chunk or rest_splits(short, max_splits, block_d),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        LAUNCH_DEPENDENTS=pdl.ENABLED,
        num_warps=2,
    )
    return out
