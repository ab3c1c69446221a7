"""GraphRunner: the device-neutral decode graph runner (upstream DecodeCudaGraphRunner).

It owns the buckets, the static input buffers and the one capture loop;
the ``ExecutionBackend`` only captures and replays. Subclasses (the MTP
draft runner) override hooks — ``_make_graph_key``, ``_forward``,
``_static_batch``, ``_slice_output`` — never the loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from graphrt.core.attention.base import AttentionBackend
from graphrt.core.batch import ForwardBatch, ForwardMode
from graphrt.core.errors import GraphrtError
from graphrt.core.runners.backend import ExecutionBackend, ShapeKey
from graphrt.core.runners.base import BaseRunner, RunnerOutput
from graphrt.core.runners.buckets import pad_to_bucket, select_buckets
from graphrt.core.runners.buffers import GraphInputBuffers


@dataclass(frozen=True)
class GraphRunnerConfig:
    max_bs: int  # largest batch a graph may serve (max running requests, KV pool)
    buckets: tuple[int, ...] | None = None  # --graph-bs; None = the default list
    padding: bool = True  # False (--no-graph-padding): only exact captured sizes run graphs


class GraphRunner(BaseRunner):
    mode = ForwardMode.DECODE  # the batches this runner's graphs serve

    def __init__(
        self,
        model: nn.Module,
        attn_backend: AttentionBackend,
        backend: ExecutionBackend,
        config: GraphRunnerConfig,
        device: torch.device,
    ):
        super().__init__(model, attn_backend)
        self.backend = backend
        self.config = config
        self.buckets = select_buckets(config.max_bs, config.buckets)
        if not self.buckets:
            raise GraphrtError(f"no graph batch size <= {config.max_bs} in {list(config.buckets)}")
        self.buffers = GraphInputBuffers.allocate(self.buckets[-1], device)
        self.attn_backend.init_graph_state(self.buckets[-1], self.buckets[-1])
        self._static_batches: dict[ShapeKey, ForwardBatch] = {}
        self._loaded: tuple[ShapeKey, ForwardBatch] | None = None
        self.capture_time_s = 0.0

    # ---- keys and padding (the one place each is decided) ------------------------

    def _make_graph_key(
        self, size: int, stream_idx: int | None = None, variant: str | None = None
    ) -> ShapeKey:
        return ShapeKey(size=size, stream_idx=stream_idx, variant=variant)

    def _pad_to_bucket(self, n: int) -> int | None:
        return pad_to_bucket(n, self.buckets, self.config.padding)

    @property
    def captured_sizes(self) -> list[int]:
        return sorted(key.size for key in self.backend.keys())

    # ---- capture -----------------------------------------------------------------

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        with self.backend.capture_session():
            # Largest first: smaller graphs then reuse the pool memory it reserved.
            for size in reversed(self.buckets):
                self.capture_one_shape(size, self._forward)
        self.capture_time_s = time.perf_counter() - start

    def capture_one_shape(
        self,
        size: int,
        forward: Callable[[ForwardBatch], RunnerOutput],
        stream_idx: int | None = None,
        variant: str | None = None,
    ) -> None:
        key = self._make_graph_key(size, stream_idx, variant)
        batch = self._static_batch(size)
        self._static_batches[key] = batch

        def init_metadata() -> None:
            self.attn_backend.init_metadata_for_capture(batch)

        init_metadata()
        # The hook re-arms metadata the warm-up runs may have advanced.
        self.backend.capture_one(key, lambda: forward(batch), post_warmup_hook=init_metadata)

    def _static_batch(self, size: int) -> ForwardBatch:
        return self.buffers.set_batch(size, self.attn_backend.seq_len_fill_value(), self.mode)

    def cleanup(self) -> None:
        self.backend.cleanup()
        self._static_batches.clear()
        self._loaded = None

    # ---- the runner contract -----------------------------------------------------

    def can_run_graph(self, batch: ForwardBatch) -> bool:
        if batch.mode is not self.mode:
            return False
        size = self._pad_to_bucket(batch.batch_size)
        return size is not None and self.backend.can_run(batch, self._make_graph_key(size))

    def load_batch(self, batch: ForwardBatch) -> None:
        key = self._make_graph_key(self._pad_to_bucket(batch.batch_size))
        static = self._static_batches[key]
        self.buffers.copy_from(batch, static, self.attn_backend.seq_len_fill_value())
        self.attn_backend.init_metadata_for_replay(static)
        self._loaded = (key, static)

    @torch.inference_mode()
    def execute(self, batch: ForwardBatch) -> RunnerOutput:
        self.load_batch(batch)
        key, static = self._loaded
        return self._slice_output(self._replay_graph(key, static), batch.batch_size)

    def _slice_output(self, out: RunnerOutput, bs: int) -> RunnerOutput:
        # Cloned, not sliced views: replay outputs live in graph memory that the
        # next replay overwrites (upstream returned views and served garbage).
        return RunnerOutput(logits=out.logits[:bs].clone(), hidden=out.hidden[:bs].clone())

    def _replay_graph(self, key: ShapeKey, static: ForwardBatch) -> RunnerOutput:
        self.backend.update_inputs(key, seq_lens_cpu=static.seq_lens_cpu)
        with self.backend.replay_session():
            return self.backend.replay(key, static)
