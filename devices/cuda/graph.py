"""CUDA graph backends: ``full`` (one torch.cuda.CUDAGraph per key) and ``breakable``."""

from __future__ import annotations

from typing import Any

from graphrt.devices.graphs import BreakableStreamGraphBackend, StreamGraphBackend


class CudaFullGraphBackend(StreamGraphBackend):
    graph_class_name = "CUDAGraph"

    def __init__(self, module: Any = None):
        import torch

        super().__init__(module if module is not None else torch.cuda)


class CudaBreakableGraphBackend(BreakableStreamGraphBackend):
    graph_class_name = "CUDAGraph"

    def __init__(self, module: Any = None):
        import torch

        super().__init__(module if module is not None else torch.cuda)
