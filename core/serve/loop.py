"""``EngineLoop``: one thread steps an ``LLM``'s engine while requests are in flight.

Continuous batching for a server: requests join and leave between steps, from any
thread. After each step the loop hands every request its new text through the
callback it was submitted with (on the loop thread: a server forwards it to its own
event loop). Aborting a request (a client that left) frees its KV before the next
step; ``drain`` stops admitting, lets what is running finish within a timeout, and
aborts the rest.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from graphrt.core.engine.request import FinishReason, Request
from graphrt.core.errors import GraphrtError
from graphrt.core.serve.llm import LLM, Completion, TextParams, TextStream

log = logging.getLogger(__name__)

# on_event(delta, new_ids, done): the text a step added ("" if none: the detokeniser or a
# possible stop string may hold it back), the tokens it added, and the completion once
# the request has finished (then it is the last call). Called after every step that gave
# the request tokens or text, so a server can time its first token.
OnEvent = Callable[[str, list[int], Completion | None], None]


class Draining(GraphrtError):
    """The loop is draining or closed: it admits no new request."""


class EngineLoop:
    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self._wake = threading.Condition()
        self._inflight: dict[int, tuple[TextStream, OnEvent]] = {}  # by request id
        self._told: dict[int, int] = {}  # request id -> the tokens handed out so far
        self._admitting = True
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
        with self._wake:
            return self._admitting

    def submit(self, prompt: str | Sequence[int], params: TextParams, on_event: OnEvent) -> Request:
        """Queue ``prompt``; its text arrives through ``on_event``. Raises ``Draining``
        once ``drain`` or ``close`` began, and the engine's errors for a bad prompt (a
        prompt longer than the context, bad ids): nothing is queued then."""
        with self._wake:
            if not self._admitting:
                raise Draining("the server is shutting down: no new requests")
            with self.llm.step_lock:
                (stream,) = self.llm.start([prompt], params)
            self._inflight[stream.req.rid] = (stream, on_event)
            self._told[stream.req.rid] = 0
            self._wake.notify()
        return stream.req

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
            events = []
            with self.llm.step_lock:
                if any(not stream.req.finished for _, (stream, _) in current):
                    self.llm.engine.step()  # a failed step finishes its requests with an error
                for rid, (stream, on_event) in current:
                    stream.advance(self.llm.engine)
                    delta = "".join(stream.deltas)
                    stream.deltas.clear()
                    done = stream.completion() if stream.req.finished else None
                    new_ids = stream.req.output_ids[self._told[rid] :]
                    self._told[rid] += len(new_ids)
                    events.append((rid, stream, on_event, delta, new_ids, done))
            for rid, stream, on_event, delta, new_ids, done in events:
                if done is not None:
                    with self._wake:
                        del self._inflight[rid], self._told[rid]
                        self._wake.notify_all()  # drain() waits on this
                if delta or new_ids or done is not None:
                    try:
                        on_event(delta, new_ids, done)
                    except Exception:  # noqa: BLE001 (a consumer's bug must not stop the loop)
                        log.exception("request %d: its consumer failed; aborting it", rid)
                        self.abort(stream.req)
