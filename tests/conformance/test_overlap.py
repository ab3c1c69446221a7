"""Plain decode steps launched ahead (``EngineConfig(overlap=True)``) on every graph
backend: the engine queues step N+1, fed by step N's tokens on the device, before it
reads step N's, and the tokens, finishes and slots are those of an eager engine that
reads every step before the next.

What launching ahead must get right, each case below: a request whose length ends
with step N is left out of step N+1 (a batch that shrinks: the fed tokens gathered);
one that stops on step N's token (end of sequence) gets one token too many, dropped,
and its slot back; an abort while a step is in flight; sampled rows on their own
streams; a prefill arriving mid-decode (the step in flight is settled first).
"""

from __future__ import annotations

import dataclasses

import pytest
from harness import CONTEXT, ENGINE_BUCKETS, case_engine
from helpers import assert_engine_idle, random_prompts, spy_launches

from graphrt.core.engine import Engine, SamplingParams

pytestmark = [pytest.mark.graphs, pytest.mark.usefixtures("cpu_compile_without_inductor")]

LENS = (5, 33, 12, 1, 21, 8)
LIMITS = (2, 3, 4, 5, 6, 9)  # the batch shrinks as lengths end
GREEDY = SamplingParams(max_new_tokens=9, ignore_eos=True)


@pytest.fixture
def engines(case, loaded, session_cache):
    """(graph engine launching ahead, eager engine reading every step), once a session."""
    key = ("overlap-engines", case.id)
    if key not in session_cache:
        session_cache[key] = (
            case_engine(case, loaded, graphs=True, overlap=True),
            case_engine(case, loaded, graphs=False, overlap=False),
        )
    return session_cache[key]


def _run(engine: Engine, params_list, prompts) -> list:
    reqs = [engine.add_request(p, params) for p, params in zip(prompts, params_list)]
    engine.run_until_finished(reqs)
    return reqs


def _replayed_every_step(engine: Engine, launched: list[int], graph_steps: int) -> bool:
    """Every step launched at a captured size (batches up to ENGINE_BUCKETS' largest)
    replayed its graph: ``graph_steps`` the engine's count before."""
    on_graphs = sum(1 for size in launched if size <= max(ENGINE_BUCKETS))
    return on_graphs > 0 and engine.stats.graph_steps - graph_steps == on_graphs


def _in_flight(engine: Engine, prompts, monkeypatch):
    """Greedy requests of ``prompts`` stepped until each has 3 tokens, a step launched
    ahead in flight; -> (the requests, the launch spy's batch sizes launched and launched
    ahead, the engine's graph steps before)."""
    launched, launched_ahead = spy_launches(engine, monkeypatch)
    replays = engine.stats.graph_steps
    reqs = [engine.add_request(p, GREEDY) for p in prompts]
    while min(len(r.output_ids) for r in reqs) < 3:
        engine.step()
    assert engine._pending is not None  # a step is in flight
    return reqs, launched, launched_ahead, replays


def _all_free(engine: Engine) -> bool:
    """No step in flight, and no request, KV slot, request row or reservation held."""
    assert_engine_idle(engine)
    return engine._pending is None


def test_steps_launched_ahead_give_the_tokens_of_steps_read_one_by_one(
    engines, loaded, monkeypatch
):
    """Lengths ending one by one and a request stopping on an end-of-sequence token:
    the same tokens and finish reasons as the eager engine; steps were launched ahead at
    shrinking batch sizes, graphs replayed, and every slot is free afterwards."""
    graph, eager = engines
    prompts = random_prompts(LENS, seed=11)
    limited = [dataclasses.replace(GREEDY, max_new_tokens=n) for n in LIMITS]
    free_run = [r.output_ids for r in _run(eager, limited, prompts)][-1]
    # The last request stops on a token that first appears third or later: an end of
    # sequence the host learns only after the step behind it was launched. (Not simply
    # the third token: a random model repeats itself, and on CUDA it emitted its third
    # token first, so the request stopped at prefill and never decoded.)
    stop_at = next(i for i in range(2, len(free_run) - 1) if free_run[i] not in free_run[:i])
    eos = free_run[stop_at]
    for engine in engines:  # the model object is frozen: each engine's view of it
        monkeypatch.setattr(engine, "loaded", dataclasses.replace(loaded, eos_token_ids=(eos,)))
    params = [*limited[:-1], dataclasses.replace(limited[-1], ignore_eos=False)]
    expected = _run(eager, params, prompts)
    # The case is what it claims: the request decoded, then stopped.
    assert expected[-1].finish_reason.value == "stop"
    assert len(expected[-1].output_ids) == stop_at + 1
    launched, launched_ahead = spy_launches(graph, monkeypatch)
    replays = graph.stats.graph_steps
    got = _run(graph, params, prompts)
    assert [r.output_ids for r in got] == [r.output_ids for r in expected]
    assert [r.finish_reason for r in got] == [r.finish_reason for r in expected]
    assert len(set(launched_ahead)) > 2, launched_ahead  # the batch shrank under launches
    # Rows launched: one a decoded token, and one the stopped request's dropped token (no
    # row for a request whose length had ended).
    assert sum(launched) == sum(len(r.output_ids) - 1 for r in got) + 1
    assert _replayed_every_step(graph, launched, replays)  # buckets 1 and 4 (padded)
    assert _all_free(graph)


def test_an_abort_while_a_step_is_in_flight_frees_it_and_the_rest_decode_on(engines, monkeypatch):
    """A request aborted between steps, while the step launched behind the last one
    still holds a slot for it: it keeps the tokens it had, its slots come back, and the
    others' tokens are the eager engine's."""
    graph, eager = engines
    prompts = random_prompts((7, 3, 10), seed=12)
    expected = _run(eager, [GREEDY] * 3, prompts)
    reqs, launched, launched_ahead, replays = _in_flight(graph, prompts, monkeypatch)
    graph.abort(reqs[1])
    graph.run_until_finished([reqs[0], reqs[2]])
    assert reqs[1].output_ids == expected[1].output_ids[: len(reqs[1].output_ids)]
    assert [reqs[0].output_ids, reqs[2].output_ids] == [
        expected[0].output_ids,
        expected[2].output_ids,
    ]
    assert launched_ahead and _replayed_every_step(graph, launched, replays)
    assert _all_free(graph)


def test_aborting_every_request_settles_the_step_in_flight_at_once(engines, monkeypatch):
    """The last running request aborted while a step launched ahead still serves it (a
    server's stop string, a client gone): that step is settled then, its slots back at
    once. Left in flight, it held them until the next request's first step, which then
    timed the idle between them as its own."""
    graph, eager = engines
    prompts = random_prompts((9, 4), seed=15)
    reqs, launched, launched_ahead, replays = _in_flight(graph, prompts, monkeypatch)
    graph.abort(reqs[0])
    assert graph._pending is not None  # it still serves reqs[1]
    graph.abort(reqs[1])
    assert _all_free(graph) and not graph.has_work
    later = _run(graph, [GREEDY], prompts[1:])[0]
    assert later.output_ids == _run(eager, [GREEDY], prompts[1:])[0].output_ids
    assert launched_ahead and _replayed_every_step(graph, launched, replays)


def test_a_prompt_arriving_mid_decode_is_prefilled_after_the_step_in_flight(engines, monkeypatch):
    """A request added while a step is in flight: that step settles first, then the
    prompt prefills, and every request's tokens are those it gets alone."""
    graph, eager = engines
    prompts = random_prompts((6, 14), seed=13)
    expected = [_run(eager, [GREEDY], [p])[0].output_ids for p in prompts]
    (first,), launched, launched_ahead, replays = _in_flight(graph, prompts[:1], monkeypatch)
    second = graph.add_request(prompts[1], GREEDY)
    graph.run_until_finished([first, second])
    assert [first.output_ids, second.output_ids] == expected
    assert launched_ahead and _replayed_every_step(graph, launched, replays)
    assert _all_free(graph)


def test_sampled_rows_draw_the_same_tokens_launched_ahead(engines, monkeypatch):
    """Sampled requests (temperature, top-k, top-p) draw on their own streams: launching
    ahead changes nothing they draw."""
    graph, eager = engines
    prompts = random_prompts((4, 9, 2), seed=14)
    params = [
        SamplingParams(max_new_tokens=7, ignore_eos=True, temperature=0.9, seed=5),
        SamplingParams(max_new_tokens=5, ignore_eos=True, temperature=1.3, top_k=20, seed=6),
        SamplingParams(max_new_tokens=7, ignore_eos=True, temperature=0.7, top_p=0.8, seed=7),
    ]
    expected = [r.output_ids for r in _run(eager, params, prompts)]
    launched, launched_ahead = spy_launches(graph, monkeypatch)
    replays = graph.stats.graph_steps
    assert [r.output_ids for r in _run(graph, params, prompts)] == expected
    assert launched_ahead and _replayed_every_step(graph, launched, replays)
    assert _all_free(graph)


def test_a_request_filling_the_context_is_not_launched_past_it(engines, monkeypatch):
    """A prompt that leaves the context room for a few tokens: its last step is not
    followed by one past the context (the token table has no column there); it finishes
    by length beside a request that decodes on, as the eager engine's do."""
    graph, eager = engines
    prompts = random_prompts((CONTEXT - 4, 3), seed=15)
    params = [dataclasses.replace(GREEDY, max_new_tokens=30)] * 2
    expected = _run(eager, params, prompts)
    assert len(expected[0].output_ids) < 30  # the context ended it
    launched, launched_ahead = spy_launches(graph, monkeypatch)
    replays = graph.stats.graph_steps
    got = _run(graph, params, prompts)
    assert [r.output_ids for r in got] == [r.output_ids for r in expected]
    assert [r.finish_reason for r in got] == [r.finish_reason for r in expected]
    assert 2 in launched_ahead and 1 in launched_ahead
    assert _replayed_every_step(graph, launched, replays)
    assert _all_free(graph)
