"""Paged decode attention in Triton: flash-decoding with a fixed number of KV splits.

One query token per request attends over that request's cached tokens, which
live at scattered slots of the token KV pool (``req_to_token`` maps position
-> slot). Stage 1 splits each row's visible range into ``num_kv_splits``
chunks and runs an online softmax over each (grid B x H x S), writing a
partial output and its log-sum-exp; stage 2 combines the S partials (grid
B x H).

Capture-safe: the launch reads only device tensors and host shapes, never
syncs, allocates nothing (the caller owns ``out`` and the scratch), and its
grid depends on the batch size and head count alone. The split count is a
fixed constant, never derived from sequence lengths, so an eager run and a
graph replay of the same padded batch are bitwise identical.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Fixed, not tuned per batch: changing it changes the float summation order.
NUM_KV_SPLITS = 8


@triton.jit
def _decode_partial_kernel(
    Q,  # (B, H, D)
    K,  # (num_slots + 1, Hkv, D)
    V,
    ReqToToken,  # (max_reqs + 1, max_ctx)
    ReqPoolIndices,  # (B,)
    SeqLens,  # (B,)
    PartialOut,  # (>= B, H, S, D) float32
    PartialLse,  # (>= B, H, S) float32
    sm_scale,
    window,  # 0 = no sliding window
    head_dim,
    stride_qb,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_req,
    stride_pob,
    stride_poh,
    stride_pos,
    stride_plb,
    stride_plh,
    KV_GROUP: tl.constexpr,  # query heads per KV head
    NUM_KV_SPLITS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    kv_h = h // KV_GROUP

    seq_len = tl.load(SeqLens + b).to(tl.int32)
    req = tl.load(ReqPoolIndices + b).to(tl.int64)
    # Key j is visible to the query at p = seq_len - 1 iff j > p - window.
    lo = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    chunk = tl.cdiv(seq_len - lo, NUM_KV_SPLITS)
    start = lo + split * chunk
    end = tl.minimum(start + chunk, seq_len)

    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_d, mask=mask_d, other=0.0)
    q = q.to(tl.float32)

    m = tl.full([1], float("-inf"), tl.float32)  # running max of the scaled scores
    l_sum = tl.zeros([1], tl.float32)  # running sum of exp(score - m)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        slots = tl.load(ReqToToken + req * stride_req + offs_n, mask=mask_n, other=0).to(tl.int64)
        mask_nd = mask_n[:, None] & mask_d[None, :]
        k = tl.load(
            K + slots[:, None] * stride_kt + kv_h * stride_kh + offs_d[None, :],
            mask=mask_nd,
            other=0.0,
        ).to(tl.float32)  # (BLOCK_N, BLOCK_D)
        scores = tl.sum(q[None, :] * k, 1) * sm_scale  # (BLOCK_N,)
        scores = tl.where(mask_n, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 0))  # finite: the block holds a visible key
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new)
        v = tl.load(
            V + slots[:, None] * stride_vt + kv_h * stride_vh + offs_d[None, :],
            mask=mask_nd,
            other=0.0,
        ).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        l_sum = l_sum * alpha + tl.sum(p, 0)
        m = m_new

    # An empty split (short or windowed rows) writes zeros and lse = -inf, so
    # stage 2 gives it weight 0 without reading uninitialised scratch.
    nonempty = l_sum > 0
    out = acc / tl.where(nonempty, l_sum, 1.0)
    lse = tl.where(nonempty, m + tl.log(tl.where(nonempty, l_sum, 1.0)), float("-inf"))
    po = PartialOut + b * stride_pob + h * stride_poh + split * stride_pos
    tl.store(po + offs_d, out, mask=mask_d)
    lse_ptr = PartialLse + b * stride_plb + h * stride_plh + split + tl.arange(0, 1)
    tl.store(lse_ptr, lse)


@triton.jit
def _decode_combine_kernel(
    PartialOut,
    PartialLse,
    Out,  # (B, H, D), q's dtype
    head_dim,
    stride_pob,
    stride_poh,
    stride_pos,
    stride_plb,
    stride_plh,
    stride_ob,
    stride_oh,
    NUM_KV_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    mask_s = offs_s < NUM_KV_SPLITS
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim

    lse = tl.load(
        PartialLse + b * stride_plb + h * stride_plh + offs_s, mask=mask_s, other=float("-inf")
    )  # (BLOCK_S,)
    lse_max = tl.max(lse, 0)
    # Every split empty (seq_len 0) would make lse_max -inf; keep it NaN-free.
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weight = tl.exp(lse - lse_max)  # 0 for empty splits
    partial = tl.load(
        PartialOut
        + b * stride_pob
        + h * stride_poh
        + offs_s[:, None] * stride_pos
        + offs_d[None, :],
        mask=mask_s[:, None] & mask_d[None, :],
        other=0.0,
    )  # (BLOCK_S, BLOCK_D)
    total = tl.sum(weight, 0)
    out = tl.sum(weight[:, None] * partial, 0) / tl.where(total > 0, total, 1.0)
    tl.store(
        Out + b * stride_ob + h * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=mask_d
    )


def allocate_decode_scratch(
    max_bs: int,
    num_heads: int,
    head_dim: int,
    device: torch.device,
    num_kv_splits: int = NUM_KV_SPLITS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial outputs (max_bs, H, S, D) and log-sum-exps (max_bs, H, S), float32.

    One pair serves every layer of that (H, D): layers run one after another.
    """
    partial_out = torch.empty(
        (max_bs, num_heads, num_kv_splits, head_dim), dtype=torch.float32, device=device
    )
    partial_lse = torch.empty(
        (max_bs, num_heads, num_kv_splits), dtype=torch.float32, device=device
    )
    return partial_out, partial_lse


def decode_attention(
    q: torch.Tensor,  # (B, H, D)
    k_buffer: torch.Tensor,  # (num_slots + 1, Hkv, D)
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,  # (max_reqs + 1, max_ctx) int64
    req_pool_indices: torch.Tensor,  # (B,) int64
    seq_lens: torch.Tensor,  # (B,) int32
    out: torch.Tensor,  # (B, H, D), written
    partial_out: torch.Tensor,  # (>= B, H, S, D) float32 scratch
    partial_lse: torch.Tensor,  # (>= B, H, S) float32 scratch
    sm_scale: float,
    sliding_window: int | None = None,
    block_n: int | None = None,  # keys per loop step; None picks by head_dim
) -> torch.Tensor:
    """Attention of each row's one query over its visible cached keys; returns ``out``.

    The split count S is the scratch's third dimension. Shapes are checked on
    the host only (no device sync), so this may be called inside a graph capture.
    """
    bs, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    num_splits = partial_out.shape[2]
    assert num_heads % num_kv_heads == 0, f"{num_heads} query heads, {num_kv_heads} KV heads"
    assert k_buffer.shape[2] == head_dim and v_buffer.shape[1:] == k_buffer.shape[1:]
    assert partial_out.shape[0] >= bs and partial_out.shape[1:] == (num_heads, num_splits, head_dim)
    assert partial_lse.shape[0] >= bs and partial_lse.shape[1:] == (num_heads, num_splits)
    assert partial_out.dtype == partial_lse.dtype == torch.float32
    assert out.shape == q.shape
    # The kernels index the last dimension (and the 1-D inputs) with unit stride.
    for name, t in (("q", q), ("k", k_buffer), ("v", v_buffer), ("out", out)):
        assert t.stride(-1) == 1, f"{name} must be contiguous in head_dim"
    assert partial_out.stride(-1) == 1 and partial_lse.stride(-1) == 1
    assert req_to_token.stride(1) == 1
    assert req_pool_indices.stride(0) == 1 and seq_lens.stride(0) == 1
    if bs == 0:
        return out

    block_d = triton.next_power_of_2(head_dim)
    if block_n is None:
        block_n = 64 if block_d <= 128 else 32  # keeps the (BLOCK_N, BLOCK_D) tile in registers
    window = 0 if sliding_window is None else int(sliding_window)
    assert window >= 0, f"sliding_window must be positive, got {sliding_window}"

    _decode_partial_kernel[(bs, num_heads, num_splits)](
        q,
        k_buffer,
        v_buffer,
        req_to_token,
        req_pool_indices,
        seq_lens,
        partial_out,
        partial_lse,
        float(sm_scale),
        window,
        head_dim,
        q.stride(0),
        q.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        req_to_token.stride(0),
        partial_out.stride(0),
        partial_out.stride(1),
        partial_out.stride(2),
        partial_lse.stride(0),
        partial_lse.stride(1),
        KV_GROUP=num_heads // num_kv_heads,
        NUM_KV_SPLITS=num_splits,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        num_warps=4,
        num_stages=2,
    )
    _decode_combine_kernel[(bs, num_heads)](
        partial_out,
        partial_lse,
        out,
        head_dim,
        partial_out.stride(0),
        partial_out.stride(1),
        partial_out.stride(2),
        partial_lse.stride(0),
        partial_lse.stride(1),
        out.stride(0),
        out.stride(1),
        NUM_KV_SPLITS=num_splits,
        BLOCK_S=triton.next_power_of_2(num_splits),
        BLOCK_D=block_d,
        num_warps=2,
    )
    return out
