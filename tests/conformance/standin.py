"""A stand-in for ``torch.cuda`` / ``torch.xpu`` / ``torch.npu`` in graph backends.

It checks graphrt's own logic only; it is not a device. ``StreamGraphBackend``
and its subclasses take their device module as a constructor argument; given a
``StandInGraphModule`` they capture and replay on CPU tensors with the
semantics of a real device graph:

- capture records every aten op run between ``capture_begin`` and
  ``capture_end`` (a ``TorchDispatchMode``): the op, its arguments and the
  tensors it produced;
- ``replay`` re-runs the recorded ops, in order, on the same tensors and copies
  each fresh result into the tensor captured as that op's output, the way a
  real graph writes into fixed addresses. Python code (a module's forward, the
  runner, host logic) does not run again: only the recorded ops do;
- what a real capture refuses is refused here too: capturing on the default
  stream, and host syncs (``.item()``, data-dependent shapes) during capture.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# Ops that read device values on the host: they break a real capture
# (cudaErrorStreamCaptureInvalidated), so they break this one too.
HOST_SYNC_OPS = {
    aten._local_scalar_dense.default,  # .item(), .tolist(), int(tensor), bool(tensor)
    aten.nonzero.default,  # data-dependent output shape
    aten.masked_select.default,
}


class CaptureError(RuntimeError):
    """What a real device raises when a capture is invalid."""


@dataclass
class RecordedOp:
    func: Any
    args: tuple
    kwargs: dict
    outputs: list  # flattened outputs as captured (tensors and non-tensors)
    aliased: list[bool]  # per output: True when it shares storage with an input (in-place, view)


class _Recorder(TorchDispatchMode):
    def __init__(self, ops: list[RecordedOp]):
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in HOST_SYNC_OPS:
            raise CaptureError(f"{func} syncs with the host: not allowed during graph capture")
        out = func(*args, **kwargs)
        inputs = {_storage_ptr(t) for t in _leaves((args, kwargs)) if _is_tensor(t)}
        outputs = _leaves(out)
        aliased = [_is_tensor(t) and _storage_ptr(t) in inputs for t in outputs]
        self.ops.append(RecordedOp(func, args, kwargs, outputs, aliased))
        return out


def _leaves(tree: Any) -> list:
    """The leaves of aten's arguments and results (nested tuples, lists and dicts), in
    order: torch's ``tree_flatten``, without its per-node registry lookups (which took
    a third of a stand-in replay's time)."""
    if not isinstance(tree, _NODES):
        return [tree]
    leaves = []
    for item in tree.values() if isinstance(tree, dict) else tree:
        if isinstance(item, _NODES):
            leaves.extend(_leaves(item))
        else:
            leaves.append(item)
    return leaves


_NODES = (tuple, list, dict)


_C10D = torch.ops._c10d_functional


def _is_collective(func: Any) -> bool:
    return func.namespace == "_c10d_functional" and func is not _C10D.wait_tensor.default


def _is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def _storage_ptr(t: torch.Tensor) -> int:
    if t.is_mkldnn:  # the CPU ops' packed weights (devices/cpu/onednn.py): no storage
        return id(t)  # to read, and no op's output aliases one
    return t.untyped_storage().data_ptr()


class StandInGraph:
    """One graph: ``CUDAGraph`` / ``XPUGraph`` / ``NPUGraph`` of the stand-in module."""

    _ids = itertools.count()

    def __init__(self, module: StandInGraphModule, keep_graph: bool = False):
        self.module = module
        self.id = next(self._ids)
        self.ops: list[RecordedOp] = []
        self.pool: Any = None
        self.capture_kwargs: dict[str, Any] = {}
        self.calls: list[tuple[str, Any]] = []  # ("capture_begin", kw), ("replay", None), ...
        self.state = "new"  # new -> capturing -> captured -> reset
        self.replays = 0
        self._recorder: _Recorder | None = None
        self._pool_user = False  # counted in module.pool_users until reset or destroyed
        module._graph_refs.append(weakref.ref(self))

    def capture_begin(self, pool: Any = None, **kw: Any) -> None:
        if self.state != "new":
            raise CaptureError(f"graph {self.id} captured twice (state {self.state})")
        if self.module.current_stream() is self.module.default_stream:
            raise CaptureError("graphs must be captured on a non-default stream")
        self.module._use_pool(pool)
        self._pool_user = pool is not None
        self.pool, self.capture_kwargs = pool, dict(kw)
        self.calls.append(("capture_begin", {"pool": pool, **kw}))
        self.module.capturing += 1
        self.state = "capturing"
        self._recorder = _Recorder(self.ops)
        self._recorder.__enter__()

    def capture_end(self) -> None:
        if self.state != "capturing":
            raise CaptureError(f"capture_end on graph {self.id} that is not capturing")
        self._recorder.__exit__(None, None, None)
        self._recorder = None
        self.module.capturing -= 1
        self.state = "captured"
        self.calls.append(("capture_end", None))

    def replay(self) -> None:
        if self.state != "captured":
            raise CaptureError(f"replay of graph {self.id} in state {self.state}")
        self.calls.append(("replay", None))
        self.replays += 1
        # A real graph knows nothing of autograd; inference mode lets the replay
        # write into inference tensors captured under the runner's inference_mode.
        with torch.inference_mode():
            for op in self.ops:
                fresh = _leaves(op.func(*op.args, **op.kwargs))
                if _is_collective(op.func):
                    # Its result is valid once waited on (a device stream orders this; the
                    # host does here), and before it is copied where the graph reads it.
                    fresh = [_C10D.wait_tensor(t) if _is_tensor(t) else t for t in fresh]
                for static, new, aliased in zip(op.outputs, fresh, op.aliased):
                    if _is_tensor(static) and not aliased and static is not new:
                        static.copy_(new)  # the graph writes into the captured address

    def update(self, cpu_update_input: Any = None) -> None:
        """NPUGraph.update: only valid for graphs captured with auto_dispatch_capture=True."""
        if self.state != "captured":
            raise CaptureError(f"update of graph {self.id} in state {self.state}")
        if not self.capture_kwargs.get("auto_dispatch_capture"):
            raise CaptureError("NPUGraph.update needs a capture with auto_dispatch_capture=True")
        self.calls.append(("update", cpu_update_input))

    def reset(self) -> None:
        self.ops.clear()
        self.state = "reset"
        self.calls.append(("reset", None))
        self._leave_pool()

    def __del__(self) -> None:
        self._leave_pool()

    def _leave_pool(self) -> None:
        if self._pool_user:
            self._pool_user = False
            self.module.pool_users[self.pool] -= 1


@dataclass(eq=False)
class StandInStream:
    module: StandInGraphModule
    name: str
    waited_on: list[StandInStream] = field(default_factory=list)

    def wait_stream(self, other: StandInStream) -> None:
        self.waited_on.append(other)

    def synchronize(self) -> None:
        return None


class StandInGraphModule:
    """Checks graphrt's own logic only; not a device.

    Use in place of ``torch.cuda`` / ``torch.xpu`` / ``torch.npu``:
    ``CudaFullGraphBackend(module=StandInGraphModule())``.
    """

    def __init__(self) -> None:
        self._graph_refs: list[weakref.ref] = []
        # Live graphs captured into each pool. As CUDA's caching allocator: a pool whose
        # graphs are all gone (reset or destroyed) cannot be captured into again
        # (TORCH_INTERNAL_ASSERT(use_count > 0) in beginAllocateToPool).
        self.pool_users: dict[Any, int] = {}
        self.graph_contexts: list[dict[str, Any]] = []  # kwargs of each graph(...) context
        self.pools: list[tuple[int, int]] = []  # every graph_pool_handle() returned
        self.capturing = 0
        self.synchronizes = 0
        self.empty_caches = 0
        self.default_stream = StandInStream(self, "default")
        self._current = self.default_stream

    @property
    def graphs(self) -> list[StandInGraph]:
        """The graphs made and still alive, in creation order."""
        return [g for g in (ref() for ref in self._graph_refs) if g is not None]

    def _use_pool(self, pool: Any) -> None:
        if pool is None:
            return
        if self.pool_users.get(pool, 1) == 0:
            raise CaptureError(
                f"capture into pool {pool}, whose graphs are all gone: the CUDA caching "
                "allocator asserts use_count > 0"
            )
        self.pool_users[pool] = self.pool_users.get(pool, 0) + 1

    # Graph classes under each device's name.
    def CUDAGraph(self, keep_graph: bool = False) -> StandInGraph:  # noqa: N802 (torch's name)
        return StandInGraph(self, keep_graph)

    XPUGraph = CUDAGraph
    NPUGraph = CUDAGraph

    @contextlib.contextmanager
    def graph(
        self, g: StandInGraph, pool: Any = None, stream: StandInStream | None = None, **kw: Any
    ) -> Iterator[StandInGraph]:
        """``torch.cuda.graph``: sync, empty the cache, switch stream, capture."""
        self.graph_contexts.append({"graph": g, "pool": pool, "stream": stream, **kw})
        self.synchronize()
        self.empty_cache()
        with self.stream(stream if stream is not None else self.Stream()):
            g.capture_begin(pool=pool, **kw)
            try:
                yield g
            finally:
                g.capture_end()

    def graph_pool_handle(self) -> tuple[int, int]:
        self.pools.append((0, len(self.pools)))
        return self.pools[-1]

    def Stream(self) -> StandInStream:  # noqa: N802 (torch's name)
        return StandInStream(self, f"side{id(self) % 1000}")

    @contextlib.contextmanager
    def stream(self, s: StandInStream | None) -> Iterator[None]:
        previous = self._current
        self._current = s if s is not None else previous
        try:
            yield
        finally:
            self._current = previous

    def current_stream(self) -> StandInStream:
        return self._current

    def synchronize(self) -> None:
        if self.capturing:
            raise CaptureError("synchronize during capture")
        self.synchronizes += 1

    def empty_cache(self) -> None:
        if self.capturing:
            raise CaptureError("empty_cache during capture")
        self.empty_caches += 1

    def mem_get_info(self) -> tuple[int, int]:
        return (0, 0)  # a stand-in holds no device memory
