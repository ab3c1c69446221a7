"""Models: Hugging Face checkpoints (config.json + safetensors) and random presets."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from graphrt import devices
from graphrt.core.errors import CheckpointError, UsageError
from graphrt.core.models.loader import LoadedModel, load_checkpoint, read_hf_config
from graphrt.core.models.ops import TORCH_OPS, ModelOps
from graphrt.core.models.presets import PRESETS, load_random, preset_hf_config
from graphrt.core.models.registry import resolve_architecture
from graphrt.core.parallel.group import SINGLE, TPGroup
from graphrt.devices.base import Device

RANDOM_PREFIX = "random:"
# Models up to this hidden size get the device's batch-invariant kernels where the CLI or
# ``LLM`` is not told otherwise (``load_model(batch_invariant=None)``): there they cost
# nothing measurable, and drafting then keeps 16-bit greedy output equal to plain
# decoding. H100, graphs, bf16, prompt 512, decode step invariant / default (BENCHMARKS.md,
# stop 70): the embedded pair's target (hidden 256) 1.04-1.05x, 0.98-0.99x and 0.84-0.89x
# at batch 1 / 8 / 64; random Llamas of hidden 512, 768 and 2048 1.47x, 1.36-1.40x and
# 1.44x at batch 1.
INVARIANT_FREE_HIDDEN = 256


def load_model(
    name: str,
    device: Device | torch.device | None = None,
    dtype: torch.dtype | None = None,
    seed: int = 0,
    ops: ModelOps | None = None,
    check_finite: bool | None = None,
    tp: TPGroup = SINGLE,
    batch_invariant: bool | None = False,
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
    rows beside it (``Device.model_ops``), for speculative output equal to plain in 16-bit;
    None (the CLI's and ``LLM``'s default): where they are free, models of hidden size up
    to INVARIANT_FREE_HIDDEN such as the embedded pair (``invariant_by_default``). False
    by default here, so that code loading small test models gets the fastest kernels
    (and drafters, whose rows only propose, load with it).
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
        if ops is None and batch_invariant is None:
            batch_invariant = invariant_by_default(name)
        ops = ops or device.model_ops(batch_invariant=bool(batch_invariant))
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


def invariant_by_default(name: str | os.PathLike) -> bool:
    """Does ``load_model`` give the model ``name`` (a checkpoint directory or
    random:PRESET) batch-invariant kernels when not told: is its hidden size at most
    INVARIANT_FREE_HIDDEN? False for a name it cannot read: the load then says why."""
    name = os.fspath(name)  # (public: a Path as load_model takes one)
    try:
        if name.startswith(RANDOM_PREFIX):
            hf_config = preset_hf_config(name[len(RANDOM_PREFIX) :])
        else:
            hf_config = read_hf_config(Path(name))
        arch_name, arch = resolve_architecture(hf_config)
        config = arch.parse_config(hf_config, arch_name)
    except (CheckpointError, KeyError, TypeError, ValueError):
        return False
    hidden = getattr(config, "hidden_size", None)  # an assistant's config has none: the
    return hidden is not None and hidden <= INVARIANT_FREE_HIDDEN  # load refuses it


__all__ = [
    "INVARIANT_FREE_HIDDEN",
    "PRESETS",
    "TORCH_OPS",
    "LoadedModel",
    "ModelOps",
    "invariant_by_default",
    "load_model",
]
