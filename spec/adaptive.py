"""Choosing, step by step, between a speculative round and a plain decode step.

A round pays when the tokens it emits per second beat a plain step's:
``L / t_round > 1 / t_plain``, with ``L`` the tokens a round emits (accepted drafts plus
the bonus token). Both times are measured as the engine runs, per batch size (the
median of the recent steps of each kind; the first of each, which pays for lazy compiles
and first-touch allocations, is left out), and ``L`` as a moving average over rounds
(each round's mean weighs 1/4: a few rounds after the text changes, ``L`` has). The mode
that loses still runs now and then, so that its figures follow what changes (acceptance
drifts with the text): after 16 steps, then 32, then every 64 while the same mode keeps
winning (at most 1 step in 64 spent looking: a change shows within about 200 steps).

This is the first part of issue 20's automatic draft length: the choice is between no
draft and the configured length; choosing the length itself is still to come.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

WINDOW = 8  # recent steps per (kind, batch size) whose median counts
LENGTH_WEIGHT = 0.25  # a round's weight in the moving average of tokens per round
FIRST_EXPLORE = 16  # steps before the losing kind runs again, doubling up to
MAX_EXPLORE = 64


@dataclass
class _BatchSize:
    """What the chooser knows at one batch size."""

    seconds: dict[bool, deque] = field(
        default_factory=lambda: {True: deque(maxlen=WINDOW), False: deque(maxlen=WINDOW)}
    )
    seen: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0})
    since_explore: int = 0
    explore_every: int = FIRST_EXPLORE
    last_winner: bool | None = None


class DraftChooser:
    def __init__(self) -> None:
        self._sizes: dict[int, _BatchSize] = {}
        self._tokens_per_round: float | None = None
        self.rounds = 0  # steps run as rounds
        self.plain_steps = 0
        self.last_batch_size = 1  # of the last step: what a summary explains

    def choose(self, batch_size: int) -> bool:
        """True: the next step of ``batch_size`` requests is a round; False: a plain step."""
        size = self._sizes.setdefault(batch_size, _BatchSize())
        for kind in (True, False):  # each kind measured first (its first step left out)
            if len(size.seconds[kind]) == 0:
                return kind
        winner = self.round_pays(batch_size)
        if winner != size.last_winner:  # the winner changed: watch closely again
            size.last_winner, size.explore_every = winner, FIRST_EXPLORE
        size.since_explore += 1
        if size.since_explore >= size.explore_every:
            size.since_explore = 0
            size.explore_every = min(2 * size.explore_every, MAX_EXPLORE)
            return not winner
        return winner

    def record(self, is_round: bool, batch_size: int, seconds: float, lengths=()) -> None:
        """A step ran: its wall time (the host's read included) and, for a round, the
        tokens each request emitted."""
        size = self._sizes.setdefault(batch_size, _BatchSize())
        self.last_batch_size = batch_size
        size.seen[is_round] += 1
        if size.seen[is_round] > 1:
            size.seconds[is_round].append(seconds)
        if lengths:
            mean = statistics.fmean(lengths)
            old = self._tokens_per_round
            self._tokens_per_round = mean if old is None else old + LENGTH_WEIGHT * (mean - old)
        if is_round:
            self.rounds += 1
        else:
            self.plain_steps += 1

    @property
    def tokens_per_round(self) -> float:
        return 1.0 if self._tokens_per_round is None else self._tokens_per_round

    def round_pays(self, batch_size: int) -> bool:
        round_s, plain_s = self._median(batch_size, True), self._median(batch_size, False)
        if round_s is None or plain_s is None:
            return True
        return self.tokens_per_round * plain_s > round_s

    def explain(self, batch_size: int) -> str:
        """One clause: what a round and a plain step cost at ``batch_size``, and which pays."""
        round_s, plain_s = self._median(batch_size, True), self._median(batch_size, False)
        if round_s is None or plain_s is None:
            return f"not measured at batch {batch_size} yet"
        verdict = "rounds pay" if self.round_pays(batch_size) else "plain steps pay"
        return (
            f"at batch {batch_size} a round emits {self.tokens_per_round:.2f} tokens in "
            f"{round_s * 1e3:.1f} ms, a plain step 1 in {plain_s * 1e3:.1f} ms: {verdict}"
        )

    def _median(self, batch_size: int, is_round: bool) -> float | None:
        size = self._sizes.get(batch_size)
        if size is None or not size.seconds[is_round]:
            return None
        return statistics.median(size.seconds[is_round])
