"""Load a model from a Hugging Face checkpoint directory (config.json + safetensors).

Only safetensors are read (no pickle). Every checkpoint tensor must land on
exactly one parameter with the right shape, and every parameter must be
loaded; anything else is a ``CheckpointError`` naming the tensor.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from graphrt.core.errors import CheckpointError
from graphrt.core.models.config import parse_dtype
from graphrt.core.models.layers import MergedLinear
from graphrt.core.models.ops import TORCH_OPS, ModelOps
from graphrt.core.models.registry import resolve_architecture

# Tensors some writers save that carry nothing graphrt needs.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class LoadedModel:
    model: nn.Module
    config: Any  # the model family's frozen config dataclass
    source: str  # directory or "random:<preset>"
    tokenizer_path: Path | None
    eos_token_ids: tuple[int, ...]

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the weights were loaded in (the first floating parameter's)."""
        return next(p.dtype for p in self.model.parameters() if p.is_floating_point())


def read_hf_config(path: Path) -> dict[str, Any]:
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {str(path)!r} does not exist")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{cfg_file} is missing")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{cfg_file} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{cfg_file} must hold a JSON object")
    return cfg


def build_model(
    model_class, config, device: torch.device, dtype: torch.dtype, ops: ModelOps = TORCH_OPS
) -> nn.Module:
    # Built directly on the target device so rope tables and weights never
    # round-trip through host memory.
    with torch.device(device):
        model = model_class(config, ops)
    return model.to(dtype=dtype).eval().requires_grad_(False)


def load_checkpoint(
    path: str | Path, device: torch.device, dtype: torch.dtype | None, ops: ModelOps = TORCH_OPS
) -> LoadedModel:
    path = Path(path)
    hf_config = read_hf_config(path)
    arch_name, arch = resolve_architecture(hf_config)
    try:
        config = arch.parse_config(hf_config, arch_name)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path / 'config.json'} is malformed: {e!r}") from None
    dtype = dtype or config.dtype or torch.float32
    model = build_model(arch.model_class, config, device, dtype, ops)
    load_weights(model, iter_safetensors(path))
    return LoadedModel(
        model=model,
        config=config,
        source=str(path),
        tokenizer_path=(path / "tokenizer.json") if (path / "tokenizer.json").is_file() else None,
        eos_token_ids=_generation_eos(path) or config.eos_token_ids,
    )


def _generation_eos(path: Path) -> tuple[int, ...]:
    gen = path / "generation_config.json"
    if not gen.is_file():
        return ()
    try:
        eos = json.loads(gen.read_text()).get("eos_token_id")
    except (json.JSONDecodeError, AttributeError):
        raise CheckpointError(f"{gen} is not a valid JSON object") from None
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise CheckpointError(f"{index} is malformed (no weight_map)") from None
        files = [path / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        pickled = [p.name for p in path.glob("*.bin")] + [p.name for p in path.glob("*.pt")]
        hint = (
            f" (found {pickled[0]}: pickle checkpoints are not loaded; convert to safetensors)"
            if pickled
            else ""
        )
        raise CheckpointError(f"no safetensors weights in {path}{hint}")
    for f in files:
        if not f.is_file():
            raise CheckpointError(f"weight file {f} named in the index is missing")
    return files


def iter_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for file in safetensors_files(path):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except CheckpointError:
            raise
        except Exception as e:  # safetensors raises its own error types on corrupt files
            raise CheckpointError(f"cannot read {file}: {e}") from None


Loader = Callable[[torch.Tensor], None]


def checkpoint_targets(model: nn.Module) -> dict[str, Loader]:
    """Checkpoint tensor name -> function copying it into the model."""
    targets: dict[str, Loader] = {}
    merged = {name: m for name, m in model.named_modules() if isinstance(m, MergedLinear)}
    for pname, param in model.named_parameters():
        module_name, _, leaf = pname.rpartition(".")
        if module_name in merged:
            module = merged[module_name]
            parent = module_name.rpartition(".")[0]
            for shard in module.shard_offsets:
                targets[f"{parent}.{shard}.{leaf}"] = lambda t, m=module, p=param, s=shard: (
                    m.load_shard(p, s, t)
                )
        else:
            targets[pname] = lambda t, p=param: _copy_exact(p, t)
    return targets


def _copy_exact(param: torch.Tensor, tensor: torch.Tensor) -> None:
    if tensor.shape != param.shape:
        raise ValueError(f"shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
    param.data.copy_(tensor)


def load_weights(model: nn.Module, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
    targets = checkpoint_targets(model)
    tied = getattr(model, "lm_head", "absent") is None
    remap = getattr(model, "map_checkpoint_name", lambda n: n)
    loaded: set[str] = set()
    for raw_name, tensor in tensors:
        name = remap(raw_name)
        if name is None or name.endswith(_IGNORED_SUFFIXES):
            continue
        if tied and name == "lm_head.weight":
            continue  # tied head: the embedding is the head; a saved copy is redundant
        if name not in targets:
            raise CheckpointError(f"unexpected tensor {raw_name!r} in checkpoint")
        if name in loaded:
            raise CheckpointError(f"tensor {raw_name!r} appears twice in the checkpoint")
        try:
            targets[name](tensor)
        except ValueError as e:
            raise CheckpointError(f"tensor {raw_name!r} has the wrong shape: {e}") from None
        loaded.add(name)
    missing = sorted(set(targets) - loaded)
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise CheckpointError(f"checkpoint is missing tensor(s) {', '.join(missing[:3])}{more}")


def resolve_dtype(
    name: str, checkpoint_dtype: torch.dtype | None, device_default: torch.dtype
) -> torch.dtype:
    """``--dtype``: auto = the checkpoint's dtype, except float32 on devices whose default is float32."""
    if name != "auto":
        return parse_dtype(name)
    if device_default == torch.float32:
        return torch.float32
    return checkpoint_dtype or device_default
