"""Rotary embeddings for q and k, every head of a token in one launch: plain (Llama
family, ``triton_rope``) or after Gemma's q/k/v RMSNorms (``gemma_qkv_norm_rope``),
one kernel for both. Either can store k and v straight into the KV cache instead of
returning them (``KVWrite``: one launch fewer per layer). Plain rope over a prefill's
many tokens (``GROUPED_FROM_TOKENS``) runs a program per token and group of heads instead
of one per token and head (``_qkv_rope_kernel``'s GROUPED programs), with the same bits.

Arithmetic: transformers' rotate-half rope with the tables cast to the activation
dtype and each product and the sum rounded to it (``triton_ops._round``), after the
norm's own rounding; plain rope is bitwise the reference's (core/models/ops.py
``torch_rope``), the normed one differs only by the norm's float32 row sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphrt.core.attention.base import KVWrite
from graphrt.devices.cuda import pdl
from graphrt.devices.cuda.triton_ops import _INTERPRETED, _norm_num_warps, _round, inv_rms


@triton.jit
def _rotated(x, xp, offs, cos_row, sin_row, dtype: tl.constexpr, ROT_DIM: tl.constexpr):
    """x (float32 values of ``dtype``) rotated at lanes ``offs`` < ROT_DIM, given each
    lane's partner ``xp`` (float32, of ``dtype``); lanes past ROT_DIM pass through. The
    reference casts the tables to the activation dtype, then rounds each product and the
    sum to it (three torch kernels): so does this. Any shape: lanes on the last axis."""
    rot = offs < ROT_DIM
    first_half = offs < ROT_DIM // 2
    # cat(-x2, x1); a sign multiply, not 0 - x, so that -0.0 stays torch.neg's.
    rotated = tl.where(first_half, -1.0, 1.0) * xp
    cos = _round(tl.load(cos_row + offs, mask=rot, other=0.0).to(tl.float32), dtype)
    sin = _round(tl.load(sin_row + offs, mask=rot, other=0.0).to(tl.float32), dtype)
    a = _round(x * cos, dtype)
    b = _round(rotated * sin, dtype)
    return tl.where(rot, _round(a + b, dtype), x)


@triton.jit
def _partner(offs, ROT_DIM: tl.constexpr):
    """The lane each rotated lane pairs with (rotate-half)."""
    return tl.where(offs < ROT_DIM // 2, offs + ROT_DIM // 2, offs - ROT_DIM // 2)


@triton.jit
def _normed_rope_rows(
    rows,  # (R, 1): each row's head, HEAD_DIM values
    live,  # (R, 1): the rows to read
    weight,  # (D,): the norm's scale, read when HAS_WEIGHT
    cos_row,  # this token's R table values (one row serves every head)
    sin_row,
    eps,
    NORM: tl.constexpr,  # Gemma's RMSNorm over each head first
    HAS_WEIGHT: tl.constexpr,
    ROPE: tl.constexpr,  # False: v (normed or as it is)
    HEAD_DIM: tl.constexpr,
    ROT_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TORCH_CUDA_MATH: tl.constexpr,
):
    """(R, BLOCK_D) float32 values of the rows' dtype: each head normed (the norm in
    float32, times the weight, one rounding) and roped (``_rotated``), as the reference
    rounds. The one arithmetic of the rope kernel's heads (``_rope_head``, ``_rope_rows``)."""
    dtype = rows.dtype.element_ty
    lanes = tl.arange(0, BLOCK_D)[None, :]
    x = tl.load(rows + lanes, mask=live & (lanes < HEAD_DIM), other=0.0).to(tl.float32)
    if NORM:
        count = tl.zeros((1,), tl.int32) + HEAD_DIM
        inv = inv_rms(tl.sum(x * x, axis=1)[:, None], count, eps, TORCH_CUDA_MATH)  # (R, 1)
        x = x * inv
        if HAS_WEIGHT:
            x = x * tl.load(weight + lanes, mask=lanes < HEAD_DIM, other=0.0).to(tl.float32)
        x = _round(x, dtype)  # the norm's output, as rope reads it
    if ROPE:
        partner = _partner(lanes, ROT_DIM)
        xp = tl.load(rows + partner, mask=live & (lanes < ROT_DIM), other=0.0).to(tl.float32)
        if NORM:  # the partner lane normed again from memory (same inv_rms: same value)
            xp = xp * inv
            if HAS_WEIGHT:
                xp = xp * tl.load(weight + partner, mask=lanes < ROT_DIM, other=0.0).to(tl.float32)
            xp = _round(xp, dtype)
        x = _rotated(x, xp, lanes, cos_row, sin_row, dtype, ROT_DIM)
    return x


@triton.jit
def _rope_head(
    src,  # this head's D values
    dst,  # where they go: an output row or a KV cache row (its dtype)
    weight,  # (D,): the norm's scale, read when HAS_WEIGHT
    cos_row,  # this token's R table values
    sin_row,
    eps,
    NORM: tl.constexpr,  # Gemma's RMSNorm over the head first
    HAS_WEIGHT: tl.constexpr,
    ROPE: tl.constexpr,  # False: v, stored (normed or as it is)
    HEAD_DIM: tl.constexpr,
    ROT_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TORCH_CUDA_MATH: tl.constexpr,
):
    """``_normed_rope_rows`` of one head, stored at ``dst``."""
    one = tl.arange(0, 1)[:, None]  # (1, 1)
    x = _normed_rope_rows(
        src + one, one >= 0, weight, cos_row, sin_row, eps, NORM, HAS_WEIGHT, ROPE, HEAD_DIM,
        ROT_DIM, BLOCK_D, TORCH_CUDA_MATH,
    )  # fmt: skip
    lanes = tl.arange(0, BLOCK_D)[None, :]
    # x holds values of the activation dtype; the cache's dtype may differ (a cast).
    tl.store(dst + one + lanes, x.to(dst.dtype.element_ty), mask=lanes < HEAD_DIM)


@triton.jit
def _rope_epilogue(
    acc, offs_m, m_mask, offs_n, Bias, Out, Positions, Cos, Sin, KCache, VCache, Loc,
    stride_cos, stride_kc_slot, stride_kc_head, stride_vc_slot, stride_vc_head,
    dtype: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, Q_ROWS: tl.constexpr, KV_ROWS: tl.constexpr,
):  # fmt: skip
    """The GEMV's q/k/v epilogue (its ROPE): float32 (BLOCK_M, BLOCK_N) sums of rope pairs
    ``[lo0, hi0, lo1, hi1, ...]`` (a head's output j beside its output j + D/2, rows
    ``offs_n``) rounded as the matmul's output is, q and k rotated by ``_rotated``, the
    plain rope kernel's own arithmetic (so the bits of the GEMV, then the rope kernel);
    q into Out (M, Q_ROWS), k and v into their caches at the rows' slots."""
    if HAS_BIAS:
        n_mask = offs_n < Q_ROWS + 2 * KV_ROWS
        acc += tl.load(Bias + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y = _round(acc, dtype)
    lo, hi = tl.split(tl.reshape(y, (BLOCK_M, BLOCK_N // 2, 2)))  # (BLOCK_M, BLOCK_N / 2)
    n_lo, n_hi = tl.split(tl.reshape(offs_n, (BLOCK_N // 2, 2)))  # (BLOCK_N / 2,)
    positions = tl.load(Positions + offs_m, mask=m_mask, other=0).to(tl.int64)
    cos_row = Cos + positions[:, None] * stride_cos  # (BLOCK_M, 1)
    sin_row = Sin + positions[:, None] * stride_cos
    lane = (n_lo % HEAD_DIM)[None, :]  # lo's lane in its head (< D/2); hi's is D/2 further
    rotate = (n_lo < Q_ROWS + KV_ROWS)[None, :]  # q and k; v is stored as it is
    lo_out = tl.where(rotate, _rotated(lo, hi, lane, cos_row, sin_row, dtype, HEAD_DIM), lo)
    hi_lane = lane + HEAD_DIM // 2
    hi_out = tl.where(rotate, _rotated(hi, lo, hi_lane, cos_row, sin_row, dtype, HEAD_DIM), hi)
    slot = tl.load(Loc + offs_m, mask=m_mask, other=0).to(tl.int64)[:, None]
    _store_heads(
        lo_out, n_lo, offs_m, m_mask, slot, Out, KCache, VCache, stride_kc_slot,
        stride_kc_head, stride_vc_slot, stride_vc_head, HEAD_DIM, Q_ROWS, KV_ROWS,
    )  # fmt: skip
    _store_heads(
        hi_out, n_hi, offs_m, m_mask, slot, Out, KCache, VCache, stride_kc_slot,
        stride_kc_head, stride_vc_slot, stride_vc_head, HEAD_DIM, Q_ROWS, KV_ROWS,
    )  # fmt: skip


@triton.jit
def _store_heads(
    y, n, offs_m, m_mask, slot, Out, KCache, VCache, stride_kc_slot, stride_kc_head,
    stride_vc_slot, stride_vc_head,
    HEAD_DIM: tl.constexpr, Q_ROWS: tl.constexpr, KV_ROWS: tl.constexpr,
):  # fmt: skip
    """(BLOCK_M, C) values of the q/k/v rows ``n`` (C,): q's into Out, k's and v's into
    their caches at the rows' ``slot`` (BLOCK_M, 1), cast to each destination's dtype."""
    n = n[None, :]
    live = m_mask[:, None] & (n < Q_ROWS + 2 * KV_ROWS)
    q_at = Out + offs_m[:, None] * Q_ROWS + n
    tl.store(q_at, y.to(Out.dtype.element_ty), mask=live & (n < Q_ROWS))
    kn = tl.maximum(n - Q_ROWS, 0)  # masked where not k; kept in range for the address
    k_at = KCache + slot * stride_kc_slot + (kn // HEAD_DIM) * stride_kc_head + kn % HEAD_DIM
    is_k = (n >= Q_ROWS) & (n < Q_ROWS + KV_ROWS)
    tl.store(k_at, y.to(KCache.dtype.element_ty), mask=live & is_k)
    vn = tl.maximum(n - Q_ROWS - KV_ROWS, 0)
    v_at = VCache + slot * stride_vc_slot + (vn // HEAD_DIM) * stride_vc_head + vn % HEAD_DIM
    tl.store(v_at, y.to(VCache.dtype.element_ty), mask=live & (n >= Q_ROWS + KV_ROWS))


# From this many tokens a plain rope (no norm) takes one program per token and group of
# heads (q, k, v), not one per token and head: an 8k-token prefill of llama-1b launched
# 393k one-warp programs of 64 values each, 239 us a layer on the H200 (3.8 of its 43.5
# ms), about ten times its bytes' time. Below it (decode, and verify up to 42 requests
# of 6 rows) a program per head, whose parallelism a few tokens need. Both give the
# same bits (rope is elementwise: the same operations in the same order on each value);
# the normed rope keeps a program per head at every width (its row sums' order is the
# kernel's).
GROUPED_FROM_TOKENS = 256


@triton.jit
def _rope_rows(
    src,  # this token's first head of the group; heads ``stride_src`` apart
    stride_src,
    dst,  # where the first head goes; heads ``stride_dst`` apart (the dst's dtype)
    stride_dst,
    num_heads,
    cos_row,  # this token's R table values
    sin_row,
    ROPE: tl.constexpr,  # False: v, stored as it is
    HEAD_DIM: tl.constexpr,
    ROT_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """``_rope_head``'s plain rope on every head of a group at once: (BLOCK_H, BLOCK_D)."""
    offs = tl.arange(0, BLOCK_D)[None, :]
    heads = tl.arange(0, BLOCK_H)[:, None]
    live = heads < num_heads
    x = _normed_rope_rows(
        src + heads * stride_src, live, src, cos_row, sin_row, 0.0, False, False, ROPE,
        HEAD_DIM, ROT_DIM, BLOCK_D, False,
    )  # fmt: skip
    tl.store(
        dst + heads * stride_dst + offs, x.to(dst.dtype.element_ty), mask=live & (offs < HEAD_DIM)
    )


@triton.jit
def _kv_heads_at(
    Cache, Out, Loc, t, stride_slot, stride_head,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, WRITE_KV: tl.constexpr,
):  # fmt: skip
    """Where token ``t``'s k (or v) heads go: (head 0's address, the stride between
    heads): its KV cache slot (WRITE_KV), else its rows of the contiguous output."""
    if WRITE_KV:
        at = Cache + tl.load(Loc + t).to(tl.int64) * stride_slot
        between = stride_head
    else:
        at = Out + t * NUM_KV_HEADS * HEAD_DIM
        between = HEAD_DIM
    return at, between


@triton.jit
def _rope_groups(
    t, Q, K, V, QOut, KOut, VOut, KCache, VCache, Loc, cos_row, sin_row, stride_qt,
    stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_kc_slot, stride_kc_head,
    stride_vc_slot, stride_vc_head,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    ROT_DIM: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr,
    BLOCK_D: tl.constexpr, WRITE_KV: tl.constexpr,
):  # fmt: skip
    """``_qkv_rope_kernel``'s GROUPED programs: token ``t``'s q heads, k heads or v heads
    (plain rope: v is launched only to be stored), each group as one tile."""
    group = tl.program_id(1)  # 0: q's heads, 1: k's, 2: v's
    if group == 0:
        _rope_rows(
            Q + t * stride_qt, stride_qh, QOut + t * NUM_Q_HEADS * HEAD_DIM, HEAD_DIM,
            NUM_Q_HEADS, cos_row, sin_row, True, HEAD_DIM, ROT_DIM, BLOCK_HQ, BLOCK_D,
        )  # fmt: skip
    elif group == 1:
        dst, stride_dst = _kv_heads_at(
            KCache, KOut, Loc, t, stride_kc_slot, stride_kc_head, NUM_KV_HEADS, HEAD_DIM, WRITE_KV
        )
        _rope_rows(
            K + t * stride_kt, stride_kh, dst, stride_dst, NUM_KV_HEADS, cos_row, sin_row,
            True, HEAD_DIM, ROT_DIM, BLOCK_HKV, BLOCK_D,
        )  # fmt: skip
    else:
        dst, stride_dst = _kv_heads_at(
            VCache, VOut, Loc, t, stride_vc_slot, stride_vc_head, NUM_KV_HEADS, HEAD_DIM, WRITE_KV
        )
        _rope_rows(
            V + t * stride_vt, stride_vh, dst, stride_dst, NUM_KV_HEADS, cos_row, sin_row,
            False, HEAD_DIM, ROT_DIM, BLOCK_HKV, BLOCK_D,
        )  # fmt: skip


@triton.jit
def _qkv_rope_kernel(
    Positions,  # (T,)
    Q,  # (T, H, D)
    K,  # (T, Hkv, D)
    V,  # (T, Hkv, D), read by the v programs (launched when V_HEADS)
    QWeight,  # (D,), read when NORM
    KWeight,
    QOut,  # (T, H, D) contiguous
    KOut,  # (T, Hkv, D) contiguous, written unless WRITE_KV
    VOut,
    KCache,  # (slots, Hkv, D), written when WRITE_KV
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
    NORM: tl.constexpr,
    WRITE_KV: tl.constexpr,
    TORCH_CUDA_MATH: tl.constexpr,
    # A program per token and group of heads (plain rope only: GROUPED_FROM_TOKENS), the
    # groups' heads padded to BLOCK_HQ and BLOCK_HKV; else a program per token and head.
    GROUPED: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
    LAUNCH_DEPENDENTS: tl.constexpr,  # decode attention's stage 1 may start (pdl.py)
):
    if LAUNCH_DEPENDENTS:
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(Positions + t * stride_pos).to(tl.int64)
    cos_row = Cos + pos * stride_cos
    sin_row = Sin + pos * stride_sin
    if GROUPED:
        _rope_groups(
            t, Q, K, V, QOut, KOut, VOut, KCache, VCache, Loc, cos_row, sin_row, stride_qt,
            stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_kc_slot,
            stride_kc_head, stride_vc_slot, stride_vc_head, NUM_Q_HEADS, NUM_KV_HEADS,
            HEAD_DIM, ROT_DIM, BLOCK_HQ, BLOCK_HKV, BLOCK_D, WRITE_KV,
        )  # fmt: skip
    else:
        h = tl.program_id(1)  # q heads, then k heads, then (when launched) v heads
        if h < NUM_Q_HEADS:
            src = Q + t * stride_qt + h * stride_qh
            dst = QOut + (t * NUM_Q_HEADS + h) * HEAD_DIM
            _rope_head(
                src, dst, QWeight, cos_row, sin_row, eps, NORM, NORM, True,
                HEAD_DIM, ROT_DIM, BLOCK_D, TORCH_CUDA_MATH,
            )  # fmt: skip
        elif h < NUM_Q_HEADS + NUM_KV_HEADS:
            kv_h = h - NUM_Q_HEADS
            dst, stride_dst = _kv_heads_at(
                KCache, KOut, Loc, t, stride_kc_slot, stride_kc_head, NUM_KV_HEADS, HEAD_DIM,
                WRITE_KV,
            )  # fmt: skip
            _rope_head(
                K + t * stride_kt + kv_h * stride_kh, dst + kv_h * stride_dst, KWeight,
                cos_row, sin_row, eps, NORM, NORM, True, HEAD_DIM, ROT_DIM, BLOCK_D,
                TORCH_CUDA_MATH,
            )  # fmt: skip
        else:  # v: normed without a scale (Gemma) or as it is (stored only)
            kv_h = h - NUM_Q_HEADS - NUM_KV_HEADS
            dst, stride_dst = _kv_heads_at(
                VCache, VOut, Loc, t, stride_vc_slot, stride_vc_head, NUM_KV_HEADS, HEAD_DIM,
                WRITE_KV,
            )  # fmt: skip
            _rope_head(
                V + t * stride_vt + kv_h * stride_vh, dst + kv_h * stride_dst, QWeight,
                cos_row, sin_row, eps, NORM, False, False, HEAD_DIM, ROT_DIM, BLOCK_D,
                TORCH_CUDA_MATH,
            )  # fmt: skip


def qkv_rope(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    norm: tuple[torch.Tensor, torch.Tensor | None, float] | None = None,
    kv_write: KVWrite | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(q, k, v) out of one launch; the shared launcher of ``triton_rope`` and
    ``gemma_qkv_norm_rope``. ``norm``: (q weight, k weight, eps) of Gemma's head norms.
    v is normed (with ``norm``) and returned, or only stored (with ``kv_write``), or not
    touched. k and v None: q only. Outputs are new contiguous tensors; None where
    ``kv_write`` stored them or nothing was asked."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = 0 if k is None else k.shape[1]
    rot_dim = cos.shape[-1]
    assert positions.shape == (num_tokens,), f"positions {tuple(positions.shape)}"
    assert cos.dim() == 2 and sin.shape == cos.shape, f"cos {cos.shape}, sin {sin.shape}"
    assert rot_dim % 2 == 0 and 0 < rot_dim <= head_dim, f"rotary dim {rot_dim} of {head_dim}"
    for name, t in (("q", q), ("k", k), ("v", v), ("cos", cos), ("sin", sin)):
        assert t is None or t.stride(-1) == 1, f"{name} must be contiguous in its last dim"
    for name, t in (("k", k), ("v", v)):
        assert t is None or (
            t.shape == (num_tokens, num_kv_heads, head_dim) and t.dtype == q.dtype
        ), f"{name} {tuple(t.shape)} {t.dtype} vs q {tuple(q.shape)} {q.dtype}"
    if norm is not None:  # per-head norm weights, read with unit stride
        for name, w in (("q_weight", norm[0]), ("k_weight", norm[1])):
            assert w is None or (w.shape == (head_dim,) and w.stride(0) == 1), (
                f"{name} {tuple(w.shape)}, stride {w.stride()}: ({head_dim},), unit stride"
            )
    v_heads = v is not None and (norm is not None or kv_write is not None)
    q_out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    k_out = v_out = None
    if k is not None and kv_write is None:
        k_out = torch.empty((num_tokens, num_kv_heads, head_dim), dtype=q.dtype, device=q.device)
        v_out = torch.empty_like(k_out) if v_heads else None
    caches = kv_caches(kv_write, num_tokens, num_kv_heads, head_dim, unused=q_out)
    if num_tokens == 0:
        return q_out, k_out, v_out
    k_in = q if k is None else k
    v_in = k_in if v is None else v
    block = triton.next_power_of_2(head_dim)
    q_weight, k_weight, eps = norm if norm is not None else (q, None, 0.0)
    args = (  # (the kernel's tensors and strides, in its order)
        positions, q, k_in, v_in, q_weight, q_weight if k_weight is None else k_weight,
        q_out, q_out if k_out is None else k_out, q_out if v_out is None else v_out,
        caches[0], caches[1], positions if kv_write is None else kv_write.loc, cos, sin,
        float(eps), positions.stride(0), q.stride(0), q.stride(1), k_in.stride(0),
        k_in.stride(1), v_in.stride(0), v_in.stride(1), cos.stride(0), sin.stride(0),
        caches[0].stride(0), caches[0].stride(1), caches[1].stride(0), caches[1].stride(1),
    )  # fmt: skip
    grouped = norm is None and num_tokens >= GROUPED_FROM_TOKENS
    block_hq = triton.next_power_of_2(num_heads)
    if grouped:  # q's heads; k's; v's (stored only): a program each
        programs = 1 + (num_kv_heads > 0) + v_heads
        num_warps = max(1, min(8, block_hq * block // 512))  # 32 heads of 64: 4 warps
    else:  # a head a program
        programs = num_heads + num_kv_heads * (2 if v_heads else 1)
        num_warps = _norm_num_warps(block)
    _qkv_rope_kernel[(num_tokens, programs)](
        *args, NUM_Q_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        ROT_DIM=rot_dim, BLOCK_D=block, NORM=norm is not None, WRITE_KV=kv_write is not None,
        TORCH_CUDA_MATH=not _INTERPRETED, GROUPED=grouped, BLOCK_HQ=block_hq,
        BLOCK_HKV=triton.next_power_of_2(max(num_kv_heads, 1)),
        LAUNCH_DEPENDENTS=pdl.ENABLED, num_warps=num_warps, enable_fp_fusion=False,
    )  # fmt: skip
    return q_out, k_out, v_out


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
    assert (v is None) == (kv_write is None), "v goes with kv_write (it is only stored)"
    q_out, k_out, _ = qkv_rope(positions, q, k, v, cos, sin, kv_write=kv_write)
    return q_out, k_out


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
    assert (k is None) == (v is None) == (k_weight is None), "k, v and k_weight go together"
    return qkv_rope(positions, q, k, v, cos, sin, (q_weight, k_weight, eps), kv_write)


def kv_caches(
    kv_write: KVWrite | None, num_tokens: int, num_kv_heads: int, head_dim: int, unused
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (K, V) caches a rope kernel writes, checked; ``unused`` (a 3-D tensor on the
    kernel's device) twice when it writes none."""
    if kv_write is None:
        return unused, unused
    k_cache, v_cache, loc = kv_write.k_buffer, kv_write.v_buffer, kv_write.loc
    assert k_cache.shape[1:] == (num_kv_heads, head_dim) and v_cache.shape == k_cache.shape
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "KV cache rows: unit stride"
    assert loc.shape == (num_tokens,) and loc.stride(0) == 1, f"loc {tuple(loc.shape)}"
    return k_cache, v_cache
