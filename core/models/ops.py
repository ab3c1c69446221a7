"""The elementwise pieces of a decoder layer, as one swappable table.

Models call these through a ``ModelOps`` table instead of spelling them out
in torch, so a device can substitute fused kernels (CUDA: Triton) without
``core/`` knowing which device it runs on. ``TORCH_OPS`` is the reference:
its arithmetic is transformers', op for op, and every device's table must
match it (bitwise in float32 where the kernel's arithmetic allows, within
rounding in bfloat16).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F


class PreNorm(NamedTuple):
    """Llama's RMSNorm applied to a matmul's input inside the matmul op (``linear(...,
    norm=)``): a device may fuse it into the matmul, saving the norm's launch."""

    weight: torch.Tensor  # (K,)
    eps: float


@dataclass(frozen=True)
class ModelOps:
    name: str
    # (x (T, D), weight (D,), eps) -> (T, D) in x's dtype
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    # (x (..., D), weight (D,) or None, eps) -> Gemma's RMSNorm (..., D) in x's dtype: the
    # norm and the weight multiply both in float32, one rounding at the end.
    gemma_rms_norm: Callable[[torch.Tensor, torch.Tensor | None, float], torch.Tensor]
    # (gate (T, I), up (T, I), activation name) -> act(gate) * up  (T, I)
    act_mul: Callable[[torch.Tensor, torch.Tensor, str], torch.Tensor]
    # (x (T, K), weight (N, K), bias (N,) or None, *, norm=None, residual=None) ->
    # rms_norm(x) @ weight.T + bias [+ residual (T, N)]  (T, N); norm a ``PreNorm``.
    # HAZARD: residual is consumed: a device may accumulate into it and return it (CUDA's
    # cuBLAS path does), so the caller must not read it again.
    linear: Callable[..., torch.Tensor]
    # (x (T, K), weight, bias, act, up, *, norm=None) -> act(x @ gate.T) * (x @ up.T) with
    # weight = [gate; up] ((2I, K): a fused gate/up projection) when up is None, else
    # act(x @ weight.T) * up; x RMS-normalised first with a ``PreNorm``.
    linear_act_mul: Callable[..., torch.Tensor]
    # (x (T, K), weight ((H + 2 Hkv) * D, K), bias, *, norm, positions (T,), cos, sin (P,
    # R), kv_write, num_heads) -> q (T, H, D): a Llama-family attention's merged q/k/v
    # projection then its rope, ``rope(positions, q, k, cos, sin, v, kv_write)``'s q, with
    # rotated k and v stored at kv_write's slots (Hkv and D: its caches'). One op, so that a
    # device may run all of it as one kernel (CUDA: the GEMV's epilogue at decode sizes).
    linear_rope: Callable[..., torch.Tensor]
    # (h, residual (T, D), weight, eps, scalar (1,) or None, next_weight or None) ->
    # (x, gemma_rms_norm(x, next_weight) or None) with x = (residual + gemma_rms_norm(h,
    # weight)) [* scalar]: Gemma's sandwich norm, residual add and layer scalar, then the
    # norm that reads x next.
    gemma_residual_norm: Callable[..., tuple[torch.Tensor, torch.Tensor | None]]
    # (h, residual (T, D), weight, eps, proj (N, D), bias=None, *, scalar=None,
    # next_weight=None, act=None, up=None) -> (x, out): x = (residual + gemma_rms_norm(h,
    # weight)) [* scalar], y = x or gemma_rms_norm(x, next_weight) when given, and out =
    # linear(y, proj, bias), or linear_act_mul(y, proj, bias, act, up) with an ``act``: a
    # Gemma 4 block's residual add and the matmul that reads the stream next, as one op
    # (CUDA fuses the norms into the GEMV at one row). Its three uses: the MLP's stacked
    # gate/up on the pre-feed-forward norm; the per-layer input's gate, (P, D) with up (T,
    # P); the next layer's attention input projection after the layer scalar and its input
    # norm.
    gemma_residual_linear: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    # (positions, q (T, H, D), k, v (T, Hkv, D) or None, q_weight, k_weight, eps, cos, sin,
    # kv_write=None) -> (rope(norm(q)), rope(norm(k)), norm(v) without scale); k, v None: q
    # only. With kv_write, k and v go into the KV cache instead and (q, None, None) returns.
    gemma_qkv_norm_rope: Callable[
        ..., tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]
    ]
    # (input_ids (T,), table (V, L*P), table_scale (), proj (T, L*P), proj_scale, norm_weight
    # (P,), eps) -> Gemma 4's per-layer inputs (T, L, P): (gemma_rms_norm(proj * proj_scale)
    # + table[input_ids] * table_scale) * 2^-0.5, per layer slice of P.
    gemma_per_layer_inputs: Callable[..., torch.Tensor]
    # (logits (N, V), cap or None, out (N, V) float32 or None) -> float32 logits, softcapped
    # as tanh(logits / cap) * cap in the logits' dtype; written into out when given.
    float_logits: Callable[..., torch.Tensor]
    # (positions (T,), q (T, H, D), k (T, Hkv, D), cos (P, R), sin (P, R), v=None,
    # kv_write=None) -> rotated (q, k): rotate-half rope over the first R dims of each head
    # (R <= D, the rest passes through). With kv_write (a ``KVWrite``), rotated k and v go
    # into the KV cache at its slots instead, and (q, None) comes back.
    rope: Callable[..., tuple[torch.Tensor, torch.Tensor | None]]
    # (x (N, C), k) -> (N, k) int64: the indices of each row's k largest values, in index
    # order; among values equal to the k-th largest, the smallest indices (the centroid-
    # masked head's clusters).
    topk_set: Callable[[torch.Tensor, int], torch.Tensor]
    # (hidden (N, H), weight (V, H), clusters (C, W) int64, top (N, k) int64) -> (N,)
    # int64: each row's token among clusters[top[row]] with the largest logit hidden .
    # weight[token] (rounded to the weight's dtype), the smallest id among equal ones:
    # the centroid-masked head's greedy draft token.
    selected_argmax: Callable[..., torch.Tensor]
    # (logits (N, V)) -> (N,) int64: each row's argmax (the smallest id among equal
    # maxima), BAD_LOGITS where the row holds NaN or +Inf: the greedy sampler.
    greedy_tokens: Callable[[torch.Tensor], torch.Tensor]
    # (input_ids (T,), table (V, H), scale () float32, tail (T, E) or None) -> (T, H [+ E])
    # in the table's dtype: [table[input_ids] * scale, tail] with the scale rounded to the
    # table's dtype first (Gemma's scaled embedding, as transformers'), the tail cast to
    # it: an MTP assistant's input row, its token's embedding beside a hidden.
    scaled_embed: Callable[..., torch.Tensor]
    # (tokens, parents, depth, valid (B, n), mask (B, n, n), target_tokens (B, n),
    # seq_lens (B,), req_slots (B,), node_locs (B, n), hidden (B * n, H), req_to_token,
    # seeds, max_context_len) -> packed (B, 1 + 3n) int64: a speculative round's tail,
    # spec.verify.round_tail's acceptance, commit, next seed and packed row, as one kernel
    # (CUDA: one launch where the tensor ops take about 45), or None, having done nothing,
    # for a tree it does not serve (CUDA: over 64 nodes). None here: spec's tensor ops.
    round_tail: Callable[..., torch.Tensor | None] | None = None
    # Every row's result independent of the rows beside it (``--batch-invariant``): the
    # model's attention layers then ask verify to round as decode (AttentionSpec).
    width_invariant: bool = False


def linear_then_rope(linear: Callable[..., torch.Tensor], rope: Callable[..., tuple]):
    """``ModelOps.linear_rope`` as its two ops, ``linear`` then ``rope`` (the reference,
    and a device's way where its fused kernel does not apply)."""

    def linear_rope(x, weight, bias, *, norm, positions, cos, sin, kv_write, num_heads):
        kv_heads, head_dim = kv_write.k_buffer.shape[-2:]
        sizes = [num_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
        q, k, v = linear(x, weight, bias, norm=norm).split(sizes, dim=-1)
        q, _ = rope(
            positions, q.view(-1, num_heads, head_dim), k.view(-1, kv_heads, head_dim),
            cos, sin, v=v.view(-1, kv_heads, head_dim), kv_write=kv_write,
        )  # fmt: skip
        return q

    return linear_rope


def residual_norm_then_linear(
    residual_norm: Callable[..., tuple], linear: Callable, linear_act_mul: Callable
):
    """``ModelOps.gemma_residual_linear`` as its two ops (the reference, and a device's way
    where its fused kernel does not apply)."""

    def gemma_residual_linear(
        h, residual, weight, eps, proj, bias=None, *, scalar=None, next_weight=None,
        act=None, up=None,
    ):  # fmt: skip
        x, normed = residual_norm(h, residual, weight, eps, scalar, next_weight)
        y = x if normed is None else normed
        if act is None:
            assert up is None, "a product needs an activation"
            return x, linear(y, proj, bias)
        return x, linear_act_mul(y, proj, bias, act, up)

    return gemma_residual_linear


def model_ops(model) -> ModelOps | None:
    """The ops table a model runs on (every model of core/models holds one), None for a
    model without one: callers then take ``TORCH_OPS``."""
    return getattr(model, "ops", None)


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def torch_gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    # transformers' Gemma4RMSNorm: pow(-0.5), not rsqrt; the weight multiplies in float32.
    xf = x.float()
    out = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        out = out * weight.float()
    return out.type_as(x)


def torch_act_mul(gate: torch.Tensor, up: torch.Tensor, act: str) -> torch.Tensor:
    return ACTIVATIONS[act](gate) * up


def torch_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm: PreNorm | None = None,
    residual: torch.Tensor | None = None,
    matmul: Callable[..., torch.Tensor] = F.linear,
) -> torch.Tensor:
    """``matmul``: (x, weight, bias) -> x @ weight.T + bias, ``F.linear``'s contract (a
    device's own: ``torch_ops_on``)."""
    if norm is not None:
        x = torch_rms_norm(x, norm.weight, norm.eps)
    out = matmul(x, weight, bias)
    return out if residual is None else residual + out


def torch_linear_act_mul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    act: str,
    up: torch.Tensor | None = None,
    *,
    norm: PreNorm | None = None,
    act_mul: Callable[[torch.Tensor, torch.Tensor, str], torch.Tensor] = torch_act_mul,
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] | None = None,
    matmul: Callable[..., torch.Tensor] = F.linear,
) -> torch.Tensor:
    """The unfused reference: the norm, one matmul, then ``act_mul`` (a device may pass its
    own norm, act_mul and matmul)."""
    if norm is not None:
        x = (rms_norm or torch_rms_norm)(x, norm.weight, norm.eps)
    out = matmul(x, weight, bias)
    if up is None:
        out, up = out.chunk(2, dim=-1)
    return act_mul(out, up, act)


def torch_gemma_residual_norm(
    h: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    scalar: torch.Tensor | None = None,
    next_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    x = residual + torch_gemma_rms_norm(h, weight, eps)
    if scalar is not None:
        x = x * scalar
    return x, None if next_weight is None else torch_gemma_rms_norm(x, next_weight, eps)


def torch_gemma_qkv_norm_rope(positions, q, k, v, q_weight, k_weight, eps, cos, sin, kv_write=None):
    q = torch_gemma_rms_norm(q, q_weight, eps)
    if k is None:  # rope rotates q and k together: a one-head view of q stands in for k
        return torch_rope(positions, q, q[:, :1], cos, sin)[0], None, None
    k = torch_gemma_rms_norm(k, k_weight, eps)
    v = torch_gemma_rms_norm(v, None, eps)
    q, k = torch_rope(positions, q, k, cos, sin)
    if kv_write is None:
        return q, k, v
    write_kv(kv_write, k, v)
    return q, None, None


def write_kv(kv_write, k: torch.Tensor, v: torch.Tensor) -> None:
    """``kv_write.k_buffer[loc] = k`` and the same for v (k, v (T, Hkv, D))."""
    kv_write.k_buffer[kv_write.loc] = k.to(kv_write.k_buffer.dtype)
    kv_write.v_buffer[kv_write.loc] = v.to(kv_write.v_buffer.dtype)


def torch_gemma_per_layer_inputs(
    input_ids: torch.Tensor,
    table: torch.Tensor,
    table_scale: torch.Tensor,
    proj: torch.Tensor,
    proj_scale: float,
    norm_weight: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    shape = (input_ids.shape[0], -1, norm_weight.shape[0])  # (T, L, P)
    tokens = (F.embedding(input_ids, table) * table_scale).view(shape)
    proj = torch_gemma_rms_norm((proj * proj_scale).view(shape), norm_weight, eps)
    return (proj + tokens) * 2.0**-0.5


def torch_float_logits(
    logits: torch.Tensor, cap: float | None, out: torch.Tensor | None = None
) -> torch.Tensor:
    if cap is not None:  # in the logits' dtype, as transformers does
        logits = torch.tanh(logits / cap) * cap
    if out is None:
        return logits.float()
    return out.copy_(logits)


def torch_scaled_embed(
    input_ids: torch.Tensor,
    table: torch.Tensor,
    scale: torch.Tensor,
    tail: torch.Tensor | None = None,
) -> torch.Tensor:
    emb = F.embedding(input_ids, table) * scale.to(table.dtype)  # (T, H)
    return emb if tail is None else torch.cat([emb, tail.to(table.dtype)], dim=-1)


def torch_topk_set(x: torch.Tensor, k: int) -> torch.Tensor:
    # A stable descending sort keeps equal values in index order (torch.topk may not).
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :k].sort(-1).values


# The token of a row whose logits hold NaN or +Inf (broken weights, an overflow): it rides
# the step's one host read with the others, and the host fails that request in one line
# instead of emitting the argmax of garbage. Never an input: the request stops first.
BAD_LOGITS = -1


def torch_greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """One max reduction gives the argmax and the row's max (a NaN propagates through both,
    a +Inf is the max), then ``max < inf``, false for NaN and +Inf alone (-Inf, a ruled-out
    token, is fine). No second pass over the logits: a one-row amax over a 262k vocabulary
    cost as much as the argmax. Device ops only: capture-safe, no sync (a decode graph
    computes it; see PlainDecode)."""
    top, tokens = logits.max(dim=-1)  # ties: the first maximum, as argmax
    return torch.where(top < float("inf"), tokens, BAD_LOGITS)


def torch_selected_argmax(
    hidden: torch.Tensor, weight: torch.Tensor, clusters: torch.Tensor, top: torch.Tensor
) -> torch.Tensor:
    tokens = clusters[top].reshape(hidden.shape[0], -1)  # (N, S)
    logits = (hidden.unsqueeze(1) @ weight[tokens].transpose(1, 2)).squeeze(1)  # (N, S)
    return smallest_token_at_max(logits, tokens, weight.shape[0])


def smallest_token_at_max(logits: torch.Tensor, tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """(N,): of each row's ``tokens`` (N, S) those whose ``logits`` (N, S) are largest, the
    smallest id: the first maximum of a full vocabulary row, whatever order S lists them.
    A NaN is the maximum, as torch's argmax has it: the id stays in the vocabulary (a draft
    step embeds it next)."""
    nan = logits.isnan()
    best = logits.amax(dim=-1, keepdim=True)  # (N, 1): NaN where the row holds one
    at_max = torch.where(nan.any(dim=-1, keepdim=True), nan, logits == best)
    return torch.where(at_max, tokens, vocab).amin(dim=-1)


ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


def torch_rope(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    v: torch.Tensor | None = None,
    kv_write=None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    cos = cos[positions].unsqueeze(1)  # (T, 1, R)
    sin = sin[positions].unsqueeze(1)
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    if kv_write is None:
        return q, k
    write_kv(kv_write, k, v)
    return q, None


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    x1, x2 = x_rot.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    # Same arithmetic as transformers: tables cast to the activation dtype first.
    out = x_rot * cos.to(x.dtype) + rotated * sin.to(x.dtype)
    return torch.cat([out, x_pass], dim=-1) if x_pass.numel() else out


def torch_ops_on(name: str, matmul: Callable[..., torch.Tensor]) -> ModelOps:
    """The reference table with every projection on ``matmul`` ((x, weight, bias) -> x @
    weight.T + bias, ``F.linear``'s contract): a device whose own matmul is its one
    difference (the CPU: oneDNN's from 2 rows, devices/cpu/onednn.py)."""
    linear = functools.partial(torch_linear, matmul=matmul)
    linear_act_mul = functools.partial(torch_linear_act_mul, matmul=matmul)
    return ModelOps(
        name=name,
        rms_norm=torch_rms_norm,
        gemma_rms_norm=torch_gemma_rms_norm,
        act_mul=torch_act_mul,
        rope=torch_rope,
        linear=linear,
        linear_act_mul=linear_act_mul,
        linear_rope=linear_then_rope(linear, torch_rope),
        gemma_residual_norm=torch_gemma_residual_norm,
        gemma_residual_linear=residual_norm_then_linear(
            torch_gemma_residual_norm, linear, linear_act_mul
        ),
        gemma_qkv_norm_rope=torch_gemma_qkv_norm_rope,
        gemma_per_layer_inputs=torch_gemma_per_layer_inputs,
        float_logits=torch_float_logits,
        topk_set=torch_topk_set,
        selected_argmax=torch_selected_argmax,
        greedy_tokens=torch_greedy_tokens,
        scaled_embed=torch_scaled_embed,
    )


TORCH_OPS = torch_ops_on("torch", F.linear)
