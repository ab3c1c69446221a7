"""NVIDIA GPUs through stock torch.cuda; Triton (graphrt[cuda]) adds fast kernels."""

from __future__ import annotations

from graphrt.devices.base import Device


class CudaDevice(Device):
    """An NVIDIA GPU. Triton is optional here: the torch attention backend runs without it."""

    name = "cuda"
    torch_type = "cuda"
    extra = "cuda"
    libraries = ("triton",)
    collective_backend = "nccl"
    # ncclDevKernel_AllReduce_Sum_bf16_RING_LL; torch's symmetric-memory one-shot kernels.
    collective_kernels = r"nccl|one_shot_all_reduce|two_shot_all_reduce"
    # Of the memory free once the weights are loaded: the rest (15%) holds activations,
    # the graphs' intermediates, cuBLAS and Triton workspaces and the allocator's slack.
    kv_memory_fraction = 0.85
    # Steps launched ahead of the read (H200, BENCHMARKS.md "Stop 51"): random:llama-1b
    # 1.23x / 1.34x tokens/s at 1 / 8 prompts, the embedded pair's plain steps 1.29x
    # (stop 50: 1.32x / 1.24x, 2.10x). For plain decoding only: see MTPDecoding.
    overlap_by_default = True

    def is_available(self) -> bool:
        try:
            import torch

            return torch.cuda.is_available()
        except Exception:
            return False

    def ensure_ready(self) -> None:
        import torch

        if torch.cuda.is_available():
            return
        if torch.version.cuda is None:
            why, fix = "built without CUDA", "install a CUDA build of torch"
        else:
            why, fix = (
                f"CUDA {torch.version.cuda}",
                "check the NVIDIA driver and CUDA_VISIBLE_DEVICES",
            )
        raise self.unavailable(
            f"is not available: torch reports no CUDA device (torch {torch.__version__}, {why}): {fix}"
        )

    def synchronize(self) -> None:
        import torch

        torch.cuda.synchronize()

    def free_memory_bytes(self) -> int | None:
        import torch

        return torch.cuda.mem_get_info()[0]

    def check_environment(self) -> None:
        from graphrt.devices.cuda import collectives

        collectives.choice()  # GRAPHRT_ALL_REDUCE

    def startup_notice(self) -> str | None:
        """On a machine's first run Triton's cache is empty: every kernel compiles (28 s of
        the README's first command's set-up on a bare H200, 2 s once cached)."""
        import os
        from pathlib import Path

        try:
            import triton
        except ImportError:  # no Triton: torch's kernels, nothing to compile
            return None
        knobs = getattr(triton, "knobs", None)  # triton >= 3.4; older: runtime.cache's default
        if knobs is not None:
            default = knobs.cache.dir
        else:
            from triton.runtime.cache import default_cache_dir

            default = default_cache_dir()
        cache = Path(os.environ.get("TRITON_CACHE_DIR") or default)
        if cache.is_dir() and any(cache.iterdir()):
            return None
        return (
            f"compiling GPU kernels: Triton's cache ({cache}) is empty, so this first start "
            "takes longer (the embedded pair: 12 s on an H100 with GEMV choices shipped for "
            "its shapes, 26 s with 30 of them missing; more for larger models); later starts "
            "reuse it"
        )

    def model_ops(self, batch_invariant: bool = False):
        """Fused Triton kernels when triton is installed (graphrt[cuda]), else torch's;
        ``batch_invariant``: the tiles-only matmuls (ops.INVARIANT_OPS)."""
        try:
            from graphrt.devices.cuda.ops import INVARIANT_OPS, TRITON_OPS
        except ImportError:
            return super().model_ops()
        return INVARIANT_OPS if batch_invariant else TRITON_OPS

    def _graph_backend_factories(self):
        from graphrt.devices.cuda.graph import CudaBreakableGraphBackend, CudaFullGraphBackend

        return {"full": CudaFullGraphBackend, "breakable": CudaBreakableGraphBackend}

    def create_attention_backend(self, kv_pool, req_to_token_pool):
        """Triton's paged decode kernel when triton is installed, else the torch reference."""
        try:
            import triton  # noqa: F401  (graphrt[cuda]; imported only once CUDA is chosen)
        except ImportError:
            return super().create_attention_backend(kv_pool, req_to_token_pool)
        from graphrt.devices.cuda.attention import TritonAttentionBackend

        return TritonAttentionBackend(kv_pool, req_to_token_pool)

    def small_all_reduce(self, tp):
        """torch's symmetric-memory one-shot all-reduce where every rank is on this host
        (``GRAPHRT_ALL_REDUCE``: devices/cuda/collectives.py)."""
        from graphrt.devices.cuda.collectives import small_all_reduce

        return small_all_reduce(tp.group, self.torch_device())

    def describe(self) -> str:
        import torch

        return torch.cuda.get_device_name(torch.cuda.current_device())

    def library_versions(self) -> dict[str, str]:
        import torch

        versions = super().library_versions()
        if torch.version.cuda is not None:
            versions["cuda"] = torch.version.cuda
        return versions
