"""Gemma 4 text configuration: one frozen dataclass, parsed from config.json.

Reads both checkpoints transformers writes: ``Gemma4ForCausalLM``
(``model_type: gemma4_text``) and the multimodal ``Gemma4ForConditionalGeneration``
(``model_type: gemma4``, text under ``text_config``, tensors under
``model.language_model.``). Per-layer values follow transformers 5.24's
``Gemma4TextConfig``: full-attention layers take ``global_head_dim`` (default
512) unless config.json carries ``per_layer_config``, which then wins.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from graphrt.core.errors import CheckpointError, UnsupportedModelError
from graphrt.core.models.config import (
    _bool,
    _non_negative_int,
    _positive_float,
    _positive_int,
    activation,
    bos_id,
    eos_ids,
    parse_dtype,
)

SLIDING, FULL = "sliding_attention", "full_attention"
LAYER_TYPES = (SLIDING, FULL)
ROPE_TYPES = ("default", "proportional")
# Attributes graphrt reads from per_layer_config; any other override would be ignored silently.
_PER_LAYER_KEYS = {"head_dim", "num_key_value_heads"}
_DEFAULT_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}


@dataclass(frozen=True)
class Gemma4Config:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    layer_types: tuple[str, ...]
    head_dims: tuple[int, ...]  # per layer: full layers usually wider (global_head_dim)
    kv_heads: tuple[int, ...]  # per layer, as the layer itself would project them
    sliding_window: int
    rope_parameters: dict[str, dict[str, Any]]  # per layer type
    rms_norm_eps: float
    max_position_embeddings: int
    num_kv_shared_layers: int = 0
    hidden_size_per_layer_input: int = 0  # 0: no per-layer inputs
    vocab_size_per_layer_input: int = 0
    attention_k_eq_v: bool = False  # full layers: V is the raw K projection
    use_double_wide_mlp: bool = False  # KV-sharing layers: 2x intermediate
    attention_bias: bool = False
    final_logit_softcapping: float | None = None
    hidden_act: str = "gelu_pytorch_tanh"
    tie_word_embeddings: bool = True
    checkpoint_prefix: str = "model."  # where the text model's tensors live
    dtype: torch.dtype | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    @property
    def first_kv_shared_layer(self) -> int:
        return self.num_layers - self.num_kv_shared_layers

    def is_kv_consumer(self, layer: int) -> bool:
        return layer >= self.first_kv_shared_layer

    @property
    def kv_producers(self) -> dict[str, int]:
        """Layer type -> the last layer of that type that computes its own KV
        (transformers' "store" layer: KV-sharing layers and the assistant read it)."""
        first = self.first_kv_shared_layer
        return {
            t: max(i for i in range(first) if self.layer_types[i] == t)
            for t in LAYER_TYPES
            if t in self.layer_types[:first]
        }

    def kv_source(self, layer: int) -> int:
        """The layer whose KV ``layer`` attends over (itself unless it shares KV)."""
        if self.is_kv_consumer(layer):
            return self.kv_producers[self.layer_types[layer]]
        return layer


def gemma4_config_from_hf(cfg: dict[str, Any], architecture: str) -> Gemma4Config:
    prefix = "model."
    if cfg.get("model_type") == "gemma4" or "text_config" in cfg:
        text = cfg.get("text_config")
        if not isinstance(text, dict):
            raise CheckpointError("config.json of a multimodal Gemma 4 has no 'text_config' object")
        prefix = "model.language_model."
    else:
        text = cfg
    _reject_unsupported(text)

    layers = _positive_int(text, "num_hidden_layers")
    heads = _positive_int(text, "num_attention_heads")
    layer_types = _layer_types(text, layers)
    head_dims, kv_heads = _per_layer_shapes(text, layer_types, heads)
    shared = text.get("num_kv_shared_layers") or 0
    if isinstance(shared, bool) or not isinstance(shared, int) or not 0 <= shared < layers:
        raise CheckpointError(
            f"config.json 'num_kv_shared_layers' must be an integer in [0, {layers}), got {shared!r}"
        )
    ple = _non_negative_int(text, "hidden_size_per_layer_input")
    vocab = _positive_int(text, "vocab_size")
    ple_vocab = _positive_int(text, "vocab_size_per_layer_input") if ple else 0
    if ple:
        if ple_vocab < vocab:  # transformers would index past the per-layer table
            raise CheckpointError(
                f"config.json 'vocab_size_per_layer_input' ({ple_vocab}) is smaller than "
                f"'vocab_size' ({vocab})"
            )
    act_key = "hidden_activation" if text.get("hidden_activation") else "hidden_act"
    softcap = text.get("final_logit_softcapping")
    if softcap is not None:
        softcap = _positive_float(text, "final_logit_softcapping")

    config = Gemma4Config(
        architecture=architecture,
        vocab_size=vocab,
        hidden_size=_positive_int(text, "hidden_size"),
        intermediate_size=_positive_int(text, "intermediate_size"),
        num_layers=layers,
        num_heads=heads,
        layer_types=layer_types,
        head_dims=head_dims,
        kv_heads=kv_heads,
        sliding_window=_positive_int(text, "sliding_window", default=512),
        rope_parameters=_rope_parameters(text, layer_types),
        rms_norm_eps=_positive_float(text, "rms_norm_eps", default=1e-6),
        max_position_embeddings=_positive_int(text, "max_position_embeddings", default=131_072),
        num_kv_shared_layers=shared,
        hidden_size_per_layer_input=ple,
        vocab_size_per_layer_input=ple_vocab,
        attention_k_eq_v=_bool(text, "attention_k_eq_v", False),
        use_double_wide_mlp=_bool(text, "use_double_wide_mlp", False),
        attention_bias=_bool(text, "attention_bias", False),
        final_logit_softcapping=softcap,
        hidden_act=activation(text, act_key, "gelu_pytorch_tanh"),
        tie_word_embeddings=_bool(
            cfg, "tie_word_embeddings", _bool(text, "tie_word_embeddings", True)
        ),
        checkpoint_prefix=prefix,
        dtype=parse_dtype(text.get("dtype") or cfg.get("dtype") or cfg.get("torch_dtype")),
        eos_token_ids=eos_ids(cfg) or eos_ids(text),
        bos_token_id=bos_id(cfg if "bos_token_id" in cfg else text),
    )
    _check_layers(config)
    return config


def _reject_unsupported(text: dict[str, Any]) -> None:
    if _bool(text, "enable_moe_block", False):
        raise UnsupportedModelError(
            "Gemma 4 MoE (enable_moe_block, e.g. 26B-A4B) is not supported yet; "
            "the dense E2B / E4B / 31B checkpoints are"
        )
    if text.get("use_bidirectional_attention") == "all":
        raise UnsupportedModelError(
            "Gemma 4 with use_bidirectional_attention='all' is not a causal decoder"
        )


def _layer_types(text: dict[str, Any], layers: int) -> tuple[str, ...]:
    types = text.get("layer_types")
    if types is None:  # transformers' default: every 6th layer full
        types = [SLIDING if (i + 1) % 6 else FULL for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers:
        raise CheckpointError(
            f"config.json 'layer_types' must list one type for each of {layers} layers"
        )
    bad = sorted({str(t) for t in types if t not in LAYER_TYPES})
    if bad:
        raise UnsupportedModelError(f"Gemma 4 layer type(s) {bad} are not supported")
    # transformers forces the last layer to full attention (with a warning); so do we.
    return (*types[:-1], FULL)


def _per_layer_shapes(
    text: dict[str, Any], layer_types: tuple[str, ...], heads: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    head_dim = _positive_int(text, "head_dim", default=256)
    kv = _positive_int(text, "num_key_value_heads", default=4)
    per_layer = text.get("per_layer_config")
    if per_layer is None:
        # What Gemma4TextConfig.__post_init__ derives when config.json has no per_layer_config.
        full = {"head_dim": _positive_int(text, "global_head_dim", default=512)}
        k_eq_v = _bool(text, "attention_k_eq_v", False)
        if k_eq_v and text.get("num_global_key_value_heads") is not None:
            full["num_key_value_heads"] = _positive_int(text, "num_global_key_value_heads")
        per_layer = {i: full for i, t in enumerate(layer_types) if t == FULL}
    if not isinstance(per_layer, dict):
        raise CheckpointError("config.json 'per_layer_config' must be an object")
    overrides: dict[int, dict[str, Any]] = {}
    for key, values in per_layer.items():
        try:
            layer = int(key)  # transformers writes zero-padded strings ("04")
        except (TypeError, ValueError):
            raise CheckpointError(
                f"config.json 'per_layer_config' key {key!r} is not a layer index"
            ) from None
        if not 0 <= layer < len(layer_types) or not isinstance(values, dict):
            raise CheckpointError(f"config.json 'per_layer_config' entry {key!r} is invalid")
        unknown = sorted(set(values) - _PER_LAYER_KEYS)
        if unknown:
            raise UnsupportedModelError(
                f"Gemma 4 per-layer override(s) {unknown} are not supported"
            )
        overrides[layer] = values
    layer_cfgs = [
        {"head_dim": head_dim, "num_key_value_heads": kv, **overrides.get(i, {})}
        for i in range(len(layer_types))
    ]
    head_dims = tuple(_positive_int(c, "head_dim") for c in layer_cfgs)
    kv_heads = tuple(_positive_int(c, "num_key_value_heads") for c in layer_cfgs)
    for i, n in enumerate(kv_heads):
        if heads % n:
            raise CheckpointError(
                f"layer {i}: {heads} attention heads do not group over {n} KV heads"
            )
    return head_dims, kv_heads


def _rope_parameters(
    text: dict[str, Any], layer_types: tuple[str, ...]
) -> dict[str, dict[str, Any]]:
    params = text.get("rope_parameters") or _DEFAULT_ROPE
    used = sorted(set(layer_types))
    if not isinstance(params, dict) or not all(isinstance(params.get(t), dict) for t in used):
        raise CheckpointError(
            f"config.json 'rope_parameters' must hold one entry per layer type ({', '.join(used)})"
        )
    out = {}
    for t in used:
        p = dict(params[t])
        p.setdefault("rope_type", "default")
        if p["rope_type"] not in ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope_type {p['rope_type']!r} ({t}) is not supported; graphrt supports "
                f"{', '.join(ROPE_TYPES)} for Gemma 4"
            )
        where = f"config.json rope_parameters.{t}"
        _positive_float(p, "rope_theta", where=where)
        _positive_float(p, "factor", default=1.0, where=where)
        if _positive_float(p, "partial_rotary_factor", default=1.0, where=where) > 1:
            raise CheckpointError(
                f"{where} 'partial_rotary_factor' must be at most 1, got {p['partial_rotary_factor']!r}"
            )
        out[t] = p
    return out


def _check_layers(c: Gemma4Config) -> None:
    for t in LAYER_TYPES:
        dims = {d for d, lt in zip(c.head_dims, c.layer_types) if lt == t}
        if len(dims) > 1:  # one rope table per layer type, as in transformers
            raise UnsupportedModelError(
                f"Gemma 4 {t} layers with different head dims {sorted(dims)}"
            )
    first = c.first_kv_shared_layer
    if set(c.layer_types[:first]) != set(c.layer_types):
        # transformers raises too: a sharing layer needs an earlier layer of its type.
        raise CheckpointError(
            "config.json 'num_kv_shared_layers' leaves a layer type with no earlier layer to share KV from"
        )
    for i in range(first, c.num_layers):
        src = c.kv_source(i)
        if c.head_dims[i] != c.head_dims[src]:
            raise CheckpointError(
                f"layer {i} shares layer {src}'s KV but its head_dim {c.head_dims[i]} differs "
                f"from {c.head_dims[src]}"
            )
        if c.num_heads % c.kv_heads[src]:
            raise CheckpointError(
                f"layer {i}: {c.num_heads} heads do not group over layer {src}'s KV heads"
            )
