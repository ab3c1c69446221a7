"""``random:<preset>`` models: real architectures with random weights, built in
memory for smoke runs and benchmarks (no checkpoint, no tokenizer)."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from graphrt.core.errors import CheckpointError
from graphrt.core.models.linear import MergedLinear
from graphrt.core.models.loader import LoadedModel, build_model
from graphrt.core.models.ops import TORCH_OPS, ModelOps
from graphrt.core.models.registry import resolve_architecture
from graphrt.core.parallel.group import SINGLE, TPGroup
from graphrt.core.parallel.layers import take_shard

# Gemma 4's rope per layer type (E2B / E4B): the assistant must rotate as its target does.
GEMMA4_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    "full_attention": {
        "rope_type": "proportional",
        "partial_rotary_factor": 0.25,
        "rope_theta": 1000000.0,
    },
}

PRESETS: dict[str, dict[str, Any]] = {
    # A few hundred thousand parameters: starts in well under a second on CPU.
    "llama-tiny": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 172,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "tie_word_embeddings": False,
        "eos_token_id": 2,
        "bos_token_id": 1,
        "dtype": "float32",
    },
    # The Llama-3.2-1B shape (1.24 B parameters).
    "llama-1b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "tie_word_embeddings": True,
        "eos_token_id": [128001, 128008, 128009],
        "bos_token_id": 128000,
        "dtype": "bfloat16",
    },
    # The Llama-3.1-8B shape (8.03 B parameters).
    "llama-8b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "tie_word_embeddings": False,
        "eos_token_id": [128001, 128008, 128009],
        "bos_token_id": 128000,
        "dtype": "bfloat16",
    },
    # The google/gemma-4-E2B text decoder (~5.1 B parameters, 2.3 B of them the
    # per-layer embedding table): 35 layers, every 5th full attention, the last 20
    # sharing the KV of layers 13 (sliding) and 14 (full).
    "gemma4-e2b": {
        "architectures": ["Gemma4ForCausalLM"],
        "model_type": "gemma4_text",
        "vocab_size": 262144,
        "hidden_size": 1536,
        "intermediate_size": 6144,
        "num_hidden_layers": 35,
        "num_attention_heads": 8,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "global_head_dim": 512,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-6,
        "sliding_window": 512,
        "layer_types": (["sliding_attention"] * 4 + ["full_attention"]) * 7,
        "rope_parameters": GEMMA4_ROPE,
        "num_kv_shared_layers": 20,
        "hidden_size_per_layer_input": 256,
        "vocab_size_per_layer_input": 262144,
        "use_double_wide_mlp": True,
        "attention_k_eq_v": False,
        "enable_moe_block": False,
        "final_logit_softcapping": 30.0,
        "tie_word_embeddings": True,
        "eos_token_id": [1, 106],
        "bos_token_id": 2,
        "pad_token_id": 0,
        "dtype": "bfloat16",
    },
    # A 4-layer MTP assistant shaped to read random:gemma4-e2b's KV (random weights:
    # drafts are rarely accepted; for smoke runs and benchmarks of the draft loop). Like
    # the real E2B and E4B assistants it scores its vocabulary through 2,048 centroids,
    # the top 32 clusters' ~4k tokens a row (a random permutation orders them).
    "gemma4-e2b-assistant": {
        "architectures": ["Gemma4AssistantForCausalLM"],
        "model_type": "gemma4_assistant",
        "backbone_hidden_size": 1536,
        "use_ordered_embeddings": True,
        "num_centroids": 2048,
        "centroid_intermediate_top_k": 32,
        "tie_word_embeddings": True,
        "dtype": "bfloat16",
        "text_config": {
            "model_type": "gemma4_text",
            "vocab_size": 262144,
            "hidden_size": 256,
            "intermediate_size": 2048,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 256,
            "global_head_dim": 512,
            "hidden_activation": "gelu_pytorch_tanh",
            "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-6,
            "sliding_window": 512,
            "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
            "rope_parameters": GEMMA4_ROPE,
            "hidden_size_per_layer_input": 0,
            "vocab_size_per_layer_input": 0,
            "eos_token_id": [1, 106],
        },
    },
}


def preset_hf_config(preset: str) -> dict[str, Any]:
    if preset not in PRESETS:
        raise CheckpointError(
            f"unknown model preset 'random:{preset}'; known: "
            + ", ".join(f"random:{p}" for p in sorted(PRESETS))
        )
    return copy.deepcopy(PRESETS[preset])  # callers may edit nested dicts


def load_random(
    preset: str,
    device: torch.device,
    dtype: torch.dtype | None,
    seed: int = 0,
    ops: ModelOps = TORCH_OPS,
    tp: TPGroup = SINGLE,
    free_bytes: int | None = None,
) -> LoadedModel:
    """Under tensor parallelism every rank draws the whole model's weights, tensor by
    tensor, and keeps its shard: the ranks together hold the model one process gets
    from the same seed (same tokens at any ``tp``)."""
    hf_config = preset_hf_config(preset)
    arch_name, arch = resolve_architecture(hf_config)
    config = arch.parse_config(hf_config, arch_name)
    model = build_model(
        arch.model_class, config, device, dtype or config.dtype, ops, tp, free_bytes
    )
    generator = torch.Generator(device=device).manual_seed(seed)
    modules = dict(model.named_modules())
    for name, param in model.named_parameters():
        module = modules[name.rpartition(".")[0]]
        full = param.data if tp.is_single else param.new_empty(_full_shape(param, module))
        if name.endswith(("norm.weight", "layer_scalar")):  # multiplicative scales start at 1
            full.fill_(1.0)
        elif name.endswith("bias"):
            full.zero_()
        elif name.endswith("token_ordering"):  # an index table: a permutation of the vocabulary
            full.copy_(torch.randperm(full.numel(), generator=generator, device=full.device))
        else:
            # std 0.02, as transformers initialises these models.
            full.normal_(0.0, 0.02, generator=generator)
        if not tp.is_single:
            _keep_shard(param, module, full)
    return LoadedModel(
        model=model,
        config=config,
        source=f"random:{preset}",
        tokenizer_path=None,
        eos_token_ids=config.eos_token_ids,
        batch_invariant=ops.width_invariant,
    )


def _full_shape(param: nn.Parameter, module: nn.Module) -> list[int]:
    """The shape of the whole (unsplit) tensor ``param`` is this rank's part of."""
    shape = list(param.shape)
    if isinstance(module, MergedLinear):  # every projection's whole rows, stacked
        shape[0] = sum(rows.full for rows in module.shard_rows.values())
    elif getattr(param, "tp_dim", None) is not None:
        shape[param.tp_dim] = param.tp_full
    return shape


def _keep_shard(param: nn.Parameter, module: nn.Module, full: torch.Tensor) -> None:
    """Copies this rank's part of ``full`` into ``param``, as the loader cuts a checkpoint."""
    if not isinstance(module, MergedLinear):
        param.data.copy_(take_shard(full, param))
        return
    start = 0
    for shard, rows in module.shard_rows.items():
        module.load_shard(param, shard, full.narrow(0, start, rows.full))
        start += rows.full
