"""The draft loop as one captured graph per *request* batch size.

A ``GraphRunner`` subclass: the base owns the buckets, static buffers, keys,
padding and the capture loop; this class only says what a "batch" is (one
row per request: last token, frozen position, KV length, seed hidden) and
what is captured (the whole ``draft_tree``: every draft step, the top-k
expansions and the organised results).
"""

from __future__ import annotations

import torch

from graphrt.core.batch import ForwardBatch, ForwardMode
from graphrt.core.runners.base import BaseRunner, RunnerOutput
from graphrt.core.runners.graph import GraphRunner
from graphrt.spec.config import SpecConfig
from graphrt.spec.draft import DraftInput, draft_tree


class MTPDraftGraphRunner(GraphRunner):
    mode = ForwardMode.DRAFT

    def __init__(
        self,
        drafter,
        attn_backend,
        backend,
        config,
        device,
        spec_config: SpecConfig,
        seed_hidden_size: int,
        dtype,
    ):
        super().__init__(drafter, attn_backend, backend, config, device)
        self.spec_config = spec_config
        # The seed hiddens every captured draft loop reads, beside the base's input buffers.
        self.seed_hidden = torch.zeros(
            self.buckets[-1], seed_hidden_size, dtype=dtype, device=device
        )

    def _make_graph_key(self, size, stream_idx=None, variant=None):
        return super()._make_graph_key(size, stream_idx, variant or "mtp-draft")

    def _static_batch(self, size: int) -> ForwardBatch:
        batch = super()._static_batch(size)
        batch.spec_info = DraftInput(hidden=self.seed_hidden[:size])
        return batch

    def load_batch(self, batch: ForwardBatch) -> None:
        super().load_batch(batch)
        _, static = self._loaded
        bs = batch.batch_size
        self.seed_hidden[:bs].copy_(batch.spec_info.hidden, non_blocking=True)
        self.seed_hidden[bs : static.batch_size].zero_()

    def _forward(self, static: ForwardBatch):
        """What is captured: the whole draft loop over the static request rows."""

        def run_step(step: ForwardBatch) -> RunnerOutput:
            # Step rows are derived inside the graph from the static buffers; their
            # metadata is the capture-safe kind (fixed KV length, device tensors).
            self.attn_backend.init_metadata_for_capture(step)
            return BaseRunner._forward(self, step)

        return draft_tree(
            run_step,
            self.spec_config,
            static.input_ids,
            static.spec_info.hidden,
            static.req_pool_indices,
            static.seq_lens,
            static.seq_lens_cpu,
        )

    def _slice_output(self, out, bs: int):
        # (parent_list, top_scores_index, draft_tokens), each (size, ...): the real rows, copied.
        return tuple(t[:bs].clone() for t in out)
