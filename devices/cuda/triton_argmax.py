"""Each row's largest logit and the smallest token id holding it, in two launches.

``greedy_tokens`` is a decode step's greedy sampler (``ModelOps.greedy_tokens``): torch's
``max(dim=-1)`` over a float32 row of Llama 3's 128,256 logits takes 27 us on an H100
whatever the row count (1 to 64 rows; 9.7 us over Gemma 4's 262,144: its reduction picks
a slow schedule for that width), about 2% of a batch-1 step. Here every program reduces
one block of a row (``_row_best_kernel``) and one program a row reduces the blocks
(``_blocks_best_kernel``, which the centroid-masked head's ``selected_argmax`` shares).

``_first_best`` is the one rule both stages and the centroid head follow: a NaN is the
largest value (torch's argmax has it so), and among equal values the smallest id wins.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphrt.core.models.ops import BAD_LOGITS
from graphrt.devices.cuda import compile_ahead

ROW_BLOCK = 4096  # logits a program: 32 programs a 128k row, 16 KB of float32 each


@triton.jit
def _first_best(values, ids, mask, none_id):
    """(largest value, smallest id holding it) of float32 ``values`` where ``mask``; a NaN
    is the largest (the first NaN's id), as torch's argmax has it. ``none_id`` where
    nothing is masked in."""
    values = tl.where(mask, values, float("-inf"))
    nan = mask & (values != values)
    any_nan = tl.max(nan.to(tl.int32), axis=0) > 0
    best = tl.max(tl.where(nan, float("-inf"), values), axis=0)
    at_best = tl.where(any_nan, nan, mask & (values == best))
    token = tl.min(tl.where(at_best, ids, none_id), axis=0)
    return tl.where(any_nan, float("nan"), best), token


@triton.jit
def _row_best_kernel(
    Logits,  # (N, V), unit stride in V
    PartialMax,  # (N, P) float32
    PartialToken,  # (N, P) int64
    stride_row,
    vocab,
    blocks,  # P
    BLOCK: tl.constexpr,
):
    """One block of one row: its largest logit and the smallest id holding it."""
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    offs = block * BLOCK + tl.arange(0, BLOCK)
    mask = offs < vocab
    logits = tl.load(Logits + row * stride_row + offs, mask=mask, other=float("-inf"))
    best, token = _first_best(logits.to(tl.float32), offs.to(tl.int64), mask, vocab)
    tl.store(PartialMax + row * blocks + block, best)
    tl.store(PartialToken + row * blocks + block, token)


@triton.jit
def _blocks_best_kernel(
    PartialMax,  # (N, P) float32
    PartialToken,  # (N, P) int64
    Out,  # (N,) int64
    blocks,  # P
    vocab,
    BLOCK_P: tl.constexpr,
    MARK_BAD: tl.constexpr,  # BAD_LOGITS where the row's largest is NaN or +Inf
    BAD: tl.constexpr,
):
    """The row's largest over its blocks' and the smallest token id holding it (a NaN
    block's first, where one holds a NaN)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_P)
    mask = offs < blocks
    best = tl.load(PartialMax + row * blocks + offs, mask=mask, other=float("-inf"))
    tokens = tl.load(PartialToken + row * blocks + offs, mask=mask, other=vocab)
    top, token = _first_best(best, tokens, mask, vocab)
    if MARK_BAD:  # false for NaN and +Inf alone (-Inf, a ruled-out token, is fine)
        token = tl.where(top < float("inf"), token, BAD)
    tl.store(Out + row, token)


def blocks_best(
    partial_max: torch.Tensor, partial_token: torch.Tensor, vocab: int, mark_bad: bool
) -> torch.Tensor:
    """(N,) int64 from (N, P) block maxima and their tokens: stage two of both heads."""
    rows, blocks = partial_max.shape
    out = torch.empty(rows, dtype=torch.int64, device=partial_max.device)
    if rows:
        _blocks_best_kernel[(rows,)](
            partial_max, partial_token, out, blocks, vocab,
            BLOCK_P=triton.next_power_of_2(blocks), MARK_BAD=mark_bad, BAD=BAD_LOGITS,
            num_warps=1,
        )  # fmt: skip
    return out


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """(N, V) logits -> (N,) int64 argmax tokens, the smallest id among equal maxima, and
    ``BAD_LOGITS`` where a row holds NaN or +Inf (``TORCH_OPS.greedy_tokens``' contract).
    Capture-safe: device work only."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1, f"logits stride {logits.stride()}: unit stride in V"
    blocks = triton.cdiv(vocab, ROW_BLOCK)
    partial_max = torch.empty((rows, blocks), dtype=torch.float32, device=logits.device)
    partial_token = torch.empty((rows, blocks), dtype=torch.int64, device=logits.device)
    if rows:
        _row_best_kernel[(rows, blocks)](
            logits, partial_max, partial_token, logits.stride(0), vocab, blocks,
            BLOCK=ROW_BLOCK, num_warps=4,
        )  # fmt: skip
    out = blocks_best(partial_max, partial_token, vocab, mark_bad=True)
    if compile_ahead.dry():  # nothing ran: a drafter embeds these ids next (HAZARD there)
        out.zero_()
    return out
