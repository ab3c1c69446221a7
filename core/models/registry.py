"""Architectures graphrt implements, keyed by config.json ``architectures[0]``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from graphrt.core.errors import CheckpointError, UnsupportedModelError
from graphrt.core.models.config import llama_config_from_hf
from graphrt.core.models.gemma4 import Gemma4ForCausalLM
from graphrt.core.models.gemma4_assistant import (
    Gemma4AssistantForCausalLM,
    gemma4_assistant_config_from_hf,
)
from graphrt.core.models.gemma4_config import gemma4_config_from_hf
from graphrt.core.models.llama import LlamaForCausalLM


@dataclass(frozen=True)
class Architecture:
    parse_config: Callable[[dict[str, Any], str], Any]
    model_class: Callable[[Any], nn.Module]


_LLAMA = Architecture(llama_config_from_hf, LlamaForCausalLM)
# Gemma 4 text; the multimodal checkpoint loads its language model only.
_GEMMA4 = Architecture(gemma4_config_from_hf, Gemma4ForCausalLM)

ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": _LLAMA,
    "Qwen2ForCausalLM": _LLAMA,
    "Qwen3ForCausalLM": _LLAMA,
    "MistralForCausalLM": _LLAMA,
    "Gemma4ForCausalLM": _GEMMA4,
    "Gemma4ForConditionalGeneration": _GEMMA4,
    "Gemma4AssistantForCausalLM": Architecture(
        gemma4_assistant_config_from_hf, Gemma4AssistantForCausalLM
    ),
}


def resolve_architecture(hf_config: dict[str, Any]) -> tuple[str, Architecture]:
    names = hf_config.get("architectures") or []
    for name in names:
        if name in ARCHITECTURES:
            return name, ARCHITECTURES[name]
    supported = ", ".join(sorted(ARCHITECTURES))
    if not names:  # not an unsupported model: a config that does not say which it is
        raise CheckpointError(
            f"config.json has no 'architectures' list (model_type "
            f"{hf_config.get('model_type')!r}); graphrt reads it to pick one of {supported}"
        )
    raise UnsupportedModelError(
        f"unsupported architecture {', '.join(names)}; graphrt supports {supported}"
    )
