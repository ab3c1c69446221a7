"""Gemma 4's elementwise chains as one Triton kernel each (``TRITON_OPS`` entries).

A Gemma 4 decoder layer spells, in transformers, four sandwich RMSNorms, three
residual adds, a layer scalar, three head norms and rope: about 20 small
kernels a layer, each reading and writing the hidden row. Here:

- ``gemma_residual_norm``: ``x = (residual + norm(h) * w) [* scalar]``, and the
  next norm of ``x`` (the following block's pre-norm, or the next layer's
  input norm) from the same registers: one launch per sandwich.
- ``gemma_qkv_norm_rope`` (in ``triton_rope``, one kernel with plain rope): q/k norms
  with scale, the v norm without, and rope on q and k, every head of a token in one
  launch.
- ``float_logits``: the LM head's logits as float32, softcapped on the way
  (``tanh(logits / cap) * cap`` in the model dtype) when the model caps them: the
  LM head's three elementwise kernels and the cast in one.
- ``scaled_embed``: the scaled token embedding, an MTP assistant's seed hidden beside it
  (the gather, the scale and the concatenation: three launches a draft step in torch).
- ``topk_set`` and ``selected_argmax``: the centroid-masked head's clusters (the top 32
  of 2,048 scores, one launch) and its greedy token (an MTP assistant's draft step) from
  their ~4k tokens, the weight rows gathered in registers: no (N, 4096, H) gather, no
  logits row, two launches (the second is ``triton_argmax``'s, as greedy decoding's).

Arithmetic and rounding are transformers' (see ``core/models/ops.py`` for the
reference and ``triton_ops`` for the rounding rules): every value torch
rounds to the activation dtype is rounded here at the same point.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphrt.devices.cuda import compile_ahead, pdl
from graphrt.devices.cuda.triton_argmax import _first_best, blocks_best
from graphrt.devices.cuda.triton_ops import (
    _INTERPRETED,
    _gemma_inv_rms,
    _norm_num_warps,
    _round,
    _tanh,
)


@triton.jit
def _residual_norm_kernel(
    H,  # (T, D): the block's output
    Residual,  # (T, D)
    PostWeight,  # (D,)
    Scalar,  # (1,): the layer scalar, read when HAS_SCALAR
    NextWeight,  # (D,), read when HAS_NEXT
    XOut,  # (T, D) contiguous: the new residual stream
    NextOut,  # (T, D) contiguous: norm(x) * next weight, written when HAS_NEXT
    eps,
    stride_h,
    stride_r,
    D: tl.constexpr,
    HAS_SCALAR: tl.constexpr,
    HAS_NEXT: tl.constexpr,
    BLOCK: tl.constexpr,
    TORCH_CUDA_MATH: tl.constexpr,
    LAUNCH_DEPENDENTS: tl.constexpr,  # the GEMV reading x next may start reading its weight
):
    if LAUNCH_DEPENDENTS:
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    dtype = H.dtype.element_ty
    h = tl.load(H + row * stride_h + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(PostWeight + offs, mask=mask, other=0.0).to(tl.float32)
    normed = _round(h * _gemma_inv_rms(h, eps, D, TORCH_CUDA_MATH) * w, dtype)
    r = tl.load(Residual + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
    x = _round(r + normed, dtype)
    if HAS_SCALAR:
        x = _round(x * tl.load(Scalar).to(tl.float32), dtype)
    tl.store(XOut + row * D + offs, x.to(dtype), mask=mask)
    if HAS_NEXT:
        w_next = tl.load(NextWeight + offs, mask=mask, other=0.0).to(tl.float32)
        nxt = _round(x * _gemma_inv_rms(x, eps, D, TORCH_CUDA_MATH) * w_next, dtype)
        tl.store(NextOut + row * D + offs, nxt.to(dtype), mask=mask)


def gemma_residual_norm(
    h: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    scalar: torch.Tensor | None = None,
    next_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(x, norm(x) * next_weight or None), x = (residual + norm(h) * weight) [* scalar]."""
    assert h.dim() == 2 and h.shape == residual.shape, f"h {h.shape}, residual {residual.shape}"
    assert h.stride(1) == 1 and residual.stride(1) == 1 and h.dtype == residual.dtype
    num_rows, dim = h.shape
    for name, w in (("weight", weight), ("next_weight", next_weight)):
        assert w is None or (w.shape == (dim,) and w.stride(0) == 1), f"{name} {w.shape}"
    x = torch.empty((num_rows, dim), dtype=h.dtype, device=h.device)
    nxt = None if next_weight is None else torch.empty_like(x)
    if num_rows == 0:
        return x, nxt
    block = triton.next_power_of_2(dim)
    _residual_norm_kernel[(num_rows,)](
        h,
        residual,
        weight,
        weight if scalar is None else scalar,
        weight if next_weight is None else next_weight,
        x,
        x if nxt is None else nxt,
        float(eps),
        h.stride(0),
        residual.stride(0),
        D=dim,
        HAS_SCALAR=scalar is not None,
        HAS_NEXT=next_weight is not None,
        BLOCK=block,
        TORCH_CUDA_MATH=not _INTERPRETED,
        LAUNCH_DEPENDENTS=pdl.ENABLED,
        num_warps=_norm_num_warps(block),
        enable_fp_fusion=False,
    )
    return x, nxt


EMBED_BLOCK = 1024  # output columns per program


@triton.jit
def _scaled_embed_kernel(
    Ids,  # (T,) int, any stride
    Table,  # (V, H) rows contiguous
    Scale,  # () float32
    Tail,  # (T, E) or a stand-in
    Out,  # (T, H + E) contiguous, the table's dtype
    stride_ids,
    stride_table,
    stride_tail,
    H,
    E,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    dtype = Out.dtype.element_ty
    in_emb = offs < H
    token = tl.load(Ids + row * stride_ids).to(tl.int64)
    emb = tl.load(Table + token * stride_table + offs, mask=in_emb, other=0.0).to(tl.float32)
    scale = _round(tl.load(Scale).to(tl.float32), dtype)  # scale.to(dtype), as torch
    emb = _round(emb * scale, dtype)
    in_tail = (offs >= H) & (offs < H + E)
    tail = tl.load(Tail + row * stride_tail + (offs - H), mask=in_tail, other=0.0)
    tail = _round(tail.to(tl.float32), dtype)  # to nearest-even (the interpreter truncates)
    out = tl.where(in_emb, emb, tail)
    tl.store(Out + row * (H + E) + offs, out.to(dtype), mask=offs < H + E)


def scaled_embed(
    input_ids: torch.Tensor,
    table: torch.Tensor,
    scale: torch.Tensor,
    tail: torch.Tensor | None = None,
) -> torch.Tensor:
    """[table[input_ids] * scale, tail] (T, H [+ E]) in the table's dtype, one launch
    (``TORCH_OPS``' contract: the scale rounded to the table's dtype first, the tail cast).
    ``input_ids`` may be a strided view: a one-graph round's roots are column 0 of its
    (B, n) node ids (read with unit stride, rows past the first embedded other nodes'
    ids, and their acceptance collapsed on the H200)."""
    rows, width = input_ids.shape[0], table.shape[1]
    extra = 0 if tail is None else tail.shape[1]
    assert table.stride(1) == 1 and scale.numel() == 1 and input_ids.dim() == 1
    assert tail is None or (tail.shape[0] == rows and tail.stride(1) == 1), f"tail {tail.shape}"
    out = torch.empty((rows, width + extra), dtype=table.dtype, device=table.device)
    if rows:
        grid = (rows, triton.cdiv(width + extra, EMBED_BLOCK))
        _scaled_embed_kernel[grid](
            input_ids, table, scale, out if tail is None else tail, out, input_ids.stride(0),
            table.stride(0), 0 if tail is None else tail.stride(0), width, extra,
            BLOCK=EMBED_BLOCK, num_warps=4,
        )  # fmt: skip
    return out


SOFTCAP_BLOCK = 2048  # logits per program


@triton.jit
def _softcap_kernel(
    Logits,  # (N, V)
    Out,  # (N, V) contiguous float32
    cap,
    stride_l,
    vocab,
    HAS_CAP: tl.constexpr,
    BLOCK: tl.constexpr,
    TORCH_CUDA_MATH: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < vocab
    x = tl.load(Logits + row * stride_l + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_CAP:
        dtype = Logits.dtype.element_ty
        if TORCH_CUDA_MATH:
            # torch on CUDA divides by a scalar as a multiply by its reciprocal, which the
            # host computes in IEEE float32 (div_rn; Triton's `/` is approximate).
            scaled = x * tl.math.div_rn(1.0, cap)
        else:
            scaled = tl.math.div_rn(x, cap)
        x = _round(_round(_tanh(_round(scaled, dtype), TORCH_CUDA_MATH), dtype) * cap, dtype)
    tl.store(Out + row * vocab + offs, x, mask=mask)


def float_logits(
    logits: torch.Tensor, cap: float | None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """float32 ``tanh(logits / cap) * cap`` (each step in the logits' dtype), or plain float32
    logits when ``cap`` is None; written into ``out`` (N, V) float32 when given."""
    assert logits.dim() == 2 and logits.stride(1) == 1, f"logits {tuple(logits.shape)}"
    rows, vocab = logits.shape
    if out is None:
        out = torch.empty((rows, vocab), dtype=torch.float32, device=logits.device)
    assert out.shape == logits.shape and out.dtype == torch.float32 and out.is_contiguous()
    if out.numel() == 0:
        return out
    block = min(SOFTCAP_BLOCK, triton.next_power_of_2(vocab))
    _softcap_kernel[(rows, triton.cdiv(vocab, block))](
        logits,
        out,
        float(cap or 1.0),
        logits.stride(0),
        vocab,
        HAS_CAP=cap is not None,
        BLOCK=block,
        TORCH_CUDA_MATH=not _INTERPRETED,
        num_warps=8,
        enable_fp_fusion=False,
    )
    return out


@triton.jit
def _per_layer_inputs_kernel(
    InputIds,  # (T,)
    Table,  # (V, L * P): the per-layer token embedding, gathered one row per token
    TableScale,  # (): sqrt(P) in the table's dtype
    Proj,  # (T, L * P): the model projection of the scaled embedding
    NormWeight,  # (P,)
    Out,  # (T, L, P) contiguous
    proj_scale,
    eps,
    stride_ids,
    stride_table,
    stride_proj,
    NUM_LAYERS: tl.constexpr,
    P: tl.constexpr,
    BLOCK: tl.constexpr,
    TORCH_CUDA_MATH: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    layer = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < P
    dtype = Proj.dtype.element_ty
    token = tl.load(InputIds + t * stride_ids).to(tl.int64)
    emb = tl.load(Table + token * stride_table + layer * P + offs, mask=mask, other=0.0)
    emb = _round(emb.to(tl.float32) * tl.load(TableScale).to(tl.float32), dtype)
    proj = tl.load(Proj + t * stride_proj + layer * P + offs, mask=mask, other=0.0)
    proj = _round(proj.to(tl.float32) * proj_scale, dtype)
    w = tl.load(NormWeight + offs, mask=mask, other=0.0).to(tl.float32)
    proj = _round(proj * _gemma_inv_rms(proj, eps, P, TORCH_CUDA_MATH) * w, dtype)
    out = _round(_round(proj + emb, dtype) * 0.7071067811865476, dtype)
    tl.store(Out + (t * NUM_LAYERS + layer) * P + offs, out.to(dtype), mask=mask)


def gemma_per_layer_inputs(
    input_ids: torch.Tensor,
    table: torch.Tensor,
    table_scale: torch.Tensor,
    proj: torch.Tensor,
    proj_scale: float,
    norm_weight: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """Gemma 4's per-layer inputs (T, L, P) in one launch: the gathered table row times its
    scale, plus the normed, scaled projection, times 2^-0.5 (see ``TORCH_OPS``)."""
    (num_tokens,) = input_ids.shape
    width = table.shape[1]
    per_layer = norm_weight.shape[0]
    assert norm_weight.dim() == 1 and norm_weight.stride(0) == 1, f"norm weight {norm_weight.shape}"
    assert width % per_layer == 0, f"table width {width} is not layers x {per_layer}"
    assert proj.shape == (num_tokens, width) and proj.stride(1) == 1, f"proj {proj.shape}"
    assert table.stride(1) == 1 and table.dtype == proj.dtype and table_scale.numel() == 1
    num_layers = width // per_layer
    out = torch.empty((num_tokens, num_layers, per_layer), dtype=proj.dtype, device=proj.device)
    if num_tokens == 0:
        return out
    block = triton.next_power_of_2(per_layer)
    _per_layer_inputs_kernel[(num_tokens, num_layers)](
        input_ids,
        table,
        table_scale,
        proj,
        norm_weight,
        out,
        float(proj_scale),
        float(eps),
        input_ids.stride(0),
        table.stride(0),
        proj.stride(0),
        NUM_LAYERS=num_layers,
        P=per_layer,
        BLOCK=block,
        TORCH_CUDA_MATH=not _INTERPRETED,
        num_warps=_norm_num_warps(block),
        enable_fp_fusion=False,
    )
    return out


# Selected tokens a stage-1 program scores. From 4 rows, 128: a row's 4,096 (32 clusters
# of 128) in 32 programs, enough programs for the SMs. Below, 32: one row in 32 programs
# left most SMs idle while each walked its 64 KB share in four dependent gathers, so a
# program takes a quarter of the tokens and their whole hidden rows in one gather. One
# row on the H200, both launches in a graph: 7.95 us at 128, 4.36 at 32 (16 to 64 tokens,
# 2 to 8 warps: 4.0 to 6.1; bench/results/h200-centroid-head-configs-stop77.log).
SELECTED_BLOCK, SELECTED_BLOCK_FEW_ROWS, FEW_ROWS = 128, 32, 4
SELECTED_TILE = 8192  # tokens x hidden columns a step: 64 float32 registers a thread (4 warps)


@triton.jit
def _topk_set_kernel(
    X,  # (N, C)
    Out,  # (N, K) int64
    stride_x,
    columns,  # C
    K: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """The indices of a row's K largest values, in index order; among values equal to the
    K-th largest, the smallest indices. One program a row: the K-th largest by bisection
    over the values' order-preserving int keys (32 counts over the row in registers)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_C)
    mask = offs < columns
    bits = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    bits = bits.to(tl.int32, bitcast=True)
    # Negative floats order backwards as ints: flipping their magnitude bits fixes that.
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)
    key = tl.where(mask, key, -(2**31) - 1)  # below every value's key
    lo = tl.full([], -(2**31), tl.int64)  # count(key >= lo) >= K holds throughout
    hi = tl.full([], 2**31 - 1, tl.int64)
    for _ in range(32):
        mid = lo + (hi - lo + 1) // 2
        enough = tl.sum((key >= mid).to(tl.int32), axis=0) >= K
        lo = tl.where(enough, mid, lo)
        hi = tl.where(enough, hi, mid - 1)
    above = key > lo  # fewer than K: lo is the largest key with K at or above it
    ties = mask & (key == lo)
    take = above | (
        ties & (tl.cumsum(ties.to(tl.int32), axis=0) <= K - tl.sum(above.to(tl.int32), axis=0))
    )
    slot = tl.cumsum(take.to(tl.int32), axis=0) - 1
    tl.store(Out + row * K + slot, offs.to(tl.int64), mask=take)


def topk_set(x: torch.Tensor, k: int) -> torch.Tensor:
    """(N, k) int64: the indices of each row's k largest values of ``x`` (N, C), in index
    order, ties at the k-th value to the smallest indices (``TORCH_OPS``' contract). One
    launch; torch's top-k took two (a radix select and a sort) and 17 us for one row of
    the E2B assistant's 2,048 centroid scores on an H200."""
    rows, columns = x.shape
    assert 0 < k <= columns and x.stride(1) == 1, f"top {k} of {columns}"
    out = torch.empty((rows, k), dtype=torch.int64, device=x.device)
    if rows:
        _topk_set_kernel[(rows,)](
            x, out, x.stride(0), columns, K=k, BLOCK_C=triton.next_power_of_2(columns),
            num_warps=4,
        )  # fmt: skip
    if compile_ahead.dry():  # nothing ran: these index the clusters next (HAZARD there)
        out.zero_()
    return out


@triton.jit
def _selected_max_kernel(
    Hidden,  # (N, H)
    Weight,  # (V, H) rows contiguous
    Clusters,  # (C, W) int64 token ids, W a cluster's
    Top,  # (N, k) int64 clusters of each row
    PartialMax,  # (N, P) float32
    PartialToken,  # (N, P) int64
    stride_h,
    stride_w,
    stride_top,
    selected,  # S = k * W
    vocab,
    blocks,  # P
    CLUSTER: tl.constexpr,  # W
    HIDDEN: tl.constexpr,
    BLOCK_H: tl.constexpr,  # hidden columns a step
    BLOCK_S: tl.constexpr,
):
    """BLOCK_S of one row's selected tokens (token s: entry s % W of cluster top[s // W]):
    logits hidden . weight[token] (float32 sums, rounded to the weight's dtype as the
    matmul's output is), their maximum and the smallest token id holding it. A NaN is the
    maximum (as torch's argmax): a NaN hidden must still draft an id in the vocabulary,
    which the next draft step embeds (an id past it ended a process in a device assert)."""
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    offs_s = block * BLOCK_S + tl.arange(0, BLOCK_S)
    mask_s = offs_s < selected
    cluster = tl.load(Top + row * stride_top + offs_s // CLUSTER, mask=mask_s, other=0)
    tokens = tl.load(Clusters + cluster * CLUSTER + offs_s % CLUSTER, mask=mask_s, other=0)
    logits = tl.zeros([BLOCK_S], tl.float32)
    for start in tl.static_range(0, HIDDEN, BLOCK_H):  # chunks keep the tile in registers
        offs_h = start + tl.arange(0, BLOCK_H)
        mask_h = offs_h < HIDDEN
        h = tl.load(Hidden + row * stride_h + offs_h, mask=mask_h, other=0.0).to(tl.float32)
        w = tl.load(
            Weight + tokens[:, None] * stride_w + offs_h[None, :],
            mask=mask_s[:, None] & mask_h[None, :],
            other=0.0,
        ).to(tl.float32)  # (BLOCK_S, BLOCK_H): the selected rows' chunk, gathered
        logits += tl.sum(w * h[None, :], axis=1)
    logits = logits.to(Weight.dtype.element_ty).to(tl.float32)
    best, token = _first_best(logits, tokens, mask_s, vocab)
    tl.store(PartialMax + row * blocks + block, best)
    tl.store(PartialToken + row * blocks + block, token)


def selected_argmax(
    hidden: torch.Tensor, weight: torch.Tensor, clusters: torch.Tensor, top: torch.Tensor
) -> torch.Tensor:
    """(N,) int64: for each row, the token of its clusters ``clusters[top[row]]`` whose
    logit ``hidden . weight[token]`` is largest, the smallest id among equal ones
    (``TORCH_OPS``' contract). Two launches, and no token list, (N, S, H) gather nor
    (N, S) logits in memory: at 64 rows the centroid head's gather alone writes and reads
    134 MB. The float32 sums run in another order than a matmul's, so a logit may round
    one ulp apart from torch's: argmax ties may break elsewhere, as two matmul
    libraries' would."""
    rows, width = hidden.shape
    cluster = clusters.shape[1]
    selected = top.shape[1] * cluster
    assert weight.shape[1] == width and weight.stride(1) == 1 and hidden.stride(1) == 1
    assert clusters.is_contiguous() and clusters.dtype == top.dtype == torch.int64
    assert top.shape[0] == rows and top.stride(1) == 1
    if rows == 0:
        return torch.empty(0, dtype=torch.int64, device=hidden.device)
    block_s = SELECTED_BLOCK_FEW_ROWS if rows < FEW_ROWS else SELECTED_BLOCK
    block_s = min(block_s, triton.next_power_of_2(selected))
    blocks = triton.cdiv(selected, block_s)
    partial_max = torch.empty((rows, blocks), dtype=torch.float32, device=hidden.device)
    partial_token = torch.empty((rows, blocks), dtype=torch.int64, device=hidden.device)
    _selected_max_kernel[(rows, blocks)](
        hidden,
        weight,
        clusters,
        top,
        partial_max,
        partial_token,
        hidden.stride(0),
        weight.stride(0),
        top.stride(0),
        selected,
        weight.shape[0],
        blocks,
        CLUSTER=cluster,
        HIDDEN=width,
        BLOCK_H=min(SELECTED_TILE // block_s, triton.next_power_of_2(width)),
        BLOCK_S=block_s,
        num_warps=4,
    )
    out = blocks_best(partial_max, partial_token, weight.shape[0], mark_bad=False)
    if compile_ahead.dry():  # nothing ran: the next draft step embeds these ids (HAZARD there)
        out.zero_()
    return out
