"""Acceptance by draft position, estimated from faded evidence: the rates and the expected
tokens a round of k steps emits that the draft-length chooser (spec/adaptive.py) weighs,
one estimate engine-wide and one a request. (A round's own accepted tokens are
spec/accept.py's ``Acceptance``.)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

# Engine-wide, the rate taken to stand before position 1: with no evidence, position 1's
# rate is this times DEPTH_DECLINE (0.45), as every deeper position's prior is the one
# before it times DEPTH_DECLINE.
UNSEEN_RATE = 0.5
PRIOR_WEIGHT = 1.0  # observations a position's prior is worth
# Engine-wide, a position's prior is the one before it times this: a drafter recurring on
# its own guesses does not get better with depth (and only rounds that accepted every
# position before reach it, a few at first: without the decline one lucky round made
# the deepest positions look certain).
DEPTH_DECLINE = 0.9
# Rounds of evidence an optimistic rate's standard error assumes beyond the request's own
# (spec/adaptive.py's OPTIMISM says why rates are raised, and what it measured).
OPTIMISM_PRIOR = 4.0


class PositionRates:
    """Acceptance by draft position (1-based), given the position before was accepted.

    Evidence fades with time: at each record, every position's counts are scaled by
    ``(1 - weight) ** steps``, the engine steps since the last record (plain steps
    included: a round after a long run of plain steps speaks for now, not the old
    rounds), then what this round saw is counted. A position's rate blends its counts
    with a prior worth ``PRIOR_WEIGHT`` observations: for a request's own estimate the
    engine-wide rate; engine-wide, the previous position's rate times ``DEPTH_DECLINE``.
    A position that short rounds stopped reaching falls back to what its neighbours say
    instead of keeping an old figure, so longer rounds get tried again when the
    positions before them look good."""

    def __init__(
        self,
        max_steps: int,
        weight: float,
        prior: PositionRates | None = None,
        max_evidence: float = math.inf,
        optimism: float = 0.0,
    ):
        self.weight, self.prior, self.max_evidence = weight, prior, max_evidence
        self.optimism = optimism  # standard errors added to each rate in expected tokens
        self.hits = [0.0] * max_steps
        self.seen = [0.0] * max_steps
        # Rounds that reached each position, never faded (one request's rounds: what its
        # optimism wears off by).
        self.reached = [0] * max_steps
        self.clock = 0  # the engine step of the last record
        self.version = 0  # bumped by every record
        self._cached: tuple[tuple[int, int], tuple] | None = None  # by (own, prior) version

    def record(self, num_steps: int, accepted: Sequence[int], step: int) -> None:
        """Rounds of ``num_steps`` at engine step ``step`` (one per request of a step)
        that accepted ``accepted[j]`` drafts: positions up to that count were accepted,
        the next one (if drafted) rejected."""
        hits, seen = self.hits, self.seen
        if step > self.clock:
            keep = (1.0 - self.weight) ** (step - self.clock)
            hits = self.hits = [h * keep for h in hits]
            seen = self.seen = [n * keep for n in seen]
            self.clock = step
        if len(accepted) == 1:  # one request's round (each step's, per request, at <= 4)
            (count,) = accepted
            reached = self.reached
            for i in range(min(count + 1, num_steps)):  # reached position i; accepted it?
                seen[i] += 1.0
                hits[i] += i < count
                reached[i] += 1
        else:
            # Rounds by accepted count: O(rounds + positions), not their product. (A list,
            # not a Counter: this runs every round step.)
            by_count = [0] * (num_steps + 1)
            for count in accepted:
                by_count[count] += 1
            reached = len(accepted)  # rounds that reached position i, walking down
            for i in range(num_steps):
                passed = reached - by_count[i]  # accepted position i
                seen[i] += reached
                hits[i] += passed
                reached = passed
        if seen[0] > self.max_evidence:  # position 1's count is the largest
            keep = self.max_evidence / seen[0]
            self.hits = [h * keep for h in hits]
            self.seen = [n * keep for n in seen]
        self.version += 1

    def rates(self) -> tuple[float, ...]:
        """[i] = the acceptance rate at position i + 1."""
        return self._estimates()[0]

    def expected_tokens(self) -> tuple[float, ...]:
        """[k] = tokens a round of k steps emits, bonus token included (k = 0: 1); with
        ``optimism``, at each position's rate plus that many standard errors."""
        return self._estimates()[1]

    def _estimates(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """(rates, expected tokens), cached until this estimate or its prior records again:
        a step's choice reads every request's, and the engine-wide ones once for all."""
        versions = (self.version, self.prior.version if self.prior is not None else 0)
        if self._cached is not None and self._cached[0] == versions:
            return self._cached[1]
        priors = self.prior.rates() if self.prior is not None else None
        rates, tokens, before, reach = [], [1.0], UNSEEN_RATE, 1.0
        for i, (hits, seen) in enumerate(zip(self.hits, self.seen)):
            prior = priors[i] if priors is not None else before * DEPTH_DECLINE
            before = (hits + PRIOR_WEIGHT * prior) / (seen + PRIOR_WEIGHT)
            rates.append(before)
            hoped = before
            if self.optimism:  # the variance floor keeps a rate of 0 or 1 uncertain
                spread = max(before * (1.0 - before), 0.01) / (self.reached[i] + OPTIMISM_PRIOR)
                hoped = min(1.0, before + self.optimism * math.sqrt(spread))
            reach *= hoped
            tokens.append(tokens[-1] + reach)
        self._cached = (versions, (tuple(rates), tuple(tokens)))
        return self._cached[1]
