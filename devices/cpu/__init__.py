"""The CPU: always present, the fallback when no accelerator is found."""

from __future__ import annotations

import os
import shutil
from typing import TYPE_CHECKING

from graphrt.devices.base import Device

if TYPE_CHECKING:
    import torch

    from graphrt.core.models.ops import ModelOps


# Each model's oneDNN weight copies (``model_ops``) may take this share of the memory free
# at its first packing (its first matmul of 2 rows or more); where that is unknown,
# PACKED_FALLBACK_BYTES. Past it, a weight's matmuls stay on MKL: a model too large for a
# second copy keeps most of its memory.
PACKED_SHARE = 0.125
PACKED_FALLBACK_BYTES = 1 << 30


class CpuDevice(Device):
    """Host CPU. Runs float32 so outputs match the Hugging Face reference exactly."""

    name = "cpu"
    torch_type = "cpu"
    extra = None

    def is_available(self) -> bool:
        return True

    def ensure_ready(self) -> None:
        return None

    def synchronize(self) -> None:
        # CPU ops run synchronously; nothing is queued.
        return None

    def default_dtype(self) -> torch.dtype:
        import torch

        return torch.float32

    def default_runner(self) -> str:
        # Compiling costs more than it saves for a job of a few hundred tokens: on 2 cores
        # the embedded pair's draft and verify graphs take minutes to compile, while eager
        # decodes ~60 tokens/s (BENCHMARKS.md, issue 9). `--runner graph` still compiles.
        return "eager"

    def model_ops(self, batch_invariant: bool = False) -> ModelOps:
        """torch's ops with float32 projections of 2 rows or more (verify, batches, prefill)
        on oneDNN's prepacked weights (devices/cpu/onednn.py), each model's copies within
        PACKED_SHARE of the memory free at its first packing. No batch-invariant kernels:
        ``batch_invariant`` changes nothing (torch's own, no promise)."""
        from graphrt.core.models.ops import torch_ops_on
        from graphrt.devices.cpu.onednn import PackedWeights

        def packed_budget() -> int:
            free = self.free_memory_bytes()
            return PACKED_FALLBACK_BYTES if free is None else int(free * PACKED_SHARE)

        return torch_ops_on("torch-onednn", PackedWeights(packed_budget).linear)

    def free_memory_bytes(self) -> int | None:
        # MemAvailable: what the kernel can hand out without swapping (Linux only).
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            pass
        return None

    def describe(self) -> str:
        return f"cpu ({_usable_cores()} cores)"

    def bind_local_rank(self, local_rank: int, local_size: int) -> None:
        """Every rank of the host runs on its CPU: they share its cores (torch would give
        each rank all of them, and the ranks would thrash)."""
        import torch

        torch.set_num_threads(max(1, _usable_cores() // local_size))

    def _graph_backend_factories(self):
        # inductor's CPU code is C++: without a compiler there is no graph backend, and
        # --runner defaults to eager instead of failing at the first compiled step.
        if not any(shutil.which(cc) for cc in ("g++", "c++", "clang++")):
            return {}
        from graphrt.devices.cpu.compile import CompiledGraphBackend

        return {"compile": CompiledGraphBackend}


def _usable_cores() -> int:
    """Cores this process may run on; a container's affinity is often below `os.cpu_count()`."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
