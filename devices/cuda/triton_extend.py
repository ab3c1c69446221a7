"""Prefill (EXTEND) attention in Triton: every request of a prefill step in one launch.

A prefill step carries B requests' chunks of new tokens, flattened request-major: request
b's ``extend_lens[b]`` tokens start at row ``extend_starts[b]`` and sit at positions
``prefix_lens[b]`` on (the tokens cached before this chunk come first). Their K/V are
already in the token pool, and the token table (``req_to_token``) lists every position's
slot, this chunk's included, so a query at position p reads keys 0 .. p of its request
through the table alone, each subject to the sliding window ``k_pos > p - window``.

Why a kernel: the torch reference runs one SDPA per request and layer, a dozen ops each
(gather, transpose, cast, the attention, the copy back). A server's prefill of 40 short
prompts on a 16-layer model was 6,700 launches and about 40 ms of host time on the H200,
for a few ms of device work, while every running request's decode waited behind it.

Work decomposition: one program per (request, query head, block of BLOCK_M of its new
tokens); a program walks its request's keys from the window's start (or 0) to its last
query's position in BLOCK_N blocks, with decode's building blocks (``_load_kv_block``,
``_attend_block``: the online softmax). The grid's last axis covers the longest chunk;
programs past a shorter request's chunk do nothing. Host lengths only: no sync.

Eager only (prefill is never captured): nothing here needs to be capture-safe, but the
launch allocates nothing either (the caller owns ``out``).

Speed (H200, bf16, llama-1b's 32 heads on 8, head_dim 64; bench/extend_blocks.py, us a
layer): 40 prompts of 200 tokens 143 against SDPA's 3,433 (one call a request), one
512-token prompt 62 against 181, but one 8,192-token prompt 1,402 against 814 (cuDNN's
flash kernel). So the attention backend sends a long chunk (``SDPA_MIN_CHUNK``) of a
full-attention layer to SDPA instead, request by request (devices/cuda/attention.py).
"""

from __future__ import annotations

from collections.abc import Collection

import torch
import triton
import triton.language as tl

from graphrt.core.host import to_device
from graphrt.devices.cuda.triton_decode import (
    MIN_DOT,
    _attend_block,
    _load_kv_block,
    check_kv_inputs,
    dot_precision,
)


def _blocks(block_d: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, warps, stages) for a padded head_dim: the q tile, the K and V
    tiles and the float32 accumulator stay in registers and shared memory at Gemma 4's 256
    and 512."""
    if block_d <= 128:  # bench/extend_blocks.py: the best of 6 at 512, 8k and 40 x 200 tokens
        return 64, 32, 4, 3
    return (32, 32, 4, 3) if block_d <= 256 else (16, 32, 8, 3)


@triton.jit
def _extend_kernel(
    Q, K, V, Out, ReqToToken, ReqSlots, Meta, sm_scale, window,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_req, num_reqs,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SLIDING: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    # The last query blocks walk the most keys: they go first, so no long one starts last.
    m0 = (tl.num_programs(2) - 1 - tl.program_id(2)) * BLOCK_M
    # Meta rows (3, B): tokens before the chunk, the chunk's first row, its length.
    n_new = tl.load(Meta + 2 * num_reqs + b)
    if m0 < n_new:
        req = tl.load(ReqSlots + b).to(tl.int64)
        prefix = tl.load(Meta + b)
        start = tl.load(Meta + num_reqs + b)
        offs_m = m0 + tl.arange(0, BLOCK_M)
        mask_m = offs_m < n_new
        q_pos = prefix + offs_m  # (BLOCK_M,)
        rows = (start + offs_m).to(tl.int64)
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < HEAD_DIM
        q = tl.load(
            Q + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
            mask=mask_m[:, None] & mask_d[None, :],
            other=0.0,
        ).to(K.dtype.element_ty)  # (BLOCK_M, BLOCK_D): the reference casts q to the cache's
        kv_h = h // GROUP
        end = prefix + tl.minimum(n_new, m0 + BLOCK_M)  # past the block's last query
        lo = 0
        if SLIDING:  # the block's first query sees nothing before its window
            lo = tl.maximum(prefix + m0 - window + 1, 0)
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_sum = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for j in range(lo, end, BLOCK_N):
            offs_n = j + tl.arange(0, BLOCK_N)
            mask_n = offs_n < end
            slots = tl.load(ReqToToken + req * stride_req + offs_n, mask=mask_n, other=0)
            k, v = _load_kv_block(
                K, V, slots.to(tl.int64), mask_n, kv_h, offs_d, mask_d,
                stride_kt, stride_kh, stride_vt, stride_vh,
            )  # fmt: skip
            visible = mask_n[None, :] & (offs_n[None, :] <= q_pos[:, None])  # causal
            if SLIDING:
                visible = visible & (offs_n[None, :] > q_pos[:, None] - window)
            m, l_sum, acc = _attend_block(q, k, v, visible, m, l_sum, acc, sm_scale, DOT_PRECISION)
        # Every query sees at least its own key: l_sum > 0 on the rows stored.
        out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
        tl.store(
            Out + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
            out.to(Out.dtype.element_ty),
            mask=mask_m[:, None] & mask_d[None, :],
        )


def extend_metadata(
    prefix_lens: list[int],
    extend_lens: list[int],
    device: torch.device,
    skip: Collection[int] = (),
) -> torch.Tensor:
    """The launch's per-request rows, one host-to-device copy a forward (not a layer):
    (3, B) int32: tokens before the chunk, the chunk's first row, its length. Requests
    in ``skip`` get length 0 (the kernel leaves their rows to another path)."""
    starts, row = [], 0
    for n in extend_lens:
        starts.append(row)
        row += n
    lens = [0 if i in skip else n for i, n in enumerate(extend_lens)]
    return to_device([prefix_lens, starts, lens], device, torch.int32)


def extend_attention(
    q: torch.Tensor,  # (T, H, D): the chunks' queries, request-major
    k_buffer: torch.Tensor,  # (slots, Hkv, D): the layer's cache, this chunk's K/V in it
    v_buffer: torch.Tensor,
    out: torch.Tensor,  # (T, H, D), written
    req_to_token: torch.Tensor,  # (requests, context): every position's slot
    req_slots: torch.Tensor,  # (B,) the requests' rows of req_to_token
    meta: torch.Tensor,  # (3, B) int32 from extend_metadata
    max_extend_len: int,  # host: the longest chunk (the grid's extent)
    sm_scale: float,
    sliding_window: int | None,
) -> None:
    """Causal (and windowed) attention of each request's new tokens over its keys."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    num_reqs = meta.shape[1]
    check_kv_inputs(q, k_buffer, v_buffer, req_to_token, out)
    assert meta.shape == (3, num_reqs) and meta.is_contiguous()
    assert req_slots.shape == (num_reqs,) and req_slots.stride(0) == 1
    assert sliding_window is None or sliding_window > 0, f"sliding window {sliding_window}"
    if num_tokens == 0:
        return
    block_d = max(MIN_DOT, triton.next_power_of_2(head_dim))
    block_m, block_n, warps, stages = _blocks(block_d)
    grid = (num_reqs, num_heads, triton.cdiv(max_extend_len, block_m))
    _extend_kernel[grid](
        q, k_buffer, v_buffer, out, req_to_token, req_slots, meta, sm_scale,
        sliding_window or 0,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1), out.stride(0), out.stride(1),
        req_to_token.stride(0), num_reqs,
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_M=block_m, BLOCK_N=block_n, SLIDING=sliding_window is not None,
        DOT_PRECISION=dot_precision(k_buffer.dtype),
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
