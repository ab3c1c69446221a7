"""Moving small tensors between the host and the device without stalling the device.

Host -> device: through pinned memory with ``non_blocking=True``, so the host
never waits for the copy (a plain ``torch.tensor(..., device=cuda)`` copies
synchronously). Device -> host: one pinned copy and an event to wait on,
the one place a decode step or speculative round waits for the device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence | torch.Tensor, device: torch.device, dtype=torch.int64):
    """``values`` (a host list or tensor) as a tensor on ``device``; never syncs the device."""
    host = torch.as_tensor(values, dtype=dtype)
    if device.type == "cpu":
        return host
    # Pinned, so the copy is truly asynchronous; the caching host allocator keeps
    # the pinned block alive until the copy has run.
    return host.pin_memory().to(device, non_blocking=True)


def read_host(tensor: torch.Tensor) -> list:
    """``tensor`` as nested Python lists: one pinned copy, then one wait on its event."""
    if tensor.device.type == "cpu":
        return tensor.tolist()
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    done = torch.Event(device=tensor.device)
    done.record()
    done.synchronize()
    return host.tolist()
