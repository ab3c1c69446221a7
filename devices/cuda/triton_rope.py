"""Rotary embeddings as one Triton launch for q and k (Llama family), optionally storing
k and v straight into the KV cache (``KVWrite``: one launch fewer per layer).

Arithmetic: transformers' rotate-half rope with the tables cast to the activation
dtype and each product and the sum rounded to it (``triton_ops._round``), so q and k
are bitwise the reference's (core/models/ops.py ``torch_rope``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphrt.core.attention.base import KVWrite
from graphrt.devices.cuda.triton_ops import _round


@triton.jit
def _rope_one_head(
    src,  # this head's D values
    dst,
    cos_row,  # this token's R table values
    sin_row,
    HEAD_DIM: tl.constexpr,
    ROT_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    dtype = src.dtype.element_ty
    offs = tl.arange(0, BLOCK_D)
    mask = offs < HEAD_DIM
    rot = offs < ROT_DIM
    first_half = offs < ROT_DIM // 2
    partner = tl.where(first_half, offs + ROT_DIM // 2, offs - ROT_DIM // 2)
    x = tl.load(src + offs, mask=mask, other=0.0)
    x_partner = tl.load(src + partner, mask=rot, other=0.0)
    # cat(-x2, x1); a sign multiply, not 0 - x, so that -0.0 stays torch.neg's.
    rotated = tl.where(first_half, -1.0, 1.0) * x_partner.to(tl.float32)
    # The reference casts the tables to the activation dtype, then rounds each
    # product and the sum to it (three torch kernels).
    cos = _round(tl.load(cos_row + offs, mask=rot, other=0.0).to(tl.float32), dtype)
    sin = _round(tl.load(sin_row + offs, mask=rot, other=0.0).to(tl.float32), dtype)
    a = _round(x.to(tl.float32) * cos, dtype)
    b = _round(rotated * sin, dtype)
    out = tl.where(rot, _round(a + b, dtype).to(dtype), x)
    tl.store(dst + offs, out.to(dst.dtype.element_ty), mask=mask)  # dst: maybe the KV cache


@triton.jit
def _rope_kernel(
    Positions,  # (T,)
    Q,  # (T, H, D)
    K,  # (T, Hkv, D)
    V,  # (T, Hkv, D), copied into VCache when WRITE_KV
    QOut,  # (T, H, D) contiguous
    KOut,  # (T, Hkv, D) contiguous, written unless WRITE_KV
    KCache,  # (slots, Hkv, D), written when WRITE_KV
    VCache,
    Loc,  # (T,) token slots, read when WRITE_KV
    Cos,  # (P, R)
    Sin,
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
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)  # q heads first, then k heads (then v heads): one launch for all
    pos = tl.load(Positions + t * stride_pos).to(tl.int64)
    cos_row = Cos + pos * stride_cos
    sin_row = Sin + pos * stride_sin
    if WRITE_KV:
        slot = tl.load(Loc + t).to(tl.int64)
    if h < NUM_Q_HEADS:
        src = Q + t * stride_qt + h * stride_qh
        dst = QOut + (t * NUM_Q_HEADS + h) * HEAD_DIM
        _rope_one_head(src, dst, cos_row, sin_row, HEAD_DIM, ROT_DIM, BLOCK_D)
    elif h < NUM_Q_HEADS + NUM_KV_HEADS:
        kv_h = h - NUM_Q_HEADS
        src = K + t * stride_kt + kv_h * stride_kh
        if WRITE_KV:
            dst = KCache + slot * stride_kc_slot + kv_h * stride_kc_head
        else:
            dst = KOut + (t * NUM_KV_HEADS + kv_h) * HEAD_DIM
        _rope_one_head(src, dst, cos_row, sin_row, HEAD_DIM, ROT_DIM, BLOCK_D)
    else:
        # v heads, launched only when WRITE_KV: v goes into the cache as it is. The body
        # sits under the constexpr too: this branch is compiled either way (h is runtime).
        if WRITE_KV:
            kv_h = h - NUM_Q_HEADS - NUM_KV_HEADS
            offs = tl.arange(0, BLOCK_D)
            mask = offs < HEAD_DIM
            row = tl.load(V + t * stride_vt + kv_h * stride_vh + offs, mask=mask)
            dst = VCache + slot * stride_vc_slot + kv_h * stride_vc_head
            tl.store(dst + offs, row.to(VCache.dtype.element_ty), mask=mask)


def triton_rope(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    v: torch.Tensor | None = None,
    kv_write: KVWrite | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rotated (q, k) as new contiguous tensors; q and k may be strided views of a qkv row.
    With ``kv_write``, rotated k and ``v`` go into the KV cache at its slots: (q, None)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    rot_dim = cos.shape[-1]
    assert k.shape == (num_tokens, num_kv_heads, head_dim) and k.dtype == q.dtype
    assert positions.shape == (num_tokens,), f"positions {tuple(positions.shape)}"
    assert cos.dim() == 2 and sin.shape == cos.shape, f"cos {cos.shape}, sin {sin.shape}"
    assert rot_dim % 2 == 0 and 0 < rot_dim <= head_dim, f"rotary dim {rot_dim} of {head_dim}"
    assert (v is None) == (kv_write is None), "v goes with kv_write (it is only stored)"
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin), ("v", v)):
        assert t is None or t.stride(-1) == 1, f"{name} must be contiguous in its last dim"
    if v is not None:
        assert v.shape == k.shape, f"v {tuple(v.shape)}, k {tuple(k.shape)}"
    q_out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    k_out = None
    if kv_write is None:
        k_out = torch.empty((num_tokens, num_kv_heads, head_dim), dtype=k.dtype, device=k.device)
    caches = kv_caches(kv_write, num_tokens, num_kv_heads, head_dim, unused=q_out)
    if num_tokens == 0:
        return q_out, k_out
    v_in = k if v is None else v
    heads = num_heads + num_kv_heads * (1 if kv_write is None else 2)
    _rope_kernel[(num_tokens, heads)](
        positions,
        q,
        k,
        v_in,
        q_out,
        q_out if k_out is None else k_out,
        caches[0],
        caches[1],
        positions if kv_write is None else kv_write.loc,
        cos,
        sin,
        positions.stride(0),
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v_in.stride(0),
        v_in.stride(1),
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
        num_warps=1,
        enable_fp_fusion=False,
    )
    return q_out, k_out


def kv_caches(
    kv_write: KVWrite | None, num_tokens: int, num_kv_heads: int, head_dim: int, unused
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (K, V) caches a fused rope kernel writes, checked; ``unused`` (a 3-D tensor on
    the kernel's device) twice when it writes none."""
    if kv_write is None:
        return unused, unused
    k_cache, v_cache, loc = kv_write.k_buffer, kv_write.v_buffer, kv_write.loc
    assert k_cache.shape[1:] == (num_kv_heads, head_dim) and v_cache.shape == k_cache.shape
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "KV cache rows: unit stride"
    assert loc.shape == (num_tokens,) and loc.stride(0) == 1, f"loc {tuple(loc.shape)}"
    return k_cache, v_cache
