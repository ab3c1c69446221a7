"""Graph breaks: ops a breakable graph backend runs eagerly between graph segments.

A model marks an op that cannot be captured (data-dependent shapes, host
logic, a kernel that is not capture-safe) by calling it through
``run_breakable(fn, *args)``. Outside a breakable capture this is a plain
call. During one, the backend's handler ends the current segment, runs
``fn`` eagerly, records it for replay and starts the next segment.

The handler lives in a ``ContextVar`` scoped to one ``capture_one`` call,
not in a module global that code elsewhere could see change.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any, Protocol


class BreakHandler(Protocol):
    def __call__(self, fn: Callable[..., Any], *args: Any) -> Any: ...


_HANDLER: ContextVar[BreakHandler | None] = ContextVar("graphrt_break_handler", default=None)


def run_breakable(fn: Callable[..., Any], *args: Any) -> Any:
    handler = _HANDLER.get()
    return fn(*args) if handler is None else handler(fn, *args)


@contextlib.contextmanager
def breaks_handled_by(handler: BreakHandler) -> Iterator[None]:
    token = _HANDLER.set(handler)
    try:
        yield
    finally:
        _HANDLER.reset(token)
