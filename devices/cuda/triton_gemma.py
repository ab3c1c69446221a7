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

Arithmetic and rounding are transformers' (see ``core/models/ops.py`` for the
reference and ``triton_ops`` for the rounding rules): every value torch
rounds to the activation dtype is rounded here at the same point.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphrt.devices.cuda import pdl
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
