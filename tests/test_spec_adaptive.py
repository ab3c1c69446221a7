"""``--spec-steps auto``: each step a round of the draft length, or a plain decode step,
that emits the most tokens a second by what the engine measured (spec.adaptive).

The choice must never change what is generated (greedy output equals plain decoding's,
whatever the mix of lengths and plain steps), must follow the measured costs and each
request's acceptance, and must go on looking at the runner-up now and then.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch
from helpers import (
    CPU,
    assert_engine_idle,
    cpu_engine,
    cycling_chooser,
    random_prompts,
    standin_device,
)
from tokenizers import Tokenizer

from graphrt.core import pretrained
from graphrt.core.engine import Engine, SamplingParams
from graphrt.core.engine.strategy import LaunchedStep, StepOutcome
from graphrt.core.models import load_model
from graphrt.spec import MTPDecoding, SpecConfig, adaptive
from graphrt.spec.adaptive import (
    FIRST_EXPLORE,
    LOOK_HORIZON,
    MAX_EVIDENCE,
    MAX_EXPLORE,
    PER_REQUEST_MAX,
    TRUSTED_SAMPLES,
    DraftChooser,
)
from graphrt.spec.position_rates import DEPTH_DECLINE, UNSEEN_RATE, PositionRates

GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)


LONG = SamplingParams(max_new_tokens=100_000, ignore_eos=True)  # looks always pay back


@dataclass
class _Req:  # what the chooser reads of a request
    rid: int
    params: SamplingParams = LONG
    output_ids: list[int] = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=list)


ONE_REQUEST = (_Req(0),)


def _run(chooser, steps, seconds, accepted, reqs=ONE_REQUEST):
    """``steps`` decisions at bucket 1 with fixed step times (``seconds(k)``) and acceptance
    (``accepted(k, rid)``: drafts accepted by a round of k); -> the step counts chosen."""
    chosen = []
    for _ in range(steps):
        k = chooser.choose(1, reqs)
        chosen.append(k)
        rounds = [(r, accepted(k, r.rid)) for r in reqs if r.params.speculate] if k else []
        chooser.record(k, 1, seconds(k), rounds)
    return chosen


def linear(fixed_ms, per_step_ms):
    """A plain step costs 1 ms; a round of k steps ``fixed + k * per_step`` ms."""
    return lambda k: 1e-3 if k == 0 else (fixed_ms + k * per_step_ms) * 1e-3


def test_the_chooser_measures_both_ends_then_follows_what_pays():
    # Every draft accepted, rounds of k steps cost 1.5 + 0.1 k ms: 5 steps emit 6 tokens
    # in 2 ms, the best rate.
    chooser = DraftChooser(5)
    chosen = _run(chooser, 200, linear(1.5, 0.1), lambda k, rid: k)
    assert chosen[:4] == [5, 5, 0, 0]  # each end twice: the first is left out
    assert chosen.count(5) > 180
    assert chooser.explain().endswith("rounds of 5 draft steps pay")
    assert "a plain step 1.00 tokens in 1.00 ms" in chooser.explain()
    # Nothing ever accepted: plain steps pay.
    chooser = DraftChooser(5)
    chosen = _run(chooser, 200, linear(1.5, 0.1), lambda k, rid: 0)
    assert chosen.count(0) > 180 and chooser.explain().endswith("plain steps pay")


def test_the_chooser_finds_the_length_that_pays_between_the_ends():
    # Position 1 always accepted, position 2 never: a round of k >= 1 emits 2 tokens, so
    # 1 step (1.2 ms) beats plain (1 token in 1 ms) and every longer round.
    chooser = DraftChooser(5)
    chosen = _run(chooser, 300, linear(1.0, 0.2), lambda k, rid: min(k, 1))
    # Looks at longer rounds now and then: position 2 is reached by them alone, so its
    # estimate is thin and optimistic (OPTIMISM), and a look runs them until their
    # evidence says otherwise (a few steps in 64).
    assert chosen[-100:].count(1) >= 90, chosen[-100:]
    assert "1 draft steps 2.00 tokens in 1.20 ms" in chooser.explain()


def test_unlucky_first_rounds_do_not_hold_a_request_on_plain_steps():
    """A request's own estimate is weighed optimistically while its evidence is thin
    (OPTIMISM): plain steps teach nothing of acceptance, so after two rounds that accepted
    nothing a plain winner would stand until the next look (16 steps), though every draft
    after them is accepted. With the optimism, short rounds go on, find the acceptance
    and the longest rounds take over."""
    chooser = DraftChooser(5)
    _timed_at_start_up(chooser, 1, plain_ms=1.0, round_ms=2.0)
    rounds = iter(range(1000))
    chosen = _run(chooser, 40, linear(1.5, 0.1), lambda k, rid: 0 if next(rounds) < 2 else k)
    assert chosen[0] == 5 and chosen[1] != 0  # the second round as soon as the first
    assert chosen[:FIRST_EXPLORE].count(0) <= 2, chosen
    assert chosen[FIRST_EXPLORE:].count(5) > 15, chosen


def test_the_runner_up_still_runs_less_and_less_often():
    chosen = _run(DraftChooser(3), 1000, linear(4.0, 0.5), lambda k, rid: 0)
    explored = [i for i, k in enumerate(chosen) if k != 0 and i >= 4]  # after the ends
    # Each look runs its length twice in a row (its first step is left out).
    looks = [i for i in explored if i - 1 not in explored]
    assert len(explored) == 2 * len(looks) and all(chosen[i + 1] == chosen[i] for i in looks)
    gaps = [b - a for a, b in zip(looks, looks[1:])]
    assert explored and gaps[-5:] == [MAX_EXPLORE] * 5 and gaps[0] >= FIRST_EXPLORE - 1
    assert len(looks) < 20


def test_explain_says_why_a_closed_batch_drafted_not_why_its_last_step_was_plain():
    """At a closed batch's last token every count emits one token: that weighing says
    nothing, and explain() keeps the last one that did (rounds of 5 paid)."""
    chooser = DraftChooser(5)
    req = _Req(0, SamplingParams(max_new_tokens=40, ignore_eos=True), [0], [0])
    while len(req.output_ids) < 40:
        k = chooser.choose(1, [req], closed=True)
        chooser.record(k, 1, linear(1.5, 0.1)(k), [(req, k)] if k else [])
        req.output_ids += [0] * min(k + 1, 40 - len(req.output_ids))
    assert chooser.steps_by_count[5] > 3
    assert chooser.explain().endswith("rounds of 5 draft steps pay"), chooser.explain()


def test_a_slow_start_up_plain_step_is_checked_at_once_over_many_requests():
    """Start-up timed a plain step at 2 ms, one in use costs 1: against that figure rounds
    accepting half their first drafts win, against the real one plain steps do. Over more
    than PER_REQUEST_MAX requests a real plain step runs as soon as a round wins (the
    winner changing would put the looks off); at batch 1 it waits for the first look (a
    plain step taken early there steered auto onto plain steps after unlucky rounds)."""
    flip = itertools.cycle([0, 1])

    def run(requests: int) -> list[int]:
        chooser = DraftChooser(5)
        _timed_at_start_up(chooser, 1, plain_ms=2.0, round_ms=2.0)
        reqs = tuple(_Req(i) for i in range(requests))
        return _run(chooser, 40, linear(1.5, 0.1), lambda k, rid: min(k, next(flip)), reqs)

    many = run(PER_REQUEST_MAX + 1)
    assert many[:2] == [5, 0], many  # the first round measures acceptance, then plain
    assert many[10:].count(0) > 25, many
    one = run(1)
    assert 0 not in one[: FIRST_EXPLORE - 1] and 0 in one, one


def test_start_up_figures_stand_as_timed():
    """A length start-up timed (the fastest of its runs on the same graphs) keeps its
    figure until real steps replace it, above the line through the others too."""
    chooser = DraftChooser(5)
    for k, ms in ((5, 3.0), (3, 2.6), (1, 1.2), (0, 1.0)):
        for _ in range(3):
            chooser.record(k, 1, ms * 1e-3, timing=True)
    seconds = chooser.step_seconds(1)
    assert [seconds[k] for k in (0, 1, 3, 5)] == pytest.approx([1e-3, 1.2e-3, 2.6e-3, 3e-3])


def test_longest_rounds_refused_at_the_first_bucket_leave_plain_steps_then_looks():
    """The graph memory cap refused the longest rounds and no other bucket was measured:
    no line through both ends and no bucket to scale from. Plain steps run, and a look
    measures a round length that may pay, which then wins."""
    chooser = DraftChooser(3)
    chosen = []
    for _ in range(200):
        k = chooser.choose(1, ONE_REQUEST, refused=frozenset({3}))
        chosen.append(k)
        chooser.record(k, 1, linear(0.5, 0.1)(k), [(ONE_REQUEST[0], k)] if k else [])
    assert 3 not in chosen and chosen[:2] == [0, 0]
    assert chosen[-50:].count(2) >= 45, chosen[-50:]  # 3 tokens in 0.7 ms: the best allowed


def test_position_rates_blend_evidence_with_the_prior_and_fade_it_by_steps():
    """Engine-wide, position i's prior is position i - 1's rate times DEPTH_DECLINE
    (position 1's: UNSEEN_RATE's), worth one observation; a request's prior is the engine's
    rate at the same position. Evidence fades by (1 - weight) an engine step."""
    engine = PositionRates(3, weight=0.5)
    engine.record(3, [1, 3], step=0)  # one round accepted 1 of 3 drafts, one all 3
    first = (2 + UNSEEN_RATE * DEPTH_DECLINE) / 3  # both reached position 1, accepted it
    second = (1 + first * DEPTH_DECLINE) / 3  # both reached it, one accepted
    third = (1 + second * DEPTH_DECLINE) / 2  # one reached it and accepted
    assert engine.rates() == pytest.approx((first, second, third), rel=1e-12)
    tokens = (1, 1 + first, 1 + first + first * second, 1 + first + first * second * (1 + third))
    assert engine.expected_tokens() == pytest.approx(tokens, rel=1e-12)
    own = PositionRates(3, weight=0.5, prior=engine)
    own.record(3, [0], step=0)  # reached position 1 and rejected it
    assert own.rates()[0] == pytest.approx(first / 2, rel=1e-12)
    assert own.rates()[1] == pytest.approx(engine.rates()[1], rel=1e-12)  # no evidence there
    engine.record(3, [0], step=2)  # two steps later: the old counts weigh a quarter
    assert engine.seen[0] == pytest.approx(2 * 0.25 + 1) and engine.hits[0] == pytest.approx(0.5)


def test_engine_wide_acceptance_follows_a_large_batch_within_a_few_steps():
    """The engine-wide evidence is worth at most MAX_EVIDENCE rounds: at batch 64, after
    50 steps of every draft accepted, three steps accepting none bring position 1's rate
    under 0.5 (fading by steps alone kept 3,200 rounds: it stayed near 0.9, and rounds
    ran at a loss for some 30 steps)."""
    chooser = DraftChooser(3)
    batch = tuple(_Req(i) for i in range(64))
    _run(chooser, 50, lambda k: 1e-3 if k == 0 else 1.2e-3, lambda k, rid: k, batch)
    assert chooser.engine_rates.rates()[0] > 0.99
    assert sum(chooser.engine_rates.seen) <= 3 * MAX_EVIDENCE
    _run(chooser, 3, lambda k: 1e-3 if k == 0 else 1.2e-3, lambda k, rid: 0, batch)
    assert chooser.engine_rates.rates()[0] < 0.5


def test_a_look_runs_a_length_new_here_twice_and_a_cheap_one_then_wins():
    """Lengths 1, 3, 4 and 5 measured; rounds of 2, never run, cost 4.5 ms where the line
    through the others says 4.94 (round times are not linear in the length: on the H200
    rounds of 1 at batch 8 cost 3.6 ms where the line through 2 to 5 said 4.5). Position 1
    is always accepted, position 2 one round in eight: rounds of 2 pay 4% over rounds of 1
    by their true cost and lose by the line's. The first look runs them, twice in a row
    (a kind's first step is left out), and from then on they win."""
    ms = {0: 3.3, 1: 4.4, 2: 4.5, 3: 5.6, 4: 5.8, 5: 6.0}
    rounds = iter(range(10**6))

    def accepted(k, rid):  # position 1 always, position 2 one round in eight
        return min(k, 1 + int(next(rounds) % 8 == 0))

    chooser = DraftChooser(5)
    for k in (0, 5, 4, 3, 1):
        for _ in range(5):
            chooser.record(k, 1, ms[k] * 1e-3, [(ONE_REQUEST[0], accepted(k, 0))] if k else [])
    assert chooser.step_seconds(1)[2] > 4.9e-3  # the line's cost
    chosen = _run(chooser, 200, lambda k: ms[k] * 1e-3, accepted)
    first = chosen.index(2)
    assert chosen[first + 1] == 2 and 0 < first < FIRST_EXPLORE + 2
    # (Looks run two steps each, and a look's fresh step can tip the close ranking of
    # rounds of 1 for a weighing: 4 steps.)
    assert chosen[-100:].count(2) >= 90


def test_a_length_shorter_than_every_round_run_is_modelled_from_a_plain_step():
    """Rounds of 3 to 5 and plain steps measured (the H200's times at batch 8, stop 40):
    the line through the rounds alone puts rounds of 1 at 4.4 ms, where they cost 3.64.
    A length below every round run costs no more than the line from a plain step to the
    shortest measured (3.86 ms). At acceptance 0.5 a position (16 requests, the engine's
    rates) rounds of 1 are the best by their true cost (8% over rounds of 4) and by the
    model now; by the line's cost rounds of 4 ranked first."""
    ms = {0: 3.303, 1: 3.637, 2: 4.797, 3: 4.975, 4: 5.092, 5: 5.531}
    runs = [0, 1, 0, 2, 0, 1, 0, 3, 0, 1, 0, 2, 0, 1, 0, 5]  # each position half the rounds
    batch = tuple(_Req(i) for i in range(len(runs)))
    chooser = DraftChooser(5)
    for k in (0, 5, 4, 3):
        for _ in range(5):
            chooser.record(
                k, 1, ms[k] * 1e-3, [(r, min(k, runs[r.rid])) for r in batch] if k else []
            )
    seconds = chooser.step_seconds(1)
    shortest = ms[3] - ms[0]
    assert seconds[1] == pytest.approx((ms[0] + shortest / 3) * 1e-3)
    assert seconds[2] == pytest.approx((ms[0] + 2 * shortest / 3) * 1e-3)
    rates = chooser.rates(1, batch)
    assert rates[1] > max(rates[3:]) > rates[0]


def test_a_change_in_acceptance_changes_the_choice():
    chooser = DraftChooser(4)
    _run(chooser, 100, linear(2.0, 0.5), lambda k, rid: 0)  # plain steps pay
    chosen = _run(chooser, 400, linear(2.0, 0.5), lambda k, rid: k)  # now 4 steps do
    assert chosen[-100:].count(4) >= 90 and chooser.explain().endswith(
        "rounds of 4 draft steps pay"
    )


def test_acceptance_is_tracked_per_request():
    # Request 0 accepts every draft, request 1 none: a batch of both expects 1 + 5 tokens
    # from 5 steps, a batch of request 1 alone expects 1 whatever the length.
    chooser = DraftChooser(5)
    both = (_Req(0), _Req(1))
    _run(chooser, 50, linear(1.5, 0.1), lambda k, rid: k if rid == 0 else 0, both)
    drafting, never = (chooser.rates(1, (_Req(rid),))[5] * 2e-3 for rid in (0, 1))
    assert drafting == pytest.approx(6, rel=0.05)  # 5 drafts and the bonus token
    # Request 1's first draft is nearly never accepted (its own rounds, blended with the
    # engine-wide rate); past it, only the engine-wide rates speak.
    assert never < 1.5
    assert chooser.rates(1, both)[5] * 2e-3 == pytest.approx(drafting + never)
    # An opted-out request emits 1 token a round whatever its history.
    opted_out = _Req(0, SamplingParams(max_new_tokens=8, speculate=False))
    assert chooser.rates(1, (opted_out,))[5] * 2e-3 == pytest.approx(1)
    # Past PER_REQUEST_MAX requests, each drafting one expects the engine-wide figure.
    many = [_Req(100 + i) for i in range(PER_REQUEST_MAX)] + [opted_out]
    engine = chooser.engine_rates.expected_tokens()[5]
    assert chooser.rates(1, many)[5] * 2e-3 == pytest.approx(PER_REQUEST_MAX * engine + 1)


def test_a_closed_batch_runs_at_the_pace_of_its_slowest_request():
    """A closed batch ends when its slowest request does (``choose(closed=True)``). One of
    eight requests accepts nothing, the others every draft: counted in tokens a second
    rounds of 5 pay (43 tokens in 2 ms against 8 in 1 ms), but the slow request emits one
    token a step whatever the length, so plain steps finish the batch soonest (they halve
    its time). Not closed (a serving batch: finished requests are replaced) the rounds
    stay; closed with every request accepting, too."""

    def run(closed, accepted):
        batch = tuple(_Req(i) for i in range(8))
        chooser = DraftChooser(5)
        chosen = []
        for _ in range(200):
            k = chooser.choose(8, batch, closed=closed)
            chosen.append(k)
            rounds = [(r, accepted(k, r.rid)) for r in batch] if k else []
            chooser.record(k, 8, linear(1.5, 0.1)(k), rounds)
        return chosen[-100:], chooser.explain()

    one_slow = lambda k, rid: 0 if rid == 0 else k  # noqa: E731
    chosen, why = run(True, one_slow)
    assert chosen.count(0) >= 90, chosen
    assert why.endswith(
        "(~ modelled, tokens at the pace of its slowest request (a closed batch)): plain steps pay"
    )
    chosen, why = run(False, one_slow)
    assert chosen.count(5) >= 90 and "closed" not in why
    chosen, _ = run(True, lambda k, rid: k)
    assert chosen.count(5) >= 90


def test_a_closed_batch_a_token_from_its_end_takes_a_plain_step():
    """Every request of a closed batch has one token left: any step ends the batch, so the
    cheapest does (a plain step), however well rounds have been accepted. (Counted in
    fractions of a step, a round of 5 "needed" a sixth of one and won.)"""
    chooser = DraftChooser(5)
    running = (_Req(0), _Req(1))
    _run(chooser, 30, linear(1.5, 0.1), lambda k, rid: k, running)  # every draft accepted
    assert chooser.choose(1, running, closed=True) == 5
    last = SamplingParams(max_new_tokens=1, ignore_eos=True)
    assert chooser.choose(1, (_Req(10, last), _Req(11, last)), closed=True) == 0


def _closed_chooser(batch, accepted, steps=60):
    """A chooser that ran ``steps`` closed steps of ``batch`` at bucket 8 (rounds of k cost
    1.5 + 0.1 k ms, a plain step 1 ms), drafts accepted as ``accepted(k, rid)``."""
    chooser = DraftChooser(5)
    step = 0
    # (Not stopped inside a look: its second step would be the next choice.)
    while step < steps or chooser._buckets[8].look_again is not None:
        k = chooser.choose(8, batch, closed=True)
        rounds = [(r, accepted(k, r.rid)) for r in batch if r.params.speculate] if k else []
        chooser.record(k, 8, linear(1.5, 0.1)(k), rounds)
        step += 1
    return chooser


def test_a_closed_batch_counts_each_requests_own_tokens_left_and_acceptance():
    """What the finish time weighs, request by request: the slow request (accepting nothing)
    holds a closed batch on plain steps only while it has as many tokens left as the
    others need; two tokens from its end (its cap, or the context's), the others' rounds
    of 5 finish the batch soonest. A request that opted out of drafting takes a plain
    step's token whatever the length: with the most tokens left it sets the pace, plain."""
    batch = tuple(_Req(i) for i in range(4))
    one_slow = lambda k, rid: 0 if rid == 0 else k  # noqa: E731
    chooser = _closed_chooser(batch, one_slow)
    assert chooser.choose(8, batch, closed=True) == 0
    # (Each batch below in another order: a batch's ranking is reused for a few steps.)
    ending = SamplingParams(max_new_tokens=2, ignore_eos=True)
    almost = (*batch[1:], _Req(0, ending))  # its cap two tokens away
    assert chooser.choose(8, almost, closed=True) == 5
    chooser.context_len = 100  # its context two tokens away: the same
    full = (batch[2], batch[1], batch[3], _Req(0, prompt_ids=[1] * 98))
    assert chooser.choose(8, full, closed=True) == 5
    chooser = _closed_chooser(batch, lambda k, rid: k)  # every draft accepted
    assert chooser.choose(8, batch, closed=True) == 5
    opted_out = _Req(0, SamplingParams(max_new_tokens=100_000, speculate=False))
    assert chooser.choose(8, (batch[1], opted_out, *batch[2:]), closed=True) == 0


def test_a_closed_batch_keeps_each_requests_rounds():
    """A request's lifetime: drafts accepted and positions reached (an all-accepted round
    reaches its last, a rejected one the first it rejected). Recorded for closed steps
    only, as they were planned (a step launched ahead is recorded after the next one's
    plan)."""
    chooser = DraftChooser(3)
    a, b = _Req(0), _Req(1)
    chooser.choose(1, (a, b), closed=True)
    chooser.record(3, 1, 2e-3, [(a, 3), (b, 1)])  # closed, as chosen
    assert chooser._lifetimes == {0: [3, 3], 1: [1, 2]}
    chooser.record(3, 1, 2e-3, [(a, 0)], closed=False)  # planned for an open batch
    assert chooser._lifetimes == {0: [3, 3], 1: [1, 2]}


def test_the_objective_changes_as_soon_as_the_batch_closes():
    """The ranking a plain or long winner reuses for a few steps is weighed again when the
    batch closes (or opens): the other objective ranks."""
    batch = tuple(_Req(i) for i in range(8))
    chooser = DraftChooser(5)
    one_slow = lambda k, rid: 0 if rid == 0 else k  # noqa: E731
    chosen = _run(chooser, 100, linear(1.5, 0.1), one_slow, batch)
    assert chosen[-1] == 5 and chooser.choose(1, batch) == 5
    for _ in range(40):  # lifetimes are kept for closed steps only
        k = chooser.choose(1, batch, closed=True)
        chooser.record(
            k, 1, linear(1.5, 0.1)(k), [(r, one_slow(k, r.rid)) for r in batch] if k else []
        )
    again = batch[::-1]  # a new batch: weighed now, its ranking reused for a few steps
    assert chooser.choose(1, again, closed=True) == 0
    assert chooser.choose(1, again) == 5  # open again: weighed again at once


def test_the_engine_tells_the_chooser_when_a_batch_only_shrinks(gemma4_tiny, gemma4_assistant):
    """``Engine.generate`` (one call's requests, none waiting to join): closed. A serving
    loop's requests (queued, then stepped): not. A generate whose prompts wait for room:
    not while one waits, closed once the last is in. Two calls' requests in one batch:
    not (one caller's slow request must not set another's draft length), closed once one
    call's are left."""
    target = load_model(str(gemma4_tiny.path), CPU, torch.float32)
    drafter = load_model(str(gemma4_assistant.path), CPU, torch.float32)
    seen = []

    class Spy(DraftChooser):
        def choose(self, bucket, reqs, refused=frozenset(), closed=False):
            seen.append((len(reqs), closed))
            return super().choose(bucket, reqs, refused, closed)

    strategy = MTPDecoding(drafter, SpecConfig(num_steps=3, adaptive=True))
    strategy.chooser = Spy(3)
    engine = cpu_engine(target, strategy, max_context_len=64, max_running_requests=2)
    prompts = random_prompts((5, 7, 6), seed=3, vocab=target.model.vocab_size)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    engine.generate(prompts[:2], params)
    assert seen and all(closed for _, closed in seen)
    seen.clear()
    reqs = engine.add_requests(prompts[:2], params)
    while not all(r.finished for r in reqs):
        engine.step()
    assert seen and not any(closed for _, closed in seen)
    seen.clear()
    engine.generate(prompts, params)  # 3 prompts, 2 run at once: the third waits
    first_closed = next(i for i, (_, closed) in enumerate(seen) if closed)
    assert first_closed > 0 and all(closed for _, closed in seen[first_closed:])
    assert seen[first_closed - 1][0] == 2  # the last choice with a prompt waiting
    seen.clear()
    mine = engine.add_requests(prompts[:1], params)
    theirs = engine.add_requests(prompts[1:2], SamplingParams(max_new_tokens=12, ignore_eos=True))
    engine.await_all(mine)
    engine.await_all(theirs)
    while not theirs[0].finished:
        engine.step()
    assert seen[0] == (2, False)
    assert all(closed == (n == 1) for n, closed in seen)  # theirs alone at the end
    assert engine.kv_pool.available() == engine.kv_pool.num_slots


@pytest.mark.parametrize("runner", ["eager", pytest.param("graph", marks=pytest.mark.graphs)])
@pytest.mark.parametrize("chooser", ["measured", "cycling"])
def test_greedy_output_is_plain_decodings_whatever_mix_of_lengths_and_plain_steps(
    runner, chooser, gemma4_tiny, gemma4_assistant
):
    target = load_model(str(gemma4_tiny.path), CPU, torch.float32)
    drafter = load_model(str(gemma4_assistant.path), CPU, torch.float32)
    prompts = random_prompts((5, 11, 7), seed=31, vocab=target.model.vocab_size)
    # Long enough that the measured chooser's first look pays back (LOOK_HORIZON).
    params = SamplingParams(max_new_tokens=LOOK_HORIZON + 8, ignore_eos=True)
    context = 12 + params.max_new_tokens + 4  # the longest prompt, a round's overhang
    plain = cpu_engine(target, max_context_len=context).generate(prompts, params)
    strategy = MTPDecoding(drafter, SpecConfig(num_steps=3, adaptive=True))
    if chooser == "cycling":
        strategy.chooser = cycling_chooser(3, (3, 1, 0, 2, 2, 3, 0, 1))
    else:
        # The chooser learns modelled step times (start-up's included), not the wall
        # clock's: with real ones what it chooses, and so whether both kinds run, follows
        # the machine's load (a clean-clone lane at stop 67 ran no round at all).
        record, model = strategy.chooser.record, linear(1.5, 0.2)
        strategy.chooser.record = lambda steps, bucket, seconds, *args, **kwargs: record(
            steps, bucket, model(steps), *args, **kwargs
        )
    device = standin_device() if runner == "graph" else None
    engine = cpu_engine(
        target, strategy, device, runner=runner, max_context_len=context, graph_buckets=(1, 2, 4)
    )
    reqs = engine.generate(prompts, params)
    assert [r.output_ids for r in reqs] == [r.output_ids for r in plain]
    stats = engine.stats
    assert stats.spec_rounds > 0 and stats.spec_plain_steps > 0  # both kinds ran
    assert stats.spec_plain_steps == strategy.chooser.plain_steps
    assert sum(stats.rounds_by_steps.values()) == stats.spec_rounds
    if chooser == "cycling":
        assert sorted(stats.rounds_by_steps) == [1, 2, 3]
        assert stats.drafted_per_position[0] == stats.spec_rounds
        assert stats.drafted_per_position[2] == stats.rounds_by_steps[3]
    if runner == "graph":  # plain steps on the drafter's own decode graphs, rounds on theirs
        # (Start-up timing ran a plain step three times at each bucket: step_timing.)
        timed = 3 * len(strategy.plain_graph.captured_sizes)
        plain_replays = sum(strategy.plain_graph.replays_per_size().values())
        assert plain_replays == stats.spec_plain_steps + timed
        # Lengths first chosen while running (all but the longest) were captured just
        # before that step: every round replayed graphs.
        assert stats.graph_rounds == stats.spec_rounds and stats.eager_steps == 1  # prefill
        if len(stats.rounds_by_steps) > 1:  # a shorter length was captured while running
            assert stats.lazy_capture_s > 0
        for k in stats.rounds_by_steps:  # one graph a round (the default)
            variant = strategy.variants[k]
            assert variant.round.captured_sizes == [1, 2, 4]
            assert sum(variant.round.replays_per_size().values()) > 0, k
        for k in set(strategy.variants) - set(stats.rounds_by_steps):  # never chosen
            assert strategy.variants[k].round.captured_sizes == []
    assert engine.kv_pool.available() == engine.kv_pool.num_slots


@pytest.mark.graphs
def test_a_short_closed_batch_runs_no_length_it_would_capture(
    gemma4_tiny, gemma4_assistant, monkeypatch
):
    """A closed batch (one generate call) with fewer than CAPTURE_HORIZON tokens left
    chooses among the lengths captured already and plain steps: a capture costs 150-300
    steps, which the README's 400 tokens never win back. Asked for every length in turn,
    it runs rounds of 3 (captured at start-up) and plain steps only, captures nothing
    while running and writes plain decoding's tokens; sampled, the longest rounds still
    run (their graphs are captured when first needed); with the horizon within reach,
    or an engine that has run that many steps already (a long-lived one), lengths 1 and
    2 are captured when first chosen and keep running after."""
    target = load_model(str(gemma4_tiny.path), CPU, torch.float32)
    drafter = load_model(str(gemma4_assistant.path), CPU, torch.float32)
    prompts = random_prompts((5, 11), seed=35, vocab=target.model.vocab_size)
    plain = cpu_engine(target, max_context_len=64).generate(prompts, GREEDY)
    sampled = SamplingParams(
        max_new_tokens=GREEDY.max_new_tokens, temperature=0.8, seed=3, ignore_eos=True
    )
    short, far = GREEDY.max_new_tokens // 2, adaptive.CAPTURE_HORIZON
    for horizon, params, lived in (
        (far, GREEDY, 0), (far, sampled, 0), (short, GREEDY, 0), (far, GREEDY, far),
    ):  # fmt: skip
        monkeypatch.setattr(adaptive, "CAPTURE_HORIZON", horizon)
        strategy = MTPDecoding(drafter, SpecConfig(num_steps=3, adaptive=True))
        strategy.chooser = cycling_chooser(3, (1, 2, 0, 3), capture_anytime=False)
        strategy.chooser.steps_by_count[0] = lived  # steps an earlier call ran
        engine = cpu_engine(
            target, strategy, standin_device(), runner="graph", max_context_len=64,
            graph_buckets=(1, 2),
        )  # fmt: skip
        reqs = engine.generate(prompts, params)
        stats = engine.stats
        assert stats.graph_rounds == stats.spec_rounds > 0 and stats.spec_plain_steps > 0
        if params is GREEDY:
            assert [r.output_ids for r in reqs] == [r.output_ids for r in plain]
        if horizon == far and not lived:  # the lengths captured (sampled: the longest) only
            assert set(stats.rounds_by_steps) == {3}
            assert all(strategy.variants[k].round.captured_sizes == [] for k in (1, 2))
            assert (stats.lazy_capture_s > 0) == (params is sampled)
        else:  # within reach at first: each length captured when first chosen, then run
            # whatever the batch has left
            assert set(stats.rounds_by_steps) == {1, 2, 3} and stats.lazy_capture_s > 0


@pytest.mark.graphs
def test_capture_all_graphs_captures_every_length_at_start_up(gemma4_tiny, gemma4_assistant):
    """A server's engine (capture_all_graphs): every length's round graphs (greedy and
    sampled) are captured before the first step, and no step captures while running."""
    target = load_model(str(gemma4_tiny.path), CPU, torch.float32)
    drafter = load_model(str(gemma4_assistant.path), CPU, torch.float32)
    prompts = random_prompts((5, 11, 7), seed=31, vocab=target.model.vocab_size)
    plain = cpu_engine(target, max_context_len=64).generate(prompts, GREEDY)
    strategy = MTPDecoding(drafter, SpecConfig(num_steps=3, adaptive=True))
    strategy.chooser = cycling_chooser(3, (3, 1, 0, 2, 2, 3, 0, 1))
    engine = cpu_engine(
        target, strategy, standin_device(), runner="graph", max_context_len=64,
        graph_buckets=(1, 2, 4), capture_all_graphs=True,
    )  # fmt: skip
    for variant in strategy.variants.values():
        assert variant.draft is variant.verify is None  # one graph a round
        for runner in (variant.round, variant.sampled_round):
            assert runner.captured_sizes == [1, 2, 4]
    reqs = engine.generate(prompts, GREEDY)
    assert [r.output_ids for r in reqs] == [r.output_ids for r in plain]
    assert sorted(engine.stats.rounds_by_steps) == [1, 2, 3]
    assert engine.stats.lazy_capture_s == 0 and engine.stats.graph_rounds > 0


@pytest.mark.graphs
@pytest.mark.parametrize("capture_all", [False, True], ids=["lazy", "capture-all"])
@pytest.mark.parametrize("one_graph", [True, False], ids=["one-graph", "two-graph"])
def test_graph_memory_cap_leaves_lengths_uncaptured_and_never_drafts_them(
    gemma4_tiny, gemma4_assistant, monkeypatch, capture_all, one_graph
):
    """max_graph_memory_bytes: once the graphs hold the cap, a length first needed is not
    captured and never chosen (the chooser asks for every length in turn); steps run the
    captured length or plain steps, all on graphs, and the output is plain decoding's.
    With capture_all_graphs (a server) the lengths are refused at start-up instead."""
    from graphrt.devices.graphs import StreamGraphBackend

    # Stand-in graphs hold no device memory: count 1 MiB a captured graph.
    monkeypatch.setattr(
        StreamGraphBackend, "memory_bytes", lambda self: len(list(self.keys())) << 20
    )
    target = load_model(str(gemma4_tiny.path), CPU, torch.float32)
    drafter = load_model(str(gemma4_assistant.path), CPU, torch.float32)
    prompts = random_prompts((5, 11), seed=33, vocab=target.model.vocab_size)
    plain = cpu_engine(target, max_context_len=64).generate(prompts, GREEDY)
    strategy = MTPDecoding(drafter, SpecConfig(num_steps=3, adaptive=True, one_graph=one_graph))
    strategy.chooser = cycling_chooser(3, (3, 1, 0, 2, 3, 0))
    # Start-up: the longest rounds' graphs (one; or verify's and the draft loop's) and
    # the plain decode graphs, 2 buckets each: the cap; any further capture would pass it.
    cap = (4 if one_graph else 6) << 20
    engine = cpu_engine(
        target, strategy, standin_device(), runner="graph", max_context_len=64,
        graph_buckets=(1, 2), max_graph_memory_bytes=cap, capture_all_graphs=capture_all,
    )  # fmt: skip
    assert engine.stats.graph_memory_bytes == cap
    if capture_all:  # refused: lengths 1 and 2's greedy and sampled round graphs and length
        # 3's sampled one; or lengths 1 and 2's draft loop, verify and sampled verify and
        # length 3's sampled verify
        assert engine.stats.refused_captures == (5 if one_graph else 7)
    reqs = engine.generate(prompts, GREEDY)
    assert [r.output_ids for r in reqs] == [r.output_ids for r in plain]
    stats = engine.stats
    assert stats.refused_captures >= 2 and stats.graph_memory_bytes == cap
    if capture_all:
        assert stats.lazy_capture_s == 0  # nothing captured while running
    assert set(stats.rounds_by_steps) == {3} and stats.spec_plain_steps > 0
    assert stats.graph_rounds == stats.spec_rounds and stats.eager_steps == 1  # the prefill
    for k in (1, 2):
        variant = strategy.variants[k]
        assert (variant.round if one_graph else variant.draft).captured_sizes == []
    assert engine.kv_pool.available() == engine.kv_pool.num_slots


@pytest.mark.graphs
def test_after_cleanup_no_length_is_captured_and_rounds_run_eagerly(gemma4_tiny, gemma4_assistant):
    """``Engine.cleanup`` drops the graphs: lengths start-up left to capture later are
    refused as over the memory cap, every step after it runs eagerly, and the output is
    plain decoding's."""
    target = load_model(str(gemma4_tiny.path), CPU, torch.float32)
    drafter = load_model(str(gemma4_assistant.path), CPU, torch.float32)
    prompts = random_prompts((5, 11), seed=33, vocab=target.model.vocab_size)
    plain = cpu_engine(target, max_context_len=64).generate(prompts, GREEDY)
    strategy = MTPDecoding(drafter, SpecConfig(num_steps=3, adaptive=True))
    strategy.chooser = cycling_chooser(3, (3, 0))
    engine = cpu_engine(
        target, strategy, standin_device(), runner="graph", max_context_len=64,
        graph_buckets=(1, 2),
    )  # fmt: skip
    engine.generate(prompts, GREEDY)  # rounds of 3 and plain steps, on graphs
    assert engine.stats.graph_rounds > 0 and engine.stats.graph_steps > 0
    engine.cleanup()
    before = dataclasses.replace(engine.stats)
    strategy.chooser = cycling_chooser(3, (1, 2, 3, 0))  # lengths 1 and 2: never captured
    reqs = engine.generate(prompts, GREEDY)
    assert [r.output_ids for r in reqs] == [r.output_ids for r in plain]
    stats = engine.stats
    assert stats.graph_rounds == before.graph_rounds and stats.graph_steps == before.graph_steps
    assert stats.refused_captures > before.refused_captures
    assert stats.spec_rounds > before.spec_rounds  # rounds still ran, eagerly
    runners = [r for v in strategy.variants.values() for r in v.runners()]
    assert all(r.captured_sizes == [] for r in runners + [strategy.plain_graph])
    assert_engine_idle(engine)


def test_a_request_that_opts_out_accepts_no_draft_and_keeps_its_output():
    """``SamplingParams(speculate=False)`` beside a drafting request, on the embedded pair
    (a trained assistant: drafts are accepted): the opted-out request accepts nothing in
    every round, the other accepts drafts, and both outputs are plain greedy decoding's."""
    target = load_model(str(pretrained.TARGET_DIR), CPU, torch.float32)
    drafter = load_model(str(pretrained.ASSISTANT_DIR), CPU, torch.float32)
    tokens = Tokenizer.from_file(str(pretrained.TARGET_DIR / "tokenizer.json"))
    prompts = [tokens.encode(p).ids for p in ("def fibonacci(n):", "import os\nimport sys\n")]
    drafting = SamplingParams(max_new_tokens=32, ignore_eos=True)
    opted_out = SamplingParams(max_new_tokens=32, ignore_eos=True, speculate=False)
    plain = cpu_engine(target).generate(prompts, drafting)
    engine = cpu_engine(target, MTPDecoding(drafter, SpecConfig(num_steps=3)))
    engine.add_request(prompts[0], drafting)
    engine.add_request(prompts[1], opted_out)
    reqs = list(engine.waiting)
    while engine.has_work:
        engine.step()
    assert [r.output_ids for r in reqs] == [r.output_ids for r in plain]
    accepted = [[len(rnd["accepted_tokens"]) for rnd in r.spec_rounds] for r in reqs]
    assert sum(accepted[0]) > 0 and accepted[1] and not any(accepted[1]), accepted


@pytest.mark.graphs
def test_a_batch_that_opted_out_takes_plain_steps_on_decode_graphs(gemma4_tiny, gemma4_assistant):
    """Fixed-length rounds, every request opted out: plain steps, on decode graphs captured
    when first needed; the output is plain greedy decoding's."""
    target = load_model(str(gemma4_tiny.path), CPU, torch.float32)
    drafter = load_model(str(gemma4_assistant.path), CPU, torch.float32)
    prompts = random_prompts((5, 9), seed=32, vocab=target.model.vocab_size)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True, speculate=False)
    plain = cpu_engine(target, max_context_len=64).generate(prompts, params)
    strategy = MTPDecoding(drafter, SpecConfig(num_steps=3))
    engine = cpu_engine(
        target, strategy, standin_device(), runner="graph", max_context_len=64, graph_buckets=(2,)
    )
    assert strategy.plain_graph.captured_sizes == []  # not at start-up: rounds need none
    reqs = engine.generate(prompts, params)
    assert [r.output_ids for r in reqs] == [r.output_ids for r in plain]
    stats = engine.stats
    assert stats.spec_rounds == 0 and stats.spec_plain_steps == 11
    assert strategy.plain_graph.captured_sizes == [2]
    assert sum(strategy.plain_graph.replays_per_size().values()) == 11
    assert stats.eager_steps == 1  # the prefill


def test_a_length_measured_a_few_times_takes_the_line_through_the_others():
    """One slow sample (a collection pause, a page fault) must not rule a length out for
    the next 64 steps: until measured TRUSTED_SAMPLES times, its time is the line a + b k
    fitted through the lengths measured more, or its own samples where they are faster (a
    stall only adds time). A length never run is on the line; a look, which takes it at its
    most hopeful, between a plain step and the longest rounds where that is less."""
    chooser = DraftChooser(5)
    for k, ms, n in ((0, 1.0, 5), (1, 1.6, 5), (5, 3.0, 5), (3, 9.0, 2)):  # one dropped each
        for _ in range(n):
            chooser.record(k, 1, ms * 1e-3)
    seconds = chooser.step_seconds(1)
    assert seconds[0] == pytest.approx(1e-3) and seconds[5] == pytest.approx(3e-3)
    assert seconds[3] == pytest.approx(2.3e-3, rel=0.05)  # not the 9 ms sample
    assert seconds[2] == pytest.approx(1.95e-3, rel=0.05)  # never measured: on the line
    hopeful = chooser.step_seconds(1, optimistic=True)
    assert hopeful[2] == pytest.approx(1.8e-3)  # 1 + 2/5 of the way to the longest rounds' 3
    assert hopeful[3] == seconds[3]  # run here: its own time or the line, never hope
    chooser.record(2, 1, 1.2e-3)  # a fast first sample (it is left out), then another
    chooser.record(2, 1, 1.2e-3)
    assert chooser.step_seconds(1)[2] == pytest.approx(1.2e-3)  # faster than the line: believed
    for _ in range(TRUSTED_SAMPLES):
        chooser.record(3, 1, 9e-3)
    assert chooser.step_seconds(1)[3] == pytest.approx(9e-3)  # measured enough: believed


def test_a_new_batch_bucket_starts_from_the_nearest_measured_one():
    """A batch that shrinks into a new bucket does not measure both ends again: the
    nearest bucket's times, scaled, decide until its own are measured."""
    chooser = DraftChooser(5)
    step = linear(1.5, 0.1)
    for _ in range(60):  # bucket 8: nothing accepted, plain steps pay
        k = chooser.choose(8, ONE_REQUEST)
        chooser.record(k, 8, step(k), [(ONE_REQUEST[0], 0)] if k else [])
    assert chooser.choose(4, ONE_REQUEST) == 0  # not the longest rounds "to measure"
    chooser.record(0, 4, 0.5e-3)  # the first step of a kind at a bucket is left out
    chooser.record(0, 4, 0.5e-3)
    seconds = chooser.step_seconds(4)  # bucket 8's times at half the cost
    assert seconds[0] == pytest.approx(0.5e-3) and seconds[5] == pytest.approx(1e-3)


def test_a_new_bucket_measures_its_own_plain_step():
    """Rounds and plain steps scale differently with the batch (verify's attention and
    matmuls grow with its rows, a plain step barely does), so a donor bucket's plain time
    scaled by the rounds' ratio is wrong: it once kept auto drafting at batch 8 and 64 on
    an H200 where plain steps were 1.4x faster. A new bucket measures a plain step first."""
    chooser = DraftChooser(5)
    accept_all = lambda k, rid: k  # noqa: E731
    one = lambda k: 1e-3 if k == 0 else (1.0 + 0.05 * k) * 1e-3  # noqa: E731
    _run(chooser, 40, one, accept_all)  # bucket 1: rounds of 5 pay (6 tokens in 1.25 ms)
    eight = lambda k: 1.1e-3 if k == 0 else (9.0 + 0.5 * k) * 1e-3  # noqa: E731
    chosen = []
    for _ in range(100):  # bucket 8: rounds of 5 take 11.5 ms for 6 tokens a request
        k = chooser.choose(8, ONE_REQUEST)
        chosen.append(k)
        chooser.record(k, 8, eight(k), [(ONE_REQUEST[0], k)] if k else [])
    assert chosen[:2] == [0, 0]  # measured (the first of a kind is left out)
    assert chosen[-50:].count(0) >= 45  # plain steps pay here, now and then a look


def test_a_plain_winner_stays_without_weighing_and_no_choice_changes():
    """After a plain step wins, the steps that would reuse its ranking and take no look are
    plain without weighing anything (``stays_plain``, what MTPDecoding.plan asks first):
    the choices, the looks included, are the ones weighing every step makes, in far fewer
    weighings. A batch that changes ends the streak; with streaks off (tensor
    parallelism) every step is weighed."""

    short = SamplingParams(max_new_tokens=LOOK_HORIZON - 1, ignore_eos=True)

    def run(streaks: bool, steps: int = 400):
        chooser = DraftChooser(5)
        chooser.streaks = streaks
        _timed_at_start_up(chooser, 1, plain_ms=1.0, round_ms=4.0)
        reqs = [_Req(0), _Req(1)]
        chosen, weighed, rng = [], [], random.Random(0)
        for step in range(steps):
            if step == 200:
                reqs = [_Req(0), _Req(2)]  # one request left, another came: same size
            if step == 300:  # too few tokens left for any look
                reqs = [_Req(3, short), _Req(4, short)]
            if chooser.stays_plain(reqs):
                k = 0
            else:
                k = chooser.choose(1, reqs)
                weighed.append(step)
            chosen.append(k)
            # Rounds cost 3.5 + 0.1 k ms and accept little: plain steps pay, with looks.
            accepted = [(r, sum(rng.random() < 0.3 for _ in range(k))) for r in reqs] if k else []
            chooser.record(k, 1, linear(3.5, 0.1)(k), accepted)
        return chosen, weighed

    every, weighed_every = run(streaks=False)
    streaked, weighed_streaked = run(streaks=True)
    assert streaked == every
    assert every.count(0) > 300 and 0 < every.count(5)  # plain steps pay; looks still run
    assert len(weighed_every) == 400
    assert len(weighed_streaked) < 0.4 * 400, len(weighed_streaked)
    assert 200 in weighed_streaked  # the new batch is weighed at once
    late = [step for step in weighed_streaked if step > 300]
    assert len(late) < 40, late  # with no look to come, streaks run on

    # Before any round ran, every step asks whether a first round may pay, on plain
    # steps' times: no streak there (here plain steps slow from 1 to 5 ms; rounds of 5
    # take 5 ms, and may pay at an optimistic acceptance once plain steps pass 1.07).
    def slowing(streaks: bool) -> list[int]:
        chooser = DraftChooser(5)
        chooser.streaks = streaks
        _timed_at_start_up(chooser, 1, plain_ms=1.0, round_ms=5.0)
        chosen = []
        for step in range(12):
            k = 0 if chooser.stays_plain(ONE_REQUEST) else chooser.choose(1, ONE_REQUEST)
            chosen.append(k)
            seconds = min(1.0 + 0.1 * step, 5.0) * 1e-3 if k == 0 else 5e-3
            chooser.record(k, 1, seconds, [(ONE_REQUEST[0], 0)] if k else [])
        return chosen

    assert slowing(streaks=True) == slowing(streaks=False)
    assert 5 in slowing(streaks=False)


def _timed_at_start_up(chooser, bucket, plain_ms, round_ms):
    """What the engine's start-up timing records at ``bucket``: each end three times in a
    row, then the longest rounds once more (MTPDecoding.step_timing)."""
    longest = chooser.max_steps
    for k in (longest,) * 3 + (0,) * 3 + (longest,):
        chooser.record(k, bucket, (plain_ms if k == 0 else round_ms) * 1e-3, timing=True)


def test_start_up_timing_skips_the_rounds_that_cannot_pay():
    """With both ends timed at start-up, the first steps do not measure them again: a
    round of 5 that costs more than an optimistic acceptance could win back (here 6 plain
    steps' time) never runs before exploration looks; one that could runs once first, to
    measure acceptance. Timing steps count as no step run."""
    costly = DraftChooser(5)
    _timed_at_start_up(costly, 1, plain_ms=1.0, round_ms=6.0)
    assert costly.steps_by_count == [0] * 6 and not costly.engine_rates.seen[0]
    chosen = _run(costly, FIRST_EXPLORE - 1, linear(5.5, 0.1), lambda k, rid: k)
    assert chosen == [0] * (FIRST_EXPLORE - 1)

    cheap = DraftChooser(5)
    _timed_at_start_up(cheap, 1, plain_ms=1.0, round_ms=2.0)
    chosen = _run(cheap, 40, linear(1.5, 0.1), lambda k, rid: 0)  # nothing accepted
    assert chosen[0] == 5  # acceptance measured at every position, then
    # a few short rounds while one round's evidence is thin (OPTIMISM), then plain steps
    assert set(chosen[1:FIRST_EXPLORE]) == {0, 1} and chosen[1:FIRST_EXPLORE].count(1) <= 4
    assert chosen[FIRST_EXPLORE - 8 : FIRST_EXPLORE] == [0] * 8  # plain steps pay


def test_no_look_where_too_few_tokens_are_left_to_pay_it_back():
    """Rounds that could pay at an optimistic acceptance are tried first, and the runner-up
    looked at now and then, only while the batch has LOOK_HORIZON tokens or more left: a
    look costs now and pays back over the steps after it. (Rounds of 5 cost 4 plain
    steps: they could pay at 0.9 a position, but not at the unseen prior, so every round
    here is a look.)"""
    short = SamplingParams(max_new_tokens=LOOK_HORIZON - 1, ignore_eos=True)
    for params, looks in ((short, False), (LONG, True)):
        chooser = DraftChooser(5)
        _timed_at_start_up(chooser, 1, plain_ms=1.0, round_ms=4.0)
        reqs = (_Req(0, params),)
        chosen = _run(chooser, 3 * FIRST_EXPLORE, linear(3.5, 0.1), lambda k, rid: 0, reqs)
        assert (chosen.count(0) < len(chosen)) == looks, chosen
        assert chosen[0] == (5 if looks else 0)


def test_no_round_on_the_acceptance_prior_alone_where_too_few_tokens_are_left():
    """Before any round ran, acceptance is a prior (with optimism: about 1.7 tokens a round
    of 1), and a round chosen on it is a look: a batch with fewer than LOOK_HORIZON tokens
    left takes plain steps only, open or closed, however cheap start-up timed the short
    rounds (here 1.4 plain steps, under the prior's promise); a longer one drafts. On 2
    CPU cores the README's 32 tokens ran rounds of 1 whenever start-up timed them under
    1.6 plain steps."""
    short = SamplingParams(max_new_tokens=LOOK_HORIZON - 1, ignore_eos=True)
    for params, closed in ((short, False), (short, True), (LONG, False)):
        chooser = DraftChooser(5)
        _timed_at_start_up(chooser, 1, plain_ms=1.0, round_ms=6.0)  # 5 could never pay
        for _ in range(3):
            chooser.record(1, 1, 1.4e-3, timing=True)
        req = _Req(0, params, [])
        chosen = []
        for _ in range(LOOK_HORIZON - 2):
            k = chooser.choose(1, (req,), closed=closed)
            chosen.append(k)
            chooser.record(k, 1, linear(1.3, 0.1)(k), [(req, 1)] if k else [])
            req.output_ids += [7] * (2 if k else 1)  # a round accepts one draft
        drafted = any(chosen)
        assert drafted == (params is LONG), (params.max_new_tokens, closed, chosen)
        why = chooser.explain()  # the summary line's: what it chose and why
        if drafted:
            assert "pay" in why and "too few" not in why, why
        else:
            said = f"no round has measured acceptance yet, and {LOOK_HORIZON - 1} tokens left"
            assert why.startswith(f"at batch 1: {said} are too few"), why


def test_looks_stop_where_the_cap_or_the_context_leaves_too_few_tokens():
    """Tokens left are the request's cap less what it emitted, and no more than its
    context's room: a look stops paying back near either end."""
    for context_len, prompt, cap in ((None, 3, 2 * LOOK_HORIZON), (LOOK_HORIZON + 40, 8, 10**6)):
        chooser = DraftChooser(5, context_len)
        _timed_at_start_up(chooser, 1, plain_ms=1.0, round_ms=4.0)
        req = _Req(0, SamplingParams(max_new_tokens=cap, ignore_eos=True), [])
        req.prompt_ids = [1] * prompt
        chosen = []
        for _ in range(3 * MAX_EXPLORE):
            k = chooser.choose(1, (req,))
            chosen.append((k, len(req.output_ids)))
            chooser.record(k, 1, linear(3.5, 0.1)(k), [(req, 0)] if k else [])
            req.output_ids.append(7)  # nothing accepted: one token a step
        looked = [emitted for k, emitted in chosen if k]
        left = (cap if context_len is None else context_len - prompt) - LOOK_HORIZON
        assert looked and max(looked) <= left, (looked, left)  # none once too few are left


def test_the_chooser_times_each_decode_step_whole_settling_included(gemma4_tiny, gemma4_assistant):
    """What the chooser learns a step costs is the engine's whole step, its settling (slots,
    tokens) included, once per decode step and never for a prefill."""
    target = load_model(str(gemma4_tiny.path), CPU, torch.float32)
    drafter = load_model(str(gemma4_assistant.path), CPU, torch.float32)
    strategy = MTPDecoding(drafter, SpecConfig(num_steps=3, adaptive=True))
    engine = cpu_engine(target, strategy, max_context_len=64)
    timed, done, settle = [], strategy.step_done, engine._apply

    def step_done(seconds):
        timed.append(seconds)
        done(seconds)

    def slow_settle(reqs, outcome):
        time.sleep(0.005)
        return settle(reqs, outcome)

    strategy.step_done, engine._apply = step_done, slow_settle
    engine.generate([[5, 6, 7]], GREEDY)
    chooser = strategy.chooser
    assert len(timed) == sum(chooser.steps_by_count) > 0  # the prefill step is not timed
    seconds = chooser._buckets[1].seconds
    # What the chooser chose depends on real timings: each kind that ran has real times,
    # but a kind start-up did not time keeps its first step out (first touches).
    ran = [k for k, n in enumerate(chooser.steps_by_count) if n]
    timed_kinds = [k for k in ran if k in seconds]
    assert all(k in timed_kinds for k in ran if chooser.steps_by_count[k] > 1)
    assert timed_kinds and all(min(seconds[k]) >= 0.005 for k in timed_kinds), {
        k: list(seconds[k]) for k in timed_kinds
    }


def test_a_step_launched_ahead_is_charged_its_own_launch_not_the_next_ones(monkeypatch):
    """Under ``--overlap`` a step's seconds run from the settling of the step before it,
    and the launch of the step behind it falls inside them: each step is charged its own
    launch instead, made in the interval before (``Engine._settle``). Here a step whose
    own launch took 10 ms settles in 5 while the next one's launch takes 30: 15 ms, not
    35 (on the H200 auto charged each plain step before a round with the round's launch).
    The engine's clock is the test's: no sleeps to time."""
    import graphrt.core.engine.engine as engine_module

    clock = [100.0]
    monkeypatch.setattr(engine_module, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    recorded = []

    def launched(launch_s: float) -> LaunchedStep:
        step = LaunchedStep(
            reqs=[],
            read=SimpleNamespace(wait=list),
            settle=lambda values: StepOutcome(tokens=[]),
            feed=lambda: (None, None),
            record=lambda seconds, outcome: recorded.append(seconds),
        )
        step.launch_s = launch_s
        return step

    def launch_ahead(step):
        clock[0] += 0.030
        return launched(0.0)

    def settle(reqs, outcome):
        clock[0] += 0.005
        return []

    engine = SimpleNamespace(
        _launch_ahead=launch_ahead,
        _apply=settle,
        _emit=lambda reqs, emitted: None,
        _drop_idle_pending=lambda: None,
    )
    step = launched(0.010)
    step.start = clock[0]
    Engine._settle(engine, step)
    assert recorded == [pytest.approx(0.015)]
    ahead = engine._pending
    assert ahead.launch_s == pytest.approx(0.030)
    assert ahead.start == clock[0]  # its seconds count from here


def test_a_step_after_a_change_of_kind_teaches_no_time():
    """A step after a step of another kind pays for the change (with steps launched ahead
    on an H100, a plain step between rounds cost 2-3x one in a row): its time is left
    out, so a kind is priced by its steps in a row, what a winner runs."""
    chooser = DraftChooser(5)
    _timed_at_start_up(chooser, 1, plain_ms=1.0, round_ms=2.0)
    chooser.record(5, 1, 2.5e-3, [(ONE_REQUEST[0], 5)])  # behind start-up's last round
    assert chooser.step_seconds(1)[5] == pytest.approx(2.5e-3)
    chooser.record(0, 1, 3.0e-3)  # a plain step between rounds: left out
    assert chooser.step_seconds(1)[0] == pytest.approx(1.0e-3)  # start-up's stands
    chooser.record(0, 1, 1.2e-3)  # one in a row replaces it
    assert chooser.step_seconds(1)[0] == pytest.approx(1.2e-3)
    chooser.record(5, 1, 9.0e-3, [(ONE_REQUEST[0], 5)])  # after plain steps: left out
    assert chooser.step_seconds(1)[5] == pytest.approx(2.5e-3)
    assert chooser.steps_by_count == [2, 0, 0, 0, 0, 2]  # every step counts as run


def test_every_look_runs_twice_in_a_row():
    """A look runs two steps in a row: its first, after a change of kind, teaches no time,
    so a look of one step would leave its kind's figure as old as its last run in a row."""
    chooser = DraftChooser(3)
    _timed_at_start_up(chooser, 1, plain_ms=1.0, round_ms=2.0)
    # Every draft accepted: rounds of 3 emit 4 tokens in 2 ms and win; plain steps at 1 ms
    # and shorter rounds are looked at now and then.
    seconds = lambda k: 1e-3 if k == 0 else (1.7 + 0.1 * k) * 1e-3  # noqa: E731
    chosen = _run(chooser, 600, seconds, lambda k, rid: k)
    runs = [(k, len(list(g))) for k, g in itertools.groupby(chosen)]
    looks = [(k, n) for k, n in runs[1:] if k != 3]
    assert 0 in {k for k, _ in looks} and {1, 2} & {k for k, _ in looks}, runs
    assert all(n == 2 for _, n in looks), runs
    assert chooser.step_seconds(1)[0] == pytest.approx(1e-3)  # plain steps in a row


def _plain_looks(chooser, plain_ms, round_ms, steps=1200):
    """The runs of plain steps a chooser between plain steps and rounds of 3 alone (rounds
    of 1 and 2 refused, as where only rounds of 3 are captured) takes in ``steps`` steps,
    every draft accepted."""
    _timed_at_start_up(chooser, 1, plain_ms, round_ms)
    chosen = []
    for _ in range(steps):
        k = chooser.choose(1, ONE_REQUEST, refused={1, 2})
        chosen.append(k)
        chooser.record(k, 1, (plain_ms if k == 0 else round_ms) * 1e-3, [(ONE_REQUEST[0], k)])
    runs = [(k, len(list(g))) for k, g in itertools.groupby(chosen)]
    assert all(n == 2 for k, n in runs[1:] if k == 0), runs  # looks, two steps each
    assert chosen.index(0) <= FIRST_EXPLORE + 1  # start-up's figure checked at the first
    return sum(1 for k, _ in runs if k == 0)


def test_looks_at_plain_steps_thin_out_where_rounds_win_twice_over(monkeypatch):
    """A look at plain steps teaches only their time, and it would take twice their speed
    to change a choice that rounds win by more than twice: three such looks in four are
    passed over (PLAIN_LOOK_MARGIN). Looks still come (a figure from a slow spell stands a
    few hundred steps at most), and where rounds win by less, every look is taken."""
    every = {}
    for margin in (adaptive.PLAIN_LOOK_MARGIN, float("inf")):
        monkeypatch.setattr(adaptive, "PLAIN_LOOK_MARGIN", margin)
        # 4 tokens in 1.8 ms against 1 in 1.5: rounds 3.3x; in 2.2 ms against 1 in 1: 1.8x.
        every[margin] = (
            _plain_looks(DraftChooser(3), 1.5, 1.8),
            _plain_looks(DraftChooser(3), 1.0, 2.2),
        )
    (wide, narrow), (wide_all, narrow_all) = every.values()
    assert wide_all >= 16 and narrow == narrow_all == wide_all, every
    assert 2 <= wide <= 2 + wide_all // (adaptive.PLAIN_LOOKS_PASSED + 1), every


def test_a_look_refreshes_a_figure_from_a_slow_spell():
    """Rounds of 5 measured in a slow spell (3 ms) lose to rounds of 4 (1.9 ms, every draft
    accepted: 6 tokens in 3 ms against 5 in 1.9); the spell ends (rounds of 5 cost 2 ms,
    and pay). A look at them, two steps in a row, replaces their figure, older than any
    gap between looks, and they win again: one step, left out after a change of kind,
    would not; nor would one fresh step among the spell's 15 in their median."""
    chooser = DraftChooser(5)
    clock = itertools.count()

    def seconds(k):
        slow = next(clock) < 40
        return {0: 1.0, 4: 1.9, 5: 3.0 if slow else 2.0}.get(k, 1.5 + 0.1 * k) * 1e-3

    chosen = _run(chooser, 700, seconds, lambda k, rid: k)
    assert chosen[40:100].count(4) > 50, chosen[:100]  # rounds of 4 won in the spell
    assert chosen[-100:].count(5) > 90, chosen[-100:]


def test_one_slow_start_up_sample_does_not_rule_plain_steps_out():
    """A stall in a start-up timing step (a collection, an interrupt) only adds time: the
    fastest sample stands. And where plain steps' one figure came out slow anyway, the
    chooser's first look runs a plain step, whose real time replaces start-up's."""
    chooser = DraftChooser(5)
    # In the engine's order (_timed_at_start_up): a kind's first step and the one after a
    # change of kind are left out.
    for k, ms in ((5, 10.0), (5, 10.0), (5, 10.5), (0, 5.0), (0, 19.5), (0, 5.5), (5, 9.0)):
        chooser.record(k, 1, ms * 1e-3, timing=True)
    assert chooser.step_seconds(1)[0] == pytest.approx(5.5e-3)
    assert chooser.step_seconds(1)[5] == pytest.approx(10e-3)

    stalled = DraftChooser(5)  # plain's only kept sample a stall: rounds look cheaper
    for k, ms in ((5, 10.0), (5, 10.0), (0, 5.0), (0, 19.5)):
        stalled.record(k, 1, ms * 1e-3, timing=True)
    # Nothing accepted, a plain step 5 ms, a round of k 9.5 + 0.1 k: plain steps pay.
    chosen = _run(
        stalled,
        6 * FIRST_EXPLORE,
        lambda k: 5e-3 if k == 0 else (9.5 + 0.1 * k) * 1e-3,
        lambda k, rid: 0,
    )
    assert chosen[: FIRST_EXPLORE - 1].count(0) == 0  # the stalled figure rules at first
    assert chosen[-FIRST_EXPLORE:] == [0] * FIRST_EXPLORE  # the looks measured plain steps
    assert stalled.explain().endswith("plain steps pay")


@pytest.mark.parametrize(
    "runner",
    [
        "eager",
        pytest.param("graph", marks=pytest.mark.graphs),
        pytest.param("graph-all", marks=pytest.mark.graphs),
        pytest.param("graph-overlap", marks=pytest.mark.graphs),
    ],
)
def test_the_engine_times_each_end_at_start_up_and_leaves_nothing_behind(
    runner, gemma4_tiny, gemma4_assistant, monkeypatch
):
    """Auto lengths: the engine's start-up runs a plain step and the longest rounds three
    times each at every captured bucket (batch 1 eagerly; eagerly rounds of 1 too; every
    length where all graphs are captured up front, as `graphrt serve` does) on throwaway
    requests; the chooser then knows those times, and the pools, the request ids and the
    stats are as before. With overlap every step runs launched behind the one before, as
    in use, the longest rounds once more behind the plain steps (both changes of kind run
    before any real step), and the last one launched is read: nothing left in flight."""
    target = load_model(str(gemma4_tiny.path), CPU, torch.float32)
    drafter = load_model(str(gemma4_assistant.path), CPU, torch.float32)
    strategy = MTPDecoding(drafter, SpecConfig(num_steps=3, adaptive=True))
    graphs, overlap = runner.startswith("graph"), runner.endswith("overlap")
    kinds_launched_ahead = []
    launch_ahead = Engine._launch_ahead

    def spy(self, step):
        ahead = launch_ahead(self, step)
        kinds_launched_ahead.append(None if ahead is None else strategy._forced)
        return ahead

    monkeypatch.setattr(Engine, "_launch_ahead", spy)
    engine = cpu_engine(
        target, strategy, standin_device() if graphs else None,
        runner="graph" if graphs else "eager", max_context_len=64, graph_buckets=(1, 2, 4),
        capture_all_graphs=runner == "graph-all", overlap=overlap,
    )  # fmt: skip
    buckets = (1, 2, 4) if graphs else (1,)
    timed = {"eager": {0, 1, 3}, "graph": {0, 3}, "graph-all": {0, 1, 2, 3}}[runner.split("-o")[0]]
    # At each bucket each step launches the next: 3 3 3 0 0 0 3, the first run, the last
    # read launching none.
    assert kinds_launched_ahead == (([3] * 3 + [0] * 3 + [3]) * len(buckets) if overlap else [])
    assert engine._pending is None
    chooser = strategy.chooser
    for bucket in buckets:
        seconds = chooser._buckets[bucket].seconds
        assert set(seconds) == timed
        assert all(len(seconds[k]) == 1 for k in timed)  # the first left out, the faster kept
    assert engine.stats.step_timing_s > 0
    assert engine.stats.generated_tokens == engine.stats.eager_steps == 0
    assert engine.stats.graph_steps == 0 and chooser.steps_by_count == [0] * 4
    assert not chooser.engine_rates.seen[0]  # a throwaway text teaches no acceptance
    assert engine.kv_pool.available() == engine.kv_pool.num_slots
    assert engine.req_pool.available() == engine.req_pool.max_requests
    # ...and hand out slots as fresh pools do (1 first), so engines that timed different
    # sizes still allocate alike.
    assert engine.req_pool.alloc() == 1 and engine.kv_pool.alloc_host(1).tolist() == [1]
    engine.req_pool.free(1)
    engine.kv_pool.free(torch.tensor([1]))
    if graphs:
        # Three plain steps; rounds 3 + 1, and with overlap the one launched behind the
        # third plain step before the last round read (both changes of kind ran).
        assert strategy.plain_graph.replays_per_size() == {1: 3, 2: 3, 4: 3}
        rounds = 5 if overlap else 4
        assert strategy.longest.round.replays_per_size() == {1: rounds, 2: rounds, 4: rounds}
    (req,) = engine.generate([[1, 2, 3]], GREEDY)
    assert req.rid == 0 and len(req.output_ids) == GREEDY.max_new_tokens
