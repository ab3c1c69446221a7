"""Token sampling: greedy, or temperature with top-k / top-p, seeded per request.

Each request draws from its own generator, so its tokens do not depend on
which other requests share its batch. Draws use the exponential trick,
``argmax(p / E)`` with ``E ~ Exp(1)`` per token: an exact draw from ``p`` made
of device operations alone (no host read), for one row or many at once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from graphrt.core.engine.request import SamplingParams


def sample(
    logits: torch.Tensor,  # (B, V) float32
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:  # (B,) int64
    tokens = logits.argmax(dim=-1)
    for row, (p, gen) in enumerate(zip(params, generators)):
        if not p.greedy:
            tokens[row] = draw(logits[row], p, gen)
    return tokens


def draw(
    logits: torch.Tensor,  # (..., V)
    p: SamplingParams,
    generator: torch.Generator | None,
) -> torch.Tensor:  # (...,) int64
    """One draw per row from ``filtered_probs(logits, p)``, without a host read."""
    probs = filtered_probs(logits, p)
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)


def filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a sampled token is drawn from: (..., V) probabilities."""
    logits = logits.float() / p.temperature
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = sorted_probs.cumsum(-1) - sorted_probs >= p.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs
