"""Gemma 4 text decoder (E2B / E4B / 31B dense), op for op as transformers 5.24 computes it.

What sets it apart from the Llama family (each point mirrors modeling_gemma4.py):
- RMSNorm scales by ``weight`` (not ``1 + weight``) and multiplies in float32
  before rounding back; ``v_norm`` has no scale at all.
- q and k are normed over head_dim before rope; attention scaling is 1.0.
- Sliding and full layers differ: head dim (full: ``global_head_dim``), rope
  (sliding: default; full: "proportional", rotating only the first
  ``partial_rotary_factor`` of the frequency pairs) and, with
  ``attention_k_eq_v``, full layers take V from the raw K projection.
- The last ``num_kv_shared_layers`` layers compute no K/V: they attend over
  the KV of the last earlier layer of their type (``writes_kv=False``).
- Four norms per block (pre/post attention, pre/post MLP), then a per-layer
  input gate (E2B/E4B), then a learned per-layer scalar.
- Embeddings scaled by sqrt(hidden) rounded to the weight dtype; tied head
  with final logit softcapping.

Tensor parallelism (``tp``): q heads split, KV heads split or replicated
(``TPGroup.kv_heads``), o_proj and down_proj row-parallel, gate/up column-parallel, the
token and per-layer embeddings and the LM head split by vocabulary rows. Norms over the
hidden row, the per-layer-input gate and projections stay whole on every rank.

Module and parameter names follow transformers' checkpoints, except q/k/v and
gate/up, which are fused into one matmul each (``MergedLinear``).
"""

from __future__ import annotations

import re
from typing import NamedTuple

import torch
from torch import nn

from graphrt.core.attention.base import AttentionBackend, AttentionSpec
from graphrt.core.batch import ForwardBatch
from graphrt.core.memory import KVLayerSpec
from graphrt.core.models.gemma4_config import FULL, SLIDING, Gemma4Config
from graphrt.core.models.layers import (
    GatedMLP,
    Linear,
    MergedLinear,
    RotaryEmbedding,
    rope_inv_freq,
)
from graphrt.core.models.ops import TORCH_OPS, ModelOps
from graphrt.core.parallel.group import SINGLE, TPGroup
from graphrt.core.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelHead,
    vocab_logits,
)

# Towers of the multimodal checkpoint graphrt does not run (text-only decoding).
_MULTIMODAL_PREFIXES = (
    "model.vision_tower.",
    "model.audio_tower.",
    "model.embed_vision.",
    "model.embed_audio.",
)
_SHARED_KV_TENSOR = re.compile(r"model\.layers\.(\d+)\.self_attn\.(k_proj|v_proj|k_norm|v_norm)\.")


class GemmaRMSNorm(nn.Module):
    """transformers' Gemma4RMSNorm: float32 norm (pow(-0.5), not rsqrt), times ``weight``
    in float32, then rounded to the input dtype (``ops.gemma_rms_norm``; ``ops.rms_norm``
    rounds before the weight multiply, which differs in bfloat16)."""

    def __init__(self, dim: int, eps: float, with_scale: bool = True, ops: ModelOps = TORCH_OPS):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.gemma_rms_norm(x, self.weight, self.eps)


def proportional_inv_freq(head_dim: int, params: dict) -> torch.Tensor:
    """transformers' "proportional" rope: ``head_dim // 2`` frequencies, of which only the
    first ``partial_rotary_factor`` share rotate; the rest are 0 (cos 1, sin 0: pass-through).
    Rotate-half pairs dim i with i + head_dim/2, so the table spans the whole head."""
    theta = float(params["rope_theta"])
    factor = float(params.get("factor", 1.0))
    rope_angles = int(float(params.get("partial_rotary_factor", 1.0)) * head_dim // 2)
    # On CPU, as rope_inv_freq (see RotaryEmbedding).
    exponents = torch.arange(0, 2 * rope_angles, 2, dtype=torch.int64, device="cpu").float()
    exponents = exponents / head_dim
    inv_freq = 1.0 / (theta**exponents)
    nope = head_dim // 2 - rope_angles
    if nope > 0:
        inv_freq = torch.cat([inv_freq, torch.zeros(nope, dtype=torch.float32, device="cpu")])
    return inv_freq / factor


def _rotary(config: Gemma4Config, layer_type: str, ops: ModelOps) -> RotaryEmbedding:
    params = config.rope_parameters[layer_type]
    head_dim = config.head_dims[config.layer_types.index(layer_type)]
    if params["rope_type"] == "proportional":
        inv_freq = proportional_inv_freq(head_dim, params)
    else:  # "default": transformers' Gemma 4 ignores partial_rotary_factor here
        inv_freq = rope_inv_freq(head_dim, {"rope_type": "default", **params})
    return RotaryEmbedding(inv_freq, config.max_position_embeddings, ops=ops)


class Gemma4Attention(nn.Module):
    def __init__(
        self,
        config: Gemma4Config,
        layer_id: int,
        rotary: RotaryEmbedding,
        ops: ModelOps = TORCH_OPS,
        tp: TPGroup = SINGLE,
        reads_target_kv: bool = False,
    ):
        """``reads_target_kv``: attend over another model's KV, computing no K/V (the MTP
        assistant reads its target's cache: ``cache_index`` is -1 until it is bound)."""
        super().__init__()
        c = config
        src = c.kv_source(layer_id)
        self.shares_kv = src != layer_id or reads_target_kv
        self.k_eq_v = c.attention_k_eq_v and c.layer_types[layer_id] == FULL
        head_dim = c.head_dims[src]
        # This rank's q heads and the KV heads they read (split, or replicated when fewer
        # than ranks): its KV pool, and the KV that sharing layers and the assistant read,
        # hold these heads only. Counts that do not split raise a one-line UsageError here.
        heads = tp.shard(c.num_heads, "num_attention_heads")
        kv_rows = tp.kv_heads(c.kv_heads[src]).scaled(head_dim)
        full_q = c.num_heads * head_dim
        self.q_size = heads * head_dim
        self.kv_size = kv_rows.size
        self.ops = ops
        if self.shares_kv:  # no K/V projections or norms at all (transformers has none either)
            self.q_proj = ColumnParallelLinear(c.hidden_size, full_q, c.attention_bias, tp, ops)
        else:
            shards = {"q_proj": full_q, "k_proj": kv_rows}
            if not self.k_eq_v:
                shards["v_proj"] = kv_rows
            self.qkv_proj = MergedLinear(c.hidden_size, shards, c.attention_bias, ops, tp)
            self.k_norm = GemmaRMSNorm(head_dim, c.rms_norm_eps, ops=ops)
            # v is normed without a scale: no parameters, done inside gemma_qkv_norm_rope.
        self.q_norm = GemmaRMSNorm(head_dim, c.rms_norm_eps, ops=ops)  # per head: whole
        self.o_proj = RowParallelLinear(full_q, c.hidden_size, c.attention_bias, tp, ops)
        self.rotary = rotary
        self.spec = AttentionSpec(
            num_heads=heads,
            num_kv_heads=kv_rows.size // head_dim,
            head_dim=head_dim,
            scaling=1.0,  # q and k are RMS-normed; transformers uses no 1/sqrt(d)
            # producers are layers 0..first_kv_shared_layer-1: buffer i = layer i
            cache_index=-1 if reads_target_kv else src,
            sliding_window=c.sliding_window if c.layer_types[layer_id] == SLIDING else None,
            writes_kv=not self.shares_kv,
            width_invariant=ops.width_invariant,
        )

    @property
    def in_proj(self) -> Linear:
        """The projection of the normed stream: q, k and v merged, or q alone."""
        return self.q_proj if self.shares_kv else self.qkv_proj

    def forward(
        self, projected: torch.Tensor, batch: ForwardBatch, attn: AttentionBackend
    ) -> torch.Tensor:
        """``projected``: ``in_proj`` of the layer's normed input, run by the layer (which
        may fuse it with the norms before it)."""
        s = self.spec
        rope = self.rotary
        if self.shares_kv:
            q = projected.view(-1, s.num_heads, s.head_dim)  # (T, H, D)
            k = v = k_weight = None
        else:
            qkv = projected
            if self.k_eq_v:
                q, k = qkv.split([self.q_size, self.kv_size], dim=-1)
                v = k  # V is the raw K projection, normed without a scale
            else:
                q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.view(-1, s.num_heads, s.head_dim)  # (T, H, D)
            k = k.view(-1, s.num_kv_heads, s.head_dim)  # (T, Hkv, D)
            v = v.view(-1, s.num_kv_heads, s.head_dim)
            k_weight = self.k_norm.weight
        # q/k norms with scale, v's without, rope on q and k: one op, which also stores k
        # and v in the KV cache where the backend lets it (both then come back None).
        kv_write = None if k is None else attn.kv_write_target(s, batch)
        q, k, v = self.ops.gemma_qkv_norm_rope(
            batch.positions,
            q,
            k,
            v,
            self.q_norm.weight,
            k_weight,
            self.q_norm.eps,
            rope.cos,
            rope.sin,
            kv_write=kv_write,
        )
        kv = (None, None) if k is None else (k.flatten(1), v.flatten(1))
        out = attn.attend(q.flatten(1), *kv, s, batch)  # (T, H*D), this rank's heads
        return self.o_proj(out)  # (T, hidden), summed over the ranks


class Gemma4DecoderLayer(nn.Module):
    def __init__(
        self,
        config: Gemma4Config,
        layer_id: int,
        rotary: RotaryEmbedding,
        ops: ModelOps,
        tp: TPGroup = SINGLE,
        reads_target_kv: bool = False,
    ):
        super().__init__()
        c = config
        self.self_attn = Gemma4Attention(c, layer_id, rotary, ops, tp, reads_target_kv)
        wide = c.use_double_wide_mlp and c.is_kv_consumer(layer_id)
        intermediate = c.intermediate_size * (2 if wide else 1)
        self.mlp = GatedMLP(c.hidden_size, intermediate, c.hidden_act, ops=ops, tp=tp)
        # Every norm of the model uses rms_norm_eps; the fused ops take that one eps for
        # the block's post norm and the norm after it.
        self.eps = eps = c.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(c.hidden_size, eps, ops=ops)
        self.post_attention_layernorm = GemmaRMSNorm(c.hidden_size, eps, ops=ops)
        self.pre_feedforward_layernorm = GemmaRMSNorm(c.hidden_size, eps, ops=ops)
        self.post_feedforward_layernorm = GemmaRMSNorm(c.hidden_size, eps, ops=ops)
        self.has_per_layer_input = bool(c.hidden_size_per_layer_input)
        if self.has_per_layer_input:
            ple = c.hidden_size_per_layer_input
            self.act = c.hidden_act
            # Whole on every rank: hidden x ple each (small), and its output is normed over
            # the hidden row; splitting them would cost one more all-reduce per layer.
            self.per_layer_input_gate = Linear(c.hidden_size, ple, False, ops)
            self.per_layer_projection = Linear(ple, c.hidden_size, False, ops)
            self.post_per_layer_input_norm = GemmaRMSNorm(c.hidden_size, eps, ops=ops)
        # A persistent buffer in transformers (saved in checkpoints): a parameter here so
        # that the loader fills it and checks it is present.
        self.layer_scalar = nn.Parameter(torch.ones(1))
        self.ops = ops

    def forward(
        self,
        stream: torch.Tensor | PendingResidual,
        per_layer_input: torch.Tensor | None,
        batch: ForwardBatch,
        attn: AttentionBackend,
    ) -> PendingResidual:
        """The residual stream in, pending or whole (the embedding), and out pending: each
        norm runs in the op of the matmul after it, so the layer's last residual add, its
        scalar and the next layer's input norm run in the next layer's input projection."""
        ops, eps = self.ops, self.eps
        proj = self.self_attn.in_proj
        if isinstance(stream, PendingResidual):
            # x = the stream after the layer before, and its input norm and in_proj: one op.
            # HAZARD: ops on proj's parameters, not proj(): right for Linear, MergedLinear and
            # ColumnParallelLinear (no collective); a layer with its own forward would break.
            x, projected = ops.gemma_residual_linear(
                stream.h, stream.residual, stream.weight, eps, proj.weight, proj.bias,
                scalar=stream.scalar, next_weight=self.input_layernorm.weight,
            )  # fmt: skip
        else:  # the embedding: nothing to add
            x = stream
            projected = proj(self.input_layernorm(x))
        # Sandwich norms: each block's output is normed again before the residual add.
        h = self.self_attn(projected, batch, attn)
        # x = x + post_attention_layernorm(h), and the MLP's gate/up on its
        # pre_feedforward_layernorm: one op (CUDA at one row: the GEMV computes both norms)
        mlp = self.mlp
        x, h = ops.gemma_residual_linear(
            h, x, self.post_attention_layernorm.weight, eps, mlp.gate_up_proj.weight,
            next_weight=self.pre_feedforward_layernorm.weight, act=mlp.act,
        )  # fmt: skip
        h = mlp.down_proj(h)  # (T, hidden), summed over the ranks
        if self.has_per_layer_input:
            # x = x + post_feedforward_layernorm(h), and the per-layer input's gate on it
            # (T, ple): one op (CUDA at one row: the gate's GEMV computes x itself)
            x, h = ops.gemma_residual_linear(
                h, x, self.post_feedforward_layernorm.weight, eps,
                self.per_layer_input_gate.weight, act=self.act, up=per_layer_input,
            )  # fmt: skip
            h = self.per_layer_projection(h)
            last_norm = self.post_per_layer_input_norm
        else:
            last_norm = self.post_feedforward_layernorm
        return PendingResidual(h, x, last_norm.weight, self.layer_scalar)


class PendingResidual(NamedTuple):
    """A layer's output stream not yet formed: ``(residual + gemma_norm(h) * weight) *
    scalar``, left to the op that reads it next (the next layer's input projection, or
    the final norm), so that its norms and that op's run as one."""

    h: torch.Tensor  # (T, hidden): the layer's last block output
    residual: torch.Tensor  # (T, hidden): the stream before that block
    weight: torch.Tensor  # (hidden,): the block's post norm
    scalar: torch.Tensor  # (1,): the layer scalar


def run_layers(
    layers: nn.ModuleList,
    x: torch.Tensor,
    per_layer: torch.Tensor | None,
    batch: ForwardBatch,
    attn: AttentionBackend,
    final_norm: GemmaRMSNorm,
) -> torch.Tensor:
    """The decoder stack from the embedding ``x`` (T, hidden) to ``final_norm`` of its output."""
    stream = x
    for i, layer in enumerate(layers):
        layer_input = per_layer[:, i] if per_layer is not None else None  # (T, ple)
        stream = layer(stream, layer_input, batch, attn)
    ops = layers[-1].ops
    _, normed = ops.gemma_residual_norm(
        stream.h, stream.residual, stream.weight, final_norm.eps, stream.scalar, final_norm.weight
    )
    return normed


class Gemma4Backbone(nn.Module):
    def __init__(self, config: Gemma4Config, ops: ModelOps, tp: TPGroup = SINGLE):
        super().__init__()
        c = config
        self.config = c
        self.ops = ops
        self.tp = tp
        self.embed_tokens = VocabParallelEmbedding(c.vocab_size, c.hidden_size, tp)
        # float32 scalars, rounded to the weight dtype when used (.to() converts them too),
        # as transformers' Gemma4TextScaledWordEmbedding does.
        self.register_buffer("embed_scale", torch.tensor(c.hidden_size**0.5), persistent=False)
        # One rope table per layer type, shared by the layers of that type.
        self.rotary = nn.ModuleDict({t: _rotary(c, t, ops) for t in sorted(set(c.layer_types))})
        self.layers = nn.ModuleList(
            Gemma4DecoderLayer(c, i, self.rotary[c.layer_types[i]], ops, tp)
            for i in range(c.num_layers)
        )
        self.norm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps, ops=ops)
        if c.hidden_size_per_layer_input:
            ple, n = c.hidden_size_per_layer_input, c.num_layers
            # vocab x (layers * ple): the largest table of E2B (2.3 B of its parameters), split
            # by vocabulary rows like the token embedding.
            self.embed_tokens_per_layer = VocabParallelEmbedding(
                c.vocab_size_per_layer_input, n * ple, tp
            )
            self.register_buffer("per_layer_embed_scale", torch.tensor(ple**0.5), persistent=False)
            # Whole on every rank: every rank needs every layer's slice of its output (split,
            # it would need an all-gather; E2B's 35 layers do not split evenly anyway).
            self.per_layer_model_projection = Linear(c.hidden_size, n * ple, False, ops)
            self.per_layer_projection_norm = GemmaRMSNorm(ple, c.rms_norm_eps, ops=ops)

    def embed(self, input_ids: torch.Tensor, tail: torch.Tensor | None = None) -> torch.Tensor:
        """The scaled token embedding (T, hidden), with ``tail`` (T, E) beside it when given
        (T, hidden + E): one launch where the vocabulary is whole (a decode step's first
        kernel; an MTP assistant's input, each of its draft steps)."""
        weight = self.embed_tokens.weight
        if self.tp.is_single:
            return self.ops.scaled_embed(input_ids, weight, self.embed_scale, tail)
        # The scale multiplies each whole row, after the ranks' rows are summed: exact.
        x = self.embed_tokens(input_ids) * self.embed_scale.to(weight.dtype)  # (T, hidden)
        return x if tail is None else torch.cat([x, tail.to(x.dtype)], dim=-1)

    def per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """(T, layers, ple): token-identity embedding plus a projection of the scaled embedding."""
        c = self.config
        ids, table = input_ids, self.embed_tokens_per_layer.weight  # gathered, one row per token
        if not self.tp.is_single:
            # This rank holds a slice of the vocabulary: the tokens' rows come from the
            # ranks first (an all-reduce of one owner's row and zeros: exact), and the op
            # then reads row t of them for token t. The rest of its math is per row.
            table = self.embed_tokens_per_layer(input_ids)  # (T, layers * ple)
            ids = torch.arange(input_ids.shape[0], device=input_ids.device)
        return self.ops.gemma_per_layer_inputs(
            ids,
            table,
            self.per_layer_embed_scale.to(table.dtype),
            self.per_layer_model_projection(x),  # (T, layers * ple)
            c.hidden_size**-0.5,
            self.per_layer_projection_norm.weight,
            c.rms_norm_eps,
        )

    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        x = self.embed(batch.input_ids)
        per_layer = None
        if self.config.hidden_size_per_layer_input:
            per_layer = self.per_layer_inputs(batch.input_ids, x)
        # (T, hidden): the final normed hidden, what the LM head and the assistant read
        return run_layers(self.layers, x, per_layer, batch, attn, self.norm)


class Gemma4ForCausalLM(nn.Module):
    """``forward`` returns the final normed hidden states (T, hidden); ``compute_logits``
    the tied LM head with final logit softcapping."""

    supports_tp = True  # built with a TPGroup, each rank holds its heads, columns and rows

    def __init__(self, config: Gemma4Config, ops: ModelOps = TORCH_OPS, tp: TPGroup = SINGLE):
        super().__init__()
        self.config = config
        self.tp = tp
        self.model = Gemma4Backbone(config, ops, tp)
        self.ops = ops
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else VocabParallelHead(config.hidden_size, config.vocab_size, tp, ops)
        )

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def max_context_len(self) -> int:
        return self.config.max_position_embeddings

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def kv_layer_specs(self) -> list[KVLayerSpec]:
        # Layers before first_kv_shared_layer own buffers 0..n-1, each sized to its own
        # KV heads (this rank's) and head dim; KV-sharing layers own none (cache_index None).
        specs = [layer.self_attn.spec for layer in self.model.layers]
        return [
            KVLayerSpec(s.num_kv_heads, s.head_dim, s.cache_index if s.writes_kv else None)
            for s in specs
        ]

    def shared_kv_layers(self) -> dict[str, AttentionSpec]:
        """Layer type -> AttentionSpec of the last layer of that type that writes KV: the
        KV the assistant's layers (and this model's KV-sharing layers) attend over.
        Read cache_index / head_dim / num_kv_heads (this rank's) / sliding_window from it."""
        return {
            t: self.model.layers[layer].self_attn.spec
            for t, layer in self.config.kv_producers.items()
        }

    def embed_tokens_scaled(self, input_ids: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
        """[the scaled token embedding, ``tail``] (T, hidden + E), as the target feeds its
        MTP assistant (``tail``: the hidden that produced each token)."""
        return self.model.embed(input_ids, tail)

    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        return self.model(batch, attn)

    def next_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """The hidden the MTP assistant is seeded with: the final normed hidden itself."""
        return hidden

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """float32 (N, vocab), softcapped in the model dtype as transformers does; written
        into ``out`` when given (graph runners share one logits buffer across batch sizes)."""
        # (N, vocab / ranks) -> every rank's columns: (N, vocab), model dtype; softcapped
        # after the gather (elementwise, so either order gives the same numbers).
        logits = vocab_logits(
            self.tp, self.ops.linear(hidden, self.lm_head_weight, None), self.vocab_size
        )
        return self.ops.float_logits(logits, self.config.final_logit_softcapping, out)

    def map_checkpoint_name(self, name: str) -> str | None:
        """Checkpoint tensor name -> this model's name; None skips the tensor."""
        prefix = self.config.checkpoint_prefix
        if prefix != "model.":
            if name.startswith(_MULTIMODAL_PREFIXES):
                return None  # vision / audio towers: graphrt decodes text only
            if name.startswith(prefix):
                name = "model." + name[len(prefix) :]
            elif name.startswith("model."):
                return f"<not the language model>{name}"  # the loader reports it as unexpected
        shared = _SHARED_KV_TENSOR.match(name)
        if shared and self.config.is_kv_consumer(int(shared.group(1))):
            return None  # some writers keep unused K/V weights on KV-sharing layers
        return name
