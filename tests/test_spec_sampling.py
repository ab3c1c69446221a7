"""Speculative sampling through the strategy (``MTPDecoding`` in an Engine), fast: on a
vocabulary of 8 with one-draft rounds, 2000 seeded requests of one prompt in one batch.
The tokens the speculative rounds emit follow the target's own distribution: the round's
first token given the prefill token, and the next given both, whether the round accepted
its draft (a draw at the drafted node) or rejected it (the next round's root draw).
The slow test in test_spec.py checks the same with three draft steps and 6000 requests."""

from __future__ import annotations

import torch
from helpers import CPU, chi2_quantile, cpu_engine

from graphrt.core.engine import SamplingParams
from graphrt.core.models import load_model
from graphrt.spec import MTPDecoding, SpecConfig

PROMPT = [1, 5, 3, 6, 4, 7]
VOCAB = 8
REQUESTS = 2000
# Low: the tiny target's logits are small, and near uniform a biased draw hides. Checked
# by planting four bugs (every draft accepted, argmax below the root, the bonus token drawn
# from p instead of the residual, no temperature in the rounds): here each fails a check by
# 3x its bound or more; with 1000 requests, or at temperature 0.2, the weakest by under 2x.
TEMPERATURE = 0.1


def _target_probs(hf, contexts: torch.Tensor) -> torch.Tensor:
    """(N, T) token ids -> (N, VOCAB) the target's next-token distribution at TEMPERATURE."""
    with torch.no_grad():
        return (hf(contexts).logits[:, -1].double() / TEMPERATURE).softmax(-1)


def _chi2(counts: torch.Tensor, expected: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic and degrees of freedom, summed over the rows (contexts) of
    (R, VOCAB) counts and expected counts; in each row the least likely cells are merged
    until the merged one expects 5 draws, and rows expecting fewer than 5 are left out."""
    stat, dof = 0.0, 0
    for c, e in zip(counts.double(), expected):
        if e.sum() < 5:
            continue
        e, order = e.sort()
        c = c[order]
        k = int((e.cumsum(0) < 5).sum()) + 1  # cells 0..k-1 merged into one
        e = torch.cat([e[:k].sum(0, keepdim=True), e[k:]])
        c = torch.cat([c[:k].sum(0, keepdim=True), c[k:]])
        stat += ((c - e) ** 2 / e).sum().item()
        dof += len(e) - 1
    return stat, dof


def _counts(context: torch.Tensor, token: torch.Tensor, contexts: int) -> torch.Tensor:
    """(contexts, VOCAB) how often each token followed each context id."""
    return torch.bincount(context * VOCAB + token, minlength=contexts * VOCAB).view(-1, VOCAB)


def test_speculative_tokens_follow_the_target_distribution(gemma4_tiny_vocab):
    """Sampling with a drafter must give the target's distribution, whatever the drafter
    proposes: acceptance, the draws at drafted nodes and the bonus token all unbiased."""
    target, drafter = gemma4_tiny_vocab
    strategy = MTPDecoding(
        load_model(str(drafter.path), CPU, torch.float32), SpecConfig(num_steps=1, topk=1)
    )
    loaded = load_model(str(target.path), CPU, torch.float32)
    engine = cpu_engine(loaded, strategy, max_context_len=16, max_running_requests=REQUESTS)
    params = SamplingParams(temperature=TEMPERATURE, max_new_tokens=3, ignore_eos=True)
    out = torch.tensor([r.output_ids for r in engine.generate([PROMPT] * REQUESTS, params)])
    t1, t2, t3 = out.unbind(1)  # t1 from the prefill; t2, t3 from speculative rounds
    rejected, accepted = engine.stats.accept_histogram
    assert accepted > REQUESTS // 10 and rejected > REQUESTS // 2, (rejected, accepted)

    base, ids = torch.tensor([PROMPT]), torch.arange(VOCAB)
    p2 = _target_probs(target.hf, torch.cat([base.expand(VOCAB, -1), ids[:, None]], 1))
    pairs = torch.cartesian_prod(ids, ids)  # (t1, t2) in row t1 * VOCAB + t2
    p3 = _target_probs(target.hf, torch.cat([base.expand(len(pairs), -1), pairs], 1))
    c2 = _counts(t1, t2, VOCAB)
    stat, dof = _chi2(c2, c2.sum(1, keepdim=True) * p2)
    assert stat < chi2_quantile(dof), f"round's first token given t1: chi2 {stat:.0f}, dof {dof}"
    c3 = _counts(t1 * VOCAB + t2, t3, VOCAB * VOCAB)
    stat, dof = _chi2(c3, c3.sum(1, keepdim=True) * p3)
    assert stat < chi2_quantile(dof), f"next token given t1, t2: chi2 {stat:.0f}, dof {dof}"
