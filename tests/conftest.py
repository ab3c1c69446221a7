"""Session fixtures: tiny transformers checkpoints, built and saved once per run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# `from helpers import ...` must work under any --import-mode (importlib does
# not put test directories on sys.path) and from nox.
_TESTS_DIR = str(Path(__file__).resolve().parent)
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)

from helpers import LLAMA3_ROPE, MISTRAL_WINDOW, TINY, Checkpoint, make_checkpoint  # noqa: E402


def _save(tmp_path_factory, name: str, config, **kwargs) -> Checkpoint:
    return make_checkpoint(tmp_path_factory.mktemp(name), config, **kwargs)


@pytest.fixture(scope="session")
def llama_gqa_untied(tmp_path_factory) -> Checkpoint:
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        **{**TINY, "num_hidden_layers": 3},
        tie_word_embeddings=False,
        rope_scaling=dict(LLAMA3_ROPE),
    )
    return _save(tmp_path_factory, "llama_gqa_untied", cfg, seed=1)


@pytest.fixture(scope="session")
def llama_tied(tmp_path_factory) -> Checkpoint:
    from transformers import LlamaConfig

    cfg = LlamaConfig(**TINY, tie_word_embeddings=True)
    return _save(tmp_path_factory, "llama_tied", cfg, seed=2)


@pytest.fixture(scope="session")
def qwen2(tmp_path_factory) -> Checkpoint:
    from transformers import Qwen2Config

    cfg = Qwen2Config(**TINY, tie_word_embeddings=False)  # q/k/v carry biases
    return _save(tmp_path_factory, "qwen2", cfg, seed=3)


@pytest.fixture(scope="session")
def qwen3(tmp_path_factory) -> Checkpoint:
    from transformers import Qwen3Config

    # head_dim 32 != hidden / heads (16): q/k/v/o shapes differ from the hidden size.
    cfg = Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=False)
    return _save(tmp_path_factory, "qwen3", cfg, seed=4)


@pytest.fixture(scope="session")
def mistral_swa(tmp_path_factory) -> Checkpoint:
    from transformers import MistralConfig

    cfg = MistralConfig(**TINY, sliding_window=MISTRAL_WINDOW, tie_word_embeddings=False)
    return _save(tmp_path_factory, "mistral_swa", cfg, seed=5)


@pytest.fixture(scope="session")
def llama_sharded(tmp_path_factory) -> Checkpoint:
    from transformers import LlamaConfig

    cfg = LlamaConfig(**TINY, tie_word_embeddings=False)
    # ~100 KB shards: the 300x64 float32 embedding alone is 77 KB, so several files.
    return _save(tmp_path_factory, "llama_sharded", cfg, seed=6, max_shard_size="100KB")
