"""``--spec-steps auto``: each step a speculative round or a plain decode step, whichever
emits more tokens a second by what the engine measured (spec.adaptive).

The choice must never change what is generated (greedy output equals plain decoding's,
whatever the mix of rounds and plain steps), must follow the measured costs, and must go
on looking at the losing kind now and then.
"""

from __future__ import annotations

import pytest
import torch
from helpers import CPU, cpu_engine, random_prompts, standin_device

from graphrt.core.engine import SamplingParams
from graphrt.core.models import load_model
from graphrt.spec import MTPDecoding, SpecConfig
from graphrt.spec.adaptive import FIRST_EXPLORE, DraftChooser

GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)


def _run(chooser: DraftChooser, steps: int, round_s: float, plain_s: float, length: int):
    """``steps`` decisions at batch 1 with fixed costs; -> the kinds chosen (True: round)."""
    kinds = []
    for _ in range(steps):
        is_round = chooser.choose(1)
        kinds.append(is_round)
        chooser.record(is_round, 1, round_s if is_round else plain_s, [length] if is_round else ())
    return kinds


def test_the_chooser_measures_both_kinds_then_follows_what_pays():
    # A round of 3 tokens in 5 ms beats plain steps of 2 ms (1.5 ms a token).
    chooser = DraftChooser()
    kinds = _run(chooser, 200, round_s=5e-3, plain_s=2e-3, length=3)
    assert kinds[:4] == [True, True, False, False]  # each kind twice: the first is left out
    assert sum(kinds) > 180
    assert chooser.explain(1).endswith(
        "3.00 tokens in 5.0 ms, a plain step 1 in 2.0 ms: rounds pay"
    )
    # Rounds of 1 token (nothing accepted) in 5 ms lose to 2 ms plain steps.
    chooser = DraftChooser()
    kinds = _run(chooser, 200, round_s=5e-3, plain_s=2e-3, length=1)
    assert sum(not k for k in kinds) > 180 and chooser.explain(1).endswith("plain steps pay")


def test_the_losing_kind_still_runs_less_and_less_often():
    kinds = _run(DraftChooser(), 1000, round_s=5e-3, plain_s=2e-3, length=1)
    explored = [i for i, k in enumerate(kinds) if k and i >= 4]  # rounds after measuring
    gaps = [b - a for a, b in zip(explored, explored[1:])]
    assert explored and gaps == sorted(gaps) and gaps[0] >= FIRST_EXPLORE - 1
    assert len(explored) < 20  # 16, 32, then 64 steps apart


def test_a_change_in_acceptance_changes_the_choice():
    chooser = DraftChooser()
    _run(chooser, 100, round_s=5e-3, plain_s=2e-3, length=1)  # plain steps pay
    kinds = _run(chooser, 400, round_s=5e-3, plain_s=2e-3, length=4)  # now rounds do
    assert sum(kinds[-100:]) >= 90 and "rounds pay" in chooser.explain(1)


@pytest.mark.parametrize("runner", ["eager", pytest.param("graph", marks=pytest.mark.graphs)])
def test_greedy_output_is_plain_decodings_whatever_mix_of_rounds_and_plain_steps(
    runner, gemma4_tiny, gemma4_assistant
):
    target = load_model(str(gemma4_tiny.path), CPU, torch.float32)
    drafter = load_model(str(gemma4_assistant.path), CPU, torch.float32)
    prompts = random_prompts((5, 11, 7), seed=31, vocab=target.model.vocab_size)
    plain = cpu_engine(target, max_context_len=64).generate(prompts, GREEDY)
    strategy = MTPDecoding(drafter, SpecConfig(num_steps=3, adaptive=True))
    device = standin_device() if runner == "graph" else None
    engine = cpu_engine(
        target, strategy, device, runner=runner, max_context_len=64, graph_buckets=(1, 2, 4)
    )
    reqs = engine.generate(prompts, GREEDY)
    assert [r.output_ids for r in reqs] == [r.output_ids for r in plain]
    stats = engine.stats
    assert stats.spec_rounds > 0 and stats.spec_plain_steps > 0  # both kinds ran
    assert stats.spec_plain_steps == strategy.chooser.plain_steps
    if runner == "graph":  # plain steps on the drafter's own decode graphs, rounds on theirs
        assert sum(strategy.plain_graph.replays_per_size().values()) == stats.spec_plain_steps
        assert stats.graph_rounds == stats.spec_rounds and stats.eager_steps == 1  # prefill
    assert engine.kv_pool.available() == engine.kv_pool.num_slots
