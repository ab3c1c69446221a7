"""The device kernels of one call, as torch.profiler records them."""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Callable

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity


def kernel_activity(device: torch.device) -> ProfilerActivity | None:
    """The profiler activity that records ``device``'s kernels (CUDA's, XPU's), or None
    where the profiler records none: the CPU runs operators, not kernels."""
    activity = getattr(ProfilerActivity, device.type.upper(), None)
    if activity in (None, ProfilerActivity.CPU):
        return None
    return activity if activity in torch.profiler.supported_activities() else None


def _profiled(fn: Callable[[], object], sync: Callable[[], None], device: torch.device):
    """The profiler after one run of ``fn`` recording ``device``'s kernels; None where it
    records none."""
    activity = kernel_activity(device)
    if activity is None:
        return None
    sync()  # nothing queued before fn lands in the trace
    with torch.profiler.profile(activities=[activity]) as prof:
        fn()
        sync()
    return prof


def device_events(fn: Callable[[], object], sync: Callable[[], None], device: torch.device):
    """Run ``fn`` once under the profiler: its device events (kernels and copies) averaged
    by name, each with a ``count``; None where the profiler records no kernels."""
    prof = _profiled(fn, sync, device)
    if prof is None:
        return None
    return [e for e in prof.key_averages() if e.device_type != DeviceType.CPU]


def device_trace(fn: Callable[[], object], sync: Callable[[], None], device: torch.device):
    """Run ``fn`` once under the profiler: its device events one by one (kernels, copies,
    memsets) in time order, as the exported trace records them, each kernel with its grid
    and block (``key_averages`` keeps neither order nor grids); None where the profiler
    records no kernels."""
    prof = _profiled(fn, sync, device)
    if prof is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    on_device = ("kernel", "gpu_memcpy", "gpu_memset")
    return sorted((e for e in events if e.get("cat") in on_device), key=lambda e: e["ts"])


def count_kernels(
    fn: Callable[[], object], sync: Callable[[], None], device: torch.device
) -> int | None:
    """Device kernels (and copies) one call of ``fn`` launches; None where none are seen."""
    count = sum(e.count for e in device_events(fn, sync, device) or ())
    return count or None  # 0: the profiler saw no kernels of this device


def _events_of_calls(fn, sync, device, calls: int):
    """``device_events`` of ``calls`` back-to-back calls of ``fn``."""

    def repeated() -> None:
        for _ in range(calls):
            fn()

    return device_events(repeated, sync, device)


def device_ms(
    fn: Callable[[], object], sync: Callable[[], None], device: torch.device, calls: int = 20
) -> float | None:
    """Device time of every kernel of one call of ``fn`` (mean of ``calls``); None where
    the profiler records no kernels (CPU)."""
    events = _events_of_calls(fn, sync, device, calls)
    if events is None:
        return None
    return sum(e.device_time_total for e in events) / 1000 / calls


def collective_ms(
    fn: Callable[[], object],
    sync: Callable[[], None],
    device: torch.device,
    kernel_names: str | None,
    calls: int = 10,
) -> float | None:
    """Device time of the collective kernels in one call of ``fn`` (mean of ``calls``):
    under tensor parallelism, what a step spends in all-reduces and gathers, waits for
    the slower rank included. ``kernel_names``: the device's regex for its collective
    library's kernels (``Device.collective_kernels``). None where the profiler records
    no kernels (CPU) or the device names none.
    HAZARD: on a tensor-parallel job every rank must call this alike (SPMD)."""
    if kernel_names is None:
        return None
    events = _events_of_calls(fn, sync, device, calls)
    if events is None:
        return None
    pattern = re.compile(kernel_names, re.IGNORECASE)
    us = sum(e.device_time_total for e in events if pattern.search(e.key))
    return us / 1000 / calls
