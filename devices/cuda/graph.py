"""CUDA graph backends: ``full`` (one torch.cuda.CUDAGraph per key) and ``breakable``."""

from __future__ import annotations

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


class CudaFullGraphBackend(_CompilesTritonAhead, StreamGraphBackend):
    graph_class_name = "CUDAGraph"

    def __init__(self, module: Any = None):
        super().__init__(module if module is not None else torch.cuda)


class CudaBreakableGraphBackend(_CompilesTritonAhead, BreakableStreamGraphBackend):
    graph_class_name = "CUDAGraph"

    def __init__(self, module: Any = None):
        super().__init__(module if module is not None else torch.cuda)
