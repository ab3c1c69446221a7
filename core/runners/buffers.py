"""Static input buffers a graph reads, sized for the largest bucket.

Two verbs: ``set_batch`` builds the static ``ForwardBatch`` a graph is
captured with; ``copy_from`` loads a live batch into those same tensors for
replay (real rows first, then padding rows). No allocation on replay.

Rows are requests of ``width`` tokens each (1 for decode and the draft loop,
the verify tree's node count for TARGET_VERIFY), plus the per-request tensors
of ``spec_info`` a graph reads (seed hiddens, tree masks).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from graphrt.core.batch import ForwardBatch, ForwardMode
from graphrt.core.memory import PADDING_SLOT

assert PADDING_SLOT == 0, "GraphInputBuffers._pad zeroes the packed rows, slots included"


@dataclass(frozen=True)
class StaticField:
    """One per-request tensor of a batch's ``spec_info`` that graphs read."""

    name: str  # the spec_info attribute
    shape: tuple[int, ...]  # per request
    dtype: torch.dtype
    pad: float = 0  # what padding rows hold (a tree mask pads True: padding nodes see a key)


@dataclass(frozen=True)
class GraphShape:
    """What one runner's graphs take: the forward mode, tokens per request, per-round inputs."""

    mode: ForwardMode = ForwardMode.DECODE
    width: int = 1  # tokens per request row
    # A type (or factory) built from ``fields`` by keyword, one slice per field.
    spec_info: Callable[..., Any] | None = None
    fields: tuple[StaticField, ...] = ()
    variant: str | None = None  # tells apart graphs of one shape that compute different things
    long_rows: bool = False  # its batches are flagged ForwardBatch.long_rows


class GraphInputBuffers:
    def __init__(self, shape: GraphShape, max_bs: int, device: torch.device):
        self.shape = shape
        tokens = max_bs * shape.width

        def zeros(n: int, dtype=torch.int64):
            return torch.zeros(n, dtype=dtype, device=device)

        # One token a request: the four int64 inputs are rows of one block, in the order
        # of ForwardBatch.packed_rows, so a decode step loads (and pads) them at once.
        self.rows = zeros(4 * max_bs).view(4, max_bs) if shape.width == 1 else None
        # Wider rows (a verify tree's nodes): the three per-token inputs are rows of one
        # block, (3, max_bs, width), in the order of ForwardBatch.packed_nodes, so a round
        # loads (and pads) them at once: each a request-major (max_bs * width,) view.
        self.nodes = None if self.rows is not None else zeros(3 * tokens).view(3, max_bs, -1)
        if self.rows is not None:
            self.out_cache_loc, self.req_pool_indices, self.positions, self.input_ids = self.rows
        else:
            self.input_ids, self.positions, self.out_cache_loc = self.nodes.flatten(1)
            self.req_pool_indices = zeros(max_bs)  # (max_bs,)
        self.seq_lens = zeros(max_bs, torch.int32)
        self.spec = {
            f.name: torch.full((max_bs, *f.shape), f.pad, dtype=f.dtype, device=device)
            for f in shape.fields
        }

    def set_batch(self, size: int, seq_len_fill: int) -> ForwardBatch:
        """The static batch of ``size`` rows a graph is captured with; every row is padding."""
        self._pad(0, size, seq_len_fill)
        tokens, width = size * self.shape.width, self.shape.width
        spec_info = None
        if self.shape.spec_info is not None:
            spec_info = self.shape.spec_info(**{n: b[:size] for n, b in self.spec.items()})
        return ForwardBatch(
            mode=self.shape.mode,
            input_ids=self.input_ids[:tokens],
            positions=self.positions[:tokens],
            req_pool_indices=self.req_pool_indices[:size],
            seq_lens=self.seq_lens[:size],
            out_cache_loc=self.out_cache_loc[:tokens],
            seq_lens_cpu=[self._pad_len(seq_len_fill)] * size,
            extend_lens_cpu=[width] * size,
            spec_info=spec_info,
            long_rows=self.shape.long_rows,
        )

    def copy_from(self, batch: ForwardBatch, static: ForwardBatch, seq_len_fill: int) -> None:
        """Load ``batch`` into the rows of ``static`` (a ``set_batch`` result); pad the rest."""
        bs, size = batch.batch_size, static.batch_size
        tokens = bs * self.shape.width
        if self.rows is not None and batch.packed_rows is not None:
            self.rows[:, :bs].copy_(batch.packed_rows, non_blocking=True)  # request slots too
        else:
            if self.nodes is not None and batch.packed_nodes is not None:
                self.nodes[:, :bs].copy_(batch.packed_nodes, non_blocking=True)
            else:
                self.input_ids[:tokens].copy_(batch.input_ids, non_blocking=True)
                self.positions[:tokens].copy_(batch.positions, non_blocking=True)
                self.out_cache_loc[:tokens].copy_(batch.out_cache_loc, non_blocking=True)
            self.req_pool_indices[:bs].copy_(batch.req_pool_indices, non_blocking=True)
        self.seq_lens[:bs].copy_(batch.seq_lens, non_blocking=True)
        for name, buf in self.spec.items():
            buf[:bs].copy_(getattr(batch.spec_info, name), non_blocking=True)
        self._pad(bs, size, seq_len_fill)
        # Host copies for metadata hooks: known on the host already, so no sync.
        pad_len = self._pad_len(seq_len_fill)
        static.seq_lens_cpu = list(batch.seq_lens_cpu) + [pad_len] * (size - bs)

    def _pad_len(self, seq_len_fill: int) -> int:
        # A padding row's tokens sit at the end of a sequence of this length: its
        # prefix is seq_len_fill - 1 cached tokens, as a decode padding row's.
        return seq_len_fill + self.shape.width - 1

    def _pad(self, start: int, end: int, seq_len_fill: int) -> None:
        # Padding rows read request slot 0 (every position -> token slot 0) and
        # write their KV into slot 0, which no live request owns.
        if start == end:
            return
        if self.rows is not None:
            # Token 0 at position 0, writing and reading slot 0 (PADDING_SLOT, asserted
            # 0 at import): the four rows in one fill.
            self.rows[:, start:end].zero_()
        else:
            self.nodes[:, start:end].zero_()  # (the same, a node's three rows in one fill)
            self.req_pool_indices[start:end].fill_(PADDING_SLOT)
        self.seq_lens[start:end].fill_(self._pad_len(seq_len_fill))
        for field in self.shape.fields:
            self.spec[field.name][start:end].fill_(field.pad)
