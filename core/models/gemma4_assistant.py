"""The Gemma 4 MTP assistant (``Gemma4AssistantForCausalLM``): the frozen-KV drafter.

Per row it reads ``[target's scaled embedding of the token, a backbone hidden]``,
projects it to its own width (``pre_projection``), runs Gemma 4 decoder layers
whose attention is query-only over the *target's* KV (full layers read the
target's last full-attention producer, sliding layers its last sliding one)
and never writes KV, and returns its final normed hidden: logits come from it
(a tied LM head, or the centroid-masked one with ``use_ordered_embeddings``),
the next step's hidden from ``post_projection`` of it.

Window: transformers masks the assistant's sliding layers with an inclusive
bidirectional window over the shared KV (|q - k| <= window, flipped to the
newest keys): the ``window + 1`` newest entries. With the query one past the
last cached key, that is graphrt's rule "key j visible iff j > p - w" at
w = window + 1, which ``bind_target`` sets.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from graphrt.core.attention.base import AttentionBackend, AttentionSpec
from graphrt.core.batch import ForwardBatch
from graphrt.core.errors import CheckpointError, GraphrtError, UsageError
from graphrt.core.memory import KVLayerSpec
from graphrt.core.models.config import _bool, _positive_int, eos_ids
from graphrt.core.models.gemma4 import Gemma4DecoderLayer, GemmaRMSNorm, _rotary, run_layers
from graphrt.core.models.gemma4_config import FULL, Gemma4Config, gemma4_config_from_hf
from graphrt.core.models.layers import Linear
from graphrt.core.models.ops import TORCH_OPS, ModelOps

_UNUSED_KV_TENSOR = re.compile(r"model\.layers\.\d+\.self_attn\.(k_proj|v_proj|k_norm|v_norm)\.")


@dataclass(frozen=True)
class Gemma4AssistantConfig:
    text: Gemma4Config
    backbone_hidden_size: int  # the target's hidden size
    use_ordered_embeddings: bool = False
    num_centroids: int = 2048
    centroid_intermediate_top_k: int = 32
    tie_word_embeddings: bool = True

    # The loader and the engine read these off any model config.
    @property
    def dtype(self):
        return self.text.dtype

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.text.eos_token_ids


def gemma4_assistant_config_from_hf(
    cfg: dict[str, Any], architecture: str
) -> Gemma4AssistantConfig:
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise CheckpointError("config.json of a Gemma 4 assistant has no 'text_config' object")
    for key in ("hidden_size_per_layer_input", "vocab_size_per_layer_input"):
        if text.get(key):
            raise CheckpointError(f"Gemma 4 assistant text_config {key!r} must be 0")
    # Every assistant layer reads the target's KV; parse its shapes as if unshared.
    text = {**text, "num_kv_shared_layers": 0, "model_type": "gemma4_text"}
    # The top-level dtype is the one save_pretrained writes: transformers 5.17 also writes a
    # text_config "dtype": null, which must not hide it (the weights would load as float32).
    text["dtype"] = (
        cfg.get("dtype") or cfg.get("torch_dtype") or text.get("dtype") or text.get("torch_dtype")
    )
    parsed = gemma4_config_from_hf(text, architecture)
    if not parsed.eos_token_ids and eos_ids(cfg):
        parsed = Gemma4Config(**{**parsed.__dict__, "eos_token_ids": eos_ids(cfg)})
    config = Gemma4AssistantConfig(
        text=parsed,
        backbone_hidden_size=_positive_int(cfg, "backbone_hidden_size"),
        use_ordered_embeddings=_bool(cfg, "use_ordered_embeddings", False),
        num_centroids=_positive_int(cfg, "num_centroids", default=2048),
        centroid_intermediate_top_k=_positive_int(cfg, "centroid_intermediate_top_k", default=32),
        tie_word_embeddings=_bool(cfg, "tie_word_embeddings", True),
    )
    if config.use_ordered_embeddings and parsed.vocab_size % config.num_centroids:
        raise CheckpointError(
            f"vocab_size {parsed.vocab_size} is not a multiple of num_centroids {config.num_centroids}"
        )
    return config


class CentroidMaskedHead(nn.Module):
    """transformers' Gemma4AssistantMaskedEmbedder: only tokens of the top-k centroids get
    real logits; every other token gets the row's smallest real logit minus one."""

    def __init__(self, config: Gemma4AssistantConfig):
        super().__init__()
        t = config.text
        self.top_k = config.centroid_intermediate_top_k
        self.num_centroids = config.num_centroids
        self.centroids = nn.Linear(t.hidden_size, config.num_centroids, bias=False)
        # Saved in checkpoints (a persistent buffer in transformers): a parameter here so
        # the loader fills it and reports it missing; integer, so .to(dtype) leaves it be.
        self.token_ordering = nn.Parameter(
            torch.zeros(t.vocab_size, dtype=torch.long), requires_grad=False
        )

    def forward(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
        rows = hidden.shape[0]
        top = self.centroids(hidden).topk(self.top_k, dim=-1).indices  # (N, k)
        clusters = self.token_ordering.view(self.num_centroids, -1)  # (C, V / C)
        tokens = clusters[top].reshape(rows, -1)  # (N, k * V / C)
        emb = lm_head_weight[tokens]  # (N, k * V / C, hidden)
        selected = (hidden.unsqueeze(1) @ emb.transpose(1, 2)).squeeze(1)  # (N, k * V / C)
        # transformers takes one min over the whole batch with .item() (a host sync); per
        # row here, which is the same for its one-row drafting and never syncs.
        fill = selected.amin(dim=-1, keepdim=True) - 1.0
        out = fill.expand(rows, lm_head_weight.shape[0]).clone()
        return out.scatter_(1, tokens, selected)


class Gemma4DraftBackbone(nn.Module):
    def __init__(self, config: Gemma4Config, ops: ModelOps):
        super().__init__()
        c = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)  # the tied LM head
        self.rotary = nn.ModuleDict({t: _rotary(c, t, ops) for t in sorted(set(c.layer_types))})
        self.layers = nn.ModuleList(
            Gemma4DecoderLayer(
                c, i, self.rotary[c.layer_types[i]], ops, kv_spec=_unbound_spec(c, i)
            )
            for i in range(c.num_layers)
        )
        self.norm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps, ops=ops)


def _unbound_spec(c: Gemma4Config, layer: int) -> AttentionSpec:
    # cache_index -1 until bind_target points the layer at the target's KV.
    window = c.sliding_window if c.layer_types[layer] != FULL else None
    return AttentionSpec(c.num_heads, c.kv_heads[layer], c.head_dims[layer], 1.0, -1, window, False)


class Gemma4AssistantForCausalLM(nn.Module):
    """``forward`` -> final normed hidden (rows, hidden); ``compute_logits`` -> its logits;
    ``next_hidden`` -> the hidden the next draft step is fed (``post_projection``)."""

    def __init__(self, config: Gemma4AssistantConfig, ops: ModelOps = TORCH_OPS):
        super().__init__()
        t = config.text
        self.config = config
        self.model = Gemma4DraftBackbone(t, ops)
        self.ops = ops
        self.pre_projection = Linear(2 * config.backbone_hidden_size, t.hidden_size, False, ops)
        self.post_projection = Linear(t.hidden_size, config.backbone_hidden_size, False, ops)
        self.lm_head = (
            None if config.tie_word_embeddings else Linear(t.hidden_size, t.vocab_size, False, ops)
        )
        self.masked_embedding = (
            CentroidMaskedHead(config) if config.use_ordered_embeddings else None
        )
        self._target: list[nn.Module] = []  # a list, so the target is not a submodule of ours

    @property
    def vocab_size(self) -> int:
        return self.config.text.vocab_size

    @property
    def max_context_len(self) -> int:
        return self.config.text.max_position_embeddings

    def kv_layer_specs(self) -> list[KVLayerSpec]:
        return []  # reads the target's KV, owns none

    def bind_target(self, target: nn.Module) -> None:
        """Point every layer at the target's KV; checks the two models fit together."""
        t = self.config.text
        if getattr(target, "shared_kv_layers", None) is None:
            raise UsageError(
                f"the Gemma 4 assistant needs a Gemma 4 target, got {type(target).__name__}"
            )
        if (
            target.config.hidden_size != self.config.backbone_hidden_size
            or target.vocab_size != t.vocab_size
        ):
            raise UsageError(
                f"assistant (backbone hidden {self.config.backbone_hidden_size}, vocab {t.vocab_size}) does "
                f"not fit target (hidden {target.config.hidden_size}, vocab {target.vocab_size})"
            )
        dtypes = [_float_dtype(m) for m in (self, target)]
        if dtypes[0] != dtypes[1]:
            raise UsageError(
                f"the assistant's weights are {dtypes[0]} but the target's are {dtypes[1]}: "
                "load both in one dtype (they share KV and hidden states)"
            )
        producers = target.shared_kv_layers()
        for i, layer in enumerate(self.model.layers):
            kind = t.layer_types[i]
            if kind not in producers:
                raise UsageError(f"the target has no {kind} layer for assistant layer {i} to read")
            prod = producers[kind]
            if prod.head_dim != t.head_dims[i] or t.num_heads % prod.num_kv_heads:
                raise UsageError(
                    f"assistant layer {i} (head_dim {t.head_dims[i]}, {t.num_heads} heads) cannot read the "
                    f"target's {kind} KV (head_dim {prod.head_dim}, {prod.num_kv_heads} KV heads)"
                )
            layer.self_attn.spec = AttentionSpec(
                num_heads=t.num_heads,
                num_kv_heads=prod.num_kv_heads,
                head_dim=prod.head_dim,
                scaling=1.0,
                cache_index=prod.cache_index,
                sliding_window=None if kind == FULL else t.sliding_window + 1,  # see module doc
                writes_kv=False,
            )
        self._target[:] = [target]

    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        if not self._target:
            raise GraphrtError("the assistant is not bound to a target model (bind_target)")
        target = self._target[0]
        emb = target.embed_tokens_scaled(batch.input_ids)  # (rows, backbone hidden)
        seed = batch.spec_info.hidden.to(emb.dtype)  # (rows, backbone hidden)
        x = self.pre_projection(torch.cat([emb, seed], dim=-1))  # (rows, hidden)
        return run_layers(self.model.layers, x, None, batch, attn, self.model.norm)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if self.masked_embedding is not None:
            logits = self.masked_embedding(hidden, self.lm_head_weight)
        else:
            logits = self.ops.linear(hidden, self.lm_head_weight, None)  # (N, vocab)
        return self.ops.float_logits(logits, None, out)  # float32

    def next_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """The next draft step's hidden input: ``post_projection`` back to the target's width."""
        return self.post_projection(hidden)

    def map_checkpoint_name(self, name: str) -> str | None:
        # Writers may keep K/V weights the assistant never uses (it reads the target's KV).
        return None if _UNUSED_KV_TENSOR.match(name) else name


def _float_dtype(module: nn.Module) -> torch.dtype:
    return next(p.dtype for p in module.parameters() if p.is_floating_point())
