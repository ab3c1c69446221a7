"""Huawei Ascend NPUs through torch_npu (graphrt[npu]).

HAZARD: torch_npu registers a `torch.backends` entry point that stock torch
auto-loads during `import torch`. On a machine with torch_npu installed but no
Ascend CANN toolkit, that makes `import torch` itself fail, for every device.
`graphrt.devices.disable_torch_backend_autoload()` sets
TORCH_DEVICE_BACKEND_AUTOLOAD=0 before torch is imported; graphrt then imports
torch_npu here, only when the NPU is probed or selected, where a failure
means "no NPU" instead of a broken interpreter.
"""

from __future__ import annotations

import importlib
import importlib.util

from graphrt.devices.base import Device, one_line


class NpuDevice(Device):
    """An Ascend NPU (e.g. 910B). torch_npu adds `torch.npu` when imported."""

    name = "npu"
    torch_type = "npu"
    extra = "npu"
    libraries = ("torch_npu",)
    collective_backend = "hccl"  # registered by torch_npu
    collective_kernels = r"hccl|allreduce|allgather"  # HCCL's; not verified on hardware

    def is_available(self) -> bool:
        if not _torch_npu_installed():
            return False
        try:
            import torch

            importlib.import_module("torch_npu")
            return torch.npu.is_available()
        except Exception:
            # A broken toolkit or driver means "no NPU here", never a crash in probing.
            return False

    def ensure_ready(self) -> None:
        if not _torch_npu_installed():
            raise self.unavailable(
                f"needs torch_npu, which is not installed: pip install 'graphrt[{self.extra}]'"
            )
        import torch

        try:
            importlib.import_module("torch_npu")
        except Exception as error:
            raise self.unavailable(
                f"found torch_npu but cannot import it ({type(error).__name__}: "
                f"{one_line(str(error))}); install the Ascend CANN toolkit and source its set_env.sh"
            ) from error
        if not torch.npu.is_available():
            raise self.unavailable(
                "is not available: torch_npu reports no Ascend NPU; "
                "check the Ascend driver and ASCEND_RT_VISIBLE_DEVICES"
            )

    def synchronize(self) -> None:
        import torch

        torch.npu.synchronize()

    def _graph_backend_factories(self):
        from graphrt.devices.npu.graph import NpuGraphBackend

        return {"full": NpuGraphBackend}

    def describe(self) -> str:
        import torch

        return torch.npu.get_device_name(torch.npu.current_device())


def _torch_npu_installed() -> bool:
    """Whether torch_npu can be found, without importing it (find_spec can raise on odd modules)."""
    try:
        return importlib.util.find_spec("torch_npu") is not None
    except (ImportError, ValueError):
        return False
