"""Building blocks shared by the model families: norms, rotary embeddings, MLP,
and parameters that load from several checkpoint tensors (fused QKV, gate/up)."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import nn

from graphrt.core.models.linear import Linear, MergedLinear
from graphrt.core.models.ops import ACTIVATIONS, TORCH_OPS, ModelOps, PreNorm
from graphrt.core.parallel.group import SINGLE, TPGroup
from graphrt.core.parallel.layers import RowParallelLinear

__all__ = ["GatedMLP", "Linear", "MergedLinear", "RMSNorm", "RotaryEmbedding", "rope_inv_freq"]


class RMSNorm(nn.Module):
    """RMS norm in float32, as transformers computes it. ``pre_norm()`` hands it to the
    matmul that reads its output (``Linear(x, norm=)``), which may fuse it."""

    def __init__(self, dim: int, eps: float, ops: ModelOps = TORCH_OPS):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)

    def pre_norm(self) -> PreNorm:
        return PreNorm(self.weight, self.eps)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up as one stacked matmul whose activation and
    product are one op (``ops.linear_act_mul``: on CUDA the GEMV's epilogue)."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        act: str = "silu",
        bias: bool = False,
        ops: ModelOps = TORCH_OPS,
        tp: TPGroup = SINGLE,
    ):
        super().__init__()
        if act not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {act!r}; known: {sorted(ACTIVATIONS)}")
        self.gate_up_proj = MergedLinear(
            hidden, {"gate_proj": intermediate, "up_proj": intermediate}, bias, ops, tp
        )
        # Rows split over the ranks, partial sums all-reduced (a plain Linear for one rank).
        self.down_proj = RowParallelLinear(intermediate, hidden, bias, tp, ops)
        self.act = act
        self.ops = ops

    def forward(
        self, x: torch.Tensor, norm: PreNorm | None = None, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        # residual + down(act(gate(norm(x))) * up(norm(x))): norm and add ride in the matmuls
        proj = self.gate_up_proj
        h = self.ops.linear_act_mul(x, proj.weight, proj.bias, self.act, norm=norm)  # (T, I)
        return self.down_proj(h, residual=residual)


def rope_inv_freq(
    head_dim: int, params: Mapping[str, object], rotary_dim: int | None = None
) -> torch.Tensor:
    """Inverse frequencies for the rope types graphrt supports (float32, on CPU).

    ``params`` is transformers' ``rope_parameters`` dict (rope_type, rope_theta, ...).
    """
    rope_type = params.get("rope_type", "default")
    theta = float(params["rope_theta"])
    dim = rotary_dim or head_dim
    # On CPU whatever the build's default device (a handful of values, as transformers
    # computes them): see RotaryEmbedding for why no arithmetic runs on the meta device.
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (theta**exponents)
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, params)
    # config.rope_parameters rejects other types with a user-facing error first.
    raise AssertionError(f"rope_type {rope_type!r} is not supported")


def _llama3_inv_freq(inv_freq: torch.Tensor, params: Mapping[str, object]) -> torch.Tensor:
    # Llama 3.1 scaling: long wavelengths divided by `factor`, short ones kept,
    # a smooth blend in between.
    factor = float(params["factor"])
    low = float(params["low_freq_factor"])
    high = float(params["high_freq_factor"])
    old_ctx = float(params["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to ``max_positions``, rotate-half layout."""

    def __init__(
        self,
        inv_freq: torch.Tensor,
        max_positions: int,
        attention_scaling: float = 1.0,
        ops: ModelOps = TORCH_OPS,
    ):
        super().__init__()
        self.ops = ops
        # Buffers, not parameters: rebuilt here, never loaded from a checkpoint; built on
        # the default device (the loader's target), so big tables never cross from host.
        shape = (max_positions, 2 * inv_freq.numel())  # (P, D)
        if torch.get_default_device().type == "meta":
            # The loader's sizing probe needs the shapes only, and arithmetic on a meta
            # tensor runs a Python decomposition whose first call imports torch._dynamo:
            # 2-3 s of every start-up.
            # Two tensors, as built: one shared would be counted once (buffers() dedups).
            cos, sin = (torch.empty(shape, dtype=torch.float32) for _ in range(2))
        else:
            t = torch.arange(max_positions, dtype=torch.float32)
            freqs = torch.outer(t, inv_freq.to(t.device))  # (P, D/2)
            emb = torch.cat([freqs, freqs], dim=-1)  # (P, D)
            cos, sin = emb.cos() * attention_scaling, emb.sin() * attention_scaling
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v=None, kv_write=None
    ):
        # q: (T, H, D), k, v: (T, Hkv, D), positions: (T,); with kv_write (the attention
        # backend's ``kv_write_target``) k and v go into the KV cache: (q, None) returns.
        return self.ops.rope(positions, q, k, self.cos, self.sin, v=v, kv_write=kv_write)
