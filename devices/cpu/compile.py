"""CPU "graphs": one ``torch.compile(dynamic=False)`` callable per key.

The CPU has no graph API; a compiled callable over the runner's static
buffers plays the same role. Compilation is lazy: ``capture_one`` only
wraps the forward, and inductor compiles a bucket the first time a batch
needs it (seconds per bucket on a small machine), so start-up stays fast.
Inductor's cache (TORCHINDUCTOR_CACHE_DIR) makes later runs quicker still.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

from graphrt.core.runners.backend import ExecutionBackend, ShapeKey

_graph_ids = itertools.count()
log = logging.getLogger(__name__)


class CompiledGraphBackend(ExecutionBackend):
    name = "compile"

    def __init__(self) -> None:
        super().__init__()
        self._compiled: dict[ShapeKey, Callable[[], Any]] = {}
        self._uncompiled: dict[ShapeKey, Callable[[], Any]] = {}
        self._first_run_done: set[ShapeKey] = set()
        self._compile_s = 0.0

    def capture_session(self, stream: Any = None) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def capture_one(
        self,
        key: ShapeKey,
        run_once: Callable[[], Any],
        post_warmup_hook: Callable[[], None] | None = None,
    ) -> None:  # no static outputs: compiled code returns fresh ones from every call
        # dynamic=False: each bucket gets code specialised to its shapes, as a
        # device graph would be; fullgraph=True: a graph break is an error, not
        # a silent eager fallback. Nothing runs here (lazy); see the module docstring.
        self._compiled[key] = torch.compile(_own_code(run_once), dynamic=False, fullgraph=True)
        self._uncompiled[key] = run_once
        if post_warmup_hook is not None:
            post_warmup_hook()

    def can_run(self, key: ShapeKey) -> bool:
        return key in self._compiled

    def _replay(self, key: ShapeKey) -> Any:
        if key in self._first_run_done:
            return self._compiled[key]()
        start = time.perf_counter()  # the first call compiles (and runs once): the capture
        try:
            out = self._compiled[key]()
        except Exception as e:  # noqa: BLE001 (a failed compile must not fail the step)
            # The same function over the same static buffers, uncompiled: same tokens.
            why = f"{type(e).__name__}: {e}".splitlines()[0]
            log.warning(
                "compiling the %s graph for batch size %d failed (%s); it runs uncompiled",
                key.mode.name.lower(),
                key.size,
                why,
            )
            self._compiled[key] = self._uncompiled[key]
            out = self._compiled[key]()
        self._compile_s += time.perf_counter() - start
        self._first_run_done.add(key)
        return out

    def lazy_compile_s(self) -> float:
        return self._compile_s

    def keys(self) -> Iterator[ShapeKey]:
        return iter(self._compiled)

    def forget(self, key: ShapeKey) -> None:
        self._compiled.pop(key, None)
        self._uncompiled.pop(key, None)
        self._first_run_done.discard(key)

    def cleanup(self) -> None:
        self._compiled.clear()
        self._uncompiled.clear()
        self._first_run_done.clear()


def _own_code(fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` with a code object of its own.

    HAZARD: dynamo caches compiled code per code object, and every graph's
    ``run_once`` is the same closure code: all graphs of all runners in the
    process would share one cache and hit its recompile limit (8) — with
    ``fullgraph=True`` an error, otherwise a silent eager fallback. One code
    object per graph keeps each cache at one entry (and the limit as a guard).
    """
    code = fn.__code__.replace(co_name=f"graphrt_graph_{next(_graph_ids)}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
