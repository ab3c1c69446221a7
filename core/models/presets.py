"""``random:<preset>`` models: real architectures with random weights, built in
memory for smoke runs and benchmarks (no checkpoint, no tokenizer)."""

from __future__ import annotations

import copy
from typing import Any

import torch

from graphrt.core.errors import CheckpointError
from graphrt.core.models.loader import LoadedModel, build_model
from graphrt.core.models.ops import TORCH_OPS, ModelOps
from graphrt.core.models.registry import resolve_architecture

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
) -> LoadedModel:
    hf_config = preset_hf_config(preset)
    arch_name, arch = resolve_architecture(hf_config)
    config = arch.parse_config(hf_config, arch_name)
    model = build_model(arch.model_class, config, device, dtype or config.dtype, ops)
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
        elif name.endswith("bias"):
            param.data.zero_()
        else:
            # std 0.02, as transformers initialises these models.
            param.data.normal_(0.0, 0.02, generator=generator)
    return LoadedModel(
        model=model,
        config=config,
        source=f"random:{preset}",
        tokenizer_path=None,
        eos_token_ids=config.eos_token_ids,
    )
