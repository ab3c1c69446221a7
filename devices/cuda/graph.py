"""CUDA graph backends: ``full`` (one torch.cuda.CUDAGraph per key) and ``breakable``."""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch

from graphrt.devices.graphs import BreakableStreamGraphBackend, StreamGraphBackend

log = logging.getLogger(__name__)


class _CompilesTritonAhead:
    module: Any

    def compile_ahead(self, runs: Iterable[Callable[[], Any]]) -> None:
        if self.module is not torch.cuda:  # a stand-in (CPU tests): no Triton launches
            return
        from graphrt.devices.cuda.compile_ahead import compile_ahead  # no Triton: runs nothing

        with torch.inference_mode():  # as the captures run
            compile_ahead(runs)


class _UploadsGraphs:
    """Each graph goes to the device as it is captured, not at its first replay.

    CUDA uploads an instantiated graph's work to the device at its first launch unless
    told to earlier (``cuGraphUpload``). Measured on the H200 (bench/graph_upload.py): a
    400-kernel graph's first replay took 0.99 ms against 0.46 ms for the next; uploaded
    at capture, 0.47 ms. A draft length auto captures lazily paid that inside its first
    round; now it lands in capture time, where start-up and lazy captures are counted.
    (That first round still costs more than later ones, for reasons not found yet.)"""

    module: Any
    _stream: Any

    def _after_capture(self, graph: Any) -> None:
        super()._after_capture(graph)
        if self.module is not torch.cuda:  # a stand-in (CPU tests): nothing to upload
            return
        if _driver() is None or not hasattr(graph, "raw_cuda_graph_exec"):
            return  # uploaded at its first replay, as before
        try:
            upload_graph(graph, self._stream)
        except Exception as e:  # noqa: BLE001 (a speed-up only: never lose the graph to it)
            # HAZARD: raising here would drop a captured graph (or a breakable key's
            # segments) mid-capture; the graph uploads at its first replay anyway.
            _warn_once(
                f"uploading CUDA graphs at capture failed ({e}); they upload at first replay"
            )


def upload_graph(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream) -> None:
    """``cuGraphUpload`` of ``graph``'s executable on ``stream`` (the driver API: torch
    exposes the handle, not the call). Ordered on the stream like a launch; no wait."""
    handle = graph.raw_cuda_graph_exec()
    result = _driver().cuGraphUpload(ctypes.c_void_p(handle), ctypes.c_void_p(stream.cuda_stream))
    if result != 0:
        raise RuntimeError(f"cuGraphUpload failed with CUresult {result}")


@functools.cache
def _driver() -> ctypes.CDLL | None:
    """The CUDA driver library with ``cuGraphUpload`` (None: graphs upload at their first
    replay): not on a ROCm build of torch (its handles are HIP's), nor without Linux's
    driver library, nor on a driver older than CUDA 11.1."""
    if torch.version.cuda is None:
        return None
    try:
        driver = ctypes.CDLL("libcuda.so.1")  # loaded already by torch's CUDA context
        upload = driver.cuGraphUpload
    except (OSError, AttributeError):
        return None
    upload.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    upload.restype = ctypes.c_int
    return driver


@functools.cache
def _warn_once(message: str) -> None:
    log.warning(message)


class CudaFullGraphBackend(_UploadsGraphs, _CompilesTritonAhead, StreamGraphBackend):
    graph_class_name = "CUDAGraph"

    def __init__(self, module: Any = None):
        super().__init__(module if module is not None else torch.cuda)


class CudaBreakableGraphBackend(_UploadsGraphs, _CompilesTritonAhead, BreakableStreamGraphBackend):
    graph_class_name = "CUDAGraph"

    def __init__(self, module: Any = None):
        super().__init__(module if module is not None else torch.cuda)
