"""The execution-backend interface: how a device captures and replays graphs.

Backends are graph-only and stateless about batches: the ``GraphRunner``
owns buffers, padding, keys and the static outputs it captured with; a
backend stores one graph (or compiled callable) per ``ShapeKey`` and replays
it. All of a backend's graphs share one memory pool, captured largest first.
"""

from __future__ import annotations

import abc
import contextlib
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from graphrt.core.batch import ForwardMode


@dataclass(frozen=True)
class ShapeKey:
    """Names one captured graph. Built only by ``GraphRunner._make_graph_key``.

    ``size`` request rows of ``width`` tokens each, in forward ``mode``; ``variant``
    tells apart graphs of one shape that compute different things (the draft loop).
    """

    size: int
    mode: ForwardMode = ForwardMode.DECODE
    width: int = 1
    variant: str | None = None


# Entered around every replay: (key) -> a context manager (benches record device events).
ReplayObserver = Callable[[ShapeKey], contextlib.AbstractContextManager]


class ExecutionBackend(abc.ABC):
    name: str = "abstract"
    # True for device graphs: a replay writes into the outputs its capture returned, so the
    # runner may hand every graph slices of one shared output buffer (compiled code returns
    # fresh outputs instead).
    replays_into_static_outputs: bool = False

    @property
    def one_length_list(self) -> bool:
        """True where a replay pushes one host list of sequence lengths into every captured
        attention op (an NPU graph with updatable ops): a graph whose ops need different
        lengths, as a whole speculative round's (the draft's, then verify's), cannot run
        on it."""
        return False

    def __init__(self) -> None:
        # Replays per key. A failed capture degrades to eager steps and a warning, so tests
        # that mean to run graphs assert on these; benches read them too.
        self.replays: Counter[ShapeKey] = Counter()
        self.replay_observer: ReplayObserver | None = None

    @abc.abstractmethod
    def capture_session(self, stream: Any = None) -> contextlib.AbstractContextManager:
        """Context around a whole capture pass (pool, side stream, synchronisation)."""

    @abc.abstractmethod
    def capture_one(
        self,
        key: ShapeKey,
        run_once: Callable[[], Any],
        post_warmup_hook: Callable[[], None] | None = None,
    ) -> Any:
        """Warm ``run_once`` up, then capture it as the graph for ``key``.

        Returns what the captured run returned: the static outputs every replay
        writes into (None where nothing ran yet, as for lazily compiled code).
        """

    def compile_ahead(self, runs: Iterable[Callable[[], Any]]) -> None:  # noqa: B027
        """A device whose kernels compile at their first launch may compile all that
        ``runs`` launch here, at once, before any capture: each of ``runs`` is a graph
        bucket's forward as its capture will warm it up (a dry run: its output is not
        used). The default runs nothing; the warm-ups compile as they go."""

    @abc.abstractmethod
    def can_run(self, key: ShapeKey) -> bool:
        """True when a graph for ``key`` exists."""

    def replay_session(self) -> contextlib.AbstractContextManager:
        """Context around replays (devices that need one set it up here)."""
        return contextlib.nullcontext()

    def replay(self, key: ShapeKey) -> Any:
        """Replay ``key``'s graph. Graphs write into the outputs ``capture_one`` returned
        and return None; compiled code returns this call's fresh outputs."""
        self.replays[key] += 1
        if self.replay_observer is None:
            return self._replay(key)
        with self.replay_observer(key):
            return self._replay(key)

    @abc.abstractmethod
    def _replay(self, key: ShapeKey) -> Any:
        """The device's replay of ``key`` (see ``replay``)."""

    @abc.abstractmethod
    def cleanup(self) -> None:
        """Drop every graph and the pool; a later capture starts afresh."""

    def update_inputs(self, key: ShapeKey, **attrs: Any) -> None:  # noqa: B027 (optional hook)
        """Rebind host-side inputs of a captured graph (Ascend's NPUGraph.update); a no-op elsewhere."""

    def keys(self) -> Iterator[ShapeKey]:
        """The captured keys."""
        return iter(())

    def forget(self, key: ShapeKey) -> None:  # noqa: B027 (backends with graphs override it)
        """Drop ``key``'s graph if there is one: the runner gave its bucket up."""

    def memory_bytes(self) -> int:
        """Device memory held by the captured graphs, as far as the device can tell."""
        return 0

    def lazy_compile_s(self) -> float:
        """Seconds spent compiling inside replays so far (lazy backends: CPU ``compile``);
        the engine keeps them out of its tokens/s."""
        return 0.0
