"""GraphRunner: the device-neutral graph runner, for every forward shape.

It owns the buckets, the static input buffers, the static outputs and the
one capture loop; the ``ExecutionBackend`` only captures and replays. What
differs between plain decode, target verify and the speculative draft loop
is configuration: a ``GraphShape`` (mode, tokens per request, per-round
inputs) and, for the draft loop, the function a graph computes from its
static batch (``forward``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from graphrt.core.attention.base import AttentionBackend
from graphrt.core.batch import ForwardBatch
from graphrt.core.errors import GraphrtError, UsageError
from graphrt.core.runners.backend import ExecutionBackend, ShapeKey
from graphrt.core.runners.base import BaseRunner, RunnerOutput, forward_model
from graphrt.core.runners.buckets import pad_to_bucket, select_buckets
from graphrt.core.runners.buffers import GraphInputBuffers, GraphShape

DECODE_SHAPE = GraphShape()  # plain decode: one token per request, no per-round inputs
# Plain decode of batches with a long row (AttentionBackend.long_row_keys): graphs of their own.
LONG_DECODE_SHAPE = GraphShape(variant="long-rows", long_rows=True)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GraphRunnerConfig:
    max_bs: int  # largest batch a graph may serve (max running requests, KV pool)
    buckets: tuple[int, ...] | None = None  # --graph-bs; None = the default list
    padding: bool = True  # False (--no-graph-padding): only exact captured sizes run graphs


class GraphRunner(BaseRunner):
    def __init__(
        self,
        model: nn.Module,
        attn_backend: AttentionBackend,
        backend: ExecutionBackend,
        config: GraphRunnerConfig,
        device: torch.device,
        shape: GraphShape = DECODE_SHAPE,
        forward: Callable[[ForwardBatch], Any] | None = None,
        after_forward: Callable[[ForwardBatch, RunnerOutput], None] | None = None,
    ):
        super().__init__(model, attn_backend)
        self.backend = backend
        self.config = config
        self.shape = shape
        # What a graph computes from its static batch: one model forward by default. (Not
        # a bound method stored on self: that would be a reference cycle, and a dropped
        # runner's graphs would wait for the cycle collector.)
        self._own_forward = forward
        # Work on the default forward's output captured in the same graph (a drafter's plain
        # steps write their seeds): device ops only, outputs unchanged.
        self._after_forward = after_forward
        # Device graphs of every bucket write their logits into slices of this one buffer
        # (allocated at capture, so graph memory counts it): only one graph replays at a
        # time, and per-bucket logits were most of the graphs' memory (20 llama-1b buckets:
        # 1,555 rows x 128,256 float32 logits, 761 MiB).
        self._shared_logits: torch.Tensor | None = None
        self.buckets = select_buckets(config.max_bs, config.buckets)
        if not self.buckets:
            raise UsageError(f"no graph batch size <= {config.max_bs} in {list(config.buckets)}")
        self.buffers = GraphInputBuffers(shape, self.buckets[-1], device)
        self.attn_backend.init_graph_state(self.buckets[-1], self.buckets[-1] * shape.width)
        # Per key: the static batch a graph reads and the outputs its replays write.
        self._captured: dict[ShapeKey, tuple[ForwardBatch, Any]] = {}
        self._loaded: tuple[ShapeKey, ForwardBatch] | None = None
        self.capture_time_s = 0.0
        self.dropped_buckets: dict[int, str] = {}  # size -> why its capture failed
        self.compiled_ahead = False  # dry_runs() handed out (the engine compiles ahead once)

    # ---- keys and padding (the one place each is decided) ------------------------

    def _make_graph_key(self, size: int) -> ShapeKey:
        s = self.shape
        return ShapeKey(size=size, mode=s.mode, width=s.width, variant=s.variant)

    def _pad_to_bucket(self, n: int) -> int | None:
        return pad_to_bucket(n, self.buckets, self.config.padding)

    @property
    def captured_sizes(self) -> list[int]:
        return sorted(key.size for key in self._captured)

    def replays_per_size(self) -> dict[int, int]:
        """How many times each of this runner's graphs replayed, by batch size."""
        own = self._make_graph_key
        return {k.size: n for k, n in self.backend.replays.items() if k == own(k.size)}

    # ---- capture -----------------------------------------------------------------

    def _allocate_shared_logits(self, size: int) -> None:
        """The logits buffer of the default forward on device graphs, for ``size``
        requests (the largest bucket captured); none for compiled code (fresh outputs
        every call) or a forward of its own (the draft loop)."""
        if self._shared_logits is not None or not self.backend.replays_into_static_outputs:
            return
        if self._own_forward is not None:
            return
        rows = size * self.shape.width
        self._shared_logits = torch.empty(
            (rows, self.model.vocab_size), dtype=torch.float32, device=self.buffers.input_ids.device
        )

    def dry_runs(self) -> Iterator[Callable[[], Any]]:
        """Every bucket's forward as its capture warms it up, largest first, for the
        backend's ``compile_ahead`` (a device that compiles kernels at their first launch
        compiles them all at once). Each is set up as it is handed out; what it computes
        is thrown away, and capture sets every buffer up again."""
        self.compiled_ahead = True
        for size in reversed(self.buckets):
            yield self._graph_function(self._capture_batch(size))

    def _capture_batch(self, size: int) -> ForwardBatch:
        """The static batch of bucket ``size``, its attention metadata set for capture."""
        batch = self.buffers.set_batch(size, self.attn_backend.seq_len_fill_value())
        self.attn_backend.init_metadata_for_capture(batch)
        return batch

    def _graph_function(self, batch: ForwardBatch) -> Callable[[], Any]:
        """What the graph of static ``batch`` computes, as a closure that holds no
        reference to this runner: a backend may keep it (compiled code does), and a
        runner <-> backend cycle would keep a dropped engine's graphs alive until the
        cycle collector ran, which may be in the middle of another capture."""
        if self._own_forward is not None:
            own = self._own_forward
            return lambda: own(batch)
        model, attn = self.model, self.attn_backend
        # Graph batches: every token's logits, into the shared buffer (None for compiled
        # code, which returns fresh outputs from every call).
        shared = self._shared_logits
        logits = None if shared is None else shared[: batch.num_tokens]
        after = self._after_forward
        if after is None:
            return lambda: forward_model(model, attn, batch, logits)

        def forward_then() -> RunnerOutput:
            out = forward_model(model, attn, batch, logits)
            after(batch, out)
            return out

        return forward_then

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first (smaller graphs then reuse the pool memory
        it reserved). A bucket whose capture fails (out of memory, an op the device cannot
        capture) is dropped with one warning: its sizes run on the next bucket up, or
        eagerly where none is left (the same tokens on width-invariant kernels or in
        float32; elsewhere a wider padded batch may round a row otherwise). HAZARD: a bug
        in the captured forward degrades the same way, to a warning and eager steps; tests
        that mean to run graphs assert that they did (stats.graph_steps, captured_sizes)."""
        taken = [s for s in self.buckets if self.backend.can_run(self._make_graph_key(s))]
        if taken:  # outside the loop's try: dropping the bucket would forget the other graph
            raise GraphrtError(
                f"{self._make_graph_key(taken[0])} is captured already on this backend: two "
                "runners of one GraphShape (or a capture without cleanup) would replace it"
            )
        start = time.perf_counter()
        with self.backend.capture_session():  # inside: the graph memory it reports counts this
            for size in reversed(self.buckets):
                try:
                    self._allocate_shared_logits(size)
                    self.capture_one_shape(size)
                except Exception as e:  # noqa: BLE001 (any failure: serve that size otherwise)
                    self._drop_bucket(size, e)
        self.capture_time_s = time.perf_counter() - start

    def _drop_bucket(self, size: int, error: Exception) -> None:
        why = f"{type(error).__name__}: {error}".splitlines()[0]
        self.buckets = tuple(b for b in self.buckets if b != size)
        self.dropped_buckets[size] = why
        self._captured.pop(self._make_graph_key(size), None)
        self.backend.forget(self._make_graph_key(size))
        if not self._captured:  # sized for this bucket: the next one allocates its own
            self._shared_logits = None
        up = self._pad_to_bucket(size)
        log.warning(
            "capturing the %s graph for batch size %d failed (%s); %s",
            self.shape.mode.name.lower(),
            size,
            why,
            f"those sizes run on the {up} bucket" if up else "those sizes run eagerly",
        )

    def capture_one_shape(self, size: int) -> None:
        key = self._make_graph_key(size)
        batch = self._capture_batch(size)

        def init_metadata() -> None:
            self.attn_backend.init_metadata_for_capture(batch)

        # The hook re-arms metadata the warm-up runs may have advanced.
        outputs = self.backend.capture_one(
            key, self._graph_function(batch), post_warmup_hook=init_metadata
        )
        self._captured[key] = (batch, outputs)

    def cleanup(self) -> None:
        self.backend.cleanup()
        self._captured.clear()
        self._loaded = None
        self._shared_logits = None

    # ---- the runner contract -----------------------------------------------------

    def can_run_graph(self, batch: ForwardBatch) -> bool:
        if batch.mode is not self.shape.mode:
            return False
        if batch.num_tokens != batch.batch_size * self.shape.width:
            return False
        return self.serves(batch.batch_size)

    def serves(self, batch_size: int) -> bool:
        """Does a captured graph serve ``batch_size`` requests of this runner's shape? (What
        ``can_run_graph`` asks of a batch's size: a caller may ask before building one.)"""
        size = self._pad_to_bucket(batch_size)
        return size is not None and self.backend.can_run(self._make_graph_key(size))

    def load_batch(self, batch: ForwardBatch) -> None:
        key = self._make_graph_key(self._pad_to_bucket(batch.batch_size))
        static, _ = self._captured[key]
        self.buffers.copy_from(batch, static, self.attn_backend.seq_len_fill_value())
        self.attn_backend.init_metadata_for_replay(static)
        self._loaded = (key, static)

    @torch.inference_mode()
    def execute(self, batch: ForwardBatch, clone: bool = True) -> Any:
        self.load_batch(batch)
        key, static = self._loaded
        self.backend.update_inputs(key, seq_lens_cpu=static.seq_lens_cpu)
        with self.backend.replay_session():
            fresh = self.backend.replay(key)
        outputs = self._captured[key][1] if fresh is None else fresh
        return real_rows(outputs, static.batch_size, batch.batch_size, clone)


def real_rows(outputs: Any, size: int, bs: int, clone: bool = True) -> Any:
    """The rows of the ``bs`` real requests in the outputs of a ``size``-request graph.

    Every output's leading dimension is a whole number of rows per request.
    Cloned, not sliced views, by default: replay outputs live in graph memory that the
    next replay overwrites (upstream returned views and served garbage). ``clone=False``
    returns the views, for a caller done with them before the next replay (a plain
    decode step samples its logits at once; the two clones took 50 us of a 630 us step
    on one H200 host start, 4 us on a faster one).
    """

    def take(t: torch.Tensor) -> torch.Tensor:
        rows = t[: t.shape[0] // size * bs]
        return rows.clone() if clone else rows

    if isinstance(outputs, RunnerOutput):
        return RunnerOutput(logits=take(outputs.logits), hidden=take(outputs.hidden))
    return tuple(take(t) for t in outputs)
