"""An engine safe to use from several threads, and calls that leave nothing behind (issue 22).

Concurrent ``generate()`` calls each get exactly their own results, as the same prompt
run alone gives them: the engine serialises steps and the callers' requests share
batches. A call that is interrupted (KeyboardInterrupt, or an exception out of its
``on_step``) finishes its unfinished requests as ``interrupted``, keeping what they
generated and freeing their KV; the next call sees none of them, in its results or
its stats.
"""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import CPU, assert_engine_idle, cpu_engine, random_prompts

from graphrt.core.engine import FinishReason, SamplingParams
from graphrt.core.models import load_model

THREADS, CALLS = 8, 20


@pytest.fixture(scope="module")
def loaded(llama_gqa_untied):
    return load_model(str(llama_gqa_untied.path), CPU, torch.float32)


def _call_plan(thread: int) -> list[tuple[list[int], SamplingParams]]:
    """Per call: a prompt (3 to 10 tokens) and a length (1 to 6 new tokens)."""
    gen = torch.Generator().manual_seed(thread)
    lengths = torch.randint(3, 11, (CALLS,), generator=gen).tolist()
    prompts = random_prompts(lengths, seed=100 + thread)
    news = torch.randint(1, 7, (CALLS,), generator=gen).tolist()
    return [(p, SamplingParams(max_new_tokens=n, ignore_eos=True)) for p, n in zip(prompts, news)]


def test_concurrent_generate_calls_each_get_their_own_results(loaded):
    plans = [_call_plan(t) for t in range(THREADS)]
    alone = cpu_engine(loaded, max_running_requests=8)
    expected = [[alone.generate([p], s)[0].output_ids for p, s in plan] for plan in plans]

    engine = cpu_engine(loaded, max_running_requests=8)
    got: list[list[list[int] | None]] = [[None] * CALLS for _ in range(THREADS)]
    errors: list[BaseException] = []
    start = threading.Barrier(THREADS)

    def worker(t: int) -> None:
        try:
            start.wait()
            for i, (prompt, params) in enumerate(plans[t]):
                (req,) = engine.generate([prompt], params)
                assert req.finish_reason is FinishReason.LENGTH, req.error
                got[t][i] = req.output_ids
        except BaseException as e:  # noqa: BLE001 (reported by the main thread)
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors, errors
    assert got == expected
    # The stats count every call's tokens once (that callers share batches: the next test).
    assert engine.stats.generated_tokens == sum(len(o) for row in expected for o in row)
    assert_engine_idle(engine)


def test_two_callers_requests_share_decode_steps(loaded):
    """Caller B queues its request while caller A's is decoding (A's on_step, run outside
    the engine's lock, waits for it): some step then serves both, and each output is the
    one its prompt gives alone."""
    engine = cpu_engine(loaded)
    prompt_a, prompt_b = random_prompts([6, 9], seed=9)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    alone = [cpu_engine(loaded).generate([p], params)[0].output_ids for p in (prompt_a, prompt_b)]
    served: list[set] = []
    step = engine._step_locked

    def recording_step():
        stepped = step()
        served.append(set(stepped))
        return stepped

    engine._step_locked = recording_step
    a_decoding, b_queued = threading.Event(), threading.Event()
    results, errors = {}, []

    def caller_a() -> None:
        def wait_for_b(stepped) -> None:
            a_decoding.set()
            assert b_queued.wait(timeout=60)

        try:
            results["a"] = engine.generate([prompt_a], params, on_step=wait_for_b)[0]
        except BaseException as e:  # noqa: BLE001 (reported by the main thread)
            errors.append(e)

    def caller_b() -> None:
        try:
            assert a_decoding.wait(timeout=60)
            reqs = engine.add_requests([prompt_b], params)
            b_queued.set()
            results["b"] = engine.run_until_finished(reqs)[0]
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=f) for f in (caller_a, caller_b)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    assert [results["a"].output_ids, results["b"].output_ids] == alone
    both = {results["a"], results["b"]}
    assert any(both <= reqs for reqs in served), "no step served both callers' requests"
    assert_engine_idle(engine)


def test_an_interrupted_call_keeps_its_tokens_and_leaves_nothing_behind(loaded):
    engine = cpu_engine(loaded)
    prompts = random_prompts([5, 8, 3], seed=7)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    reqs = engine.add_requests(prompts, params)
    steps = []

    def interrupt_after_three(stepped) -> None:
        steps.append(len(stepped))
        if len(steps) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        engine.run_until_finished(reqs, on_step=interrupt_after_three)
    for req in reqs:  # the prefill's token and two decode steps' each
        assert req.finish_reason is FinishReason.INTERRUPTED
        assert len(req.output_ids) == 3
    assert_engine_idle(engine)

    before = engine.stats.generated_tokens
    (req,) = engine.generate([prompts[0]], SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert engine.stats.generated_tokens - before == 4  # only its own work
    fresh = cpu_engine(loaded).generate([prompts[0]], SamplingParams(max_new_tokens=4))
    assert req.output_ids == fresh[0].output_ids


def test_a_failing_caller_does_not_disturb_another_threads_call(loaded):
    engine = cpu_engine(loaded)
    prompt_a, prompt_b = random_prompts([6, 9], seed=8)
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    expected_b = cpu_engine(loaded).generate([prompt_b], params)[0].output_ids
    results, errors = {}, []
    both_running = threading.Barrier(2)

    def failing() -> None:
        def boom(stepped) -> None:
            raise ValueError("the caller's own bug")

        both_running.wait()
        try:
            engine.generate([prompt_a], params, on_step=boom)
        except ValueError as e:
            errors.append(e)

    def healthy() -> None:
        both_running.wait()
        results["b"] = engine.generate([prompt_b], params)[0]

    threads = [threading.Thread(target=f) for f in (failing, healthy)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert len(errors) == 1
    assert results["b"].output_ids == expected_b
    assert results["b"].finish_reason is FinishReason.LENGTH
    assert_engine_idle(engine)
