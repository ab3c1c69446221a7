"""A failed step loses nothing (issue 10, item 3): the requests of a step that raises
finish with ``FinishReason.ERROR`` and the error, every KV and request slot comes back,
and the engine serves later requests exactly as a fresh one would. A ``generate`` call
with one bad prompt queues none of them.

Failures are injected where a step can fail: sampling, a forward (eager, or a graph
replay), and a speculative round.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import (
    CPU,
    assert_engine_idle,
    cli_error_line,
    cpu_engine,
    random_prompts,
    rounds_ahead_engine,
)

from graphrt.core.cli.main import main
from graphrt.core.engine import FinishReason, SamplingParams
from graphrt.core.engine import sampling as sampling_module
from graphrt.core.errors import RequestError
from graphrt.core.models import load_model

pytestmark = pytest.mark.step_failures  # these tests make steps fail on purpose
GREEDY = SamplingParams(max_new_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded(llama_gqa_untied):
    return load_model(str(llama_gqa_untied.path), CPU, torch.float32)


def _fail_on_call(monkeypatch, obj, name: str, call: int, error=None) -> list[int]:
    """Make ``obj.name`` raise ``error`` (a RuntimeError of two lines) on its ``call``-th
    call (1-based), once; returns the counter."""
    real = getattr(obj, name)
    calls = [0]

    def flaky(*args, **kwargs):
        calls[0] += 1
        if calls[0] == call:
            raise error or RuntimeError("injected failure\nsecond line")
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, name, flaky)
    return calls


def _fresh(loaded, prompts, **config) -> list[list[int]]:
    engine = cpu_engine(loaded, max_context_len=64, **config)
    return [r.output_ids for r in engine.generate(prompts, GREEDY)]


@pytest.mark.parametrize("call", [1, 3], ids=["in-prefill", "in-decode"])
def test_a_sampling_failure_fails_its_step_only_and_frees_every_slot(loaded, monkeypatch, call):
    engine = cpu_engine(loaded, max_context_len=64, max_running_requests=2)
    prompts = random_prompts((5, 9, 7))  # the third waits: 2 running at most
    _fail_on_call(monkeypatch, sampling_module, "sample", call)
    reqs = engine.generate(prompts, GREEDY)
    failed = [r for r in reqs if r.finish_reason is FinishReason.ERROR]
    assert [r.error for r in failed] == ["RuntimeError: injected failure"] * 2  # one line
    assert all(r.req_slot is None for r in reqs)
    # The request that waited behind the failed step ran afterwards, as if alone.
    (survivor,) = [r for r in reqs if r.finish_reason is FinishReason.LENGTH]
    assert survivor is reqs[2] and survivor.output_ids == _fresh(loaded, [prompts[2]])[0]
    assert_engine_idle(engine)
    # The engine serves the next call as a fresh engine would.
    again = random_prompts((6, 11), seed=3)
    assert [r.output_ids for r in engine.generate(again, GREEDY)] == _fresh(loaded, again)
    assert_engine_idle(engine)


def test_a_request_the_step_finished_before_it_failed_keeps_its_reason(loaded, monkeypatch):
    engine = cpu_engine(loaded, max_context_len=64)
    short, long = random_prompts((5, 9))
    done = engine.add_request(short, SamplingParams(max_new_tokens=2, ignore_eos=True))
    cut = engine.add_request(long, GREEDY)
    # The first decode step emits ``done``'s last token, then fails in its bookkeeping.
    _fail_on_call(monkeypatch, engine.strategy, "step_done", 1)
    engine.run_until_finished([done, cut])
    assert done.finish_reason is FinishReason.LENGTH and done.error is None
    assert len(done.output_ids) == 2
    assert cut.finish_reason is FinishReason.ERROR and len(cut.output_ids) == 2
    assert_engine_idle(engine)


@pytest.mark.graphs
def test_a_round_in_flight_that_fails_when_its_requests_are_aborted_frees_its_slots(
    gemma4_tiny, gemma4_assistant, monkeypatch
):
    """An abort settles the round launched ahead once none of its requests runs; if that
    read fails, the abort raises it and the round's tree slots (in no request's table)
    come back."""
    target = load_model(str(gemma4_tiny.path), CPU, torch.float32)
    drafter = load_model(str(gemma4_assistant.path), CPU, torch.float32)
    engine = rounds_ahead_engine(target, drafter)
    reqs = engine.add_requests(random_prompts((5, 9)), GREEDY)
    while len(reqs[0].output_ids) < 3:
        engine.step()
    assert engine._pending is not None  # a round launched ahead, in flight
    assert engine.stats.graph_rounds > 0 and engine.stats.launched_ahead > 0
    _fail_on_call(monkeypatch, engine._pending, "finish", 1)
    engine.abort(reqs[0])
    with pytest.raises(RuntimeError, match="injected failure"):
        engine.abort(reqs[1])
    assert engine._pending is None
    assert_engine_idle(engine)


@pytest.mark.graphs
def test_a_forward_failure_in_a_graph_replay_frees_every_slot(loaded, monkeypatch):
    # One bucket: batches of 3, 2 and 1 replay it padded (a CPU compile per bucket).
    engine = cpu_engine(loaded, max_context_len=64, runner="graph", graph_buckets=(4,))
    prompts = random_prompts((5, 9))
    _fail_on_call(monkeypatch, engine.graph_runner, "execute", 2)
    reqs = engine.generate(prompts, GREEDY)
    assert all(r.finish_reason is FinishReason.ERROR for r in reqs)
    assert_engine_idle(engine)
    again = random_prompts((4, 8, 12), seed=5)
    got = [r.output_ids for r in engine.generate(again, GREEDY)]
    assert got == _fresh(loaded, again)
    assert engine.stats.graph_steps > 0  # the graphs still serve after the failure
    assert_engine_idle(engine)


def _serves_as_a_fresh_engine(engine, target, drafter) -> None:
    """``engine`` (rounds of 3) generates what a fresh one does, and is idle after."""
    from graphrt.spec import MTPDecoding, SpecConfig

    plain = cpu_engine(target, MTPDecoding(drafter, SpecConfig(num_steps=3)), max_context_len=64)
    again = random_prompts((6, 10), seed=8)
    want = [r.output_ids for r in plain.generate(again, GREEDY)]
    assert [r.output_ids for r in engine.generate(again, GREEDY)] == want
    assert_engine_idle(engine)


def test_a_failed_speculative_round_frees_its_tree_slots(
    gemma4_tiny, gemma4_assistant, monkeypatch
):
    from graphrt.spec import MTPDecoding, SpecConfig

    target = load_model(str(gemma4_tiny.path), CPU, torch.float32)
    drafter = load_model(str(gemma4_assistant.path), CPU, torch.float32)
    engine = cpu_engine(target, MTPDecoding(drafter, SpecConfig(num_steps=3)), max_context_len=64)
    strategy = engine.strategy
    # The verify forward fails after the draft tree's KV slots were allocated.
    _fail_on_call(monkeypatch, strategy, "verify", 2)
    prompts = random_prompts((5, 9), seed=7)
    reqs = engine.generate(prompts, GREEDY)
    assert all(r.finish_reason is FinishReason.ERROR for r in reqs)
    assert_engine_idle(engine)
    _serves_as_a_fresh_engine(engine, target, drafter)


def test_an_interrupt_inside_a_round_frees_its_tree_slots_and_fails_only_its_step(
    gemma4_tiny, gemma4_assistant, monkeypatch
):
    """A KeyboardInterrupt (or SIGTERM's) inside a step is no Exception: the step's
    requests finish as INTERRUPTED, the tree's slots (in no request's table) come back,
    the interrupt goes on, and the engine serves the next call as a fresh one would."""
    from graphrt.spec import MTPDecoding, SpecConfig

    target = load_model(str(gemma4_tiny.path), CPU, torch.float32)
    drafter = load_model(str(gemma4_assistant.path), CPU, torch.float32)
    engine = cpu_engine(target, MTPDecoding(drafter, SpecConfig(num_steps=3)), max_context_len=64)
    # The verify forward is interrupted after the draft tree's KV slots were allocated.
    _fail_on_call(monkeypatch, engine.strategy, "verify", 2, KeyboardInterrupt())
    reqs = engine.add_requests(random_prompts((5, 9), seed=7), GREEDY)
    with pytest.raises(KeyboardInterrupt):
        engine.run_until_finished(reqs)
    assert all(r.finish_reason is FinishReason.INTERRUPTED for r in reqs)
    assert all(r.output_ids for r in reqs)  # the tokens of the steps before are kept
    assert_engine_idle(engine)
    _serves_as_a_fresh_engine(engine, target, drafter)


def test_return_logits_with_a_drafter_is_refused_not_misaligned(gemma4_tiny, gemma4_assistant):
    """A round's tokens come from verify's rows, whose logits no request keeps: with a
    drafter, ``return_logits`` would pair plain steps' logits with the wrong tokens."""
    from graphrt.spec import MTPDecoding, SpecConfig

    target = load_model(str(gemma4_tiny.path), CPU, torch.float32)
    drafter = load_model(str(gemma4_assistant.path), CPU, torch.float32)
    engine = cpu_engine(target, MTPDecoding(drafter, SpecConfig(num_steps=2)), max_context_len=32)
    params = SamplingParams(max_new_tokens=4, return_logits=True)
    with pytest.raises(RequestError, match="return_logits keeps each token's logits"):
        engine.add_request([5, 6, 7], params)
    assert_engine_idle(engine)
    plain = cpu_engine(target, max_context_len=32)
    (req,) = plain.generate([[5, 6, 7]], params)
    assert len(req.output_logits) == len(req.output_ids) == 4


def test_generate_with_one_bad_prompt_queues_nothing(loaded):
    engine = cpu_engine(loaded, max_context_len=64)
    with pytest.raises(RequestError, match="outside the vocabulary"):
        engine.generate([[1, 2], [3, 4], [10**9]], GREEDY)
    assert_engine_idle(engine)  # the two good prompts were not left queued
    reqs = engine.generate([[5, 6]], GREEDY)
    assert len(reqs) == 1 and len(reqs[0].output_ids) == GREEDY.max_new_tokens


def test_cli_prints_what_was_produced_then_one_error_line(capsys, monkeypatch):
    _fail_on_call(monkeypatch, sampling_module, "sample", 2)  # request 0's first decode step
    argv = ["generate", "--model", "random:llama-tiny", "--runner", "eager", "--json"]
    argv += ["--prompt-ids", "1,2,3", "--prompt-ids", "4,5", "--max-running-requests", "1"]
    assert main([*argv, "--max-new-tokens", "4", "--ignore-eos"]) == 1
    captured = capsys.readouterr()
    out = json.loads(captured.out)  # the whole result still came out
    first, second = out["requests"]
    assert first["error"] == "RuntimeError: injected failure" and "error" not in second
    assert len(second["output_ids"]) == 4
    error = cli_error_line(captured.err)
    assert "1 of 2 requests failed (request 0: RuntimeError: injected failure)" in error


def test_bench_whose_prefill_fails_stops_with_that_error_in_one_line(capsys, monkeypatch):
    """Timing requests whose prefill failed once ended in a TypeError from the token table
    (a request without a slot) that named nothing; the bench now names the failure."""
    from graphrt.core.bench import decode

    monkeypatch.setattr(decode, "copy_bandwidth_gbps", lambda *a: 10.0)  # skips a 1 GiB copy
    _fail_on_call(monkeypatch, sampling_module, "sample", 1)  # batch 1's prefill
    argv = ["bench", "--model", "random:llama-tiny", "--device", "cpu", "--runners", "eager"]
    argv += ["--batch-sizes", "1", "--prompt-len", "8", "--steps", "2", "--warmup", "1"]
    assert main([*argv, "--json", "--no-plot"]) == 1
    err = capsys.readouterr().err  # the bench's own header line, then the error
    assert "Traceback" not in err and err.count("graphrt: error:") == 1, err
    assert err.strip().splitlines()[-1] == (
        "graphrt: error: bench: 1 of 1 requests failed in prefill (RuntimeError: injected failure)"
    ), err


def test_steady_decoding_stops_at_a_failed_step_with_its_error(loaded, monkeypatch):
    """A request that fails while steady_tokens_per_s runs would be replaced like one that
    finished, its missing tokens hidden in the rate: the bench stops there instead."""
    from graphrt.core.bench import decode
    from graphrt.core.errors import GraphrtError

    engine = cpu_engine(loaded, max_context_len=64, max_running_requests=2)
    _fail_on_call(monkeypatch, sampling_module, "sample", 3)  # the first decode step
    with pytest.raises(GraphrtError, match=r"2 of 2 requests failed in steady decoding \("):
        decode.steady_tokens_per_s(engine, random_prompts((5, 9)), GREEDY)
    assert_engine_idle(engine)
