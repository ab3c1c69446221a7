"""EagerRunner: runs every batch op by op; the reference every graph runner must match."""

from __future__ import annotations

import torch

from graphrt.core.batch import ForwardBatch
from graphrt.core.runners.base import BaseRunner, RunnerOutput


class EagerRunner(BaseRunner):
    def can_run_graph(self, batch: ForwardBatch) -> bool:
        return False

    def load_batch(self, batch: ForwardBatch) -> None:
        # Eager reads the batch's own tensors: no static buffers to copy into,
        # only the attention metadata for this exact shape.
        self.attn_backend.init_forward_metadata(batch)

    @torch.inference_mode()
    def execute(self, batch: ForwardBatch, clone: bool = True) -> RunnerOutput:
        self.load_batch(batch)  # (eager outputs are the forward's own: clone says nothing)
        return self._forward(batch)
