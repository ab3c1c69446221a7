"""The engine's settings: one frozen dataclass, checked when it is made."""

from __future__ import annotations

from dataclasses import dataclass

from graphrt.core.engine.request import is_int
from graphrt.core.errors import UsageError

RUNNERS = ("graph", "eager")


@dataclass(frozen=True)
class EngineConfig:
    max_running_requests: int = 32
    # Pool and context sizes: see core/engine/kv_plan.py. None: the device's defaults (on
    # an accelerator, a share of free memory and the model's context; on the CPU, 1 GiB
    # and at most 4096 tokens).
    max_context_len: int | None = None
    kv_pool_tokens: int | None = None
    kv_cache_bytes: int | None = None
    kv_memory_fraction: float | None = None  # of free memory after the weights, (0, 1]
    max_prefill_tokens: int = 8192  # prompt tokens per prefill step
    seed: int = 0
    runner: str | None = None  # "graph" | "eager"; None: graph where the device has a backend
    graph_backend: str | None = None  # the device's graph backend (--graph-backend); None: default
    graph_buckets: tuple[int, ...] | None = None  # --graph-bs; None = the default list
    graph_padding: bool = True  # False (--no-graph-padding): exact captured sizes only
    # Capture default buckets up to this batch only (a generate of N prompts never runs more
    # than N: the CLI passes N); None: up to max_running_requests. --graph-bs lists win.
    graph_max_batch: int | None = None
    # Graphs captured after start-up (a speculative length, the sampled verify, first needed
    # by some step) are captured only while the graphs' memory stays under this; a length
    # refused is not drafted (a plain step, or the lengths captured, serve instead).
    # None: no cap (a capture that runs out of memory is dropped, as at start-up).
    max_graph_memory_bytes: int | None = None
    # Capture every graph the strategy may need at start-up (every speculative length,
    # the sampled verify), not when a step first needs it: start-up takes longer, and no
    # step stalls on a capture (a server: `graphrt serve`). Still under the memory cap.
    capture_all_graphs: bool = False
    # Freeze the objects start-up left alive out of Python's garbage collector's walks
    # (core/engine/heap.py; process-wide): full collections otherwise stall decoding.
    freeze_gc: bool = True
    # Launch each decode step (a plain step, or a speculative round on its one graph) of
    # the same requests before reading the last one's result (fed by it on the device),
    # so the host prepares a step while the device runs the one before; a request that
    # stopped meanwhile has its extra step dropped. Speculative steps hold two trees' KV
    # slots a request. None: the device's default (``Device.overlap_by_default``: on
    # for CUDA, measured there; off on the CPU, where the host is the device) for a
    # strategy that takes it (``DecodeStrategy.overlap_by_default``: plain and
    # speculative decoding).
    overlap: bool | None = None

    def __post_init__(self):
        sizes = ("max_running_requests", "max_prefill_tokens")
        optional = ("max_context_len", "kv_pool_tokens", "kv_cache_bytes", "graph_max_batch")
        optional += ("max_graph_memory_bytes",)
        for name in (*sizes, *optional, "seed"):
            value = getattr(self, name)
            if value is None and name in optional:
                continue
            if not is_int(value):
                raise UsageError(f"{name} must be an integer, got {value!r}")
            if value < 1 and name != "seed":
                raise UsageError(f"{name} must be >= 1, got {value}")
        fraction = self.kv_memory_fraction
        if fraction is not None and not (
            isinstance(fraction, (int, float)) and not isinstance(fraction, bool)
            and 0 < fraction <= 1
        ):  # fmt: skip
            raise UsageError(f"kv_memory_fraction must be in (0, 1], got {fraction!r}")
        buckets = self.graph_buckets
        if buckets is not None and not (
            isinstance(buckets, (tuple, list)) and all(map(is_int, buckets))
        ):
            raise UsageError(f"graph_buckets must be a list of integers, got {buckets!r}")
        for name in ("graph_padding", "capture_all_graphs", "overlap"):
            value = getattr(self, name)
            if not isinstance(value, bool) and not (name == "overlap" and value is None):
                raise UsageError(f"{name} must be True or False, got {value!r}")
        if self.runner not in (None, *RUNNERS):
            raise UsageError(f"runner must be one of {', '.join(RUNNERS)}, got {self.runner!r}")
