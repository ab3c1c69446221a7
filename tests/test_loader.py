"""Checkpoint loading (DESIGN.md layer 2): clear one-line errors for every bad checkpoint,
no pickle loading, random presets, dtype selection."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import CPU, make_tokenizer
from safetensors.torch import load_file, save_file

from graphrt.core.errors import CheckpointError, GraphrtError, UnsupportedModelError
from graphrt.core.models import load_model
from graphrt.core.models.loader import resolve_dtype
from graphrt.core.models.presets import preset_hf_config
from graphrt.core.models.registry import resolve_architecture

LAYER0_Q = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture
def ckpt(llama_gqa_untied, tmp_path) -> Path:
    """A private, writable copy of a good single-file checkpoint."""
    return Path(shutil.copytree(llama_gqa_untied.path, tmp_path / "ckpt"))


def _load_error(path, error=CheckpointError, dtype=torch.float32) -> str:
    with pytest.raises(error) as info:
        load_model(str(path), CPU, dtype)
    message = str(info.value)
    assert message and "\n" not in message, f"not one line: {message!r}"
    return message


def _edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is _DELETE:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (path / "config.json").write_text(json.dumps(cfg))


_DELETE = object()


def _edit_tensors(path: Path, edit) -> None:
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def test_good_checkpoint_loads(ckpt):
    loaded = load_model(str(ckpt), CPU, torch.float32)
    assert loaded.source == str(ckpt)
    assert loaded.config.architecture == "LlamaForCausalLM"
    assert loaded.tokenizer_path is None  # no tokenizer.json written


def test_missing_directory(tmp_path):
    missing = tmp_path / "nope"
    assert str(missing) in _load_error(missing)


def test_file_instead_of_directory(tmp_path):
    file = tmp_path / "weights.safetensors"
    file.write_bytes(b"")
    assert str(file) in _load_error(file)


def test_missing_config(ckpt):
    (ckpt / "config.json").unlink()
    assert "config.json" in _load_error(ckpt)


@pytest.mark.parametrize("text", ["{not json", "", "[1, 2]"])
def test_malformed_config_json(ckpt, text):
    (ckpt / "config.json").write_text(text)
    assert "config.json" in _load_error(ckpt)


def test_config_missing_required_field(ckpt):
    _edit_config(ckpt, hidden_size=_DELETE)
    assert "hidden_size" in _load_error(ckpt)


@pytest.mark.parametrize(
    "changes",
    [
        {"vocab_size": "300"},  # a string where an int belongs
        {"num_attention_heads": 0, "head_dim": _DELETE},  # head_dim = hidden // 0
    ],
    ids=["string-vocab_size", "zero-heads"],
)
def test_config_with_invalid_values(ckpt, changes):
    """A config.json whose values are wrong is a bad checkpoint: a CheckpointError, not a traceback."""
    _edit_config(ckpt, **changes)
    message = _load_error(ckpt)
    assert any(key in message for key in changes), message


def test_unsupported_architecture(ckpt):
    _edit_config(ckpt, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    message = _load_error(ckpt, UnsupportedModelError)
    assert "GPT2LMHeadModel" in message
    assert "LlamaForCausalLM" in message  # says what is supported


def test_no_architectures_names_model_type(ckpt):
    """A config without 'architectures' is not "unsupported": it says nothing; the line
    says what is missing (exit 3, CheckpointError)."""
    _edit_config(ckpt, architectures=_DELETE, model_type="gpt2")
    message = _load_error(ckpt, CheckpointError)
    assert "no 'architectures' list" in message and "gpt2" in message
    assert "unsupported" not in message


def test_unsupported_rope_type(ckpt):
    """A rope scaling graphrt does not implement is an unsupported model, not a crash."""
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
    _edit_config(ckpt, rope_parameters=rope, rope_scaling=_DELETE)
    assert "yarn" in _load_error(ckpt, UnsupportedModelError)


def test_missing_tensor(ckpt):
    _edit_tensors(ckpt, lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    message = _load_error(ckpt)
    assert "missing" in message and "model.layers.1.mlp.down_proj.weight" in message


def test_missing_fused_shard(ckpt):
    """k_proj is loaded into the fused qkv matmul; its absence is still named."""
    _edit_tensors(ckpt, lambda t: t.pop("model.layers.0.self_attn.k_proj.weight"))
    assert "model.layers.0.self_attn.k_proj.weight" in _load_error(ckpt)


def test_untied_checkpoint_without_lm_head(ckpt):
    _edit_tensors(ckpt, lambda t: t.pop("lm_head.weight"))
    assert "lm_head.weight" in _load_error(ckpt)


def test_unexpected_tensor(ckpt):
    name = "model.layers.0.self_attn.rogue.weight"
    _edit_tensors(ckpt, lambda t: t.__setitem__(name, torch.zeros(4, 4)))
    message = _load_error(ckpt)
    assert "unexpected" in message and name in message


@pytest.mark.parametrize("name", [LAYER0_Q, "model.norm.weight", "lm_head.weight"])
def test_misshaped_tensor(ckpt, name):
    def edit(tensors):
        tensors[name] = torch.zeros(*[d + 1 for d in tensors[name].shape])

    _edit_tensors(ckpt, edit)
    message = _load_error(ckpt)
    assert name in message and "shape" in message


def test_only_pickle_weights_are_refused(ckpt):
    model = load_model(str(ckpt), CPU, torch.float32).model
    (ckpt / "model.safetensors").unlink()
    torch.save(model.state_dict(), ckpt / "pytorch_model.bin")
    message = _load_error(ckpt)
    assert "pytorch_model.bin" in message and "safetensors" in message


def test_no_weights_at_all(ckpt):
    (ckpt / "model.safetensors").unlink()
    assert "safetensors" in _load_error(ckpt)


def test_corrupt_safetensors_file(ckpt):
    (ckpt / "model.safetensors").write_bytes(b"\x00" * 64)
    assert "model.safetensors" in _load_error(ckpt)


def test_index_naming_missing_shard(llama_sharded, tmp_path):
    path = Path(shutil.copytree(llama_sharded.path, tmp_path / "sharded"))
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    (path / shard).unlink()
    message = _load_error(path)
    assert shard in message and "missing" in message


def test_malformed_index(llama_sharded, tmp_path):
    path = Path(shutil.copytree(llama_sharded.path, tmp_path / "sharded"))
    (path / "model.safetensors.index.json").write_text("{}")
    assert "index" in _load_error(path)


def test_tied_checkpoint_with_redundant_lm_head_loads(llama_tied, tmp_path):
    """Some writers save the tied head anyway; it is the embedding and is skipped."""
    path = Path(shutil.copytree(llama_tied.path, tmp_path / "tied"))
    _edit_tensors(
        path, lambda t: t.__setitem__("lm_head.weight", t["model.embed_tokens.weight"].clone())
    )
    loaded = load_model(str(path), CPU, torch.float32)
    assert loaded.model.lm_head is None


def test_tokenizer_and_generation_eos_are_found(ckpt):
    make_tokenizer(ckpt, 300)
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    loaded = load_model(str(ckpt), CPU, torch.float32)
    assert loaded.tokenizer_path == ckpt / "tokenizer.json"
    assert loaded.eos_token_ids == (2, 7)


def test_make_tokenizer_round_trip(tmp_path):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(make_tokenizer(tmp_path, 300)))
    assert tokenizer.get_vocab_size() == 300
    ids = tokenizer.encode("hello world w0").ids
    assert all(0 <= i < 300 for i in ids) and len(ids) == 3
    assert tokenizer.decode(ids) == "hello world w0"
    assert tokenizer.token_to_id("</s>") == 2


# ---- dtypes -------------------------------------------------------------------


def test_dtype_none_uses_checkpoint_dtype(ckpt):
    assert _param_dtypes(load_model(str(ckpt), CPU, None)) == {torch.float32}
    _edit_config(ckpt, dtype="bfloat16")
    assert _param_dtypes(load_model(str(ckpt), CPU, None)) == {torch.bfloat16}


def test_explicit_bfloat16(ckpt):
    loaded = load_model(str(ckpt), CPU, torch.bfloat16)
    assert _param_dtypes(loaded) == {torch.bfloat16}


def test_unsupported_checkpoint_dtype(ckpt):
    _edit_config(ckpt, dtype="float64")
    assert "float64" in _load_error(ckpt, dtype=None)


def _param_dtypes(loaded) -> set[torch.dtype]:
    return {p.dtype for p in loaded.model.parameters()}


@pytest.mark.parametrize(
    ("name", "checkpoint", "device_default", "expected"),
    [
        ("auto", torch.bfloat16, torch.float32, torch.float32),  # CPU: float32 regardless
        ("auto", torch.bfloat16, torch.float16, torch.bfloat16),  # accelerator: checkpoint's
        ("auto", None, torch.bfloat16, torch.bfloat16),  # no checkpoint dtype: device's
        ("float16", torch.bfloat16, torch.float32, torch.float16),  # explicit wins
        ("bfloat16", None, torch.float32, torch.bfloat16),
        ("float32", torch.bfloat16, torch.bfloat16, torch.float32),
    ],
)
def test_resolve_dtype(name, checkpoint, device_default, expected):
    assert resolve_dtype(name, checkpoint, device_default) == expected


def test_resolve_dtype_rejects_unknown_name():
    with pytest.raises(GraphrtError, match="float64"):
        resolve_dtype("float64", None, torch.float32)


# ---- random presets -------------------------------------------------------------


def test_random_tiny_preset():
    a = load_model("random:llama-tiny", CPU)
    b = load_model("random:llama-tiny", CPU)
    c = load_model("random:llama-tiny", CPU, seed=1)
    assert a.source == "random:llama-tiny" and a.tokenizer_path is None
    assert a.config.vocab_size == 512 and a.eos_token_ids == (2,)
    pa, pb, pc = (dict(m.model.named_parameters()) for m in (a, b, c))
    name = "model.layers.0.self_attn.qkv_proj.weight"
    assert torch.equal(pa[name], pb[name])  # same seed, same weights
    assert not torch.equal(pa[name], pc[name])


def test_unknown_preset():
    with pytest.raises(CheckpointError) as info:
        load_model("random:llama-huge", CPU)
    message = str(info.value)
    assert "random:llama-huge" in message and "random:llama-tiny" in message
    assert "\n" not in message


def test_llama_1b_preset_shape():
    # Only the config: allocating 1.24 B parameters has no place in a unit test.
    hf = preset_hf_config("llama-1b")
    arch_name, arch = resolve_architecture(hf)
    config = arch.parse_config(hf, arch_name)
    assert config.num_layers == 16
    assert config.hidden_size == 2048
    assert config.num_heads == 32 and config.num_kv_heads == 8
    assert config.head_dim == 64
    assert config.vocab_size == 128256
    assert config.tie_word_embeddings
    assert config.dtype == torch.bfloat16
    assert config.rope_parameters["rope_type"] == "llama3"
    assert preset_hf_config("llama-1b") is not preset_hf_config("llama-1b")  # callers get copies


def test_llama_8b_preset_is_the_llama_3_1_8b_shape():
    hf = preset_hf_config("llama-8b")
    arch_name, arch = resolve_architecture(hf)
    config = arch.parse_config(hf, arch_name)
    with torch.device("meta"):  # shapes only: no 8 B parameters allocated
        model = arch.model_class(config)
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248  # Llama-3.1-8B's count
    assert not config.tie_word_embeddings
    assert config.rope_parameters["factor"] == 8.0


def test_sizing_every_preset_runs_no_arithmetic_on_the_meta_device():
    """The memory check builds the model on the meta device first; one arithmetic op on a
    meta tensor (a rope table) runs a Python decomposition, whose first call imports
    torch._dynamo: 2-3 s of every CLI start-up and every TP rank. Sized in a fresh
    interpreter, nothing imports it."""
    import subprocess
    import sys

    script = """
import sys, torch
from graphrt.core.models import loader, presets
from graphrt.core.models.registry import resolve_architecture
for name in presets.PRESETS:
    hf = presets.preset_hf_config(name)
    arch_name, arch = resolve_architecture(hf)
    config = arch.parse_config(hf, arch_name)
    loader._check_fits(arch.model_class, config, presets.TORCH_OPS, presets.SINGLE,
                       torch.device("cpu"), torch.bfloat16, 1 << 50)
print("torch._dynamo" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_rope_tables_of_the_sizing_probe_have_the_built_shapes():
    from graphrt.core.models.layers import RotaryEmbedding, rope_inv_freq

    inv_freq = rope_inv_freq(16, {"rope_type": "default", "rope_theta": 10000.0})
    built = RotaryEmbedding(inv_freq, 32)
    with torch.device("meta"):
        probe = RotaryEmbedding(inv_freq, 32)
    for name in ("cos", "sin"):
        real, meta = getattr(built, name), getattr(probe, name)
        assert meta.is_meta and (meta.shape, meta.dtype) == (real.shape, real.dtype)
    assert torch.allclose(built.cos[3, :8], torch.cos(3 * inv_freq))
    # What the memory check sums: every buffer, each counted once (buffers() dedups).
    assert sum(b.numel() for b in probe.buffers()) == sum(b.numel() for b in built.buffers())
