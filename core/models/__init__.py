"""Models: Hugging Face checkpoints (config.json + safetensors) and random presets."""

from __future__ import annotations

import torch

from graphrt.core.models.loader import LoadedModel, load_checkpoint
from graphrt.core.models.presets import PRESETS, load_random

RANDOM_PREFIX = "random:"


def load_model(
    name: str, device: torch.device, dtype: torch.dtype | None = None, seed: int = 0
) -> LoadedModel:
    """``name`` is a checkpoint directory or ``random:<preset>``; dtype None = the checkpoint's."""
    if name.startswith(RANDOM_PREFIX):
        return load_random(name[len(RANDOM_PREFIX) :], device, dtype, seed)
    return load_checkpoint(name, device, dtype)


__all__ = ["PRESETS", "LoadedModel", "load_model"]
