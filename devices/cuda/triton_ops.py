"""The elementwise ops of a decoder layer as one Triton kernel each, and the rounding and
activation building blocks the other Triton files share (rope: ``triton_rope``, Gemma's
chains: ``triton_gemma``, the GEMV's epilogue: ``triton_gemv``).

At batch 1 a decode step inside a CUDA graph is bound by kernel count, not by
bytes: the torch reference spells RMSNorm as ~7 kernels and rope as ~14 per
layer. Each op here is one launch with the reference's arithmetic
(core/models/ops.py), rounding for rounding:

- every intermediate the reference materialises in the activation dtype is
  rounded to that dtype here too (``_round``, to nearest even) before it is
  read again; bfloat16 is rounded by bit arithmetic because the interpreter's
  float32 -> bfloat16 cast truncates (triton 3.7), and a float32 that holds a
  bfloat16 value converts exactly under either cast;
- float32 products and sums are left unfused (``enable_fp_fusion=False``: an
  FMA would skip the rounding torch does between its separate kernels), and
  float32 divisions and square roots are the IEEE ones (``div_rn``,
  ``sqrt_rn``; Triton's ``/`` is an approximate division on NVIDIA).

So the residual add is bitwise the reference's (rope too, in its own file); RMSNorm
differs only in the order of its float32 row sum, and the activations in their float32
``exp`` / ``tanh``.

Capture-safe: launchers read host shapes and strides only (no sync), allocate
only their outputs with ``torch.empty``, and skip the launch when T == 0. Every
kernel also runs under ``TRITON_INTERPRET=1`` on CPU tensors (the CPU test lane).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

ACT_BLOCK = 1024  # columns of one act_mul program


def _norm_num_warps(block: int) -> int:
    return max(1, min(8, block // 256))  # 2048 columns -> 8 warps of 8 elements a thread


@triton.jit
def _round(x, dtype: tl.constexpr):
    """float32 x rounded to nearest-even in ``dtype``, returned as float32 (exact in dtype)."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        rounded = tl.where(x != x, x, bits.to(tl.float32, bitcast=True))  # NaN stays NaN
    else:
        rounded = x.to(dtype).to(tl.float32)
    return rounded


@triton.jit
def _rms_norm_kernel(
    X,  # (T, D)
    Weight,  # (D,)
    Out,  # (T, D) contiguous, promote(x, weight) dtype
    eps,
    stride_x,
    D: tl.constexpr,
    BLOCK: tl.constexpr,
    TORCH_CUDA_MATH: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    dtype = X.dtype.element_ty
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if TORCH_CUDA_MATH:
        # torch on CUDA: mean = sum * (1/D), rsqrt = libdevice rsqrtf (2 ulp, not 1/sqrt).
        mean_sq = tl.sum(x * x, 0) * (1.0 / D)
        inv_rms = libdevice.rsqrt(mean_sq + eps)
    else:
        # torch on CPU (and the interpreter): mean = sum / D, rsqrt = 1 / sqrt, both exact.
        mean_sq = tl.math.div_rn(tl.sum(x * x, 0), D * 1.0)
        inv_rms = tl.math.div_rn(1.0, tl.math.sqrt_rn(mean_sq + eps))
    normed = _round(x * inv_rms, dtype)  # x.to(dtype) of the reference
    w = tl.load(Weight + offs, mask=mask, other=0.0).to(tl.float32)
    out_dtype = Out.dtype.element_ty
    tl.store(Out + row * D + offs, _round(w * normed, out_dtype).to(out_dtype), mask=mask)


@triton.jit
def inv_rms(sum_sq, n, eps, TORCH_CUDA_MATH: tl.constexpr):
    """rsqrt(sum_sq / n + eps) for float32 row sums of squares over n (a runtime int) columns,
    as torch computes RMSNorm's (and Gemma's pow(-0.5)) on CUDA, or exactly elsewhere."""
    count = n.to(tl.float32)
    if TORCH_CUDA_MATH:
        return libdevice.rsqrt(sum_sq * tl.math.div_rn(1.0, count) + eps)
    return tl.math.div_rn(1.0, tl.math.sqrt_rn(tl.math.div_rn(sum_sq, count) + eps))


@triton.jit
def _gemma_inv_rms(x, eps, D: tl.constexpr, TORCH_CUDA_MATH: tl.constexpr):
    """pow(mean(x^2) + eps, -0.5) of a float32 row (masked lanes hold 0), as torch computes it."""
    if TORCH_CUDA_MATH:
        # torch on CUDA: mean = sum * (1/D); pow(-0.5) is libdevice rsqrtf there.
        inv_rms = libdevice.rsqrt(tl.sum(x * x, 0) * (1.0 / D) + eps)
    else:
        inv_rms = tl.math.div_rn(
            1.0, tl.math.sqrt_rn(tl.math.div_rn(tl.sum(x * x, 0), D * 1.0) + eps)
        )
    return inv_rms


@triton.jit
def _gemma_rms_norm_kernel(
    X,  # (T, H, D): H rows of D per token (H = 1 for a plain (T, D))
    Weight,  # (D,), read when HAS_WEIGHT
    Out,  # (T, H, D) contiguous, x's dtype
    eps,
    stride_t,
    stride_h,
    H: tl.constexpr,
    D: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    BLOCK: tl.constexpr,
    TORCH_CUDA_MATH: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    token, head = row // H, row % H
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    dtype = X.dtype.element_ty
    x = tl.load(X + token * stride_t + head * stride_h + offs, mask=mask, other=0.0)
    x = x.to(tl.float32)
    normed = x * _gemma_inv_rms(
        x, eps, D, TORCH_CUDA_MATH
    )  # float32, not rounded: Gemma multiplies the weight in first
    if HAS_WEIGHT:
        normed = normed * tl.load(Weight + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + row * D + offs, _round(normed, dtype).to(dtype), mask=mask)


# Activations by code, so one kernel serves each (fused epilogues read the same table).
ACTIVATION_CODES = {None: 0, "silu": 1, "gelu_pytorch_tanh": 2}


def activation_code(act: str | None) -> int:
    if act not in ACTIVATION_CODES:
        raise ValueError(f"no fused Triton kernel for activation {act!r}")
    return ACTIVATION_CODES[act]


@triton.jit
def _tanh(x, PRECISE: tl.constexpr):
    if PRECISE:
        t = libdevice.tanh(x)  # tanhf, as torch's CUDA gelu calls it
    else:  # the interpreter has no libdevice: tanh from numpy's exp
        e = tl.exp(-2.0 * tl.abs(x))
        t = tl.where(x < 0, -1.0, 1.0) * tl.math.div_rn(1.0 - e, 1.0 + e)
    return t


@triton.jit
def _activate(x, ACT: tl.constexpr, PRECISE: tl.constexpr):
    """float32 activation of float32 ``x`` (not rounded), as torch computes it in float32."""
    if ACT == 1:  # F.silu: x / (1 + exp(-x))
        if PRECISE:
            e = libdevice.exp(-x)
        else:
            e = tl.exp(-x)
        y = tl.math.div_rn(x, 1.0 + e)
    elif ACT == 2:  # F.gelu(approximate="tanh"), ATen's order of operations
        inner = 0.7978845608028654 * (x + 0.044715 * (x * x * x))
        y = (0.5 * x) * (1.0 + _tanh(inner, PRECISE))
    else:
        y = x
    return y


@triton.jit
def _act_mul_kernel(
    Gate,  # (T, I)
    Up,  # (T, I)
    Out,  # (T, I) contiguous
    stride_g,
    stride_u,
    inter,  # I
    BLOCK: tl.constexpr,
    ACT: tl.constexpr,
    PRECISE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(Gate + row * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(Up + row * stride_u + offs, mask=mask, other=0.0).to(tl.float32)
    # The activation rounds to the dtype (its own torch kernel), the product rounds again.
    dtype = Gate.dtype.element_ty
    act = _round(_activate(gate, ACT, PRECISE), dtype)
    tl.store(Out + row * inter + offs, _round(act * up, dtype).to(dtype), mask=mask)


# Triton picks compiled or interpreted kernels when they are decorated (TRITON_INTERPRET=1
# at import). Compiled: silu's exp and gelu's tanh are libdevice's expf / tanhf, the ones
# torch's CUDA kernels call (tl.exp is an approximate exp2 there); the interpreter has no
# libdevice, and its tl.exp is numpy's float32 exp.
_INTERPRETED = type(_act_mul_kernel).__name__ == "InterpretedFunction"


def _check_rows(name: str, t: torch.Tensor) -> None:
    assert t.dim() == 2, f"{name} must be (T, D), got {tuple(t.shape)}"
    assert t.stride(-1) == 1 or t.shape[-1] <= 1, f"{name} must be contiguous in its last dim"


def triton_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    _check_rows("x", x)
    num_rows, dim = x.shape
    assert weight.shape == (dim,) and weight.stride(0) == 1, f"weight {tuple(weight.shape)}"
    out = torch.empty(
        (num_rows, dim), dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device
    )
    if num_rows == 0:
        return out
    block = triton.next_power_of_2(dim)
    _rms_norm_kernel[(num_rows,)](
        x,
        weight,
        out,
        float(eps),
        x.stride(0),
        D=dim,
        BLOCK=block,
        TORCH_CUDA_MATH=not _INTERPRETED,
        num_warps=_norm_num_warps(block),
        enable_fp_fusion=False,
    )
    return out


def triton_gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm over the last dim of a (T, D) or (T, H, D) view, in one launch."""
    rows = x if x.dim() == 3 else x.unsqueeze(1)  # (T, H, D)
    assert rows.dim() == 3 and rows.stride(-1) == 1, f"x {tuple(x.shape)}: (T, [H,] D), unit stride"
    num_tokens, heads, dim = rows.shape
    if weight is not None:
        assert weight.shape == (dim,) and weight.stride(0) == 1, f"weight {tuple(weight.shape)}"
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    block = triton.next_power_of_2(dim)
    _gemma_rms_norm_kernel[(num_tokens * heads,)](
        rows,
        rows if weight is None else weight,
        out,
        float(eps),
        rows.stride(0),
        rows.stride(1),
        H=heads,
        D=dim,
        HAS_WEIGHT=weight is not None,
        BLOCK=block,
        TORCH_CUDA_MATH=not _INTERPRETED,
        num_warps=_norm_num_warps(block),
        enable_fp_fusion=False,
    )
    return out


def triton_act_mul(gate: torch.Tensor, up: torch.Tensor, act: str) -> torch.Tensor:
    """``act(gate) * up`` for (T, I) views (e.g. the halves of a gate/up projection)."""
    _check_rows("gate", gate)
    _check_rows("up", up)
    assert gate.shape == up.shape and gate.dtype == up.dtype, f"{gate.shape} vs {up.shape}"
    num_rows, inter = gate.shape
    out = torch.empty((num_rows, inter), dtype=gate.dtype, device=gate.device)  # (T, I)
    if num_rows == 0 or inter == 0:
        return out
    block = min(triton.next_power_of_2(inter), ACT_BLOCK)
    _act_mul_kernel[(num_rows, triton.cdiv(inter, block))](
        gate,
        up,
        out,
        gate.stride(0),
        up.stride(0),
        inter,
        BLOCK=block,
        ACT=activation_code(act),
        PRECISE=not _INTERPRETED,
        num_warps=4,
        enable_fp_fusion=False,
    )
    return out
