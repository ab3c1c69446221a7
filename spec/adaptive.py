"""Choosing each step's draft length: 0 (a plain decode step) up to the configured steps.

Each step runs the step count ``k`` that maximises the batch's expected tokens a second,
``sum_r E_r(k) / t(B, k)``:

- ``E_r(k) = 1 + sum_{i<=k} a_r[1] * ... * a_r[i]``: the bonus token plus each drafted
  position reached and accepted. ``a_r[i]`` is request r's acceptance at position i given
  position i - 1 was accepted, a moving average over its rounds (each weighs 1/4), which
  starts from the engine-wide rates (each request-round weighs 1/10 there). A position
  never drafted yet takes the rate of the one before it. ``E_r(0) = 1``; a request that
  opted out (``SamplingParams.speculate``) emits 1 token whatever ``k``.
- ``t(B, k)``: the median wall time of the recent steps of ``k`` at batch bucket ``B``
  (the first of each, which pays for lazy captures, compiles and first touches, is left
  out). A ``k`` not measured yet is interpolated linearly between the nearest measured
  counts below and above: optimistic where a round's fixed cost dominates, so a count
  that might win gets tried, and then it is measured.

At a new bucket the longest rounds run first (they measure acceptance at every
position), then plain steps. Another count still runs now and then, so the figures follow
what changes (acceptance drifts with the text): after 16 steps of the same winner, then
32, then every 64 (at most 1 step in 64 spent looking once the choice is stable), the
runner-up and the longest rounds in turn.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from graphrt.core.engine.request import Request

WINDOW = 8  # recent steps per (kind, bucket) whose median counts
REQUEST_WEIGHT = 0.25  # a round's weight in its request's acceptance rates
ENGINE_WEIGHT = 0.1  # a request-round's weight in the engine-wide rates
FIRST_EXPLORE = 16  # steps before the runner-up runs again, doubling up to
MAX_EXPLORE = 64
UNSEEN_RATE = 0.5  # acceptance assumed at position 1 before any round ran


@dataclass
class _Bucket:
    """What the chooser knows at one batch bucket: step times by step count."""

    seconds: dict[int, deque] = field(default_factory=dict)
    seen: dict[int, int] = field(default_factory=dict)
    since_explore: int = 0
    explore_every: int = FIRST_EXPLORE
    explored: int = 0  # looks at the runner-up taken
    last_winner: int | None = None

    def median(self, steps: int) -> float | None:
        times = self.seconds.get(steps)
        return statistics.median(times) if times else None


class Acceptance:
    """Acceptance by draft position (1-based), each a moving average; None: not seen."""

    def __init__(self, max_steps: int, weight: float, prior: Acceptance | None = None):
        self.weight = weight
        self.rates: list[float | None] = list(prior.rates) if prior else [None] * max_steps
        self._expected: tuple[float, ...] | None = None  # cached until the next record

    def record(self, num_steps: int, accepted: int) -> None:
        """One round of ``num_steps`` that accepted ``accepted`` drafts: positions up to
        ``accepted`` were accepted, the next one (if drafted) rejected."""
        for i in range(min(accepted + 1, num_steps)):
            hit = 1.0 if i < accepted else 0.0
            old = self.rates[i]
            self.rates[i] = hit if old is None else old + self.weight * (hit - old)
        self._expected = None

    def expected_tokens(self) -> tuple[float, ...]:
        """[k] = tokens a round of k steps emits, bonus token included (k = 0: 1)."""
        if self._expected is None:
            tokens, reach, rate = [1.0], 1.0, UNSEEN_RATE
            for seen in self.rates:
                rate = rate if seen is None else seen
                reach *= rate
                tokens.append(tokens[-1] + reach)
            self._expected = tuple(tokens)
        return self._expected


class DraftChooser:
    def __init__(self, max_steps: int):
        self.max_steps = max_steps
        self._buckets: dict[int, _Bucket] = {}
        self.engine_rates = Acceptance(max_steps, ENGINE_WEIGHT)
        self._requests: dict[int, Acceptance] = {}  # by request id, while it runs
        self.steps_by_count = [0] * (max_steps + 1)  # [k] = steps run with k draft steps
        self.last: tuple[int, list[float], list[float]] | None = None  # what explain() says

    @property
    def rounds(self) -> int:
        return sum(self.steps_by_count[1:])

    @property
    def plain_steps(self) -> int:
        return self.steps_by_count[0]

    def choose(self, bucket: int, reqs: Sequence[Request]) -> int:
        """The draft steps of the next step of ``reqs`` (batch bucket ``bucket``); 0: a plain
        decode step."""
        if len(self._requests) > 2 * len(reqs) + 16:  # finished requests' rates go
            running = {r.rid for r in reqs}
            self._requests = {rid: a for rid, a in self._requests.items() if rid in running}
        size = self._buckets.setdefault(bucket, _Bucket())
        for steps in (self.max_steps, 0):  # each end measured first (its first step left out)
            if not size.seconds.get(steps):
                return steps
        rates = self.rates(bucket, reqs)
        ranked = sorted(range(self.max_steps + 1), key=lambda k: rates[k], reverse=True)
        winner, runner_up = ranked[0], ranked[1]
        if winner != size.last_winner:  # the winner changed: watch closely again
            size.last_winner, size.explore_every, size.since_explore = winner, FIRST_EXPLORE, 0
        size.since_explore += 1
        if size.since_explore >= size.explore_every:
            size.since_explore = 0
            size.explore_every = min(2 * size.explore_every, MAX_EXPLORE)
            size.explored += 1
            # Every other look runs the longest rounds, whatever the runner-up: only they
            # measure acceptance at every position (a shorter runner-up would leave the
            # deeper positions' rates as old as the last long round).
            if size.explored % 2 == 0 and winner != self.max_steps:
                return self.max_steps
            return runner_up
        return winner

    def rates(self, bucket: int, reqs: Sequence[Request]) -> list[float]:
        """[k] = expected tokens a second of a step with k draft steps over ``reqs``."""
        plain = (1.0,) * (self.max_steps + 1)
        engine = self.engine_rates
        per_request = [
            (self._requests.get(r.rid) or engine).expected_tokens() if r.params.speculate else plain
            for r in reqs
        ]
        tokens = [sum(column) for column in zip(*per_request)]
        seconds = self.step_seconds(bucket)
        self.last = (bucket, tokens, seconds)
        return [t / s for t, s in zip(tokens, seconds)]

    def step_seconds(self, bucket: int) -> list[float]:
        """[k] = a step's measured (or interpolated) seconds with k draft steps."""
        size = self._buckets[bucket]
        known = {k: m for k in range(self.max_steps + 1) if (m := size.median(k)) is not None}
        seconds = []
        for k in range(self.max_steps + 1):
            if k in known:
                seconds.append(known[k])
                continue
            below = max(j for j in known if j < k)  # 0 and max_steps are measured first
            above = min(j for j in known if j > k)
            share = (k - below) / (above - below)
            seconds.append(known[below] + share * (known[above] - known[below]))
        return seconds

    def record(
        self,
        steps: int,
        bucket: int,
        seconds: float,
        accepted: Sequence[tuple[Request, int]] = (),
    ) -> None:
        """A step with ``steps`` draft steps ran: its wall time (the host's read included)
        and, for a round, the drafts each drafting request accepted."""
        size = self._buckets.setdefault(bucket, _Bucket())
        size.seen[steps] = size.seen.get(steps, 0) + 1
        if size.seen[steps] > 1:
            size.seconds.setdefault(steps, deque(maxlen=WINDOW)).append(seconds)
        self.steps_by_count[steps] += 1
        for req, n in accepted:
            if req.rid not in self._requests:
                self._requests[req.rid] = Acceptance(
                    self.max_steps, REQUEST_WEIGHT, self.engine_rates
                )
            self._requests[req.rid].record(steps, n)
            self.engine_rates.record(steps, n)

    def explain(self) -> str:
        """One clause: what the last choice weighed (tokens and time a step, by step
        count, at its bucket), and which count pays."""
        if self.last is None:
            return "not measured yet"
        bucket, tokens, seconds = self.last
        best = max(range(len(tokens)), key=lambda k: tokens[k] / seconds[k])
        measured = self._buckets[bucket].seconds
        cells = ", ".join(
            f"{'a plain step' if k == 0 else f'{k} draft steps'} {t:.2f} tokens in "
            f"{'' if measured.get(k) else '~'}{s * 1e3:.2f} ms"
            for k, (t, s) in enumerate(zip(tokens, seconds))
        )
        verdict = "plain steps pay" if best == 0 else f"rounds of {best} draft steps pay"
        return f"at batch {bucket}: {cells} (~ interpolated): {verdict}"
