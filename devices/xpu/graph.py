"""Intel XPU graph backend: ``torch.xpu.XPUGraph`` (stock torch >= 2.11, no IPEX).

Not verified on hardware: tested here against the stand-in device module
in tests/conformance/standin.py, which checks graphrt's own logic only.
"""

from __future__ import annotations

from typing import Any

from graphrt.devices.graphs import StreamGraphBackend


class XpuGraphBackend(StreamGraphBackend):
    graph_class_name = "XPUGraph"

    def __init__(self, module: Any = None):
        import torch

        super().__init__(module if module is not None else torch.xpu)
