"""Model configuration: one frozen dataclass, parsed from a checkpoint's config.json."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from graphrt.core.errors import CheckpointError, UnsupportedModelError
from graphrt.core.models.ops import ACTIVATIONS

# Rope types layers.rope_inv_freq implements; anything else fails at config time.
ROPE_TYPES = ("default", "linear", "llama3")
# The parameters each rope type reads besides rope_theta (all positive numbers).
_ROPE_FACTORS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
LAYER_TYPES = ("full_attention", "sliding_attention")

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def parse_dtype(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    name = str(name).removeprefix("torch.")
    if name not in _DTYPES:
        raise CheckpointError(f"unsupported dtype {name!r}; use one of {sorted(_DTYPES)}")
    return _DTYPES[name]


@dataclass(frozen=True)
class LlamaConfig:
    """The Llama family (Llama 2/3, Qwen2, Qwen3, Mistral) in one shape."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_parameters: dict[str, Any]
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2: q/k/v carry a bias, o does not
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before rope
    hidden_act: str = "silu"
    # Per-layer sliding window (None = full attention), from layer_types / sliding_window.
    layer_windows: tuple[int | None, ...] = field(default=())
    dtype: torch.dtype | None = None  # the checkpoint's own dtype
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    def __post_init__(self):
        if not self.layer_windows:
            object.__setattr__(self, "layer_windows", (None,) * self.num_layers)


def _require(cfg: dict[str, Any], key: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise CheckpointError(f"config.json has no {key!r}")
    return cfg[key]


# The typed readers: each returns the value of ``cfg[key]`` (``default`` when it is absent or
# null; a required key has no default) or raises a CheckpointError naming the key. JSON gives
# Python bool for true/false, and bool is an int subclass: every integer reader refuses it.
# ``where`` names the object the key sits in (config.json itself unless nested).


def _positive_int(cfg: dict[str, Any], key: str, default: int | None = None) -> int:
    value = cfg.get(key) if default is None or cfg.get(key) is not None else default
    if value is None:
        raise CheckpointError(f"config.json has no {key!r}")
    if not _is_int(value) or value < 1:
        raise CheckpointError(f"config.json {key!r} must be a positive integer, got {value!r}")
    return value


def _non_negative_int(cfg: dict[str, Any], key: str, default: int = 0) -> int:
    value = cfg.get(key)
    if value is None:
        return default
    if not _is_int(value) or value < 0:
        raise CheckpointError(f"config.json {key!r} must be a non-negative integer, got {value!r}")
    return value


def _positive_float(
    cfg: dict[str, Any], key: str, default: float | None = None, where: str = "config.json"
) -> float:
    """A finite number > 0 (an integer is fine: JSON writes 10000 for 10000.0); NaN,
    Infinity, strings and booleans are refused."""
    value = cfg.get(key)
    if value is None:
        if default is None:
            raise CheckpointError(f"{where} has no {key!r}")
        return default
    if not _is_number(value) or not math.isfinite(value) or value <= 0:
        raise CheckpointError(f"{where} {key!r} must be a finite positive number, got {value!r}")
    return float(value)


def _bool(cfg: dict[str, Any], key: str, default: bool) -> bool:
    # NOTE: bool("false") is True: a string here would silently flip the setting.
    value = cfg.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise CheckpointError(f"config.json {key!r} must be true or false, got {value!r}")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def eos_ids(cfg: dict[str, Any], where: str = "config.json") -> tuple[int, ...]:
    """``eos_token_id``: a token id or a list of them; absent or null: ()."""
    value = cfg.get("eos_token_id")
    if value is None:
        return ()
    ids = value if isinstance(value, list) else [value]
    if not all(_is_int(i) and i >= 0 for i in ids):
        raise CheckpointError(
            f"{where} 'eos_token_id' must be a token id or a list of token ids, got {value!r}"
        )
    return tuple(ids)


def bos_id(cfg: dict[str, Any]) -> int | None:
    value = cfg.get("bos_token_id")
    if value is not None and not (_is_int(value) and value >= 0):
        raise CheckpointError(f"config.json 'bos_token_id' must be a token id, got {value!r}")
    return value


def architectures(cfg: dict[str, Any]) -> list[str]:
    """config.json ``architectures``: a list of class names (absent or null: [])."""
    names = cfg.get("architectures")
    if names is None:
        return []
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise CheckpointError(
            f"config.json 'architectures' must be a list of strings, got {names!r}"
        )
    return names


def activation(cfg: dict[str, Any], key: str, default: str) -> str:
    act = cfg.get(key) or default
    if not isinstance(act, str) or act not in ACTIVATIONS:
        raise UnsupportedModelError(
            f"config.json {key!r} {act!r} is not supported; graphrt supports "
            f"{', '.join(sorted(ACTIVATIONS))}"
        )
    return act


def rope_parameters(cfg: dict[str, Any]) -> dict[str, Any]:
    """transformers >= 5 writes ``rope_parameters``; older writers ``rope_theta`` + ``rope_scaling``."""
    key = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    raw = cfg.get(key) or {}
    if not isinstance(raw, dict):
        raise CheckpointError(f"config.json {key!r} must be an object, got {raw!r}")
    params = dict(raw)
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    if params["rope_type"] not in ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope_type {params['rope_type']!r} is not supported; graphrt supports {', '.join(ROPE_TYPES)}"
        )
    if params.get("rope_theta") is None:
        params["rope_theta"] = _positive_float(cfg, "rope_theta", default=10000.0)
    where = f"config.json {key}"
    for name in ("rope_theta", *_ROPE_FACTORS[params["rope_type"]]):
        _positive_float(params, name, where=where)
    if params["rope_type"] == "llama3" and params["high_freq_factor"] <= params["low_freq_factor"]:
        raise CheckpointError(
            f"{where} 'high_freq_factor' ({params['high_freq_factor']}) must be greater than "
            f"'low_freq_factor' ({params['low_freq_factor']})"
        )
    return params


def llama_config_from_hf(cfg: dict[str, Any], architecture: str) -> LlamaConfig:
    hidden = _positive_int(cfg, "hidden_size")
    heads = _positive_int(cfg, "num_attention_heads")
    kv_heads = _positive_int(cfg, "num_key_value_heads", default=heads)
    if heads % kv_heads:
        raise CheckpointError(
            f"config.json 'num_attention_heads' ({heads}) is not a multiple of "
            f"'num_key_value_heads' ({kv_heads})"
        )
    layers = _positive_int(cfg, "num_hidden_layers")
    model_type = cfg.get("model_type", "llama")
    attention_bias = _bool(cfg, "attention_bias", False)
    return LlamaConfig(
        architecture=architecture,
        vocab_size=_positive_int(cfg, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_positive_int(cfg, "intermediate_size"),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=_positive_int(cfg, "head_dim", default=hidden // heads),
        rms_norm_eps=_positive_float(cfg, "rms_norm_eps", default=1e-6),
        rope_parameters=rope_parameters(cfg),
        max_position_embeddings=_positive_int(cfg, "max_position_embeddings", default=4096),
        tie_word_embeddings=_bool(cfg, "tie_word_embeddings", False),
        qkv_bias=model_type == "qwen2" or attention_bias,
        o_proj_bias=model_type != "qwen2" and attention_bias,
        mlp_bias=_bool(cfg, "mlp_bias", False),
        qk_norm=model_type == "qwen3",
        hidden_act=activation(cfg, "hidden_act", "silu"),
        layer_windows=_layer_windows(cfg, layers),
        dtype=parse_dtype(cfg.get("dtype") or cfg.get("torch_dtype")),
        eos_token_ids=eos_ids(cfg),
        bos_token_id=bos_id(cfg),
    )


def _layer_windows(cfg: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    layer_types = cfg.get("layer_types")
    if layer_types:
        if not isinstance(layer_types, list) or len(layer_types) != num_layers:
            raise CheckpointError(
                f"config.json 'layer_types' must list one type for each of {num_layers} layers"
            )
        unknown = sorted({str(t) for t in layer_types} - set(LAYER_TYPES))
        if unknown:
            raise UnsupportedModelError(
                f"config.json 'layer_types' {unknown} are not supported; graphrt supports "
                f"{', '.join(LAYER_TYPES)}"
            )
        sliding = [t == "sliding_attention" for t in layer_types]
    else:  # Qwen2 without layer_types: use_sliding_window false turns the window off
        sliding = [_bool(cfg, "use_sliding_window", True)] * num_layers
    # Only a window some layer uses is read (Qwen2 writes one it does not use); null: none.
    window = None
    if any(sliding) and cfg.get("sliding_window") is not None:
        window = _positive_int(cfg, "sliding_window")
    return tuple(window if s else None for s in sliding)
