"""Intel GPUs through stock torch.xpu.

NOTE: never intel_extension_for_pytorch: torch.xpu in stock torch is the
supported path, and IPEX patches torch globally when imported.
"""

from __future__ import annotations

from graphrt.devices.base import Device


class XpuDevice(Device):
    """An Intel GPU (Data Center GPU Max, Arc) via torch's built-in XPU backend."""

    name = "xpu"
    torch_type = "xpu"
    extra = "xpu"
    libraries = ("pytorch-triton-xpu",)
    collective_backend = "xccl"  # torch >= 2.8 builds it in for XPU
    collective_kernels = r"ccl|allreduce|allgather"  # oneCCL's; not verified on hardware
    # XPUGraph (torch 2.11) recording XCCL is new (torch-xpu-ops#2992: oneCCL >= 2021.17.2)
    # and has an open report of a replayed all-reduce making later ones return NaN
    # (pytorch#189403): tensor parallelism on XPU runs eagerly until that is settled.
    graphs_capture_collectives = False

    def is_available(self) -> bool:
        try:
            import torch

            return hasattr(torch, "xpu") and torch.xpu.is_available()
        except Exception:
            return False

    def ensure_ready(self) -> None:
        import torch

        if not hasattr(torch, "xpu"):
            raise self.unavailable(
                f"needs torch.xpu, which torch {torch.__version__} lacks: "
                "install torch 2.5 or newer built for XPU"
            )
        if not torch.xpu.is_available():
            raise self.unavailable(
                f"is not available: torch reports no Intel GPU (torch {torch.__version__}); "
                "install an XPU build of torch and the Intel GPU driver"
            )

    def synchronize(self) -> None:
        import torch

        torch.xpu.synchronize()

    def _graph_backend_factories(self):
        from graphrt.devices.xpu.graph import XpuGraphBackend

        return {"full": XpuGraphBackend}

    def describe(self) -> str:
        import torch

        return torch.xpu.get_device_name(torch.xpu.current_device())
