"""The Llama family: Llama 2/3, Qwen2 (qkv bias), Qwen3 (q/k norm), Mistral (sliding window).

Module and parameter names follow transformers' checkpoints, except q/k/v
and gate/up, which are fused into one matmul each (``MergedLinear``).
"""

from __future__ import annotations

import torch
from torch import nn

from graphrt.core.attention.base import AttentionBackend, AttentionSpec
from graphrt.core.batch import ForwardBatch
from graphrt.core.memory import KVLayerSpec
from graphrt.core.models.config import LlamaConfig
from graphrt.core.models.layers import (
    GatedMLP,
    MergedLinear,
    RMSNorm,
    RotaryEmbedding,
    rope_inv_freq,
)
from graphrt.core.models.ops import TORCH_OPS, ModelOps, PreNorm
from graphrt.core.parallel.group import SINGLE, TPGroup
from graphrt.core.parallel.layers import (
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelHead,
    vocab_logits,
)


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: LlamaConfig,
        layer_id: int,
        rotary: RotaryEmbedding,
        ops: ModelOps,
        tp: TPGroup = SINGLE,
    ):
        super().__init__()
        c = config
        # Under tensor parallelism each rank holds its heads (q) and KV heads, and their
        # KV: the attention spec, and so the KV pool, are this rank's.
        heads = tp.shard(c.num_heads, "num_attention_heads")
        kv_rows = tp.kv_heads(c.num_kv_heads).scaled(c.head_dim)  # split, or replicated
        kv_heads = kv_rows.size // c.head_dim
        self.q_size = heads * c.head_dim
        self.kv_size = kv_rows.size
        full_q = c.num_heads * c.head_dim
        self.qkv_proj = MergedLinear(
            c.hidden_size,
            {"q_proj": full_q, "k_proj": kv_rows, "v_proj": kv_rows},
            c.qkv_bias,
            ops,
            tp,
        )
        self.o_proj = RowParallelLinear(full_q, c.hidden_size, c.o_proj_bias, tp, ops)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, ops)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, ops)
        self.qk_norm = c.qk_norm
        self.rotary = rotary
        self.ops = ops
        self.spec = AttentionSpec(
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=c.head_dim,
            scaling=c.head_dim**-0.5,
            cache_index=layer_id,
            sliding_window=c.layer_windows[layer_id],
            width_invariant=ops.width_invariant,
        )

    def forward(
        self, x: torch.Tensor, norm: PreNorm, batch: ForwardBatch, attn: AttentionBackend
    ) -> torch.Tensor:
        """x + o_proj(attention(norm(x))): the residual stream after the attention block."""
        s = self.spec
        kv_write = attn.kv_write_target(s, batch)
        if kv_write is not None and not self.qk_norm:
            # The projection, rope and the KV write as one op (CUDA at decode sizes: one
            # GEMV launch where there were two, the GEMV and the rope kernel).
            q = self.ops.linear_rope(
                x, self.qkv_proj.weight, self.qkv_proj.bias, norm=norm,
                positions=batch.positions, cos=self.rotary.cos, sin=self.rotary.sin,
                kv_write=kv_write, num_heads=s.num_heads,
            )  # fmt: skip
            out = attn.attend(q.flatten(1), None, None, s, batch)  # (T, H*D)
            return self.o_proj(out, residual=x)
        q, k, v = self.qkv_proj(x, norm).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, s.num_heads, s.head_dim)  # (T, H, D)
        k = k.view(-1, s.num_kv_heads, s.head_dim)  # (T, Hkv, D)
        if self.qk_norm:  # over head_dim: (T*H, D) rows for the norm kernel
            q = self.q_norm(q.reshape(-1, s.head_dim)).view(-1, s.num_heads, s.head_dim)
            k = self.k_norm(k.reshape(-1, s.head_dim)).view(-1, s.num_kv_heads, s.head_dim)
        if kv_write is not None:  # rope stores k and v in the cache itself: one launch
            v = v.view(-1, s.num_kv_heads, s.head_dim)
            q, _ = self.rotary(batch.positions, q, k, v, kv_write)
            out = attn.attend(q.flatten(1), None, None, s, batch)  # (T, H*D)
        else:
            q, k = self.rotary(batch.positions, q, k)
            out = attn.attend(q.flatten(1), k.flatten(1), v, s, batch)
        return self.o_proj(out, residual=x)


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: LlamaConfig,
        layer_id: int,
        rotary: RotaryEmbedding,
        ops: ModelOps,
        tp: TPGroup = SINGLE,
    ):
        super().__init__()
        c = config
        self.self_attn = LlamaAttention(c, layer_id, rotary, ops, tp)
        self.mlp = GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_act, c.mlp_bias, ops, tp)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, ops)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        # x is the residual stream (T, hidden). Each norm rides in the matmul that reads it
        # and each residual add in the matmul that ends its block: on CUDA at decode sizes
        # both are the GEMV's, and so is rope with the KV write (``linear_rope``): a layer
        # is 6 launches (qkv, attention x2, o, gate/up, down).
        h = self.self_attn(x, self.input_layernorm.pre_norm(), batch, attn)
        return self.mlp(h, self.post_attention_layernorm.pre_norm(), residual=h)


class LlamaBackbone(nn.Module):
    def __init__(self, config: LlamaConfig, ops: ModelOps, tp: TPGroup = SINGLE):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        # One rope table shared by every layer (a buffer, so it follows .to(device)).
        rotary = RotaryEmbedding(
            rope_inv_freq(config.head_dim, config.rope_parameters),
            config.max_position_embeddings,
            ops=ops,
        )
        self.rotary = rotary
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, rotary, ops, tp) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        x = self.embed_tokens(batch.input_ids)  # (T, hidden)
        for layer in self.layers:
            x = layer(x, batch, attn)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    """``forward`` returns final hidden states (T, hidden); ``compute_logits`` the LM head."""

    supports_tp = True  # built with a TPGroup, each rank holds its heads and columns

    def __init__(self, config: LlamaConfig, ops: ModelOps = TORCH_OPS, tp: TPGroup = SINGLE):
        super().__init__()
        self.config = config
        self.tp = tp
        self.model = LlamaBackbone(config, ops, tp)
        self.ops = ops
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = VocabParallelHead(config.hidden_size, config.vocab_size, tp, ops)

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
        c = self.config
        kv_heads = self.model.layers[0].self_attn.spec.num_kv_heads  # this rank's
        return [KVLayerSpec(kv_heads, c.head_dim, i) for i in range(c.num_layers)]

    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        return self.model(batch, attn)

    def next_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """The hidden a speculative draft step is fed: the final hidden itself."""
        return hidden

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """float32 (N, vocab); written into ``out`` when given (graph runners share one
        logits buffer across batch sizes)."""
        # (N, vocab / ranks) -> every rank's columns: (N, vocab), model dtype
        logits = vocab_logits(
            self.tp, self.ops.linear(hidden, self.lm_head_weight, None), self.vocab_size
        )
        return self.ops.float_logits(logits, None, out)
