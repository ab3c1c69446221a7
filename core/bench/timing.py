"""Timing and the bandwidth floor: what a decode step cannot beat."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from graphrt.core.attention.base import AttentionSpec


def median_ms(fn: Callable[[], object], sync: Callable[[], None], steps: int, warmup: int) -> float:
    """Median wall time of ``fn`` in ms, each call synchronised before and after.

    Per-call synchronisation makes every sample one whole step as a caller
    sees it (input loading, launches, device work), not overlapped work.
    """
    for _ in range(warmup):
        fn()
    sync()
    samples = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        sync()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def copy_bandwidth_gbps(
    device: torch.device, sync: Callable[[], None], nbytes: int = 1 << 30
) -> float:
    """Device copy bandwidth (bytes read + bytes written per second), measured now."""
    # Constant contents: a plain copy's speed does not depend on them, and filling is a
    # copy's cost where random_() takes seconds on a CPU.
    src = torch.full((nbytes // 2,), 7, dtype=torch.int16, device=device)
    dst = torch.empty_like(src)
    copy = lambda: dst.copy_(src)  # noqa: E731
    # Samples by the copy's own length, not the device: a 10 ms copy or longer (a CPU's
    # GiB: 0.1 s or more) needs few, launch noise is nothing to it (20 took 5 s of a CPU
    # bench, per TP rank); a GPU's 0.5 ms copy takes 20.
    first = median_ms(copy, sync, steps=1, warmup=1)
    steps, warmup = (20, 2) if first < 10 else (4, 0)
    ms = median_ms(copy, sync, steps=steps, warmup=warmup)
    return 2 * nbytes / (ms / 1e3) / 1e9


def host_launch_us(
    device: torch.device,
    sync: Callable[[], None],
    launches: int = 1000,
    runs: int = 5,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """How fast this machine's host is now: the host time of launching one small device op,
    in us (the median of ``runs`` runs of ``launches``). Figures the host bounds (a small
    model, small batches) move with it between machines of one kind: two starts of an H200
    machine on 2026-12-04 took 22 and 6.6 us to launch one decode graph (and 629 and 260 us
    of host time for the embedded target's whole step), so such figures compare side by
    side within one run, or beside this probe."""
    x = torch.zeros(1, device=device)
    samples = []
    for _ in range(runs):
        sync()
        start = clock()
        for _ in range(launches):
            x.add_(1)
        samples.append((clock() - start) / launches * 1e6)
    sync()
    return round(statistics.median(samples), 2)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every distinct parameter (a tied head counts once)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


@dataclass(frozen=True)
class StepBytes:
    """Bytes one decode step must read from device memory, at the least."""

    weights: int  # parameters read whole: projections, norms, the LM head (once when tied)
    gathered: int  # rows gathered from embedding tables that are not the LM head
    kv: int  # cached K and V every attention layer attends over

    @property
    def total(self) -> int:
        return self.weights + self.gathered + self.kv


def step_bytes_read(model: nn.Module, seq_lens: Sequence[int], kv_dtype: torch.dtype) -> StepBytes:
    """What a decode step over requests of ``seq_lens`` (each counting its new token) reads.

    An embedding table only gathers the step's token rows, unless it is also the
    LM head (tied), which multiplies by all of it.
    """
    tokens = len(seq_lens)  # one new token per request
    head = model.lm_head_weight.data_ptr()
    tables = {
        m.weight.data_ptr()
        for m in model.modules()
        if isinstance(m, nn.Embedding) and m.weight.data_ptr() != head
    }
    seen, weights, gathered = set(), 0, 0
    for p in model.parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        if p.data_ptr() in tables:
            rows = min(tokens, p.shape[0])
            gathered += rows * p[0].numel() * p.element_size()
        else:
            weights += p.numel() * p.element_size()
    return StepBytes(weights, gathered, kv_bytes_read(model, seq_lens, kv_dtype))


def kv_bytes_read(model: nn.Module, seq_lens: Sequence[int], kv_dtype: torch.dtype) -> int:
    """K and V bytes the attention layers read for one decode token per request.

    Every attention layer counts, KV-sharing ones too (they read another layer's
    cache). A sliding layer sees the last ``window`` positions, its own included
    (key j is visible to query p iff j > p - window), so min(seq_len, window).
    """
    total = 0
    for spec in attention_specs(model):
        window = spec.sliding_window
        tokens = sum(s if window is None else min(s, window) for s in seq_lens)
        total += tokens * spec.num_kv_heads * spec.head_dim * 2 * kv_dtype.itemsize
    return total


def attention_specs(model: nn.Module) -> Iterator[AttentionSpec]:
    """The ``AttentionSpec`` of every attention layer of ``model``, in module order."""
    for module in model.modules():
        spec = getattr(module, "spec", None)
        if isinstance(spec, AttentionSpec):
            yield spec


def floor_ms(bytes_read: int, bandwidth_gbps: float) -> float:
    """The least time a step reading ``bytes_read`` can take at the measured bandwidth."""
    return bytes_read / (bandwidth_gbps * 1e9) * 1e3


def achieved_gbps(bytes_read: int, ms: float | None) -> float | None:
    """The bandwidth a step of ``ms`` reading ``bytes_read`` achieved (None when untimed)."""
    return None if not ms else bytes_read / (ms / 1e3) / 1e9
