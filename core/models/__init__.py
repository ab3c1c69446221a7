"""Models: Hugging Face checkpoints (config.json + safetensors) and random presets."""

from __future__ import annotations

import os

import torch

from graphrt import devices
from graphrt.core.errors import UsageError
from graphrt.core.models.loader import LoadedModel, load_checkpoint
from graphrt.core.models.ops import TORCH_OPS, ModelOps
from graphrt.core.models.presets import PRESETS, load_random
from graphrt.core.parallel.group import SINGLE, TPGroup
from graphrt.devices.base import Device

RANDOM_PREFIX = "random:"


def load_model(
    name: str,
    device: Device | torch.device | None = None,
    dtype: torch.dtype | None = None,
    seed: int = 0,
    ops: ModelOps | None = None,
    check_finite: bool | None = None,
    tp: TPGroup = SINGLE,
    batch_invariant: bool = False,
) -> LoadedModel:
    """``name`` is a checkpoint directory or ``random:<preset>``.

    ``tp``: the tensor-parallel group; this process loads its rank's shard.
    ``check_finite``: refuse a checkpoint whose weights hold NaN or Inf (costs 10-25% of
    the load time); None: the GRAPHRT_CHECK_FINITE environment variable decides (off).

    ``device``: a graphrt ``Device`` (None: ``devices.current()``) gives the model its
    fused kernels (``Device.model_ops()``) and, with dtype None, the device's float32
    preference (the CPU) over the checkpoint's dtype. A plain ``torch.device`` loads
    with the torch reference ops unless ``ops`` is given; dtype None = the checkpoint's.
    ``batch_invariant``: the device's ops whose every row's result is independent of the
    rows beside it (``Device.model_ops``), for speculative output equal to plain in 16-bit.
    """
    if not isinstance(name, (str, os.PathLike)):
        raise UsageError(
            f"load_model: name must be a checkpoint directory or 'random:<preset>', got {name!r}"
        )
    name = os.fspath(name)
    if device is not None and not isinstance(device, (Device, torch.device)):
        raise UsageError(
            f"load_model: device must be a graphrt Device or a torch.device, got {device!r}"
        )
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise UsageError(f"load_model: dtype must be a torch.dtype, got {dtype!r}")
    free_bytes = None  # a plain torch.device: nothing to ask
    if device is None or isinstance(device, Device):
        device = device or devices.current()
        ops = ops or device.model_ops(batch_invariant=batch_invariant)
        free_bytes = device.free_memory_bytes()
        if dtype is None and device.default_dtype() == torch.float32:
            dtype = torch.float32
        device = device.torch_device()
    ops = ops or TORCH_OPS
    if name.startswith(RANDOM_PREFIX):
        return load_random(name[len(RANDOM_PREFIX) :], device, dtype, seed, ops, tp, free_bytes)
    return load_checkpoint(
        name, device, dtype, ops, check_finite=check_finite, tp=tp, free_bytes=free_bytes
    )


__all__ = ["PRESETS", "TORCH_OPS", "LoadedModel", "ModelOps", "load_model"]
