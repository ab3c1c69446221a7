"""Graph capture and replay for devices with torch.cuda-style graph APIs.

CUDA (``torch.cuda``), Intel XPU (``torch.xpu``) and Ascend (``torch.npu``)
expose the same shape of API: a graph class with ``capture_begin`` /
``capture_end`` / ``replay`` / ``reset``, a ``graph(...)`` context manager,
``graph_pool_handle()``, streams. The backends here are written once against
that shape and take the device module as an argument; each device's
subpackage names its graph class and any capture options of its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from graphrt.core.graph_breaks import breaks_handled_by
from graphrt.core.runners.backend import ExecutionBackend, ShapeKey


class StreamGraphBackend(ExecutionBackend):
    """``full``: one device graph per key, all in one shared memory pool."""

    name = "full"
    replays_into_static_outputs = True
    graph_class_name = "CUDAGraph"  # attribute of the device module
    warmup_runs = 2  # lazy initialisation (workspaces, autotuning) happens outside capture

    def __init__(self, module: Any):
        super().__init__()
        self.module = module  # torch.cuda, torch.xpu, torch.npu (or the tests' stand-in)
        self._graphs: dict[ShapeKey, Any] = {}
        # HAZARD: graphs (or segments) whose capture failed, or whose key the runner gave
        # up, stay alive until cleanup. Destroying the only graph that used the shared
        # pool releases the pool, and the next capture into it then trips the CUDA
        # caching allocator's "use_count > 0" assert (seen on the H200).
        self._parked: list[Any] = []
        self._pool: Any = None
        self._stream: Any = None
        self._memory = 0

    # ---- capture -----------------------------------------------------------------

    @contextlib.contextmanager
    def capture_session(self, stream: Any = None) -> Iterator[None]:
        if self._pool is None:
            self._pool = self.module.graph_pool_handle()
        # Capture must not run on the default stream (CUDA refuses it). One stream for every
        # session: each fresh one cycles through torch's 32 pooled streams, and cuBLAS keeps
        # a workspace (32 MiB on Hopper) per stream it ran on for the process's life
        # (devices/cuda/gemv_tuner.py's HAZARD), counted here as graph memory.
        if stream is not None:
            self._stream = stream
        elif self._stream is None:
            self._stream = self.module.Stream()
        free_before = self._free_memory()
        # No cycle collection around capture: destroying a graph while another captures
        # invalidates that capture, but engines, strategies and runners hold no reference
        # cycles, so a dropped engine's graphs are freed when it is dropped, never by a
        # collection in the middle of a capture (tests/test_engine.py holds them to it).
        try:
            yield
        finally:
            self._memory += max(0, free_before - self._free_memory())

    def capture_one(
        self,
        key: ShapeKey,
        run_once: Callable[[], Any],
        post_warmup_hook: Callable[[], None] | None = None,
    ) -> Any:
        self._warm_up(run_once, post_warmup_hook)
        graph = self._new_graph()
        try:
            with self._graph_context(graph):
                outputs = run_once()
        except BaseException:
            self._parked.append(graph)  # see the HAZARD in __init__
            raise
        self._graphs[key] = graph
        self._after_capture(graph)
        return outputs  # every replay writes into these; the runner keeps them

    def _after_capture(self, graph: Any) -> None:
        """A captured graph, before its first replay (a device may prepare it there)."""

    def _warm_up(self, run_once: Callable[[], Any], hook: Callable[[], None] | None) -> None:
        self._stream.wait_stream(self.module.current_stream())
        with self.module.stream(self._stream):
            for _ in range(self.warmup_runs):
                run_once()
        self.module.current_stream().wait_stream(self._stream)
        if hook is not None:
            hook()

    def _new_graph(self) -> Any:
        return getattr(self.module, self.graph_class_name)()

    def _graph_context(self, graph: Any) -> contextlib.AbstractContextManager:
        return self.module.graph(graph, pool=self._pool, stream=self._stream)

    def _free_memory(self) -> int:
        # Cached blocks are released first: the graph context empties the cache
        # at each capture, and that must not cancel out the pool's growth.
        self.module.synchronize()
        self.module.empty_cache()
        try:
            return int(self.module.mem_get_info()[0])
        except (AttributeError, RuntimeError):
            return 0  # the device cannot tell; graph memory is then reported as 0

    # ---- replay ------------------------------------------------------------------

    def can_run(self, key: ShapeKey) -> bool:
        return key in self._graphs

    def _replay(self, key: ShapeKey) -> None:
        self._graphs[key].replay()

    def keys(self) -> Iterator[ShapeKey]:
        return iter(self._graphs)

    def forget(self, key: ShapeKey) -> None:
        graph = self._graphs.pop(key, None)
        if graph is not None:
            self._parked.append(graph)  # not reset: see the HAZARD in __init__

    def memory_bytes(self) -> int:
        return self._memory

    def cleanup(self) -> None:
        for graph in [*self._graphs.values(), *self._parked]:
            graph.reset()
        self._graphs.clear()
        self._parked.clear()
        self._pool = None
        self._memory = 0
        self.module.synchronize()
        self.module.empty_cache()


class BreakableStreamGraphBackend(StreamGraphBackend):
    """``breakable``: graph segments, with the ops marked by ``run_breakable`` run eagerly
    between them. Replay is: segment 0, eager op 0, segment 1, ... in capture order."""

    name = "breakable"

    def capture_one(
        self,
        key: ShapeKey,
        run_once: Callable[[], Any],
        post_warmup_hook: Callable[[], None] | None = None,
    ) -> Any:
        self._warm_up(run_once, post_warmup_hook)
        steps: list[Callable[[], Any]] = []
        segments: list[Any] = []  # keeps every segment alive as long as the key

        def begin() -> None:
            segments.append(self._new_graph())
            segments[-1].capture_begin(pool=self._pool)

        def end() -> None:
            segments[-1].capture_end()
            self._after_capture(segments[-1])
            steps.append(segments[-1].replay)

        def on_break(fn: Callable[..., Any], *args: Any) -> Any:
            end()
            out = fn(*args)
            # The next segment was captured reading `out`; each replay writes
            # the eager result back into that same memory.
            steps.append(lambda: _copy_into(out, fn(*args)))
            begin()
            return out

        with self.module.stream(self._stream), breaks_handled_by(on_break):
            begin()
            try:
                outputs = run_once()
            except BaseException:
                # End the open segment's capture: the stream must not stay capturing
                # for the buckets the runner captures next.
                with contextlib.suppress(Exception):
                    segments[-1].capture_end()
                self._parked.extend(segments)  # see the HAZARD in __init__
                raise
            end()
        self._graphs[key] = _Segments(steps, segments)
        return outputs

    def _replay(self, key: ShapeKey) -> None:
        for step in self._graphs[key].steps:
            step()


class _Segments:
    """A breakable key's replay steps, with the reset that cleanup expects of a graph."""

    def __init__(self, steps: list[Callable[[], Any]], graphs: list[Any]):
        self.steps = steps
        self.graphs = graphs

    def reset(self) -> None:
        for graph in self.graphs:
            graph.reset()


def _copy_into(static: Any, fresh: Any) -> None:
    if isinstance(static, torch.Tensor):
        static.copy_(fresh)
    else:
        for s, f in zip(static, fresh):
            _copy_into(s, f)
