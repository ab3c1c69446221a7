"""The Engine over a graph backend: graphs where can_run_graph says so, eager for the rest
(prefill, batches above the buckets, sizes exact mode did not capture), and the same
greedy tokens as an eager-only Engine."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from harness import ENGINE_BUCKETS, case_engine
from helpers import random_prompts

from graphrt.core.batch import ForwardBatch, ForwardMode
from graphrt.core.engine import Engine, SamplingParams

pytestmark = [pytest.mark.graphs, pytest.mark.usefixtures("cpu_compile_without_inductor")]

LENS = (5, 33, 12, 1, 21, 8)  # mixed prompt lengths
# Request i stops after LIMITS[i] tokens: decode batches shrink 6, 5, 4, 3, 2, 1.
LIMITS = (2, 3, 4, 5, 6, 7)
GREEDY = SamplingParams(max_new_tokens=8, ignore_eos=True)


@pytest.fixture
def graph_engine(case, loaded, session_cache):
    """One graph Engine per case and padding mode, captured once per session."""

    def get(padding: bool = True) -> Engine:
        key = ("engine", case.id, padding)
        if key not in session_cache:
            session_cache[key] = case_engine(case, loaded, graphs=True, graph_padding=padding)
        return session_cache[key]

    return get


def _run_staggered(engine: Engine, prompts) -> tuple[list[list[int]], list[tuple]]:
    """Step requests with LIMITS to completion; returns tokens and (runner, mode, bs) per step."""
    steps: list[tuple] = []

    def spy(name, execute):
        def run(batch: ForwardBatch, *args):
            steps.append((name, batch.mode, batch.batch_size))
            return execute(batch, *args)

        return run

    runners = [engine.eager_runner] + ([engine.graph_runner] if engine.graph_runner else [])
    originals = [r.execute for r in runners]
    for runner, name in zip(runners, ("eager", "graph")):
        runner.execute = spy(name, runner.execute)
    try:
        reqs = [
            engine.add_request(p, dataclasses.replace(GREEDY, max_new_tokens=n))
            for p, n in zip(prompts, LIMITS)
        ]
        while engine.has_work:
            engine.step()
    finally:
        for runner, execute in zip(runners, originals):
            runner.execute = execute
    return [r.output_ids for r in reqs], steps


def _stats(engine: Engine) -> tuple[int, int]:
    return engine.stats.eager_steps, engine.stats.graph_steps


def test_generate_matches_eager_engine(case, loaded, graph_engine):
    prompts = random_prompts((7, 30, 2), seed=11, vocab=loaded.model.vocab_size)
    engine = graph_engine()
    assert engine.stats.captured_sizes == list(ENGINE_BUCKETS)
    eager0, graph0 = _stats(engine)
    reference = case_engine(case, loaded, graphs=False).generate(prompts, GREEDY)
    out = engine.generate(prompts, GREEDY)
    assert [r.output_ids for r in out] == [r.output_ids for r in reference]
    # One eager prefill, then every decode step (3 requests -> bucket 4) on a graph.
    assert _stats(engine) == (eager0 + 1, graph0 + GREEDY.max_new_tokens - 1)


def test_falls_back_to_eager_above_the_buckets_and_for_prefill(case, loaded, graph_engine):
    prompts = random_prompts(LENS, seed=12, vocab=loaded.model.vocab_size)
    engine = graph_engine()
    reference, _ = _run_staggered(case_engine(case, loaded, graphs=False), prompts)
    eager0, graph0 = _stats(engine)
    tokens, steps = _run_staggered(engine, prompts)
    assert tokens == reference
    decode = ForwardMode.DECODE
    expected = [("eager", ForwardMode.EXTEND, 6)] + [
        ("graph" if bs <= max(ENGINE_BUCKETS) else "eager", decode, bs) for bs in (6, 5, 4, 3, 2, 1)
    ]
    assert steps == expected
    assert _stats(engine) == (eager0 + 3, graph0 + 4)


def test_exact_mode_runs_graphs_only_at_captured_sizes(case, loaded, graph_engine, monkeypatch):
    engine = graph_engine(padding=False)
    runner = engine.graph_runner
    assert runner.captured_sizes == list(ENGINE_BUCKETS)
    for bs in range(1, 7):
        assert runner.can_run_graph(_dummy_decode(bs, case.device)) is (bs in ENGINE_BUCKETS)

    # Regression (SGLang #30746): exact mode once looked graphs up by a raw int where
    # they are keyed by ShapeKey, so captured sizes silently ran eager.
    replayed = []
    replay = engine.graph_backend.replay
    monkeypatch.setattr(
        engine.graph_backend, "replay", lambda key: replayed.append(key) or replay(key)
    )
    prompts = random_prompts(LENS, seed=13, vocab=loaded.model.vocab_size)
    reference, _ = _run_staggered(case_engine(case, loaded, graphs=False), prompts)
    eager0, graph0 = _stats(engine)
    tokens, steps = _run_staggered(engine, prompts)
    assert tokens == reference
    graph_sizes = [bs for name, _, bs in steps if name == "graph"]
    assert graph_sizes == [4, 1]
    assert [key.size for key in replayed] == graph_sizes
    assert _stats(engine) == (eager0 + 5, graph0 + 2)


def _dummy_decode(bs: int, device: torch.device) -> ForwardBatch:
    """A decode batch of ``bs`` rows; can_run_graph reads only its mode and size."""
    zeros = torch.zeros(bs, dtype=torch.int64, device=device)
    return ForwardBatch(
        mode=ForwardMode.DECODE,
        input_ids=zeros,
        positions=zeros,
        req_pool_indices=zeros,
        seq_lens=torch.ones(bs, dtype=torch.int32, device=device),
        out_cache_loc=zeros,
        seq_lens_cpu=[1] * bs,
        extend_lens_cpu=[1] * bs,
    )
