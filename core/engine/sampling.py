"""Token sampling for a whole batch at once: greedy, or temperature with top-k / top-p,
each request on a reproducible random stream of its own.

One call serves every row of a batch (plain decode rows, speculative tree nodes), with
no per-row Python loop and no host read. A request's stream is counter-based, as
Philox is in cuRAND and FlashInfer: the noise of its draw number ``offset`` at token
``v`` is a hash of (seed, offset, v). Seeds and offsets are tensors, so a captured
graph draws exactly as eager code does, and a request's tokens do not depend on which
other requests share its batch.

Draws use the exponential trick, ``argmax(p / E)`` with ``E = -log U`` per token: an
exact draw from ``p``. The hash is integer arithmetic that no device rounds (every
product stays below 2^63), so every device draws the same tokens from the same logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from graphrt.core.engine.request import Request, SamplingParams
from graphrt.core.host import read_host, to_device
from graphrt.core.models.ops import BAD_LOGITS, TORCH_OPS, ModelOps

_MASK32 = 0xFFFFFFFF
_NOISE_BITS = 24  # a float32 holds 24 bits exactly: U = (h + 0.5) / 2^24 is never 0 or 1


@dataclass
class SamplingRows:
    """What each row of a batch samples with; (R,) tensors on the logits' device, or None
    for a batch of greedy rows alone (an argmax needs none: no copies to the device)."""

    temperature: torch.Tensor | None  # float32; 0 = greedy
    top_k: torch.Tensor | None  # int64; 0 = no cut
    top_p: torch.Tensor | None  # float32; 1 = no cut
    seed: torch.Tensor | None  # int64: the request's stream
    offset: torch.Tensor | None  # int64: the draw's number in that stream
    # Known on the host when the rows are built, so no read decides what runs:
    greedy: bool  # every row greedy: an argmax, nothing else
    filtered: bool  # some row cuts by top-k or top-p: a sort of every row's logits

    @property
    def num_rows(self) -> int:
        return int(self.seed.shape[0])


def sampling_rows(
    params: Sequence[SamplingParams],
    seeds: Sequence[int],
    offsets: Sequence[int] | torch.Tensor,
    device: torch.device,
) -> SamplingRows:
    """Rows for ``params[i]`` drawing at ``offsets[i]`` of stream ``seeds[i]`` (seeds
    are taken modulo 2^64, as signed int64)."""
    # One host tensor per dtype, one copy each (non-blocking: see core.host).
    ints = to_device(
        [[_int64(s) for s in seeds], [p.top_k for p in params]], device
    )  # (2, R) -> seed, top_k
    floats = to_device(
        [[p.temperature for p in params], [p.top_p for p in params]], device, torch.float32
    )
    offset = offsets if isinstance(offsets, torch.Tensor) else to_device(list(offsets), device)
    return SamplingRows(
        temperature=floats[0],
        top_k=ints[1],
        top_p=floats[1],
        seed=ints[0],
        offset=offset.to(device=device, dtype=torch.int64),
        greedy=all(p.greedy for p in params),
        filtered=any(not p.greedy and (p.top_k > 0 or p.top_p < 1.0) for p in params),
    )


def repeat_rows(rows: SamplingRows, n: int) -> SamplingRows:
    """Each row ``n`` times in a row, drawing at offsets ``offset .. offset + n - 1``: the
    nodes of a request's verify tree, each an independent draw of its stream."""
    if rows.seed is None:  # greedy rows alone: nothing to repeat
        return rows
    step = torch.arange(n, device=rows.offset.device).repeat(rows.num_rows)
    return SamplingRows(
        temperature=rows.temperature.repeat_interleave(n),
        top_k=rows.top_k.repeat_interleave(n),
        top_p=rows.top_p.repeat_interleave(n),
        seed=rows.seed.repeat_interleave(n),
        offset=rows.offset.repeat_interleave(n) + step,
        greedy=rows.greedy,
        filtered=rows.filtered,
    )


def greedy_tokens(logits: torch.Tensor, ops: ModelOps | None = None) -> torch.Tensor:
    """(R, V) logits -> (R,) int64 argmax tokens, BAD_LOGITS where a row holds NaN or +Inf
    (``ModelOps.greedy_tokens``), through the model's ``ops`` where given (CUDA: two
    Triton launches), else torch's."""
    return (ops or TORCH_OPS).greedy_tokens(logits)


def sample(
    logits: torch.Tensor, rows: SamplingRows, greedy: torch.Tensor | None = None
) -> torch.Tensor:
    """(R, V) logits -> (R,) int64 tokens: the argmax of greedy rows, a draw for others;
    BAD_LOGITS for a row whose logits hold NaN or +Inf. ``greedy``: ``greedy_tokens`` of
    these logits where already computed (inside a decode graph)."""
    if greedy is None:
        greedy = greedy_tokens(logits)
    if rows.greedy:
        return greedy
    probs = filtered_probs(logits, rows)
    drawn = (probs / exponential_noise(rows.seed, rows.offset, logits.shape[-1])).argmax(-1)
    tokens = torch.where(rows.temperature == 0, greedy, drawn)
    return torch.where(greedy == BAD_LOGITS, BAD_LOGITS, tokens)


def filtered_probs(logits: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    """(R, V) logits -> the distribution each row draws from: softmax(logits / T) cut to
    the row's top-k, then to the smallest nucleus whose mass reaches its top-p."""
    # Greedy rows divide by 1: their draw is discarded, but must not be NaN.
    temperature = torch.where(rows.temperature > 0, rows.temperature, 1.0)
    logits = logits.float() / temperature.unsqueeze(1)
    if not rows.filtered:
        return torch.softmax(logits, dim=-1)
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # (R, V)
    k = torch.where((rows.top_k > 0) & (rows.top_k < vocab), rows.top_k, vocab)
    kth = sorted_logits.gather(1, (k - 1).unsqueeze(1))  # (R, 1)
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    # top_p 1 keeps all: a cumulative sum rounded up to 1 early must not cut the tail.
    top_p = rows.top_p.unsqueeze(1)
    drop = (sorted_probs.cumsum(-1) - sorted_probs >= top_p) & (top_p < 1.0)
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    sorted_probs = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
    return torch.zeros_like(sorted_probs).scatter(-1, order, sorted_probs)


def exponential_noise(seed: torch.Tensor, offset: torch.Tensor, vocab: int) -> torch.Tensor:
    """(R,) seeds and offsets -> (R, V) float32 Exp(1) draws, one per row and token, a
    function of (seed, offset, token) alone."""
    # Two 32-bit keys per row from the 64-bit seed and offset, then one hash per token.
    seed_lo, seed_hi = seed & _MASK32, (seed >> 32) & _MASK32
    off_lo, off_hi = offset & _MASK32, (offset >> 32) & _MASK32
    key1 = _fmix32(seed_lo ^ _fmix32(off_hi ^ _fmix32(off_lo ^ 0x9E3779B9)))
    key2 = _fmix32(seed_hi ^ _fmix32(key1 ^ 0x7F4A7C15))
    token = torch.arange(vocab, device=seed.device, dtype=torch.int64)
    h = _fmix32(_mul32(token, 0x9E3779B1).unsqueeze(0) ^ key1.unsqueeze(1))  # (R, V)
    h = _fmix32((h + key2.unsqueeze(1)) & _MASK32)
    u = ((h >> (32 - _NOISE_BITS)).float() + 0.5) * (1.0 / (1 << _NOISE_BITS))
    return -torch.log(u)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2^32 for x in [0, 2^32), in int64 without overflow: c in 16-bit halves."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser: every input bit flips each output bit with
    probability about 1/2."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def _int64(seed: int) -> int:
    """A seed modulo 2^64 as a signed int64 (any integer --seed is a valid stream)."""
    seed %= 1 << 64
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def request_rows(reqs: Sequence[Request], device: torch.device) -> SamplingRows:
    """Each request's row at its next draw (no tensors when every request is greedy)."""
    params = [r.params for r in reqs]
    if all(p.greedy for p in params):
        return SamplingRows(None, None, None, None, None, greedy=True, filtered=False)
    return sampling_rows(params, [r.seed for r in reqs], [r.draws for r in reqs], device)


def draw_tokens(
    reqs: Sequence[Request], logits: torch.Tensor, greedy: torch.Tensor | None = None
) -> torch.Tensor:
    """(B, V) logits, a row per request -> (B,) int64 tokens on the device, not read. Each
    request's stream moves on by one draw; requests that keep logits (tests, logprobs;
    off by default) get their row. ``greedy``: see ``sample``."""
    tokens = sample(logits, request_rows(reqs, logits.device), greedy)
    for i, req in enumerate(reqs):
        req.draws += 1
        if req.params.return_logits:
            req.output_logits.append(logits[i].to("cpu", copy=True))
    return tokens


def sample_requests(
    reqs: Sequence[Request], logits: torch.Tensor, greedy: torch.Tensor | None = None
) -> list[int]:
    """``draw_tokens``, then the tokens on the host: the step's one wait on the device
    (core.host.read_host)."""
    return read_host(draw_tokens(reqs, logits, greedy))
