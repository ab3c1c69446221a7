"""Architectures graphrt implements, keyed by config.json ``architectures[0]``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from graphrt.core.errors import UnsupportedModelError
from graphrt.core.models.config import llama_config_from_hf
from graphrt.core.models.llama import LlamaForCausalLM


@dataclass(frozen=True)
class Architecture:
    parse_config: Callable[[dict[str, Any], str], Any]
    model_class: Callable[[Any], nn.Module]


_LLAMA = Architecture(llama_config_from_hf, LlamaForCausalLM)

ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": _LLAMA,
    "Qwen2ForCausalLM": _LLAMA,
    "Qwen3ForCausalLM": _LLAMA,
    "MistralForCausalLM": _LLAMA,
}


def resolve_architecture(hf_config: dict[str, Any]) -> tuple[str, Architecture]:
    names = hf_config.get("architectures") or []
    for name in names:
        if name in ARCHITECTURES:
            return name, ARCHITECTURES[name]
    shown = ", ".join(names) if names else f"model_type {hf_config.get('model_type')!r}"
    raise UnsupportedModelError(
        f"unsupported architecture {shown}; graphrt supports {', '.join(sorted(ARCHITECTURES))}"
    )
