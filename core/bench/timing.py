"""Timing and the bandwidth floor: what a decode step cannot beat."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from torch import nn


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
    src = torch.empty(nbytes // 2, dtype=torch.int16, device=device).random_()
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), sync, steps=20, warmup=3)
    return 2 * nbytes / (ms / 1e3) / 1e9


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every distinct parameter (a tied head counts once)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def floor_ms(weights: int, kv_bytes_read: int, bandwidth_gbps: float) -> float:
    """A decode step reads every weight and every cached K/V once: that over bandwidth."""
    return (weights + kv_bytes_read) / (bandwidth_gbps * 1e9) * 1e3
