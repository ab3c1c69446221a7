"""The elementwise pieces of a decoder layer, as one swappable table.

Models call these through a ``ModelOps`` table instead of spelling them out
in torch, so a device can substitute fused kernels (CUDA: Triton) without
``core/`` knowing which device it runs on. ``TORCH_OPS`` is the reference:
its arithmetic is transformers', op for op, and every device's table must
match it (bitwise in float32 where the kernel's arithmetic allows, within
rounding in bfloat16).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class ModelOps:
    name: str
    # (x (T, D), weight (D,), eps) -> (T, D) in x's dtype
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    # (x, residual (T, D), weight, eps) -> (rms_norm(x + residual), x + residual); the sum is
    # rounded to x's dtype before the norm reads it, as transformers' residual add does.
    add_rms_norm: Callable[
        [torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]
    ]
    # (x (..., D), weight (D,) or None, eps) -> Gemma's RMSNorm (..., D) in x's dtype: the
    # norm and the weight multiply both in float32, one rounding at the end.
    gemma_rms_norm: Callable[[torch.Tensor, torch.Tensor | None, float], torch.Tensor]
    # (x (T, 2I)) -> silu(x[:, :I]) * x[:, I:]  (T, I)
    silu_mul: Callable[[torch.Tensor], torch.Tensor]
    # (positions (T,), q (T, H, D), k (T, Hkv, D), cos (P, R), sin (P, R)) -> rotated (q, k):
    # rotate-half rope over the first R dims of each head (R <= D, the rest passes through).
    rope: Callable[
        [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
        tuple[torch.Tensor, torch.Tensor],
    ]


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def torch_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x + residual
    return torch_rms_norm(summed, weight, eps), summed


def torch_gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    # transformers' Gemma4RMSNorm: pow(-0.5), not rsqrt; the weight multiplies in float32.
    xf = x.float()
    out = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        out = out * weight.float()
    return out.type_as(x)


def torch_silu_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def torch_rope(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    cos = cos[positions].unsqueeze(1)  # (T, 1, R)
    sin = sin[positions].unsqueeze(1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    x1, x2 = x_rot.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    # Same arithmetic as transformers: tables cast to the activation dtype first.
    out = x_rot * cos.to(x.dtype) + rotated * sin.to(x.dtype)
    return torch.cat([out, x_pass], dim=-1) if x_pass.numel() else out


TORCH_OPS = ModelOps(
    name="torch",
    rms_norm=torch_rms_norm,
    add_rms_norm=torch_add_rms_norm,
    gemma_rms_norm=torch_gemma_rms_norm,
    silu_mul=torch_silu_mul,
    rope=torch_rope,
)
