"""Ascend NPU graph backend: ``torch.npu.NPUGraph`` captured with
``auto_dispatch_capture=True``, so that ``NPUGraph.update`` can re-issue the
captured fused-attention ops with new sequence lengths at replay.

Not verified on hardware: tested here against the stand-in device module
in tests/conformance/standin.py, which checks graphrt's own logic only.
"""

from __future__ import annotations

import contextlib
from typing import Any

from graphrt.core.runners.backend import ShapeKey
from graphrt.devices.graphs import StreamGraphBackend


class NpuGraphBackend(StreamGraphBackend):
    graph_class_name = "NPUGraph"

    def __init__(self, module: Any = None, updatable_ops: int = 0):
        """``updatable_ops``: attention ops per forward captured with host-side sequence
        lengths (``npu_fused_infer_attention_score`` and kin); 0 when the attention
        backend reads lengths from device tensors, so there is nothing to rebind."""
        if module is None:
            import torch
            import torch_npu  # noqa: F401  (registers torch.npu)

            module = torch.npu
        super().__init__(module)
        self.updatable_ops = updatable_ops

    @property
    def one_length_list(self) -> bool:
        return self.updatable_ops > 0  # update_inputs: the same list for every op

    def _graph_context(self, graph: Any) -> contextlib.AbstractContextManager:
        # auto_dispatch_capture=True is what makes NPUGraph.update possible later.
        return self.module.graph(
            graph, pool=self._pool, stream=self._stream, auto_dispatch_capture=True
        )

    def update_inputs(self, key: ShapeKey, **attrs: Any) -> None:
        if not self.updatable_ops or "seq_lens_cpu" not in attrs:
            return
        # One dict per captured attention op, in capture order.
        update = {"actual_seq_lengths_kv": list(attrs["seq_lens_cpu"])}
        self._graphs[key].update(cpu_update_input=[update] * self.updatable_ops)
