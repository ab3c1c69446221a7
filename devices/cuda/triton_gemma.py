"""Gemma 4's elementwise chains as one Triton kernel each (``TRITON_OPS`` entries).

A Gemma 4 decoder layer spells, in transformers, four sandwich RMSNorms, three
residual adds, a layer scalar, three head norms and rope: about 20 small
kernels a layer, each reading and writing the hidden row. Here:

- ``gemma_residual_norm``: ``x = (residual + norm(h) * w) [* scalar]``, and the
  next norm of ``x`` (the following block's pre-norm, or the next layer's
  input norm) from the same registers: one launch per sandwich.
- ``gemma_qkv_norm_rope``: q/k norms with scale, the v norm without, and rope
  on q and k, every head of a token in one launch.
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

from graphrt.core.attention.base import KVWrite
from graphrt.devices.cuda.triton_ops import (
    _INTERPRETED,
    _gemma_inv_rms,
    _norm_num_warps,
    _round,
    _tanh,
)
from graphrt.devices.cuda.triton_rope import kv_caches


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
):
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
        num_warps=_norm_num_warps(block),
        enable_fp_fusion=False,
    )
    return x, nxt


@triton.jit
def _norm_rope_head(
    src,  # this head's D raw values
    dst,
    weight,  # (D,), read when HAS_WEIGHT
    cos_row,
    sin_row,
    eps,
    HAS_WEIGHT: tl.constexpr,
    ROPE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROT_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TORCH_CUDA_MATH: tl.constexpr,
):
    dtype = src.dtype.element_ty
    offs = tl.arange(0, BLOCK_D)
    mask = offs < HEAD_DIM
    x = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
    inv_rms = _gemma_inv_rms(x, eps, HEAD_DIM, TORCH_CUDA_MATH)
    normed = x * inv_rms
    if HAS_WEIGHT:
        normed = normed * tl.load(weight + offs, mask=mask, other=0.0).to(tl.float32)
    normed = _round(normed, dtype)  # the norm's output, as rope reads it
    if ROPE:
        # Rope's partner lane, normed again from memory (same inv_rms: same value).
        rot = offs < ROT_DIM
        first_half = offs < ROT_DIM // 2
        partner = tl.where(first_half, offs + ROT_DIM // 2, offs - ROT_DIM // 2)
        xp = tl.load(src + partner, mask=rot, other=0.0).to(tl.float32) * inv_rms
        if HAS_WEIGHT:
            xp = xp * tl.load(weight + partner, mask=rot, other=0.0).to(tl.float32)
        rotated = tl.where(first_half, -1.0, 1.0) * _round(xp, dtype)
        cos = _round(tl.load(cos_row + offs, mask=rot, other=0.0).to(tl.float32), dtype)
        sin = _round(tl.load(sin_row + offs, mask=rot, other=0.0).to(tl.float32), dtype)
        a = _round(normed * cos, dtype)
        b = _round(rotated * sin, dtype)
        normed = tl.where(rot, _round(a + b, dtype), normed)
    # dst may be the KV cache (its dtype): the value is already rounded to the activations'.
    tl.store(dst + offs, normed.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _qkv_norm_rope_kernel(
    Positions,  # (T,)
    Q,  # (T, H, D)
    K,  # (T, Hkv, D), read when Hkv > 0
    V,  # (T, Hkv, D)
    QWeight,  # (D,)
    KWeight,  # (D,)
    QOut,  # (T, H, D) contiguous
    KOut,  # (T, Hkv, D) contiguous
    VOut,  # (T, Hkv, D) contiguous
    KCache,  # (slots, Hkv, D): written instead of KOut / VOut when WRITE_KV
    VCache,
    Loc,  # (T,) token slots, read when WRITE_KV
    Cos,  # (P, R)
    Sin,
    eps,
    stride_pos,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cos,
    stride_sin,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_slot,
    stride_vc_head,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROT_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    WRITE_KV: tl.constexpr,
    TORCH_CUDA_MATH: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)  # q heads, then k heads, then v heads
    pos = tl.load(Positions + t * stride_pos).to(tl.int64)
    if WRITE_KV:
        slot = tl.load(Loc + t).to(tl.int64)
    cos_row = Cos + pos * stride_cos
    sin_row = Sin + pos * stride_sin
    if h < NUM_Q_HEADS:
        src = Q + t * stride_qt + h * stride_qh
        dst = QOut + (t * NUM_Q_HEADS + h) * HEAD_DIM
        _norm_rope_head(
            src, dst, QWeight, cos_row, sin_row, eps, True, True,
            HEAD_DIM, ROT_DIM, BLOCK_D, TORCH_CUDA_MATH,
        )  # fmt: skip
    elif h < NUM_Q_HEADS + NUM_KV_HEADS:
        kv_h = h - NUM_Q_HEADS
        src = K + t * stride_kt + kv_h * stride_kh
        if WRITE_KV:
            dst = KCache + slot * stride_kc_slot + kv_h * stride_kc_head
        else:
            dst = KOut + (t * NUM_KV_HEADS + kv_h) * HEAD_DIM
        _norm_rope_head(
            src, dst, KWeight, cos_row, sin_row, eps, True, True,
            HEAD_DIM, ROT_DIM, BLOCK_D, TORCH_CUDA_MATH,
        )  # fmt: skip
    else:
        kv_h = h - NUM_Q_HEADS - NUM_KV_HEADS
        src = V + t * stride_vt + kv_h * stride_vh
        if WRITE_KV:
            dst = VCache + slot * stride_vc_slot + kv_h * stride_vc_head
        else:
            dst = VOut + (t * NUM_KV_HEADS + kv_h) * HEAD_DIM
        _norm_rope_head(
            src, dst, QWeight, cos_row, sin_row, eps, False, False,
            HEAD_DIM, ROT_DIM, BLOCK_D, TORCH_CUDA_MATH,
        )  # fmt: skip


def gemma_qkv_norm_rope(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_write: KVWrite | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Normed, rotated (q, k) and normed v as new contiguous tensors; k and v None for a
    layer that reads another layer's KV (q only). q/k/v may be strided views of one row.
    With ``kv_write``, k and v go into the KV cache at its slots: (q, None, None)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = 0 if k is None else k.shape[1]
    rot_dim = cos.shape[-1]
    assert (k is None) == (v is None) == (k_weight is None), "k, v and k_weight go together"
    assert positions.shape == (num_tokens,), f"positions {tuple(positions.shape)}"
    assert cos.dim() == 2 and sin.shape == cos.shape, f"cos {cos.shape}, sin {sin.shape}"
    assert rot_dim % 2 == 0 and 0 < rot_dim <= head_dim, f"rotary dim {rot_dim} of {head_dim}"
    views = [("q", q), ("cos", cos), ("sin", sin)]
    if k is not None:
        assert k.shape == v.shape == (num_tokens, num_kv_heads, head_dim), f"{k.shape} {v.shape}"
        views += [("k", k), ("v", v)]
    for name, t in views:
        assert t.stride(-1) == 1, f"{name} must be contiguous in its last dim"
    q_out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    k_out = v_out = None
    if k is not None and kv_write is None:
        k_out = torch.empty((num_tokens, num_kv_heads, head_dim), dtype=q.dtype, device=q.device)
        v_out = torch.empty_like(k_out)
    caches = kv_caches(kv_write, num_tokens, num_kv_heads, head_dim, unused=q_out)
    if num_tokens == 0:
        return q_out, k_out, v_out
    kv = (k, v) if k is not None else (q, q)
    _qkv_norm_rope_kernel[(num_tokens, num_heads + 2 * num_kv_heads)](
        positions,
        q,
        kv[0],
        kv[1],
        q_weight,
        q_weight if k_weight is None else k_weight,
        q_out,
        q_out if k_out is None else k_out,
        q_out if v_out is None else v_out,
        caches[0],
        caches[1],
        positions if kv_write is None else kv_write.loc,
        cos,
        sin,
        float(eps),
        positions.stride(0),
        q.stride(0),
        q.stride(1),
        kv[0].stride(0),
        kv[0].stride(1),
        kv[1].stride(0),
        kv[1].stride(1),
        cos.stride(0),
        sin.stride(0),
        caches[0].stride(0),
        caches[0].stride(1),
        caches[1].stride(0),
        caches[1].stride(1),
        NUM_Q_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        ROT_DIM=rot_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        WRITE_KV=kv_write is not None,
        TORCH_CUDA_MATH=not _INTERPRETED,
        num_warps=_norm_num_warps(triton.next_power_of_2(head_dim)),
        enable_fp_fusion=False,
    )
    return q_out, k_out, v_out


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
