"""uvicorn's server, with a drain: the first SIGTERM or SIGINT stops admitting requests,
lets those in flight finish for a while, then aborts the rest (``EngineLoop.drain``)."""

from __future__ import annotations

import threading
import time

import uvicorn

from graphrt.core.serve.loop import EngineLoop


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, loop: EngineLoop, drain_timeout: float) -> None:
        super().__init__(config)
        self.engine_loop = loop
        self.drain_timeout = drain_timeout
        self.drained: str | None = None  # what the drain did, once it has run
        self._drainer: threading.Thread | None = None

    def handle_exit(self, sig, frame) -> None:
        # Not uvicorn's: that re-raises the signal once shut down, which would end a
        # server that drained cleanly with 143 instead of 0.
        if self.should_exit:  # a second signal: stop now
            self.force_exit = True
            return
        self.should_exit = True  # uvicorn closes the socket, waits for open responses
        self._drainer = threading.Thread(target=self._drain, name="graphrt-drain", daemon=True)
        self._drainer.start()

    def _drain(self) -> None:
        start = time.perf_counter()
        left = self.engine_loop.inflight
        if self.engine_loop.drain(self.drain_timeout):
            took = time.perf_counter() - start
            self.drained = f"drained: {left} requests in flight finished in {took:.1f} s"
            if self.force_exit:  # a second signal: their handlers were cancelled, aborting them
                self.drained = f"stopped at a second signal: {left} requests in flight aborted"
        else:
            self.drained = (
                f"drained: requests still running after {self.drain_timeout:g} s were aborted "
                "(finish reason: abort)"
            )

    def wait_drained(self) -> str | None:
        """After ``run``: the drain's one-line account (None if no signal came)."""
        if self._drainer is not None:
            self._drainer.join()
        return self.drained
