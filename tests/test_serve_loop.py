"""``EngineLoop``: one thread stepping the engine for many callers (the server's core),
on the embedded pair, CPU, float32, reading each step's tokens before the next step and
launching plain steps ahead (``EngineConfig(overlap=True)``). Each caller gets exactly
its own greedy text, a request that is aborted frees its KV at once, and draining stops
admitting and lets what is in flight finish."""

from __future__ import annotations

import queue
import threading
import time

import pytest
from helpers import load_bench

from graphrt.core.engine import EngineConfig
from graphrt.core.errors import UsageError
from graphrt.core.serve import LLM, Draining, EngineLoop, TextParams
from graphrt.core.serve.llm import FairLock
from graphrt.core.serve.loop import PASS_FIELDS

PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:", "for i in range(", "x = ["]
PARAMS = TextParams(max_tokens=20)


@pytest.fixture(scope="module", params=[False, True], ids=["read-each-step", "overlap"])
def llm(request) -> LLM:
    """The embedded pair; overlap: plain steps launched before the last one's tokens are
    read (a step is in flight between the loop's passes)."""
    return LLM(device="cpu", config=EngineConfig(overlap=request.param))


def _kv_free(llm: LLM) -> bool:
    return llm.engine.kv_pool.available() == llm.engine.kv_pool.num_slots


class Collector:
    """A consumer: the deltas and the completion the loop hands one request."""

    def __init__(self) -> None:
        self.deltas: list[str] = []
        self.tokens: list[int] = []
        self.done = queue.Queue()

    def __call__(self, delta, new_ids, done) -> None:
        self.tokens += new_ids
        if delta:
            self.deltas.append(delta)
        if done is not None:
            self.done.put(done)

    def wait(self):
        return self.done.get(timeout=120)


def test_concurrent_callers_each_get_their_own_greedy_text(llm):
    want = [c.text for c in llm.generate(PROMPTS, PARAMS)]
    launched = llm.engine.stats.launched_ahead
    loop = EngineLoop(llm, trace_steps=True)
    try:
        collectors = [Collector() for _ in PROMPTS]

        def submit(i):
            loop.submit(PROMPTS[i], PARAMS, collectors[i])

        threads = [threading.Thread(target=submit, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        done = [c.wait() for c in collectors]
        assert [d.text for d in done] == want
        assert ["".join(c.deltas) for c in collectors] == want  # streamed == whole
        assert [c.tokens for c in collectors] == [d.token_ids for d in done]  # every token once
        assert all(d.finish_reason == "length" for d in done)
        assert loop.inflight == 0 and _kv_free(llm)
        # The loop's steps were launched ahead where asked: a step in flight between passes.
        assert (llm.engine.stats.launched_ahead > launched) == llm.engine.config.overlap
    finally:
        loop.close()
    # The step trace (graphrt serve --step-trace), read once the loop thread has ended
    # (a pass's record follows its last events): one record a pass, its tokens those the
    # callers received, the prompts' first tokens in prefill passes.
    passes = [dict(zip(PASS_FIELDS, p)) for p in loop.trace]
    assert all(len(p) == len(PASS_FIELDS) for p in loop.trace)
    assert sum(p["tokens"] for p in passes) == sum(len(c.tokens) for c in collectors)
    assert sum(p["tokens"] for p in passes if p["prefill_s"] > 0) == len(PROMPTS)
    assert [p["t"] for p in passes] == sorted(p["t"] for p in passes)
    # bench/step_trace.py reads what --step-trace writes: every pass classed, the tokens
    # counted once.
    step_trace = load_bench("step_trace")
    trace = {"fields": list(PASS_FIELDS), "passes": [list(p) for p in loop.trace]}
    (summary,) = [step_trace.summarise(t) for t in step_trace.segments(trace, idle_s=60.0)]
    assert summary["passes"] == len(passes) and "prefill" in summary["kinds"]
    assert sum(k["passes"] for k in summary["kinds"].values()) == len(passes) - 1


def test_an_aborted_request_frees_its_kv_and_the_others_go_on(llm):
    loop = EngineLoop(llm)
    try:
        first = threading.Event()
        leaving, staying = Collector(), Collector()

        def on_leaving(delta, new_ids, done):
            leaving(delta, new_ids, done)
            first.set()

        # Far from its end whenever the abort lands (no EOS, 2000 tokens): it must be the
        # abort that ends it, however slowly this thread gets there.
        long = TextParams(max_tokens=2000, ignore_eos=True)
        req = loop.submit(PROMPTS[0], long, on_leaving)
        loop.submit(PROMPTS[1], PARAMS, staying)
        assert first.wait(timeout=120)
        loop.abort(req)  # a client that left
        assert leaving.wait().finish_reason == "interrupted"
        (want,) = llm.generate(PROMPTS[1:2], PARAMS)
        assert staying.wait().text == want.text
        assert _kv_free(llm)
    finally:
        loop.close()


def test_a_failing_consumer_aborts_only_its_request(llm):
    loop = EngineLoop(llm)
    try:
        calls = []

        def broken(delta, new_ids, done):
            calls.append(done)
            raise RuntimeError("consumer bug")

        fine = Collector()
        loop.submit(PROMPTS[2], TextParams(max_tokens=2000, ignore_eos=True), broken)
        loop.submit(PROMPTS[3], PARAMS, fine)
        assert fine.wait().finish_reason == "length"
        assert loop.drain(timeout=60) and _kv_free(llm)
        assert calls[-1] is not None and calls[-1].finish_reason == "interrupted"
    finally:
        loop.close()


def test_submit_all_refuses_a_bare_string_or_a_callback_short_and_queues_nothing(llm):
    loop = EngineLoop(llm)
    try:
        for prompts, callbacks in (("def f(", [Collector()]), (PROMPTS[:2], [Collector()])):
            with pytest.raises(UsageError, match="one callback for each"):
                loop.submit_all(prompts, PARAMS, callbacks)
        assert loop.inflight == 0 and not llm.engine.waiting and _kv_free(llm)
    finally:
        loop.close()


def test_drain_stops_admitting_and_lets_requests_in_flight_finish(llm):
    loop = EngineLoop(llm)
    running = Collector()
    loop.submit(PROMPTS[4], PARAMS, running)
    assert loop.drain(timeout=120)
    assert running.wait().finish_reason == "length"
    with pytest.raises(Draining, match="shutting down"):
        loop.submit(PROMPTS[0], PARAMS, Collector())
    loop.close()
    assert _kv_free(llm) and not llm.engine.has_work


def test_drain_past_its_timeout_aborts_what_is_left(llm):
    loop = EngineLoop(llm)
    long = Collector()
    loop.submit(PROMPTS[0], TextParams(max_tokens=4000, ignore_eos=True), long)
    assert not loop.drain(timeout=0.2)
    assert long.wait().finish_reason == "interrupted"
    loop.close()
    assert _kv_free(llm)


def test_the_step_lock_goes_to_a_waiting_thread_before_the_loop_takes_it_again():
    """A thread that steps back to back (the loop) must not starve a waiting abort or
    submit: with threading.Lock the re-acquire usually won, for seconds."""
    lock, order = FairLock(), []

    def waiter():
        with lock:
            order.append("waiter")

    with lock:
        thread = threading.Thread(target=waiter)
        thread.start()
        deadline = time.monotonic() + 60
        while lock._next < 2 and time.monotonic() < deadline:  # the waiter holds a ticket
            time.sleep(0.001)
    with lock:  # the loop's next step, asked for after the waiter
        order.append("loop")
    thread.join(timeout=60)
    assert order == ["waiter", "loop"]


def test_a_thread_interrupted_while_waiting_for_the_step_lock_leaves_it_usable():
    """A Ctrl-C while a thread waits for its turn must not leave its ticket blocking every
    later thread."""
    lock = FairLock()
    got = threading.Event()

    def interrupted_wait(timeout=None):
        raise KeyboardInterrupt

    def interrupted():
        with pytest.raises(KeyboardInterrupt):
            with lock:
                pass

    def later():
        with lock:
            got.set()

    with lock:
        lock._turn.wait = interrupted_wait  # this instance's waits raise, as a Ctrl-C does
        waiter = threading.Thread(target=interrupted)
        waiter.start()
        waiter.join(timeout=60)
        del lock._turn.wait
        thread = threading.Thread(target=later)
        thread.start()
    assert got.wait(timeout=60) and lock._abandoned == set()
    thread.join(timeout=60)


def test_a_failing_pass_ends_its_requests_with_an_error_and_the_loop_goes_on(llm, monkeypatch):
    loop = EngineLoop(llm)
    try:
        original = type(llm.engine)._admit
        calls = []

        def admit_once_broken(engine):
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("admission bug")
            return original(engine)

        monkeypatch.setattr(type(llm.engine), "_admit", admit_once_broken)
        failed = Collector()
        loop.submit(PROMPTS[0], PARAMS, failed)
        done = failed.wait()
        assert done.finish_reason == "error" and "admission bug" in done.error
        fine = Collector()
        loop.submit(PROMPTS[1], PARAMS, fine)
        (want,) = llm.generate(PROMPTS[1:2], PARAMS)
        assert fine.wait().text == want.text
        assert _kv_free(llm)
    finally:
        loop.close()
