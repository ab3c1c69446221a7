"""Static input buffers a graph reads, sized for the largest bucket.

Two verbs: ``set_batch`` builds the static ``ForwardBatch`` a graph is
captured with; ``copy_from`` loads a live batch into those same tensors for
replay (real rows first, then padding rows). No allocation on replay.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphrt.core.batch import ForwardBatch, ForwardMode
from graphrt.core.memory import PADDING_SLOT


@dataclass
class GraphInputBuffers:
    input_ids: torch.Tensor  # (max_bs,) int64
    positions: torch.Tensor  # (max_bs,) int64
    req_pool_indices: torch.Tensor  # (max_bs,) int64
    seq_lens: torch.Tensor  # (max_bs,) int32
    out_cache_loc: torch.Tensor  # (max_bs,) int64

    @classmethod
    def allocate(cls, max_bs: int, device: torch.device) -> GraphInputBuffers:
        def zeros(dtype=torch.int64):
            return torch.zeros(max_bs, dtype=dtype, device=device)

        return cls(zeros(), zeros(), zeros(), zeros(torch.int32), zeros())

    def set_batch(self, size: int, seq_len_fill: int, mode: ForwardMode) -> ForwardBatch:
        """The static batch of ``size`` rows a graph is captured with; every row is padding."""
        self._pad(0, size, seq_len_fill)
        return ForwardBatch(
            mode=mode,
            input_ids=self.input_ids[:size],
            positions=self.positions[:size],
            req_pool_indices=self.req_pool_indices[:size],
            seq_lens=self.seq_lens[:size],
            out_cache_loc=self.out_cache_loc[:size],
            seq_lens_cpu=[seq_len_fill] * size,
            extend_lens_cpu=[1] * size,
        )

    def copy_from(self, batch: ForwardBatch, static: ForwardBatch, seq_len_fill: int) -> None:
        """Load ``batch`` into the rows of ``static`` (a ``set_batch`` result); pad the rest."""
        bs, size = batch.batch_size, static.batch_size
        self.input_ids[:bs].copy_(batch.input_ids, non_blocking=True)
        self.positions[:bs].copy_(batch.positions, non_blocking=True)
        self.req_pool_indices[:bs].copy_(batch.req_pool_indices, non_blocking=True)
        self.seq_lens[:bs].copy_(batch.seq_lens, non_blocking=True)
        self.out_cache_loc[:bs].copy_(batch.out_cache_loc, non_blocking=True)
        self._pad(bs, size, seq_len_fill)
        # Host copies for metadata hooks: known on the host already, so no sync.
        static.seq_lens_cpu = list(batch.seq_lens_cpu) + [seq_len_fill] * (size - bs)

    def _pad(self, start: int, end: int, seq_len_fill: int) -> None:
        # Padding rows read request slot 0 (every position -> token slot 0) and
        # write their KV into slot 0, which no live request owns.
        if start == end:
            return
        self.input_ids[start:end].zero_()
        self.positions[start:end].zero_()
        self.req_pool_indices[start:end].fill_(PADDING_SLOT)
        self.seq_lens[start:end].fill_(seq_len_fill)
        self.out_cache_loc[start:end].fill_(PADDING_SLOT)
