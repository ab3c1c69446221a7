"""``EngineLoop``: one thread steps an ``LLM``'s engine while requests are in flight.

Continuous batching for a server: requests join and leave between steps, from any
thread. After each step the loop hands every request its new text through the
callback it was submitted with (on the loop thread: a server forwards it to its own
event loop). Aborting a request (a client that left) frees its KV before the next
step; ``drain`` stops admitting, lets what is running finish within a timeout, and
aborts the rest.

With ``trace_steps`` the loop keeps one record per pass (``PASS_FIELDS``; the last
``TRACE_LIMIT``): when it began, how long it waited for the step lock, stepped the
engine, turned tokens into text and handed out events, what the step was and how much
of it the loop thread ran on a CPU (the rest waited for the GIL or the device).
``graphrt serve --step-trace FILE`` writes them; ``bench/step_trace.py`` reads them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

from graphrt.core.engine.request import FinishReason, Request
from graphrt.core.errors import GraphrtError, UsageError, first_line
from graphrt.core.serve.llm import LLM, Completion, TextParams, TextStream

log = logging.getLogger(__name__)

# on_event(delta, new_ids, done): the text a step added ("" if none: the detokeniser or a
# possible stop string may hold it back), the tokens it added, and the completion once
# the request has finished (then it is the last call). Called after every step that gave
# the request tokens or text, so a server can time its first token.
OnEvent = Callable[[str, list[int], Completion | None], None]


# One trace record a pass: seconds since the loop started; seconds waiting for the step
# lock, stepping the engine, turning tokens into text (under the lock), handing out
# events; the loop thread's CPU seconds in the pass; requests running and waiting before
# the step; the step's eager and graph forwards, speculative rounds (a round a request)
# and their draft steps summed, plain steps of a speculative strategy, tokens emitted and
# seconds of prefill (0: a decode step).
PASS_FIELDS = (
    "t", "lock_s", "step_s", "text_s", "events_s", "cpu_s", "running", "waiting",
    "eager", "graph", "rounds", "drafted", "plain", "tokens", "prefill_s",
)  # fmt: skip
TRACE_LIMIT = 100_000  # passes kept (about 400 bytes each in CPython: 40 MB at most)


class Draining(GraphrtError):
    """The loop is draining or closed: it admits no new request."""


class EngineLoop:
    def __init__(self, llm: LLM, trace_steps: bool = False) -> None:
        self.llm = llm
        self.trace: deque[tuple] | None = deque(maxlen=TRACE_LIMIT) if trace_steps else None
        self._started = self._stepped = time.perf_counter()
        self._wake = threading.Condition()
        self._inflight: dict[int, tuple[TextStream, OnEvent]] = {}  # by request id
        self._admitting = True  # a plain read for /health: no lock on the event loop
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="graphrt-engine-loop", daemon=True)
        self._thread.start()

    @property
    def inflight(self) -> int:
        with self._wake:
            return len(self._inflight)

    @property
    def admitting(self) -> bool:
        """False once ``drain`` or ``close`` began."""
        return self._admitting

    def submit(self, prompt: str | Sequence[int], params: TextParams, on_event: OnEvent) -> Request:
        """Queue ``prompt``; its text arrives through ``on_event``. Raises ``Draining``
        once ``drain`` or ``close`` began, and the engine's errors for a bad prompt (a
        prompt longer than the context, bad ids): nothing is queued then."""
        return self.submit_all([prompt], params, [on_event])[0]

    def submit_all(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: TextParams,
        on_events: Sequence[OnEvent],
    ) -> list[Request]:
        """``submit`` for several prompts (a request's choices): all checked, each encoded
        once, then all queued; a bad one queues none."""
        if isinstance(prompts, (str, bytes)) or len(prompts) != len(on_events):
            raise UsageError("submit_all takes a list of prompts and one callback for each")
        # HAZARD: never wait for the step lock while holding _wake: the loop thread and
        # every reader of _wake would wait a whole step behind this submit.
        if not self._admitting:
            raise Draining("the server is shutting down: no new requests")
        ids = [self.llm.encode(p) for p in prompts]  # before the lock: the loop steps meanwhile
        with self.llm.step_lock:
            streams = self.llm.start(ids, params)
            with self._wake:  # step lock, then _wake: the only order the two are nested in
                if not self._admitting:  # a drain began meanwhile
                    for stream in streams:
                        self.llm.engine.abort(stream.req, FinishReason.INTERRUPTED)
                    raise Draining("the server is shutting down: no new requests")
                for stream, on_event in zip(streams, on_events):
                    self._inflight[stream.req.rid] = (stream, on_event)
                self._wake.notify()
        return [stream.req for stream in streams]

    def abort(self, req: Request) -> None:
        """Stop ``req`` now and free its KV (a client that left); its callback gets the
        completion ("interrupted") at the loop's next pass."""
        with self.llm.step_lock:
            if not req.finished:
                self.llm.engine.abort(req, FinishReason.INTERRUPTED)
        with self._wake:
            self._wake.notify()

    def drain(self, timeout: float) -> bool:
        """Admit nothing more; wait up to ``timeout`` seconds for the requests in flight to
        finish, then abort what is left. -> whether all finished in time."""
        with self._wake:
            self._admitting = False
            deadline = time.monotonic() + timeout
            while self._inflight and time.monotonic() < deadline:
                self._wake.wait(deadline - time.monotonic())
            left = [stream.req for stream, _ in self._inflight.values()]
        for req in left:
            self.abort(req)
        return not left

    def close(self, timeout: float = 0.0) -> None:
        """``drain(timeout)``, then stop the loop thread."""
        self.drain(timeout)
        with self._wake:
            self._closed = True
            self._wake.notify_all()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._inflight and not self._closed:
                    self._wake.wait()
                if not self._inflight:  # closed, nothing left
                    return
                current = list(self._inflight.items())
            tracing = self.trace is not None
            began, cpu = time.perf_counter(), time.thread_time()
            with self.llm.step_lock:
                locked, before = time.perf_counter(), tracing and self._counters()
                self._stepped = locked  # _step moves it on once the engine has stepped
                try:
                    events = self._step(current)
                except Exception as e:  # noqa: BLE001 (the loop must outlive it: see _fail)
                    log.exception("the engine loop's pass failed; failing its requests")
                    events = self._fail(current, e)
                texted, after = time.perf_counter(), tracing and self._counters()
            for rid, stream, on_event, delta, new_ids, done in events:
                if delta or new_ids or done is not None:
                    try:
                        on_event(delta, new_ids, done)
                    except Exception:  # noqa: BLE001 (a consumer's bug must not stop the loop)
                        log.exception("request %d: its consumer failed; aborting it", rid)
                        self.abort(stream.req)
                if done is not None:  # after its last event: drain() returns only then
                    with self._wake:
                        del self._inflight[rid]
                        self._wake.notify_all()
            if tracing:
                ended = time.perf_counter()
                self.trace.append((
                    round(began - self._started, 6), round(locked - began, 6),
                    round(self._stepped - locked, 6), round(texted - self._stepped, 6),
                    round(ended - texted, 6),
                    round(time.thread_time() - cpu, 6), *before[:2],
                    *(round(b - a, 6) for a, b in zip(before[2:], after[2:])),
                ))  # fmt: skip

    def _counters(self) -> tuple[float, ...]:
        """Running, waiting, then the engine's counters a trace record takes differences of
        (the order of PASS_FIELDS from "running")."""
        engine = self.llm.engine
        s = engine.stats
        return (
            len(engine.running), len(engine.waiting), s.eager_steps, s.graph_steps,
            s.spec_rounds, sum(k * n for k, n in s.rounds_by_steps.items()),
            s.spec_plain_steps, s.generated_tokens, s.prefill_s,
        )  # fmt: skip

    def _step(self, current) -> list[tuple]:
        """One engine step, then each request's new text and tokens (under the step lock)."""
        if any(not stream.req.finished for _, (stream, _) in current):
            self.llm.engine.step()  # a failed step finishes its requests with an error
        self._stepped = time.perf_counter()
        events = []
        for rid, (stream, on_event) in current:
            before = stream.seen  # the tokens handed out so far
            stream.advance(self.llm.engine)
            delta = "".join(stream.deltas)
            stream.deltas.clear()
            done = stream.completion() if stream.req.finished else None
            new_ids = stream.req.output_ids[before:]
            events.append((rid, stream, on_event, delta, new_ids, done))
        return events

    def _fail(self, current, error: Exception) -> list[tuple]:
        """A pass that raised outside the engine's own step guard (admission, the
        detokeniser): its requests end with an error and free their KV, so no caller
        waits forever."""
        events = []
        for rid, (stream, on_event) in current:
            req = stream.req
            if not req.finished:
                self.llm.engine.abort(req, FinishReason.ERROR)
                req.error = f"the engine loop failed: {first_line(error)}"
            events.append((rid, stream, on_event, "", [], stream.completion()))
        return events
