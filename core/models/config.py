"""Model configuration: one frozen dataclass, parsed from a checkpoint's config.json."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from graphrt.core.errors import CheckpointError, UnsupportedModelError

# Rope types layers.rope_inv_freq implements; anything else fails at config time.
ROPE_TYPES = ("default", "linear", "llama3")

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


def _positive_int(cfg: dict[str, Any], key: str, default: int | None = None) -> int:
    value = cfg.get(key) if default is None or cfg.get(key) is not None else default
    if value is None:
        raise CheckpointError(f"config.json has no {key!r}")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CheckpointError(f"config.json {key!r} must be a positive integer, got {value!r}")
    return value


def rope_parameters(cfg: dict[str, Any]) -> dict[str, Any]:
    """transformers >= 5 writes ``rope_parameters``; older writers ``rope_theta`` + ``rope_scaling``."""
    params = dict(cfg.get("rope_parameters") or {})
    if not params:
        params = dict(cfg.get("rope_scaling") or {})
        if "type" in params and "rope_type" not in params:
            params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    if params["rope_type"] not in ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope_type {params['rope_type']!r} is not supported; graphrt supports {', '.join(ROPE_TYPES)}"
        )
    return params


def eos_ids(cfg: dict[str, Any]) -> tuple[int, ...]:
    eos = cfg.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def llama_config_from_hf(cfg: dict[str, Any], architecture: str) -> LlamaConfig:
    hidden = _positive_int(cfg, "hidden_size")
    heads = _positive_int(cfg, "num_attention_heads")
    layers = _positive_int(cfg, "num_hidden_layers")
    model_type = cfg.get("model_type", "llama")
    return LlamaConfig(
        architecture=architecture,
        vocab_size=_positive_int(cfg, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_positive_int(cfg, "intermediate_size"),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=_positive_int(cfg, "num_key_value_heads", default=heads),
        head_dim=_positive_int(cfg, "head_dim", default=hidden // heads),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_parameters=rope_parameters(cfg),
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
        o_proj_bias=model_type != "qwen2" and bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=model_type == "qwen3",
        hidden_act=cfg.get("hidden_act", "silu"),
        layer_windows=_layer_windows(cfg, layers),
        dtype=parse_dtype(cfg.get("dtype") or cfg.get("torch_dtype")),
        eos_token_ids=eos_ids(cfg),
        bos_token_id=cfg.get("bos_token_id"),
    )


def _layer_windows(cfg: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    window = cfg.get("sliding_window")
    layer_types = cfg.get("layer_types")
    if layer_types:
        if len(layer_types) != num_layers:
            raise CheckpointError(
                f"config.json layer_types has {len(layer_types)} entries for {num_layers} layers"
            )
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    if cfg.get("use_sliding_window") is False:  # Qwen2 without layer_types
        return (None,) * num_layers
    return (window,) * num_layers
