"""``TRITON_OPS``: the CUDA device's ``ModelOps`` table (``CudaDevice.model_ops``).

The elementwise kernels live in ``triton_ops`` (shared by every model) and
``triton_gemma`` (Gemma 4's chains); skinny matmuls go to ``triton_gemv``
where ``gemv_tuner`` measured it faster than cuBLAS for that shape, and to
cuBLAS otherwise (prefill, batches over 16 rows, float32: the parity runs
keep cuBLAS's arithmetic).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from graphrt.core.models.ops import (
    ModelOps,
    PreNorm,
    linear_then_rope,
    residual_norm_then_linear,
    torch_act_mul,
    torch_linear_act_mul,
)
from graphrt.devices.cuda.gemv_tuner import CUBLAS, TUNER
from graphrt.devices.cuda.triton_argmax import greedy_tokens
from graphrt.devices.cuda.triton_gemma import (
    float_logits,
    gemma_per_layer_inputs,
    gemma_residual_norm,
    scaled_embed,
    selected_argmax,
    topk_set,
)
from graphrt.devices.cuda.triton_gemv import (
    MAX_ROWS,
    ROW_CONFIGS,
    ResidualNorm,
    RopeWrite,
    gemv,
    invariant_configs,
)
from graphrt.devices.cuda.triton_ops import (
    ACTIVATION_CODES,
    triton_act_mul,
    triton_gemma_rms_norm,
    triton_rms_norm,
)
from graphrt.devices.cuda.triton_rope import gemma_qkv_norm_rope, triton_rope
from graphrt.devices.cuda.triton_round_tail import round_tail

_GEMV_DTYPES = (torch.bfloat16, torch.float16)


def _skinny(
    x: torch.Tensor, weight: torch.Tensor, norm: PreNorm | None = None, max_rows: int = MAX_ROWS
) -> bool:
    """A decode-sized matmul the GEMV may serve (else cuBLAS, untuned)."""
    return (
        (norm is None or norm.weight.dtype == x.dtype)
        and x.dim() == 2
        and 0 < x.shape[0] <= max_rows
        and x.dtype in _GEMV_DTYPES
        and weight.dtype == x.dtype
        and x.stride(1) == 1
        and weight.is_contiguous()
    )


def _row_class(x: torch.Tensor) -> str:
    # One row runs the CUDA-core path, 2..16 rows one tensor-core tile: within a class
    # the cost is the weight's read, whatever the rows, so one timing serves the class.
    return "1" if x.shape[0] == 1 else f"2-{MAX_ROWS}"


def cublas_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm: PreNorm | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``linear`` without the GEMV: the norm kernel, then cuBLAS. A 16-bit residual rides in
    cuBLAS's epilogue, accumulated into ``residual`` itself (``addmm_``: one launch, one
    rounding where torch rounds twice; an out-of-place addmm would copy it first, a
    second launch), as ``ModelOps.linear`` allows; float32 keeps the reference's separate
    add (the parity runs)."""
    if norm is not None:
        x = triton_rms_norm(x, norm.weight, norm.eps)
    if residual is None:
        return F.linear(x, weight, bias)
    if bias is None and x.dim() == 2 and x.dtype in _GEMV_DTYPES and residual.is_contiguous():
        return residual.addmm_(x, weight.t())
    return residual + F.linear(x, weight, bias)


def cublas_linear_act_mul(x, weight, bias, act, up=None, *, norm=None) -> torch.Tensor:
    """``linear_act_mul`` without the GEMV: norm kernel, cuBLAS, the act_mul kernel."""
    return torch_linear_act_mul(
        x, weight, bias, act, up, norm=norm, act_mul=act_mul, rms_norm=triton_rms_norm
    )


def triton_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm: PreNorm | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    def run(config, w=weight, residual=residual):
        if config is None:
            return cublas_linear(x, w, bias, norm=norm, residual=residual)
        return gemv(x, w, bias, config, norm=norm, residual=residual)

    if not _skinny(x, weight, norm):
        return run(None)
    key = ("linear", _row_class(x), *weight.shape, x.dtype, bias is not None)
    key += (norm is not None, residual is not None)
    # HAZARD: cuBLAS's candidate accumulates into the residual (addmm_), and the tuner
    # runs every candidate about a hundred times on the call's inputs: its runs add into a
    # copy, never into the live residual stream (stop 64: a fresh process's first prompt
    # of 2 to 16 tokens took the sum of every timed call).
    scratch: list[torch.Tensor] = []

    def timed(config, w=weight):
        if residual is None:
            return run(config, w)
        if not scratch:  # the tuner's first, eager call: outside its captures
            scratch.append(residual.clone())
        return run(config, w, scratch[0])

    return run(TUNER.choose(key, x.shape[0], weight, timed))


def triton_linear_rope(x, weight, bias=None, *, norm, positions, cos, sin, kv_write, num_heads):
    """``ModelOps.linear_rope``: at decode sizes the GEMV with rope and the KV write in its
    epilogue (one launch where there were two: the projection, the rope kernel) where the
    tuner finds it faster than the two launches at their best; the two ops otherwise
    (many rows, a rope over part of a head)."""
    head_dim = kv_write.k_buffer.shape[-1]

    def two_launches(config, w=weight):  # the GEMV (or cuBLAS), then the rope kernel
        def linear(x, w, bias, *, norm):
            if config is None:
                return cublas_linear(x, w, bias, norm=norm)
            return gemv(x, w, bias, config, norm=norm)

        return linear_then_rope(linear, triton_rope)(
            x, w, bias, norm=norm, positions=positions, cos=cos, sin=sin, kv_write=kv_write,
            num_heads=num_heads,
        )  # fmt: skip

    if not _skinny(x, weight, norm) or cos.shape[1] != head_dim:
        return two_launches(None)
    key = ("linear_rope", _row_class(x), *weight.shape, x.dtype, bias is not None)
    key += (norm is not None, head_dim)
    # The two launches' own best first (never inside another key's timing: see
    # triton_gemma_residual_linear).
    apart = TUNER.choose(("two launches", *key), x.shape[0], weight, two_launches)

    def run(config, w=weight):
        if config is None:  # the tuner's other candidate: the two launches at their best
            return two_launches(apart, w)
        rope = RopeWrite(positions, cos, sin, kv_write, num_heads)
        return gemv(x, w, bias, config, norm=norm, rope=rope).view(-1, num_heads, head_dim)

    return run(TUNER.choose(key, x.shape[0], weight, run))


# The most rows the residual prologue serves. Each program computes every row's norms from
# L2 (programs x rows x 2K values), so its cost grows with the rows where the two launches'
# does not: one timing serves 2 to 8 rows (a verify of up to 7 draft tokens, or 8 requests'
# draft rows), not up to 16.
RESIDUAL_ROWS = 8


def triton_gemma_residual_linear(
    h, residual, weight, eps, proj, bias=None, *, scalar=None, next_weight=None, act=None,
    up=None,
):  # fmt: skip
    """``ModelOps.gemma_residual_linear``: at decode sizes the GEMV computes x (and its
    next norm) itself (the residual norm kernel's launch goes; the first output tile's
    programs store x), on the row path with one K chunk, where the tuner finds that faster
    than the two launches at their best (every program recomputes each row's norms: a wide
    matmul's many programs, or many rows, may lose more than the launch; two to
    RESIDUAL_ROWS rows, a verify's or a batch's draft rows, weigh the row path against the
    tiles); the two ops otherwise."""
    gated = act is not None and up is None

    def two_launches(config, w=proj):  # the norm kernel, then the GEMV (or cuBLAS) on x
        x, normed = gemma_residual_norm(h, residual, weight, eps, scalar, next_weight)
        y = x if normed is None else normed
        if config is not None:
            return x, gemv(y, w, bias, config, act=act, gated=gated, up=up)
        if act is None:
            return x, cublas_linear(y, w, bias)
        return x, cublas_linear_act_mul(y, w, bias, act, up)

    one_chunk = tuple(c for c in ROW_CONFIGS if c.block_k >= h.shape[-1])
    fits = h.dim() == 2 and h.shape[0] <= RESIDUAL_ROWS and residual.stride(-1) == 1
    fits = fits and bool(one_chunk)
    fits = fits and (act is None or act in ACTIVATION_CODES) and _skinny(h, proj)
    dtypes = {weight.dtype, h.dtype} | ({next_weight.dtype} if next_weight is not None else set())
    if not fits or len(dtypes) > 1:
        return UNFUSED_RESIDUAL_LINEAR(
            h, residual, weight, eps, proj, bias, scalar=scalar, next_weight=next_weight,
            act=act, up=up,
        )  # fmt: skip
    rows = h.shape[0]
    row_class = "1" if rows == 1 else f"2-{RESIDUAL_ROWS}"
    key = ("residual_linear", row_class, *proj.shape, h.dtype, act, gated, bias is not None)
    key += (scalar is not None, next_weight is not None)
    # The two launches' own best first, tuned here: never inside another key's timing (the
    # tuner captures its candidates, and a capture cannot tune).
    apart = TUNER.choose(("two launches", *key), rows, proj, two_launches)

    def run(config, w=proj):
        if config is None:  # the tuner's other candidate: the two launches at their best
            return two_launches(apart, w)
        x = torch.empty_like(h)
        norm = ResidualNorm(residual, weight, eps, x, next_weight, scalar)
        return x, gemv(h, w, bias, config, act=act, gated=gated, up=up, residual_norm=norm)

    return run(TUNER.choose(key, rows, proj, run, (CUBLAS, *one_chunk)))


def act_mul(gate: torch.Tensor, up: torch.Tensor, act: str) -> torch.Tensor:
    """One Triton kernel for the activations it knows, torch's arithmetic for the rest."""
    if act not in ACTIVATION_CODES:  # e.g. erf "gelu": no fused kernel (yet)
        return torch_act_mul(gate, up, act)
    return triton_act_mul(gate, up, act)


def triton_linear_act_mul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    act: str,
    up: torch.Tensor | None = None,
    *,
    norm: PreNorm | None = None,
) -> torch.Tensor:
    def run(config=None, w=weight):
        if config is None:  # norm kernel, cuBLAS, then the activation kernel
            return cublas_linear_act_mul(x, w, bias, act, up, norm=norm)
        return gemv(x, w, bias, config, act=act, gated=up is None, up=up, norm=norm)

    # An activation without a fused epilogue (erf GELU) keeps torch's matmul and activation.
    if act not in ACTIVATION_CODES or not _skinny(x, weight, norm):
        return run()
    key = (
        "act_mul",
        _row_class(x),
        *weight.shape,
        x.dtype,
        bias is not None,
        act,
        up is None,
    )
    key += (norm is not None,)
    return run(TUNER.choose(key, x.shape[0], weight, run))


# The residual linear's two ops where its fusion does not apply: the residual norm kernel,
# then the tuned GEMV (or cuBLAS), with the product where there is one.
UNFUSED_RESIDUAL_LINEAR = residual_norm_then_linear(
    gemma_residual_norm, triton_linear, triton_linear_act_mul
)


# ---- batch-invariant ops ----------------------------------------------------------------

# Decode and verify rows up to 64 requests x 16 tree nodes; above (prefill), cuBLAS.
INVARIANT_MAX_ROWS = 1024


def _tile_class(x: torch.Tensor) -> str:
    rows = x.shape[0]
    if rows <= MAX_ROWS:
        return f"1-{MAX_ROWS}"
    return next(f"<={top}" for top in (64, 256, INVARIANT_MAX_ROWS) if rows <= top)


def invariant_linear(x, weight, bias=None, *, norm=None, residual=None) -> torch.Tensor:
    """``linear`` whose every row gets the same bits whatever the rows beside it: the norm
    kernel (per row), then tensor-core tiles only (triton_gemv.invariant_configs). The GEMV's
    fused norm is left out: its sum of squares runs in another order than the norm
    kernel's, and one model must not mix the two across row classes."""
    if not _skinny(x, weight, max_rows=INVARIANT_MAX_ROWS):
        return cublas_linear(x, weight, bias, norm=norm, residual=residual)
    if norm is not None:
        x = triton_rms_norm(x, norm.weight, norm.eps)

    def run(config, w=weight):
        return gemv(x, w, bias, config, residual=residual)

    key = ("linear-inv", _tile_class(x), *weight.shape, x.dtype, bias is not None)
    key += (residual is not None,)
    candidates = invariant_configs(x.shape[0])
    return run(TUNER.choose(key, x.shape[0], weight, run, candidates))


def invariant_linear_act_mul(x, weight, bias, act, up=None, *, norm=None) -> torch.Tensor:
    """``linear_act_mul`` on tiles only, as ``invariant_linear``."""
    if act not in ACTIVATION_CODES or not _skinny(x, weight, max_rows=INVARIANT_MAX_ROWS):
        return cublas_linear_act_mul(x, weight, bias, act, up, norm=norm)
    if norm is not None:
        x = triton_rms_norm(x, norm.weight, norm.eps)

    def run(config, w=weight):
        return gemv(x, w, bias, config, act=act, gated=up is None, up=up)

    key = ("act_mul-inv", _tile_class(x), *weight.shape, x.dtype, bias is not None, act)
    key += (up is None,)
    candidates = invariant_configs(x.shape[0])
    return run(TUNER.choose(key, x.shape[0], weight, run, candidates))


TRITON_OPS = ModelOps(
    name="triton",
    rms_norm=triton_rms_norm,
    gemma_rms_norm=triton_gemma_rms_norm,
    act_mul=act_mul,
    rope=triton_rope,
    linear=triton_linear,
    linear_act_mul=triton_linear_act_mul,
    linear_rope=triton_linear_rope,
    gemma_residual_norm=gemma_residual_norm,
    gemma_residual_linear=triton_gemma_residual_linear,
    gemma_qkv_norm_rope=gemma_qkv_norm_rope,
    gemma_per_layer_inputs=gemma_per_layer_inputs,
    float_logits=float_logits,
    topk_set=topk_set,
    selected_argmax=selected_argmax,
    greedy_tokens=greedy_tokens,
    scaled_embed=scaled_embed,
    round_tail=round_tail,
)

# Batch-invariant (``--batch-invariant``): a row's logits do not depend on how many rows
# run beside it, so speculative greedy output equals plain greedy output in 16-bit, as
# with float32. Its models' attention layers say so (``width_invariant``), and verify
# attention then walks decode's splits (triton_verify) instead of one pass a request.
INVARIANT_OPS = dataclasses.replace(
    TRITON_OPS,
    name="triton-batch-invariant",
    width_invariant=True,
    linear=invariant_linear,
    linear_act_mul=invariant_linear_act_mul,
    linear_rope=linear_then_rope(invariant_linear, triton_rope),
    gemma_residual_linear=residual_norm_then_linear(
        gemma_residual_norm, invariant_linear, invariant_linear_act_mul
    ),
)
