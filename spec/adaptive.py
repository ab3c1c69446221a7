"""Choosing each step's draft length: 0 (a plain decode step) up to the configured steps.

Each step runs the step count ``k`` that maximises the batch's expected tokens a second,
``sum_r E_r(k) / t(B, k)``:

- ``E_r(k) = 1 + sum_{i<=k} a_r[1] * ... * a_r[i]``: the bonus token plus each drafted
  position reached and accepted. ``a_r[i]`` is request r's acceptance at position i given
  position i - 1 was accepted: its own recent rounds (evidence fading by 1/10 an engine
  step), blended with the engine-wide rate (all requests' rounds, fading by 1/50 a step
  and worth ``MAX_EVIDENCE`` rounds at most; a position no recent round reached takes the
  rate of the one before it): ``PositionRates``. A request's own estimate is weighed
  optimistically, each rate raised by ``OPTIMISM`` standard errors of its evidence, which
  wears off as the request's rounds add up (plain steps teach nothing of acceptance: a
  pessimistic guess would stand). Steps of more than ``PER_REQUEST_MAX`` requests use
  the engine-wide rates for each. ``E_r(0) = 1``; a request that opted out
  (``SamplingParams.speculate``) emits 1 token whatever ``k``.
- ``t(B, k)``: the median wall time of the recent steps of ``k`` at batch bucket ``B``
  that ran behind a step of the same ``k`` (the first of each kind, which pays for first
  touches, and every step after a change of kind are left out: see ``record``), or where
  ``k`` was measured fewer than ``TRUSTED_SAMPLES`` times, a line ``a + b * k`` fitted through the
  measured lengths, its own samples where they are faster (``step_seconds``): one slow
  sample must not decide for 64 steps; a stall only adds time. A kind not run for
  ``STALE_STEPS`` engine steps starts its figure afresh from its next step.

The engine times a plain step, the longest rounds and every length whose graphs it
captured up front at each batch bucket it captured (batch 1 when eager) at start-up, on
throwaway requests (``Engine``'s step timing), so the first real steps already know what
each costs (the fastest of its samples, standing until the kind runs). Before any round
has measured acceptance, the longest rounds run first where they could pay at all (at an
acceptance of ``OPTIMISTIC_RATE`` a position): they measure acceptance at every
position; where even that would lose to plain steps, no round runs until exploration
looks. A batch with fewer than ``LOOK_HORIZON`` tokens left runs no round before one has
measured acceptance: a round on the prior alone is a look it cannot pay back. A bucket
start-up left unmeasured measures its own plain step, then starts its rounds from the
nearest measured bucket's times, scaled. Another count still runs now and then, so the
figures follow what changes (acceptance drifts with the text): after 16 steps of the
same winner, then 32, then every 64 (at most 1 step in 64 spent looking once the choice
is stable), the runner-up and the longest rounds in turn (and first a plain step, where
its time is still start-up's alone), each look two steps in a row: its first, after a
change of kind, is left out. A look's runner-up takes lengths never run at the bucket
at their most hopeful cost (between a plain step and the longest rounds, where that is
under the line). A look at plain steps where rounds win more than twice over on the
figures is passed over three times in four (``PLAIN_LOOK_MARGIN``).
Looks (the optimistic first round too) are only taken while the batch has
``LOOK_HORIZON`` tokens or more left to pay them back.

A **closed batch** (``choose(closed=True)``: one call's requests, run to completion
together, none waiting to join, as in ``Engine.generate``) ends when its slowest request
does: a step's tokens a second speak for the batch only while finished requests are
replaced. There a step runs the count ``k`` that finishes the batch soonest, ``t(B, k) *
max_r max(left_r / E_r(k), 1)`` (``left_r``: the tokens request r may still emit; a whole
step at least), each request's ``E_r`` from its own rounds in closed batches: every
position's engine-wide rate scaled by the request's acceptance rate over the engine's,
shrunk toward the engine's by ``CLOSED_PRIOR`` positions, then raised by
``CLOSED_OPTIMISM`` standard errors (the slowest-looking of many estimates is the
unluckiest as often as the slowest). Not faded: a closed batch is one job's, and at
batch 1 this drafted better than the faded, per-position estimate (``CLOSED_PRIOR``'s
figures). With fewer than ``CAPTURE_HORIZON`` tokens left, in an engine that has run
fewer steps than that, it runs only the lengths whose graphs are captured
(``pays_a_capture``; the strategy refuses the others), looks included: a capture costs
more steps than it can win back there.
"""

from __future__ import annotations

import math
import operator
import statistics
from collections import deque
from collections.abc import Sequence, Set
from dataclasses import dataclass, field

from graphrt.core.engine.request import Request
from graphrt.spec.position_rates import PositionRates

WINDOW = 16  # recent steps per (kind, bucket) whose median counts
TRUSTED_SAMPLES = 3  # a length measured fewer times takes the fitted line's time
# (or its own, where faster)
REQUEST_WEIGHT = 0.1  # each engine step fades a request's own evidence by this share
ENGINE_WEIGHT = 0.02  # and the engine-wide evidence by this one
# The engine-wide evidence is worth at most this many rounds: fading by engine steps alone
# kept 50 steps' rounds, 3,200 at batch 64, so a batch whose acceptance fell from 0.9 to
# 0.5 drafted at a loss for some 30 steps (bench/chooser_sim.py: 0.83 of plain decoding
# there; 0.97 with the cap). 128 rounds: a rate's standard error about 0.04.
MAX_EVIDENCE = 128.0
# Above this many requests in a step, the engine-wide rates stand for each request: per-
# request estimates in Python cost about 8 us a request a round step (recorded, and
# weighed every REDECIDE steps; 2-core CPU host, in an engine, whose forwards leave
# Python's working set cold), and over many requests the sum of their expectations is
# close to the batch times the engine's. At 16 the embedded pair's auto steps at batch 8
# spent 57 us choosing and 80 recording (step times 0.4-0.9 ms on an H200), which kept
# auto under plain decoding there (BENCHMARKS.md, stop 44).
PER_REQUEST_MAX = 4
REDECIDE = 4  # steps between two weighings of the same batch
FIRST_EXPLORE = 16  # steps before the runner-up runs again, doubling up to
MAX_EXPLORE = 64
STALE_STEPS = MAX_EXPLORE  # engine steps after which a kind's step times are dropped
# A look at plain steps is passed over while rounds win by more than this factor on the
# figures (plain steps' measured in use: their time is all such a look teaches, and only
# twice their speed would change the choice), up to PLAIN_LOOKS_PASSED looks in a row (a
# figure from a slow spell stands some 256 steps at most). Each look is two changes of
# kind. Where only the longest rounds are captured (the README's command) every look is
# at plain steps: 28 plain steps in 801 over profile_auto's six 400-token generates on an
# H100, 8 with the margin. In bench/chooser_sim.py, that workload (lengths 1-4 refused,
# acceptance 0.8): 0.982 -> 0.996 of fixed rounds of 5 with a change of kind at 0.25 plain
# steps, 0.959 -> 0.989 at 1.5; unchanged at acceptance 0.5, and in every other cell. On
# the H100 (stop 72) within the noise of processes: auto 0.84-0.99 of rounds of 5 in one
# process (mean 0.906, six processes), 0.79-1.00 (0.914) without. A look whose plain step
# is itself overpriced would not correct the figure either.
PLAIN_LOOK_MARGIN = 2.0
PLAIN_LOOKS_PASSED = 3
# Before any round ran, the longest rounds run first (to measure acceptance) only if at
# this acceptance a position they would beat plain steps: rounds measured at start-up to
# cost more than that never run before exploration looks (2 CPU cores: the embedded
# pair's rounds of 5 cost 3.3 plain steps).
OPTIMISTIC_RATE = 0.9
# A look (the first optimistic round, exploration) costs up to a few plain steps now and
# pays back only over the steps after it: a batch whose longest request has fewer tokens
# left than this gets none (the README's 32-token command on the CPU paid 6% for its one
# round of 5 where plain steps were right).
LOOK_HORIZON = 64
# A closed batch with fewer tokens left than this takes only the lengths whose graphs are
# captured already (``pays_a_capture``): a capture costs 150-300 steps (the embedded pair
# on an H100: 0.05-0.07 s a length against rounds of 0.5 ms), which a length 10% better
# than the captured ones wins back in some 2,000 steps. The README's command (400 tokens)
# captured rounds of 2 and 4 for its looks: 0.11-0.15 s of wall time, more than its
# 0.08-0.1 s of decoding (stop 70). The steps the engine ran before count too: over many
# calls (the ``LLM`` API's) a capture pays back across batches.
CAPTURE_HORIZON = 2048
# A request's own estimate weighs a step's choice optimistically: each position's rate
# plus OPTIMISM standard errors of a rate measured on the rounds of the request that
# reached it (OPTIMISM_PRIOR more; counted over its life, not faded), its expected tokens
# from those. Plain steps teach nothing of acceptance, so a pessimistic estimate stood
# until the next look (16 to 64 steps) while an optimistic one is corrected by the round
# it runs: with evidence faded to about 10 rounds, a request accepting half its drafts
# looked below the break-even a third of the time. bench/chooser_sim.py (64 seeds, the
# H200's step times, --steady 2), batch 1 at rate 0.5 against the best fixed length:
# 0.914 -> 0.974 on the pair's step times, 0.957 -> 0.977 on the oracle's; the pair's
# acceptance on held-out text (bench/pair_acceptance.py) 0.916 -> 0.963. The bonus wears
# off as the request's rounds add up, so one that drafts at a loss returns to plain
# steps; at rates 0.2-0.4, where plain steps are best, batches of 1 to 8 in closed
# batches: worst cell 0.915 -> 0.940 (oracle's times), 0.971 -> 0.942 (pair's).
OPTIMISM = 1.0  # (OPTIMISM_PRIOR: spec/position_rates.py)
# A closed batch (see the module's docstring) weighs its finish time on each request's own
# rate over its life (drafts accepted over drafted positions reached), shrunk toward the
# engine-wide rate by CLOSED_PRIOR positions and raised by CLOSED_OPTIMISM standard errors.
# bench/chooser_sim.py (64 seeds, the H200's step times of stop 40, closed batches; auto
# over the best fixed length, worst cell / mean; bench/results/cpu-chooser-sim-stop49.log),
# on the oracle's and on the pair's step times: the pair's acceptance on held-out text,
# whose requests accept differently, 0.907 / 0.945 -> 0.936 / 0.964 and 0.853 / 0.882 ->
# 0.930 / 0.938 (plain steps or rounds of 1 best from batch 8: the slow requests' tail of
# rounds cost more than the fast ones saved); one rate for every request, 0.5-0.9 at batch
# 1-64, 0.885 / 0.976 -> 0.887 / 0.975 and 0.931 / 0.977 -> 0.929 / 0.974; 0.2-0.4 at batch
# 1-8, 0.940 / 0.974 -> 0.964 / 0.983 and 0.942 / 0.966 -> 0.965 / 0.972. Steady batches
# are not closed (0.980-0.990 means, as before). Tried: shrinking by 4 or 16 (pair's text
# 0.946 / 0.934, one rate 0.970 / 0.974), no optimism or optimism growing with the batch
# (the slowest-looking of 64 estimates is the unluckiest: one-rate means down to 0.965),
# an empirical-Bayes shrink by the batch's spread of rates (one rate down to 0.951), the
# finish time at batch > 1 only (batch 1 drafted worse on the faded, per-position
# estimate: the text's batch-1 cell 0.936 against 0.956). Weighing a batch of 64 costs
# 60-80 us on a 2-core CPU (12 us by tokens a second), every REDECIDE steps or batch
# change.
CLOSED_PRIOR = 8.0
CLOSED_OPTIMISM = 1.0
_RID = operator.attrgetter("rid")  # a batch's request ids, each step: map, not a generator


@dataclass
class _BucketStats:
    """What the chooser knows at one batch bucket: step times by step count."""

    seconds: dict[int, deque] = field(default_factory=dict)
    seen: dict[int, int] = field(default_factory=dict)
    since_explore: int = 0
    explore_every: int = FIRST_EXPLORE
    explored: int = 0  # looks at the runner-up taken
    ranked: list[int] | None = None  # step counts, best first, as last weighed
    ranked_for: tuple[int, ...] = ()  # the request ids it was weighed for
    ranked_age: int = 0  # steps since
    last_winner: int | None = None
    # The length a look just ran, to run once more at once: a step after a change of kind
    # (and a kind's first at a bucket, first touches) is left out, so one alone would
    # teach no time.
    look_again: int | None = None
    looks_passed: int = 0  # looks at plain steps passed over in a row (PLAIN_LOOK_MARGIN)
    # Kinds whose time is start-up's figure alone (the fastest of its timing runs, on
    # throwaway one-token requests): the first real step of the kind replaces it.
    from_start_up: set[int] = field(default_factory=set)
    timed_at: dict[int, int] = field(default_factory=dict)  # engine step of each kind's last time

    def median(self, steps: int) -> float | None:
        times = self.seconds.get(steps)
        return statistics.median(times) if times else None


@dataclass
class _Streak:
    """Plain steps ``choose`` is known to pick next, for one batch (``stays_plain``)."""

    size: int  # the batch's request count
    ends: tuple[int, int]  # its first and last request ids (new requests join at the end)
    left: int  # steps still known plain
    stats: _BucketStats  # whose counts those steps advance


class DraftChooser:
    def __init__(self, max_steps: int, context_len: int | None = None):
        self.max_steps = max_steps
        self.context_len = context_len  # the engine's context (None: unbounded)
        self._buckets: dict[int, _BucketStats] = {}
        self.engine_rates = PositionRates(max_steps, ENGINE_WEIGHT, max_evidence=MAX_EVIDENCE)
        self._requests: dict[int, PositionRates] = {}  # by request id, while it runs
        self.steps_by_count = [0] * (max_steps + 1)  # [k] = steps run with k draft steps
        # What explain() says: bucket, tokens and seconds by count, closed or not; or the
        # bucket and tokens left of a batch that took plain steps before any round ran,
        # too short to try one.
        self.last: tuple[int, list[float], list[float], bool] | None = None
        self.untried: tuple[int, int] | None = None
        # Steps a plain winner is known to stay (see ``stays_plain``). Off under tensor
        # parallelism, whose ranks must agree on every step.
        self.streaks = True
        self._streak: _Streak | None = None
        # Whether the batch last chosen for is closed (see the module's docstring), and
        # each request's [drafts accepted, drafted positions reached] over its rounds in
        # closed batches, by request id, while it runs.
        self.closed = False
        self._lifetimes: dict[int, list[int]] = {}
        self._last_steps: int | None = None  # the draft steps of the step recorded last

    @property
    def rounds(self) -> int:
        return sum(self.steps_by_count[1:])

    @property
    def plain_steps(self) -> int:
        return self.steps_by_count[0]

    def stays_plain(self, reqs: Sequence[Request]) -> bool:
        """Is the next step of ``reqs`` a plain step that ``choose`` would pick without
        weighing anything (O(1))? After a plain step wins, ``choose`` reuses its ranking for
        up to REDECIDE steps and looks nowhere until its next look is due: those steps are
        plain whatever it would compute; this counts them as it would. Choosing every step
        cost 29-36 us of a 545 us plain step at batch 64 on an H200 (the embedded pair),
        with the step itself slower beside it. The batch is recognised by its size and end
        requests: one that changes only in between is weighed again within REDECIDE steps,
        as it would be anyway."""
        streak = self._streak
        if streak is None:
            return False
        same = len(reqs) == streak.size and (reqs[0].rid, reqs[-1].rid) == streak.ends
        if streak.left > 0 and same:
            streak.left -= 1
            streak.stats.ranked_age += 1  # what choose would count for this step
            streak.stats.since_explore += 1
            return True
        self._streak = None
        return False

    def choose(
        self,
        bucket: int,
        reqs: Sequence[Request],
        refused: Set[int] = frozenset(),
        closed: bool = False,
    ) -> int:
        """The draft steps of the next step of ``reqs`` (batch bucket ``bucket``); 0: a plain
        decode step. ``refused``: draft lengths this batch cannot run on graphs (the graph
        memory cap left them uncaptured), never chosen; a plain step always can be.
        ``closed``: the batch only shrinks (one call's requests, none waiting to join):
        the count that finishes it soonest runs (see the module's docstring)."""
        self._streak = None  # set again below where a plain winner stays
        if closed != self.closed:  # the other objective ranks: weigh again
            self.closed = closed
            self._stats_at(bucket).ranked = None
        if len(self._requests) + len(self._lifetimes) > 2 * len(reqs) + 16:
            running = {r.rid for r in reqs}  # finished requests' rates go
            self._requests = {rid: a for rid, a in self._requests.items() if rid in running}
            self._lifetimes = {rid: n for rid, n in self._lifetimes.items() if rid in running}
        stats = self._stats_at(bucket)
        # Both ends measured here is the usual case (start-up timed them): no other
        # bucket to look up.
        if not (stats.seconds.get(0) and stats.seconds.get(self.max_steps)):
            if self._donor(bucket) is None:  # the first bucket: each end measured first
                for steps in (self.max_steps, 0):  # (their first step left out)
                    if not stats.seconds.get(steps) and steps not in refused:
                        return steps
            elif not stats.seconds.get(0):
                # Any later bucket measures its own plain step (two: the first is left
                # out). Rounds and plain steps scale differently with the batch (verify's
                # rows grow, a plain step's barely), so the donor's plain time scaled by
                # rounds' ratios is wrong, and plain steps, never the runner-up, were
                # never looked at: on an H200 auto kept drafting at batches 8 and 64
                # where plain steps were 1.4x faster.
                return 0
        if not self.engine_rates.seen[0]:  # no round ran yet: acceptance is a prior
            left = _remaining(reqs, self.context_len)
            if left < LOOK_HORIZON:
                # A round chosen on the prior alone (with its optimism: 1.6 tokens a round
                # of 1) is a look too, and a batch this short cannot pay one back.
                if self.untried is None:  # what the batch had left when it started so
                    self.last, self.untried = None, (bucket, left)
                return 0
            if self._may_pay(bucket, refused):
                return self.max_steps  # this one measures every position
        again, stats.look_again = stats.look_again, None
        if again is not None and again not in refused:
            stats.since_explore += 1  # (a look's second step: looks start every N steps)
            return again
        # The ranking is redone every REDECIDE steps, or when the batch changes: it moves
        # slowly, and weighing it costs tens of microseconds (a plain step of a small
        # model is a few hundred).
        batch = tuple(map(_RID, reqs))
        if stats.ranked is None or stats.ranked_for != batch or stats.ranked_age >= REDECIDE:
            rates = self.rates(bucket, reqs)
            stats.ranked = sorted(range(self.max_steps + 1), key=lambda k: rates[k], reverse=True)
            stats.ranked_for, stats.ranked_age = batch, 0
        stats.ranked_age += 1
        allowed = [k for k in stats.ranked if k not in refused]  # 0 is never refused
        winner, runner_up = allowed[0], allowed[min(1, len(allowed) - 1)]
        if winner != stats.last_winner:  # the winner changed: watch closely again
            stats.last_winner, stats.explore_every, stats.since_explore = winner, FIRST_EXPLORE, 0
        stats.since_explore += 1
        # A plain step first while its time is start-up's alone: every count is weighed
        # against it, and where that one figure came out slow a plain step would never be
        # the runner-up. Over more than PER_REQUEST_MAX requests, at once: there a winner
        # that changes puts the looks off (on the H200 the pair's closed batch of 64 ran
        # 35 rounds against start-up's plain step of 0.67 ms, 0.55 in use, and looked at
        # none). In bench/chooser_sim.py (64 seeds, start-up's plain steps 1.2x and rounds
        # 1.25x those in use, as there), worst cell / mean: one rate, the pair's times
        # 0.890 / 0.965 -> 0.927 / 0.969, the oracle's 0.905 / 0.975 -> 0.943 / 0.978;
        # the pair's text 0.918 / 0.928 -> 0.928 / 0.938; unbiased, within 0.002
        # (bench/results/cpu-chooser-sim-stop50.log). Fewer requests wait for a look:
        # there a plain step taken early steered auto onto plain steps for good after a
        # few unlucky rounds (the pair's text at batch 1: 0.932 -> 0.854, 16 seeds).
        if winner != 0 and 0 in stats.from_start_up and len(reqs) > PER_REQUEST_MAX:
            return 0
        if stats.since_explore >= stats.explore_every and self._worth_a_look(reqs):
            stats.since_explore = 0
            if winner != 0 and 0 in stats.from_start_up:  # (it takes no turn of the looks)
                stats.look_again = 0  # (its first step, after a round, teaches no time)
                return 0
            stats.explore_every = min(2 * stats.explore_every, MAX_EXPLORE)
            stats.explored += 1
            # Every other look runs the longest rounds, whatever the runner-up: only they
            # measure acceptance at every position (a shorter runner-up would leave the
            # deeper positions' rates as old as the last long round).
            longest = max(allowed)
            if stats.explored % 2 == 0 and winner != longest:
                stats.look_again = longest  # (see below)
                return longest
            # The others, the runner-up with lengths never run here taken at their most
            # hopeful cost: the line through the lengths run can overrate a short round's
            # (measured on the H200, rounds of 1 at batch 8 cost 3.6 ms where the line
            # through 2 to 5 said 4.5), and a length never run would never be the
            # runner-up. Hope costs a look at most (1 step in 16 to 64), never a winner.
            hopeful = self.rates(bucket, reqs, optimistic=True)
            others = [k for k in allowed if k != winner]
            look = max(others, key=lambda k: hopeful[k]) if others else runner_up
            if look == 0:
                passed = hopeful[0] * PLAIN_LOOK_MARGIN < hopeful[winner]
                if passed and stats.looks_passed < PLAIN_LOOKS_PASSED:
                    stats.looks_passed += 1
                    return winner
                stats.looks_passed = 0
            # Twice in a row: the first, after a change of kind, teaches no time (record),
            # so a look of one step would leave its kind's figure as old as its last run
            # in a row, however stale (record replaces a stale one by the second step).
            # Looks at plain steps and start-up's lengths alone ran twice at first: the
            # longest rounds' start-up figure then stood for good in bench/chooser_sim.py,
            # rounds of 4 winning at batch 1 where 5 paid (0.90 of the best).
            stats.look_again = look
            return look
        # The next steps that would reuse this ranking and take no look: plain whatever
        # choose computes (see stays_plain, which counts them as choose would). Not before
        # a round ran: then each step asks again whether a first round may pay, on plain
        # steps' times that the streak's own steps move.
        if winner == 0 and self.streaks and self.engine_rates.seen[0]:
            to_look = stats.explore_every - 1 - stats.since_explore
            if to_look <= 0 and not self._worth_a_look(reqs):
                to_look = REDECIDE  # no look can come: a batch's tokens left only shrink
            left = min(REDECIDE - stats.ranked_age, to_look)
            if left > 0:
                self._streak = _Streak(len(reqs), (reqs[0].rid, reqs[-1].rid), left, stats)
        return winner

    def _stats_at(self, bucket: int) -> _BucketStats:
        """What is known at ``bucket`` (a new one is made only once: ``setdefault`` would
        build a throwaway ``_Bucket`` every step, a few us of a step's choice)."""
        stats = self._buckets.get(bucket)
        if stats is None:
            stats = self._buckets[bucket] = _BucketStats()
        return stats

    def pays_a_capture(self, reqs: Sequence[Request]) -> bool:
        """Can a length's capture be won back (``CAPTURE_HORIZON``): has the closed batch
        ``reqs`` that many tokens left, or the engine run that many steps already (a
        long-lived one, as ``LLM``'s, wins it back over later calls)?"""
        lived = sum(self.steps_by_count)  # (no scan of the batch once that is enough)
        return (
            lived >= CAPTURE_HORIZON
            or lived + _remaining(reqs, self.context_len) >= CAPTURE_HORIZON
        )

    def _worth_a_look(self, reqs: Sequence[Request]) -> bool:
        """Has the batch enough tokens left to pay a look back (``LOOK_HORIZON``)?"""
        return _remaining(reqs, self.context_len) >= LOOK_HORIZON

    def _may_pay(self, bucket: int, refused: Set[int]) -> bool:
        """Could the longest rounds beat plain steps at ``bucket``, were every position
        accepted at ``OPTIMISTIC_RATE``? (Both ends measured.)"""
        if self.max_steps in refused:
            return False
        seconds = self.step_seconds(bucket)
        tokens = sum(OPTIMISTIC_RATE**i for i in range(self.max_steps + 1))
        return tokens / seconds[self.max_steps] > 1.0 / seconds[0]

    def rates(self, bucket: int, reqs: Sequence[Request], optimistic: bool = False) -> list[float]:
        """[k] = expected tokens a second of a step with k draft steps over ``reqs``.
        ``optimistic``: lengths never measured at ``bucket`` cost no more than between a
        plain step and the longest rounds (``_own_seconds``), for a look's choice."""
        engine = self.engine_rates
        drafting = [r for r in reqs if r.params.speculate]
        if self.closed:
            tokens = self._finishing_tokens(reqs)
        elif len(reqs) > PER_REQUEST_MAX:
            tokens = [
                len(reqs) - len(drafting) + len(drafting) * e for e in engine.expected_tokens()
            ]
        else:
            plain = (1.0,) * (self.max_steps + 1)
            per_request = [
                (self._requests.get(r.rid) or engine).expected_tokens()
                if r.params.speculate
                else plain
                for r in reqs
            ]
            tokens = [sum(column) for column in zip(*per_request)]
        seconds = self.step_seconds(bucket, optimistic)
        # explain()'s weighing: not one where every count emits alike (a closed batch's last
        # steps, each request a step or less from its end): "plain steps pay" there, after
        # a generate of rounds, said why the last step was plain, not why the rest drafted.
        if not optimistic and (self.last is None or max(tokens) > min(tokens)):
            self.last, self.untried = (bucket, tokens, seconds, self.closed), None
        return [t / s for t, s in zip(tokens, seconds)]

    def _finishing_tokens(self, reqs: Sequence[Request]) -> list[float]:
        """[k] = the tokens a step of k draft steps emits over a closed batch ``reqs``,
        counted as the batch's tokens left over the steps its slowest request needs at k
        (``max_r left_r / E_r(k)``): tokens a second by it rank the counts by the batch's
        finish time (see the module's docstring)."""
        engine, lifetimes, none = self.engine_rates, self._lifetimes, (0, 0)
        # The request's rate over the positions it reached against the engine's over all:
        # a mix of positions unlike the engine's recent one biases it (deep positions
        # reached while long rounds ran), but the rate against the engine-wide rates at
        # its own positions drafted worse in bench/chooser_sim.py (the pair's text
        # 0.942 -> 0.934, one rate 0.976 -> 0.973: noise, or the pooled rate's shrink).
        mean = (sum(engine.hits) + 1.0) / (sum(engine.seen) + 2.0)
        profile = [rate / mean for rate in engine.rates()]  # each position's over the mean
        # [k] = the slowest request's steps to its end at k, a whole step at least (a
        # request a few tokens from its end takes one step whatever the length: at 1 token
        # left, a round "needed" 0.67 and beat a plain step, as the tails of
        # bench/chooser_sim.py's batches showed).
        slowest = [1.0] * (self.max_steps + 1)
        total = 0.0
        # Plain Python, not numpy: numpy's small-array calls cost 154 us a weighing of the
        # README's one request (a 2-core CPU host, in an engine), this 27 us, where the
        # steps weighed for take 0.45-1 ms of host work on an H100. A batch of 64 is a few
        # hundred multiplications.
        for r in reqs:
            accepted, reached = lifetimes.get(r.rid, none)
            left = max(_tokens_left(r, self.context_len), 1.0)
            total += left
            own = 0.0  # opted out: no draft reached
            if r.params.speculate:
                own = (accepted + CLOSED_PRIOR * mean) / (reached + CLOSED_PRIOR)
                spread = max(own * (1.0 - own), 0.01) / (reached + CLOSED_PRIOR)
                own = min(own + CLOSED_OPTIMISM * math.sqrt(spread), 1.0)
            slowest[0] = max(slowest[0], left)
            expected = reach = 1.0  # the bonus token, then each position reached
            for k, rate in enumerate(profile, start=1):
                reach *= min(own * rate, 1.0)
                expected += reach
                slowest[k] = max(slowest[k], left / expected)
        return [total / steps for steps in slowest]

    def step_seconds(self, bucket: int, optimistic: bool = False) -> list[float]:
        """[k] = a step's seconds with k draft steps at ``bucket``: its own measurements
        and model (``_own_seconds``), and where those say nothing, the nearest bucket's
        figures scaled to this one's (a batch that shrinks or grows into a new bucket
        starts from what the engine knows, instead of measuring both ends again)."""
        own = self._own_seconds(bucket, optimistic)
        if None not in own:
            return own
        donor = self._donor(bucket)
        if donor is None:
            # Nothing to scale from: the first bucket, its longest rounds refused (the graph
            # memory cap), so no line through its ends. Unknown lengths are never weighed
            # to win; a look at the runner-up measures one, and a line follows.
            return [o if o is not None else math.inf for o in own]
        theirs = self._own_seconds(donor, optimistic)
        ratios = [o / t for o, t in zip(own, theirs) if o is not None]
        scale = statistics.median(ratios) if ratios else 1.0
        return [o if o is not None else t * scale for o, t in zip(own, theirs)]

    def _donor(self, bucket: int) -> int | None:
        """The measured bucket nearest ``bucket`` in size (both ends measured), if any."""
        measured = [
            b
            for b, stats in self._buckets.items()
            if b != bucket and stats.seconds.get(0) and stats.seconds.get(self.max_steps)
        ]
        return min(measured, key=lambda b: abs(math.log(b / bucket)), default=None)

    def _own_seconds(self, bucket: int, optimistic: bool = False) -> list[float | None]:
        """[k] = a step's seconds with k draft steps from ``bucket``'s own measurements:
        measured, or modelled; None where they say nothing.

        A round costs about ``a + b * k`` (the draft loop grows by one step's kernels per
        step; verify reads the target's weights once whatever its width), so once two
        lengths are measured a line through their medians (weighted by samples; through
        the well-measured ones where two are) predicts the others, and stands in for a
        length measured only a few times unless its own samples are faster. Before that,
        lengths between a plain step and the longest rounds are interpolated linearly
        between the two: optimistic (a round's fixed cost is spread), so they get tried.
        A length shorter than every round measured takes no more than the line between a
        plain step and the shortest measured: the line through longer rounds alone
        overrates short ones (on the H200 at batch 8, rounds of 1 cost 3.64 ms where the
        line through 3 to 5 said 4.6; in bench/chooser_sim.py, 64 seeds, closed batches,
        that held the oracle at rate 0.5 on rounds of 3-4 for tens of steps: worst cell
        0.887 -> 0.941, the pair's text on the oracle's times 0.936 -> 0.968, no cell
        worse beyond noise, steady too; bench/results/cpu-chooser-sim-stop49.log).
        ``optimistic`` (a look's runner-up): lengths never measured here take the lesser
        of the line and the interpolation between the ends."""
        stats = self._buckets[bucket]
        counts = {k: len(stats.seconds.get(k, ())) for k in range(self.max_steps + 1)}
        known = {k: stats.median(k) for k, n in counts.items() if n}
        # Start-up's figure for a kind stands as it is (the fastest of its runs, on the
        # same graphs): the line through the ends would not move it.
        for k in stats.from_start_up:
            counts[k] = max(counts[k], TRUSTED_SAMPLES)
        rounds = {k: (m, counts[k]) for k, m in known.items() if k > 0}
        trusted = {k: p for k, p in rounds.items() if p[1] >= TRUSTED_SAMPLES}
        line = _fit_line(trusted if len(trusted) >= 2 else rounds)
        ends = 0 in known and self.max_steps in known
        seconds: list[float | None] = []
        for k in range(self.max_steps + 1):
            if k in known and (k == 0 or counts[k] >= TRUSTED_SAMPLES or line is None):
                seconds.append(known[k])
            elif line is not None and k > 0:
                modelled = max(line[0] + line[1] * k, 1e-9)
                if k in known:  # a few samples: a slow one is set aside, a fast one believed
                    modelled = min(modelled, known[k])
                else:
                    if 0 in known and k < min(rounds):  # below every length run
                        low = min(rounds)
                        modelled = min(modelled, known[0] + k / low * (rounds[low][0] - known[0]))
                    if optimistic and ends:
                        share = k / self.max_steps
                        ramp = known[0] + share * (known[self.max_steps] - known[0])
                        modelled = min(modelled, ramp)
                seconds.append(modelled)
            elif ends and k > 0:
                share = k / self.max_steps
                seconds.append(known[0] + share * (known[self.max_steps] - known[0]))
            else:
                seconds.append(None)
        return seconds

    def record(
        self,
        steps: int,
        bucket: int,
        seconds: float,
        accepted: Sequence[tuple[Request, int]] = (),
        timing: bool = False,
        closed: bool | None = None,
    ) -> None:
        """A step with ``steps`` draft steps ran: its wall time (the whole step, the
        engine's settling of it included: ``DecodeStrategy.step_done``)
        and, for a round, the drafts each drafting request accepted. ``timing``: a start-up
        step timing that kind on throwaway requests: its time counts, nothing else.
        ``closed``: whether the step was chosen for a closed batch (None: as the last
        choice was; a step launched ahead is recorded after the next one is chosen)."""
        stats = self._stats_at(bucket)
        stats.seen[steps] = stats.seen.get(steps, 0) + 1
        # A step after a step of another kind pays for the change, and its time does not
        # say what a run of its kind costs (what the choice is between: a winner runs in
        # a row). With steps launched ahead, on an H100 (the embedded pair, batch 1): a
        # plain step between rounds took 0.87-1.63 ms, plain steps in a row 0.41-0.65; a
        # round of 5 after a plain step 1.25-1.39, in a row 0.80-1.06. Kept, the looks'
        # lone plain steps priced plain decoding at 2-3x its cost, and auto drafted at
        # 0.61x --no-draft on an H200 (BENCHMARKS.md, stops 68-69).
        changed, self._last_steps = self._last_steps != steps, steps
        if stats.seen[steps] > 1 and not changed:
            times = stats.seconds.setdefault(steps, deque(maxlen=WINDOW))
            if timing:
                # Start-up's figure is the fastest of its samples (a stall, a collection or
                # an interrupt, only adds time: a plain step timed at 19.5 ms, not 5.5,
                # once kept rounds running for good), and stands until a real step of
                # the kind replaces it.
                fastest = min([seconds, *times])  # start-up runs before any real step
                times.clear()
                times.append(fastest)
                stats.from_start_up.add(steps)
            else:
                # A figure older than the longest gap between looks was taken under other
                # conditions (the host's pace drifts, acceptance moves the verify width):
                # on an H100 rounds of 5 kept a slow spell's 1.37 ms and rounds of 3 won
                # 848 steps of 880, at 0.69x the tokens/s of rounds of 5. The fresh step
                # stands alone (under TRUSTED_SAMPLES the fitted line caps a slow one).
                now = sum(self.steps_by_count)
                stale = now - stats.timed_at.get(steps, now) > STALE_STEPS
                if steps in stats.from_start_up or stale:
                    stats.from_start_up.discard(steps)
                    times.clear()
                times.append(seconds)
                stats.timed_at[steps] = now
        if timing:
            return
        self.steps_by_count[steps] += 1
        if not accepted:
            return
        if self.closed if closed is None else closed:  # lifetime rates (_finishing_tokens)
            lifetimes = self._lifetimes
            for req, n in accepted:
                counts = lifetimes.get(req.rid)
                if counts is None:
                    counts = lifetimes[req.rid] = [0, 0]
                counts[0] += n
                counts[1] += n + 1 if n < steps else n  # the first rejected one reached
        clock = sum(self.steps_by_count)
        self.engine_rates.record(steps, [n for _, n in accepted], clock)
        if len(accepted) > PER_REQUEST_MAX:
            return  # the engine-wide rates stand for each request (see PER_REQUEST_MAX)
        for req, n in accepted:
            if req.rid not in self._requests:
                self._requests[req.rid] = PositionRates(
                    self.max_steps, REQUEST_WEIGHT, self.engine_rates, optimism=OPTIMISM
                )
            self._requests[req.rid].record(steps, (n,), clock)

    def explain(self) -> str:
        """One clause: what the last choice weighed (tokens and time a step, by step
        count, at its bucket), and which count pays."""
        if self.untried is not None:
            bucket, left = self.untried
            return (
                f"at batch {bucket}: no round has measured acceptance yet, and {left} tokens"
                f" left are too few to win a first one back (under {LOOK_HORIZON}):"
                " plain steps"
            )
        if self.last is None:
            return "not measured yet"
        bucket, tokens, seconds, closed = self.last
        best = max(range(len(tokens)), key=lambda k: tokens[k] / seconds[k])
        measured = self._buckets[bucket].seconds
        cells = ", ".join(
            f"{'a plain step' if k == 0 else f'{k} draft steps'} {t:.2f} tokens in "
            f"{'' if measured.get(k) else '~'}{s * 1e3:.2f} ms"
            for k, (t, s) in enumerate(zip(tokens, seconds))
        )
        verdict = "plain steps pay" if best == 0 else f"rounds of {best} draft steps pay"
        closed = closed and bucket > 1
        pace = ", tokens at the pace of its slowest request (a closed batch)" if closed else ""
        return f"at batch {bucket}: {cells} (~ modelled{pace}): {verdict}"


def _tokens_left(req: Request, context_len: int | None) -> int:
    """Tokens ``req`` may still emit: its cap, and the context's room (``context_len``:
    the engine's context, None: no limit)."""
    left = req.params.max_new_tokens - len(req.output_ids)
    if context_len is None:
        return left
    return min(left, context_len - len(req.prompt_ids) - len(req.output_ids))


def _remaining(reqs: Sequence[Request], context_len: int | None) -> int:
    """Tokens the longest-running request of ``reqs`` may still emit."""
    return max((_tokens_left(r, context_len) for r in reqs), default=0)


def _fit_line(points: dict[int, tuple[float, int]]) -> tuple[float, float] | None:
    """``(a, b)`` of ``t = a + b * k`` by least squares over ``{k: (median, samples)}``,
    each length weighing its sample count; None with fewer than two lengths."""
    if len(points) < 2:
        return None
    weight = sum(n for _, n in points.values())
    mean_k = sum(k * n for k, (_, n) in points.items()) / weight
    mean_t = sum(t * n for t, n in points.values()) / weight
    var = sum(n * (k - mean_k) ** 2 for k, (_, n) in points.items())
    cov = sum(n * (k - mean_k) * (t - mean_t) for k, (t, n) in points.items())
    slope = max(cov / var, 0.0)  # a longer round never costs less
    return mean_t - slope * mean_k, slope
