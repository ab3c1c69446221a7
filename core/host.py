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


class HostRead:
    """``tensor``'s values on their way to the host: a pinned copy queued behind the work
    that writes them, and an event to wait on. Start it before queueing more work (a
    step launched ahead), wait for it after: the host waits for this work alone."""

    def __init__(self, tensor: torch.Tensor):
        if tensor.device.type == "cpu":
            # Read now: the CPU has run the work, and a static buffer may be rewritten by
            # the next step before ``wait``.
            self._values, self._host, self._done = tensor.tolist(), None, None
            return
        self._values = None
        self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self._host.copy_(tensor, non_blocking=True)
        self._done = torch.Event(device=tensor.device)
        self._done.record()

    def wait(self) -> list:
        """The values as nested Python lists, once the copy has run."""
        if self._values is None:
            self._done.synchronize()
            self._values = self._host.tolist()
        return self._values


def read_host(tensor: torch.Tensor) -> list:
    """``tensor`` as nested Python lists: one pinned copy, then one wait on its event."""
    return HostRead(tensor).wait()
