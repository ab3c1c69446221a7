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

Tensor parallelism: the assistant must be built with the target's ``TPGroup``. Its
query heads split like the target's (rank r's heads are the ones that read the KV heads
rank r holds), o_proj and the MLP like the target's, its tied LM head by vocabulary rows
(the centroid head too: each rank scores the selected tokens it holds). The pre/post
projections and the centroid scores stay whole on every rank (small matmuls; split, each
would cost a collective per draft step).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from graphrt.core.attention.base import AttentionBackend
from graphrt.core.batch import ForwardBatch
from graphrt.core.errors import CheckpointError, GraphrtError, UsageError
from graphrt.core.memory import KVLayerSpec
from graphrt.core.models.config import _bool, _positive_int, eos_ids
from graphrt.core.models.gemma4 import Gemma4DecoderLayer, GemmaRMSNorm, _rotary, run_layers
from graphrt.core.models.gemma4_config import FULL, Gemma4Config, gemma4_config_from_hf
from graphrt.core.models.layers import Linear
from graphrt.core.models.ops import TORCH_OPS, ModelOps, smallest_token_at_max
from graphrt.core.parallel.group import SINGLE, TPGroup
from graphrt.core.parallel.layers import VocabParallelEmbedding, VocabParallelHead, vocab_logits

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

    def __init__(
        self, config: Gemma4AssistantConfig, ops: ModelOps = TORCH_OPS, tp: TPGroup = SINGLE
    ):
        super().__init__()
        t = config.text
        self.ops = ops
        self.top_k = config.centroid_intermediate_top_k
        self.num_centroids = config.num_centroids
        self.vocab_size = t.vocab_size
        self.tp = tp
        # Whole on every rank, as is token_ordering: top-k needs every centroid's score.
        self.centroids = Linear(t.hidden_size, config.num_centroids, False, ops)
        # Saved in checkpoints (a persistent buffer in transformers): a parameter here so
        # the loader fills it and reports it missing; integer, so .to(dtype) leaves it be.
        self.token_ordering = nn.Parameter(
            torch.zeros(t.vocab_size, dtype=torch.long), requires_grad=False
        )

    def forward(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """``lm_head_weight``: this rank's vocabulary rows (all of them for one rank)."""
        rows = hidden.shape[0]
        tokens = self._selected_tokens(hidden)  # (N, k * V / C)
        selected = self._selected_logits(hidden, lm_head_weight, tokens)  # (N, k * V / C)
        # transformers takes one min over the whole batch with .item() (a host sync); per
        # row here, which is the same for its one-row drafting and never syncs.
        fill = selected.amin(dim=-1, keepdim=True) - 1.0
        out = fill.expand(rows, self.vocab_size).clone()
        return out.scatter_(1, tokens, selected)

    def greedy_tokens(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """(N,) int64: the first maximum of ``forward``'s row without building the row.
        Only selected tokens can hold it (the fill is below their smallest), so it is the
        smallest token id among the selected maxima; the float32 logits order as the
        model's dtype does. Exact unless all of a row's k * V / C selected logits are
        equal and the fill rounds onto them (then an unselected id could come first)."""
        if self.tp.is_single:  # one fused op where the device has one (no (N, S, H) gather)
            return self.ops.selected_argmax(
                hidden, lm_head_weight, self._clusters, self._top(hidden)
            )
        tokens = self._selected_tokens(hidden)  # (N, k * V / C)
        selected = self._selected_logits(hidden, lm_head_weight, tokens)  # (N, k * V / C)
        return smallest_token_at_max(selected, tokens, self.vocab_size)

    @property
    def _clusters(self) -> torch.Tensor:
        return self.token_ordering.view(self.num_centroids, -1)  # (C, V / C) token ids

    def _top(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, k): each row's top-k centroids, in index order (the clusters' order changes
        no logit, and the argmax breaks ties by token id), ties to the smallest index
        (torch.topk, which transformers calls, leaves those unspecified)."""
        return self.ops.topk_set(self.centroids(hidden), self.top_k)

    def _selected_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, k * V / C): the token ids of each row's top-k centroids' clusters."""
        return self._clusters[self._top(hidden)].reshape(hidden.shape[0], -1)

    def _selected_logits(
        self, hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor
    ) -> torch.Tensor:
        if self.tp.is_single:
            emb = weight[tokens]  # (N, k * V / C, hidden)
            return (hidden.unsqueeze(1) @ emb.transpose(1, 2)).squeeze(1)
        # Each rank keeps the logits of the selected tokens among its rows and zeros for
        # the others (it multiplies every selected row, clamped into its own: fixed shapes,
        # as graphs need); the all-reduce adds one rank's logit to zeros: exact.
        local = tokens - self.tp.rank * weight.shape[0]
        outside = (local < 0) | (local >= weight.shape[0])
        emb = weight[local.clamp(0, weight.shape[0] - 1)]  # (N, k * V / C, hidden)
        part = (hidden.unsqueeze(1) @ emb.transpose(1, 2)).squeeze(1)
        return self.tp.all_reduce(part.masked_fill(outside, 0))


class Gemma4DraftBackbone(nn.Module):
    def __init__(self, config: Gemma4Config, ops: ModelOps, tp: TPGroup = SINGLE):
        super().__init__()
        c = config
        # The tied LM head only (the input embedding is the target's): split by vocabulary.
        self.embed_tokens = VocabParallelEmbedding(c.vocab_size, c.hidden_size, tp)
        self.rotary = nn.ModuleDict({t: _rotary(c, t, ops) for t in sorted(set(c.layer_types))})
        self.layers = nn.ModuleList(
            Gemma4DecoderLayer(c, i, self.rotary[c.layer_types[i]], ops, tp, reads_target_kv=True)
            for i in range(c.num_layers)
        )
        self.norm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps, ops=ops)


class Gemma4AssistantForCausalLM(nn.Module):
    """``forward`` -> final normed hidden (rows, hidden); ``compute_logits`` -> its logits;
    ``next_hidden`` -> the hidden the next draft step is fed (``post_projection``)."""

    supports_tp = True  # built with the target's TPGroup (see the module doc)

    def __init__(
        self, config: Gemma4AssistantConfig, ops: ModelOps = TORCH_OPS, tp: TPGroup = SINGLE
    ):
        super().__init__()
        t = config.text
        self.config = config
        self.tp = tp
        self.model = Gemma4DraftBackbone(t, ops, tp)
        self.ops = ops
        # Whole on every rank: they read and write whole hidden rows.
        self.pre_projection = Linear(2 * config.backbone_hidden_size, t.hidden_size, False, ops)
        self.post_projection = Linear(t.hidden_size, config.backbone_hidden_size, False, ops)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else VocabParallelHead(t.hidden_size, t.vocab_size, tp, ops)
        )
        self.masked_embedding = (
            CentroidMaskedHead(config, ops, tp) if config.use_ordered_embeddings else None
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
        if (target.tp.size, target.tp.rank) != (self.tp.size, self.tp.rank):
            raise UsageError(
                f"the assistant is built for rank {self.tp.rank} of {self.tp.size} but the "
                f"target for rank {target.tp.rank} of {target.tp.size}: load both with one "
                "TPGroup (the assistant reads the KV heads its rank holds)"
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
            prod, spec = producers[kind], layer.self_attn.spec
            # Both counts are this rank's: with one TPGroup, rank r's query heads are those
            # whose KV heads rank r holds, grouped as in one process.
            if prod.head_dim != t.head_dims[i] or spec.num_heads % prod.num_kv_heads:
                raise UsageError(
                    f"assistant layer {i} (head_dim {t.head_dims[i]}, {spec.num_heads} heads) cannot read the "
                    f"target's {kind} KV (head_dim {prod.head_dim}, {prod.num_kv_heads} KV heads)"
                )
            layer.self_attn.spec = replace(
                spec,
                num_kv_heads=prod.num_kv_heads,
                head_dim=prod.head_dim,
                cache_index=prod.cache_index,
                sliding_window=None if kind == FULL else t.sliding_window + 1,  # see module doc
            )
        self._target[:] = [target]

    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        if not self._target:
            raise GraphrtError("the assistant is not bound to a target model (bind_target)")
        target = self._target[0]
        # (rows, 2 x backbone hidden): each token's embedding beside its seed hidden.
        x = target.embed_tokens_scaled(batch.input_ids, batch.spec_info.hidden)
        x = self.pre_projection(x)  # (rows, hidden)
        return run_layers(self.model.layers, x, None, batch, attn, self.model.norm)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if self.masked_embedding is not None:
            logits = self.masked_embedding(hidden, self.lm_head_weight)
        else:  # (N, vocab / ranks) -> every rank's columns: (N, vocab)
            logits = vocab_logits(
                self.tp, self.ops.linear(hidden, self.lm_head_weight, None), self.vocab_size
            )
        return self.ops.float_logits(logits, None, out)  # float32

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N,) int64: ``compute_logits(hidden).argmax(-1)``; the centroid head's without
        its (N, vocab) row (a greedy draft chain's step: ``ForwardBatch.greedy_only``)."""
        if self.masked_embedding is not None:
            return self.masked_embedding.greedy_tokens(hidden, self.lm_head_weight)
        return self.compute_logits(hidden).argmax(dim=-1)

    def next_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """The next draft step's hidden input: ``post_projection`` back to the target's width."""
        return self.post_projection(hidden)

    def map_checkpoint_name(self, name: str) -> str | None:
        # Writers may keep K/V weights the assistant never uses (it reads the target's KV).
        return None if _UNUSED_KV_TENSOR.match(name) else name


def _float_dtype(module: nn.Module) -> torch.dtype:
    return next(p.dtype for p in module.parameters() if p.is_floating_point())
