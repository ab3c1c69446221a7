"""CUDA graph backends: ``full`` (one torch.cuda.CUDAGraph per key) and ``breakable``."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch

from graphrt.devices.graphs import BreakableStreamGraphBackend, StreamGraphBackend


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
        if self.module is not torch.cuda:  # a stand-in (CPU tests): nothing to upload
            return
        if _driver() is not None and hasattr(graph, "raw_cuda_graph_exec"):
            upload_graph(graph, self._stream)  # else: uploaded at the first replay


def upload_graph(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream) -> None:
    """``cuGraphUpload`` of ``graph``'s executable on ``stream`` (the driver API: torch
    exposes the handle, not the call). Ordered on the stream like a launch; no wait."""
    handle = graph.raw_cuda_graph_exec()
    result = _driver().cuGraphUpload(ctypes.c_void_p(handle), ctypes.c_void_p(stream.cuda_stream))
    if result != 0:
        raise RuntimeError(f"cuGraphUpload failed with CUresult {result}")


@functools.cache
def _driver() -> ctypes.CDLL | None:
    try:
        driver = ctypes.CDLL("libcuda.so.1")  # loaded already by torch's CUDA context
    except OSError:  # not Linux's driver library: graphs upload at their first replay
        return None
    driver.cuGraphUpload.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    driver.cuGraphUpload.restype = ctypes.c_int
    return driver


class CudaFullGraphBackend(_UploadsGraphs, _CompilesTritonAhead, StreamGraphBackend):
    graph_class_name = "CUDAGraph"

    def __init__(self, module: Any = None):
        super().__init__(module if module is not None else torch.cuda)


class CudaBreakableGraphBackend(_UploadsGraphs, _CompilesTritonAhead, BreakableStreamGraphBackend):
    graph_class_name = "CUDAGraph"

    def __init__(self, module: Any = None):
        super().__init__(module if module is not None else torch.cuda)
