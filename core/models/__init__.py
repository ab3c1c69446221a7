"""Models: Hugging Face checkpoints (config.json + safetensors) and random presets."""

from __future__ import annotations

import torch

from graphrt.core.models.loader import LoadedModel, load_checkpoint
from graphrt.core.models.ops import TORCH_OPS, ModelOps
from graphrt.core.models.presets import PRESETS, load_random

RANDOM_PREFIX = "random:"


def load_model(
    name: str,
    device: torch.device,
    dtype: torch.dtype | None = None,
    seed: int = 0,
    ops: ModelOps = TORCH_OPS,
) -> LoadedModel:
    """``name`` is a checkpoint directory or ``random:<preset>``; dtype None = the checkpoint's.

    ``ops`` is the device's table of fused elementwise kernels (``Device.model_ops()``).
    """
    if name.startswith(RANDOM_PREFIX):
        return load_random(name[len(RANDOM_PREFIX) :], device, dtype, seed, ops)
    return load_checkpoint(name, device, dtype, ops)


__all__ = ["PRESETS", "TORCH_OPS", "LoadedModel", "ModelOps", "load_model"]
