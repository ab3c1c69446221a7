"""Load a model from a Hugging Face checkpoint directory (config.json + safetensors).

Only safetensors are read (no pickle), and only from inside the checkpoint
directory. Every checkpoint tensor must land on exactly one parameter with the
right shape and kind of dtype (floating weights stay floating: an integer tensor
is never cast into one), and with ``check_finite`` hold finite values; every
parameter must be loaded. Anything else is a ``CheckpointError`` naming the file or
tensor, raised while loading, before the model runs. Under tensor parallelism each
rank reads only its slice of every split tensor from the file (``LazyTensor``, cut by
``parallel.layers.take_shard`` and ``MergedLinear.load_shard``): no rank copies a whole
split tensor.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import safe_open
from torch import nn
from torch.overrides import TorchFunctionMode

from graphrt.core.errors import (
    CheckpointError,
    OutOfMemoryError,
    UsageError,
    first_line,
    out_of_memory,
)
from graphrt.core.models.config import architectures, eos_ids, parse_dtype
from graphrt.core.models.layers import MergedLinear
from graphrt.core.models.ops import TORCH_OPS, ModelOps
from graphrt.core.models.registry import resolve_architecture
from graphrt.core.parallel.group import SINGLE, TPGroup
from graphrt.core.parallel.layers import take_shard

CHECK_FINITE_ENV = "GRAPHRT_CHECK_FINITE"
# Tensors some writers save that carry nothing graphrt needs.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class LoadedModel:
    model: nn.Module
    config: Any  # the model family's frozen config dataclass
    source: str  # directory or "random:<preset>"
    tokenizer_path: Path | None
    eos_token_ids: tuple[int, ...]
    # Its ops compute every row as they would alone (``ModelOps.width_invariant``).
    batch_invariant: bool = False

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the weights were loaded in (the first floating parameter's)."""
        return next(p.dtype for p in self.model.parameters() if p.is_floating_point())


def read_hf_config(path: Path) -> dict[str, Any]:
    if not path.is_dir():
        what = "is not a directory" if path.exists() else "does not exist"
        raise CheckpointError(f"checkpoint directory {str(path)!r} {what}")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{cfg_file} is missing")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{cfg_file} is not valid JSON: {e}") from None
    except OSError as e:  # permissions, a dangling symlink, an I/O error
        raise CheckpointError(f"cannot read {cfg_file}: {e.strerror or e}") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{cfg_file} must hold a JSON object")
    return cfg


def build_model(
    model_class,
    config,
    device: torch.device,
    dtype: torch.dtype,
    ops: ModelOps = TORCH_OPS,
    tp: TPGroup = SINGLE,
    free_bytes: int | None = None,
) -> nn.Module:
    """``free_bytes``: what the device has free; a model whose build needs more is refused
    (OutOfMemoryError, the numbers named) before anything is allocated."""
    if not tp.is_single and not getattr(model_class, "supports_tp", False):
        raise UsageError(
            f"tensor parallelism is not implemented for {model_class.__name__} yet "
            "(the Llama family and Gemma 4 have it)"
        )
    if free_bytes is not None:
        _check_fits(model_class, config, ops, tp, device, dtype, free_bytes)
    # Built directly on the target device so rope tables and weights never
    # round-trip through host memory.
    with torch.device(device):
        model = model_class(config, ops) if tp.is_single else model_class(config, ops, tp=tp)
    return model.to(dtype=dtype).eval().requires_grad_(False)


class _NoInit(TorchFunctionMode):
    """Parameter initialisation skipped: on the meta device it only costs time (the first
    meta ``normal_`` imports torch's Python decompositions, 2 s of every start-up)."""

    # Tensor methods and torch.nn.init's functions (which take the tensor as ``tensor``).
    INIT = {"normal_", "uniform_", "fill_", "zero_", "trunc_normal_", "kaiming_uniform_"}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) in self.INIT:
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


def _check_fits(model_class, config, ops, tp, device, dtype, free_bytes: int) -> None:
    # The same modules on the meta device: sizes without memory. The build below makes
    # them in the default dtype (float32) and casts after, so the peak is that size.
    with torch.device("meta"), _NoInit():
        probe = model_class(config, ops) if tp.is_single else model_class(config, ops, tp=tp)
    tensors = [*probe.parameters(), *probe.buffers()]
    built = sum(t.numel() * t.element_size() for t in tensors)
    final = sum(t.numel() * dtype.itemsize if t.is_floating_point() else 0 for t in tensors)
    if built > free_bytes:
        gib = 1 << 30
        raise OutOfMemoryError(
            f"the model needs {built / gib:.1f} GiB to build on {device} ({final / gib:.1f} "
            f"GiB of weights in {str(dtype).removeprefix('torch.')}) but {free_bytes / gib:.1f} "
            "GiB is free: free memory, use a smaller model, or shard it (--tp)"
        )


def load_checkpoint(
    path: str | Path,
    device: torch.device,
    dtype: torch.dtype | None,
    ops: ModelOps = TORCH_OPS,
    check_finite: bool | None = None,
    tp: TPGroup = SINGLE,
    free_bytes: int | None = None,
) -> LoadedModel:
    """``check_finite``: refuse weights holding NaN or Inf (None: the GRAPHRT_CHECK_FINITE
    environment variable, off by default: one more pass over the weights, 12-22% of the
    load time on 2 CPU cores)."""
    path = Path(path)
    if check_finite is None:
        check_finite = env_flag(CHECK_FINITE_ENV)
    hf_config = read_hf_config(path)
    architectures(hf_config)  # a list of strings, before the registry reads it
    arch_name, arch = resolve_architecture(hf_config)
    try:
        config = arch.parse_config(hf_config, arch_name)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path / 'config.json'} is malformed: {e!r}") from None
    eos_token_ids = _generation_eos(path) or config.eos_token_ids
    _check_special_ids(path, config, eos_token_ids)
    dtype = dtype or config.dtype or torch.float32
    if free_bytes is not None and _surely_fits(path, free_bytes):
        free_bytes = None  # no need for the exact (meta-device) sizing: see _surely_fits
    model = build_model(arch.model_class, config, device, dtype, ops, tp, free_bytes)
    load_weights(model, iter_safetensors(path), check_finite)
    return LoadedModel(
        model=model,
        config=config,
        source=str(path),
        tokenizer_path=(path / "tokenizer.json") if (path / "tokenizer.json").is_file() else None,
        eos_token_ids=eos_token_ids,
        batch_invariant=ops.width_invariant,
    )


def _surely_fits(path: Path, free_bytes: int) -> bool:
    """Whether the checkpoint's tensors, built in float32 (4 bytes an element, read from
    the safetensors headers: nothing loaded), take under half of ``free_bytes``. Then the
    exact check is skipped: its meta-device build imports torch's decompositions on first
    use, 1.3 to 2 s of every start-up. A whole checkpoint bounds any rank's shard."""
    elements = 0
    for file in safetensors_files(path):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                elements += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
        except Exception:  # noqa: BLE001 (unreadable: the exact check and the load say why)
            return False
    return 4 * elements < free_bytes // 2


def _check_special_ids(path: Path, config, eos_token_ids: tuple[int, ...]) -> None:
    """End and begin token ids must be tokens of the vocabulary: an eos the model can never
    emit silently turns every stop into --max-new-tokens."""
    text = getattr(config, "text", config)  # an assistant's: its text config's vocabulary
    vocab = text.vocab_size
    named = [("eos_token_id", t) for t in eos_token_ids]
    if getattr(text, "bos_token_id", None) is not None:
        named.append(("bos_token_id", text.bos_token_id))
    for name, token in named:
        if not 0 <= token < vocab:
            raise CheckpointError(
                f"{path}: {name} {token} is outside the vocabulary (vocab_size {vocab})"
            )


def env_flag(name: str) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise UsageError(f"environment variable {name}={value!r}: use 1 or 0")


def _generation_eos(path: Path) -> tuple[int, ...]:
    gen = path / "generation_config.json"
    if not gen.is_file():
        return ()
    try:
        cfg = json.loads(gen.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        cfg = None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{gen} is not a valid JSON object")
    return eos_ids(cfg, where=str(gen))


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = [_confined(path, name, index) for name in sorted(set(_weight_map(index).values()))]
    else:
        files = [_confined(path, f.name) for f in sorted(path.glob("*.safetensors"))]
    if not files:
        pickled = [p.name for p in path.glob("*.bin")] + [p.name for p in path.glob("*.pt")]
        hint = (
            f" (found {pickled[0]}: pickle checkpoints are not loaded; convert to safetensors)"
            if pickled
            else ""
        )
        raise CheckpointError(f"no safetensors weights in {path}{hint}")
    for f in files:
        if f.is_file():
            if not os.access(f, os.R_OK):  # safetensors would call it missing
                raise CheckpointError(f"cannot read {f}: permission denied")
            continue
        if f.is_symlink() and not f.exists():
            what = f"is a symlink to {os.readlink(f)!r}, which does not exist"
        elif f.exists():
            what = "is not a file"
        else:
            what = "named in the index is missing" if index.is_file() else "is missing"
        raise CheckpointError(f"weight file {f} {what}")
    return files


def _weight_map(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        raise CheckpointError(f"{index} is not a valid JSON object") from None
    except OSError as e:
        raise CheckpointError(f"cannot read {index}: {e.strerror or e}") from None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CheckpointError(
            f"{index} is malformed: 'weight_map' must map tensor names to file names"
        )
    return weight_map


def _confined(path: Path, name: str, index: Path | None = None) -> Path:
    """``path / name``, refused unless it is a safetensors file inside the checkpoint
    directory once symlinks are resolved (an index could otherwise make graphrt read any
    file on the machine). The Hugging Face hub cache is the one exception: a snapshot's
    files are symlinks into its repository's ``blobs/``."""
    what = f"{index} names {name!r}" if index else f"weight file {str(path / name)!r}"
    if not name.endswith(".safetensors"):
        raise CheckpointError(f"{what}: not a .safetensors file (pickle is never loaded)")
    if Path(name).is_absolute():
        raise CheckpointError(f"{what}: an absolute path, not a file of the checkpoint")
    root = path.resolve()
    roots = [root]
    if root.parent.name == "snapshots":  # <cache>/models--org--name/snapshots/<revision>/
        roots.append(root.parent.parent / "blobs")
    real = (path / name).resolve()
    if not any(real.is_relative_to(r) for r in roots):
        raise CheckpointError(f"{what}: resolves to {str(real)!r}, outside the checkpoint")
    return path / name


# safetensors' dtype names (the header's) -> torch dtypes.
_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
    "BOOL": torch.bool, "C64": torch.complex64,
}  # fmt: skip


class LazyTensor:
    """One tensor of an open safetensors file, read only as far as it is asked for:
    ``narrow`` reads one slice (a rank's shard), ``read`` all of it. Shape and dtype come
    from the file's header, so they are checked before anything is read. Valid while
    the file is open (``iter_safetensors`` keeps it open until the next file)."""

    def __init__(self, handle: Any, name: str):
        self._slice = handle.get_slice(name)
        self.name = name
        self.shape = torch.Size(self._slice.get_shape())
        kind = self._slice.get_dtype()
        if kind not in _SAFETENSORS_DTYPES:
            raise CheckpointError(f"tensor {name!r} has dtype {kind}, which graphrt does not read")
        self.dtype = _SAFETENSORS_DTYPES[kind]

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        return self._get((slice(None),) * dim + (slice(start, start + length),))

    def read(self) -> torch.Tensor:
        return self._get(...)

    def _get(self, index) -> torch.Tensor:
        try:
            return self._slice[index]
        except (MemoryError, RuntimeError) as e:
            if out_of_memory(e):
                raise
            raise CheckpointError(f"cannot read tensor {self.name!r}: {first_line(e)}") from None
        except Exception as e:  # OSError from the mapped file, safetensors' own errors
            raise CheckpointError(f"cannot read tensor {self.name!r}: {first_line(e)}") from None


def materialize(tensor: torch.Tensor | LazyTensor) -> torch.Tensor:
    return tensor if isinstance(tensor, torch.Tensor) else tensor.read()


def iter_safetensors(path: Path) -> Iterator[tuple[str, LazyTensor]]:
    for file in safetensors_files(path):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, LazyTensor(f, name)
        except CheckpointError:
            raise
        except Exception as e:  # safetensors raises its own error types on corrupt files
            raise CheckpointError(f"cannot read {file}: {e}") from None


class Target(NamedTuple):
    param: nn.Parameter  # the parameter the tensor lands in (whole, or one shard of it)
    # Copies the tensor (this rank's part of it) in, casting its dtype; -> what was read.
    load: Callable[[torch.Tensor | LazyTensor], torch.Tensor]


def checkpoint_targets(model: nn.Module) -> dict[str, Target]:
    """Checkpoint tensor name -> where it goes in the model."""
    targets: dict[str, Target] = {}
    merged = {name: m for name, m in model.named_modules() if isinstance(m, MergedLinear)}
    for pname, param in model.named_parameters():
        module_name, _, leaf = pname.rpartition(".")
        if module_name in merged:
            module = merged[module_name]
            parent = module_name.rpartition(".")[0]
            for shard in module.shard_offsets:
                targets[f"{parent}.{shard}.{leaf}"] = Target(
                    param, lambda t, m=module, p=param, s=shard: m.load_shard(p, s, t)
                )
        else:
            targets[pname] = Target(param, lambda t, p=param: _copy_exact(p, t))
    return targets


def _copy_exact(param: torch.Tensor, tensor: torch.Tensor | LazyTensor) -> torch.Tensor:
    tensor = take_shard(tensor, param)  # this rank's slice under tensor parallelism
    if tensor.shape != param.shape:
        raise ValueError(f"shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
    piece = materialize(tensor)
    param.data.copy_(piece)
    return piece


def load_weights(
    model: nn.Module,
    tensors: Iterator[tuple[str, torch.Tensor | LazyTensor]],
    check_finite: bool = False,
) -> None:
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
        _check_dtype(raw_name, tensor.dtype, targets[name].param)
        try:
            piece = targets[name].load(tensor)
        except ValueError as e:
            raise CheckpointError(f"tensor {raw_name!r} has the wrong shape: {e}") from None
        # What this rank read: each rank checks its own shard.
        if check_finite and piece.is_floating_point() and not _all_finite(piece):
            bad = int(piece.numel() - torch.isfinite(piece).sum())
            raise CheckpointError(f"tensor {raw_name!r} holds {bad} NaN or Inf value(s)")
        loaded.add(name)
    missing = sorted(set(targets) - loaded)
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise CheckpointError(f"checkpoint is missing tensor(s) {', '.join(missing[:3])}{more}")


def _check_dtype(name: str, dtype: torch.dtype, param: torch.Tensor) -> None:
    """Before the cast into ``param``: floating weights take floating tensors only (casting
    between float dtypes is normal; an integer or boolean tensor there is a broken or
    quantized checkpoint), integer parameters (an index table) integer tensors only."""
    kind, expected = _dtype_kind(dtype), _dtype_kind(param.dtype)
    if kind != expected:
        article = "an" if expected[0] in "aeiou" else "a"
        raise CheckpointError(
            f"tensor {name!r} has dtype {dtype} ({kind}), expected {article} {expected} dtype"
        )


def _dtype_kind(dtype: torch.dtype) -> str:
    if dtype.is_floating_point:
        return "floating"
    if dtype.is_complex:
        return "complex"
    return "boolean" if dtype == torch.bool else "integer"


def _all_finite(tensor: torch.Tensor) -> bool:
    # One reduction pass, no temporary: a NaN or Inf anywhere makes the sum non-finite.
    # A finite tensor whose sum overflows (float16 past 65504) takes the exact check,
    # which allocates a mask and is ~20x slower.
    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())


def resolve_dtype(
    name: str, checkpoint_dtype: torch.dtype | None, device_default: torch.dtype
) -> torch.dtype:
    """``--dtype``: auto = the checkpoint's dtype, except float32 on devices whose default is float32."""
    if name != "auto":
        return parse_dtype(name)
    if device_default == torch.float32:
        return torch.float32
    return checkpoint_dtype or device_default
