"""Checkpoint validation (DESIGN.md layer 2): a config value of the wrong type or range, a
weight of the wrong dtype or holding NaN/Inf, or an index reaching outside the checkpoint
is a one-line CheckpointError naming the key, tensor or file, raised while loading (before
the model runs), and exit status 3 from the CLI, with no traceback."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from helpers import CPU, cli_error_line
from safetensors.torch import load_file, save_file

from graphrt.core.cli.main import main
from graphrt.core.errors import CheckpointError, UnsupportedModelError, UsageError
from graphrt.core.models import load_model
from graphrt.core.models.loader import CHECK_FINITE_ENV, load_checkpoint

NAN, INF = float("nan"), float("inf")
_DELETE = object()
NORM = "model.norm.weight"
K_PROJ = "model.layers.0.self_attn.k_proj.weight"  # a shard of the fused qkv matmul


@pytest.fixture
def llama(llama_gqa_untied, tmp_path) -> Path:
    """A writable copy of an untied Llama 3 checkpoint (llama3 rope, lm_head saved)."""
    return Path(shutil.copytree(llama_gqa_untied.path, tmp_path / "llama"))


@pytest.fixture
def gemma(gemma4_tiny, tmp_path) -> Path:
    return Path(shutil.copytree(gemma4_tiny.path, tmp_path / "gemma"))


@pytest.fixture
def sharded(llama_sharded, tmp_path) -> Path:
    return Path(shutil.copytree(llama_sharded.path, tmp_path / "sharded"))


def _load_error(path: Path, error=CheckpointError, **kwargs) -> str:
    with pytest.raises(error) as info:
        load_checkpoint(path, CPU, torch.float32, **kwargs)
    message = str(info.value)
    assert message and "\n" not in message, f"not one line: {message!r}"
    return message


def _edit_json(file: Path, changes: dict) -> None:
    """``changes``: dotted key -> value (``_DELETE`` removes the key)."""
    data = json.loads(file.read_text())
    for dotted, value in changes.items():
        *parents, key = dotted.split(".")
        node = data
        for part in parents:
            node = node[part]
        if value is _DELETE:
            node.pop(key, None)
        else:
            node[key] = value
    file.write_text(json.dumps(data))  # NaN and Infinity as Python's json writes (and reads) them


def _edit_tensors(path: Path, edit, file: str = "model.safetensors") -> None:
    tensors = load_file(str(path / file))
    edit(tensors)
    save_file(tensors, str(path / file), metadata={"format": "pt"})


def _set_tensor(name: str, make):
    return lambda tensors: tensors.__setitem__(name, make(tensors[name]))


# ---- config.json: values of the wrong type or range ------------------------------

LLAMA_BAD_CONFIGS = {
    # id: (changes, what the message must name)
    "eps-nan": ({"rms_norm_eps": NAN}, "'rms_norm_eps'"),
    "eps-negative": ({"rms_norm_eps": -1e-6}, "'rms_norm_eps'"),
    "eps-zero": ({"rms_norm_eps": 0}, "'rms_norm_eps'"),
    "eps-string": ({"rms_norm_eps": "1e-6"}, "'rms_norm_eps'"),
    "eps-bool": ({"rms_norm_eps": True}, "'rms_norm_eps'"),
    "theta-negative": ({"rope_parameters.rope_theta": -10000.0}, "'rope_theta'"),
    "theta-zero": ({"rope_parameters.rope_theta": 0}, "'rope_theta'"),
    "theta-nan": ({"rope_parameters.rope_theta": NAN}, "'rope_theta'"),
    "theta-inf": ({"rope_parameters.rope_theta": INF}, "'rope_theta'"),
    "theta-top-level": (
        {"rope_parameters": _DELETE, "rope_scaling": None, "rope_theta": -1.0},
        "'rope_theta'",
    ),
    "theta-in-rope_scaling": (
        {
            "rope_parameters": _DELETE,
            "rope_scaling": {"type": "linear", "factor": 2.0, "rope_theta": NAN},
        },
        "rope_scaling 'rope_theta'",
    ),
    "rope-not-object": ({"rope_parameters": "llama3"}, "'rope_parameters'"),
    "llama3-no-factor": ({"rope_parameters.factor": _DELETE}, "'factor'"),
    "llama3-no-low": ({"rope_parameters.low_freq_factor": _DELETE}, "'low_freq_factor'"),
    "llama3-no-high": ({"rope_parameters.high_freq_factor": _DELETE}, "'high_freq_factor'"),
    "llama3-no-original-max": (
        {"rope_parameters.original_max_position_embeddings": _DELETE},
        "'original_max_position_embeddings'",
    ),
    "llama3-factor-string": ({"rope_parameters.factor": "8"}, "'factor'"),
    "llama3-high-below-low": ({"rope_parameters.high_freq_factor": 0.5}, "'high_freq_factor'"),
    "linear-no-factor": (
        {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0}},
        "'factor'",
    ),
    "max-pos-minus-one": ({"max_position_embeddings": -1}, "'max_position_embeddings'"),
    "max-pos-zero": ({"max_position_embeddings": 0}, "'max_position_embeddings'"),
    "max-pos-float": ({"max_position_embeddings": 256.5}, "'max_position_embeddings'"),
    "window-negative": ({"sliding_window": -8}, "'sliding_window'"),
    "window-zero": ({"sliding_window": 0}, "'sliding_window'"),
    "window-float": ({"sliding_window": 2.5}, "'sliding_window'"),
    "kv-heads-float": ({"num_key_value_heads": 2.5}, "'num_key_value_heads'"),
    "kv-heads-bool": ({"num_key_value_heads": True}, "'num_key_value_heads'"),
    "kv-heads-not-dividing": ({"num_key_value_heads": 3}, "'num_key_value_heads'"),
    "layers-float": ({"num_hidden_layers": 3.0}, "'num_hidden_layers'"),
    "intermediate-bool": ({"intermediate_size": True}, "'intermediate_size'"),
    "head-dim-float": ({"head_dim": 2.5}, "'head_dim'"),
    "head-dim-negative": ({"head_dim": -16}, "'head_dim'"),
    "architectures-string": ({"architectures": "LlamaForCausalLM"}, "'architectures'"),
    "architectures-ints": ({"architectures": [1, 2]}, "'architectures'"),
    "eos-string": ({"eos_token_id": "2"}, "'eos_token_id'"),
    "eos-bool": ({"eos_token_id": True}, "'eos_token_id'"),
    "eos-list-with-bool": ({"eos_token_id": [2, False]}, "'eos_token_id'"),
    "eos-float": ({"eos_token_id": 2.5}, "'eos_token_id'"),
    "eos-negative": ({"eos_token_id": -1}, "'eos_token_id'"),
    "bos-string": ({"bos_token_id": "1"}, "'bos_token_id'"),
    "bos-bool": ({"bos_token_id": False}, "'bos_token_id'"),
    "bos-list": ({"bos_token_id": [1, 2]}, "'bos_token_id'"),
    # JSON booleans only: bool("false") is True
    "tie-string": ({"tie_word_embeddings": "false"}, "'tie_word_embeddings'"),
    "tie-int": ({"tie_word_embeddings": 0}, "'tie_word_embeddings'"),
    "attention-bias-string": ({"attention_bias": "true"}, "'attention_bias'"),
    "mlp-bias-int": ({"mlp_bias": 1}, "'mlp_bias'"),
    "use-sliding-window-string": ({"use_sliding_window": "false"}, "'use_sliding_window'"),
}


LLAMA_UNSUPPORTED = {
    "hidden-act": ({"hidden_act": "swish"}, ["'hidden_act'", "swish", "silu", "gelu"]),
    "hidden-act-not-string": ({"hidden_act": ["silu"]}, ["'hidden_act'", "silu"]),
    "layer-type": (
        {"layer_types": ["full_attention", "linear_attention", "full_attention"]},
        ["'layer_types'", "linear_attention", "sliding_attention"],
    ),
}


@pytest.mark.parametrize(
    ("changes", "needles"), LLAMA_UNSUPPORTED.values(), ids=LLAMA_UNSUPPORTED.keys()
)
def test_llama_unsupported_value_lists_the_supported_ones(llama, changes, needles):
    _edit_json(llama / "config.json", changes)
    message = _load_error(llama, UnsupportedModelError)
    assert all(n in message for n in needles), message


def test_string_false_does_not_drop_the_lm_head(llama):
    """The bug this guards: "false" read as truthy tied the head to the embedding and
    skipped the checkpoint's own lm_head.weight without a word."""
    _edit_json(llama / "config.json", {"tie_word_embeddings": "false"})
    assert "'tie_word_embeddings'" in _load_error(llama)
    _edit_json(llama / "config.json", {"tie_word_embeddings": False})
    assert load_checkpoint(llama, CPU, torch.float32).model.lm_head is not None


def test_unused_sliding_window_is_not_read(llama):
    """Qwen2 writes a sliding_window it does not use (use_sliding_window false)."""
    _edit_json(llama / "config.json", {"use_sliding_window": False, "sliding_window": -1})
    loaded = load_checkpoint(llama, CPU, torch.float32)
    assert set(loaded.config.layer_windows) == {None}


GEMMA4_BAD_CONFIGS = {
    "double-wide-string": ({"use_double_wide_mlp": "true"}, "'use_double_wide_mlp'"),
    "k-eq-v-string": ({"attention_k_eq_v": "false"}, "'attention_k_eq_v'"),
    "attention-bias-string": ({"attention_bias": "false"}, "'attention_bias'"),
    "tie-string": ({"tie_word_embeddings": "false"}, "'tie_word_embeddings'"),
    "moe-string": ({"enable_moe_block": "false"}, "'enable_moe_block'"),
    "eps-string": ({"rms_norm_eps": "1e-6"}, "'rms_norm_eps'"),
    "eps-nan": ({"rms_norm_eps": NAN}, "'rms_norm_eps'"),
    "window-zero": ({"sliding_window": 0}, "'sliding_window'"),
    "window-negative": ({"sliding_window": -6}, "'sliding_window'"),
    "max-pos-zero": ({"max_position_embeddings": 0}, "'max_position_embeddings'"),
    "theta-negative": (
        {"rope_parameters.full_attention.rope_theta": -1.0},
        "full_attention 'rope_theta'",
    ),
    "theta-missing": (
        {"rope_parameters.sliding_attention.rope_theta": _DELETE},
        "sliding_attention has no 'rope_theta'",
    ),
    "partial-rotary-above-one": (
        {"rope_parameters.full_attention.partial_rotary_factor": 1.5},
        "'partial_rotary_factor'",
    ),
    "rope-factor-zero": ({"rope_parameters.full_attention.factor": 0}, "'factor'"),
    "softcap-nan": ({"final_logit_softcapping": NAN}, "'final_logit_softcapping'"),
    "softcap-bool": ({"final_logit_softcapping": True}, "'final_logit_softcapping'"),
    "ple-float": ({"hidden_size_per_layer_input": 2.5}, "'hidden_size_per_layer_input'"),
    "eos-string": ({"eos_token_id": "1"}, "'eos_token_id'"),
    "bos-bool": ({"bos_token_id": True}, "'bos_token_id'"),
    "head-dim-float": ({"head_dim": 16.5}, "'head_dim'"),
}


BAD_CONFIGS = [
    *(pytest.param("llama", *case, id=f"llama-{name}") for name, case in LLAMA_BAD_CONFIGS.items()),
    *(
        pytest.param("gemma", *case, id=f"gemma4-{name}")
        for name, case in GEMMA4_BAD_CONFIGS.items()
    ),
]


@pytest.mark.parametrize(("model", "changes", "needle"), BAD_CONFIGS)
def test_config_value_is_refused(request, model, changes, needle):
    path = request.getfixturevalue(model)
    _edit_json(path / "config.json", changes)
    message = _load_error(path)
    assert needle in message and "config.json" in message, message


def test_gemma4_unknown_activation_lists_the_supported_ones(gemma):
    _edit_json(gemma / "config.json", {"hidden_activation": "relu"})
    message = _load_error(gemma, UnsupportedModelError)
    assert "'hidden_activation'" in message and "gelu_pytorch_tanh" in message, message


def test_generation_config_eos_is_checked(llama):
    (llama / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, "3"]}))
    message = _load_error(llama)
    assert "generation_config.json" in message and "'eos_token_id'" in message, message


# ---- tensors: dtypes and values ----------------------------------------------------

BAD_DTYPES = {
    "int-norm": (NORM, torch.int32),
    "int8-fused-shard": (K_PROJ, torch.int8),
    "bool-lm-head": ("lm_head.weight", torch.bool),
    "int64-embedding": ("model.embed_tokens.weight", torch.int64),
    "uint8-mlp": ("model.layers.1.mlp.down_proj.weight", torch.uint8),
}


@pytest.mark.parametrize(("name", "dtype"), BAD_DTYPES.values(), ids=BAD_DTYPES.keys())
def test_integer_or_boolean_weight_is_refused(llama, name, dtype):
    _edit_tensors(llama, _set_tensor(name, lambda t: t.to(dtype)))
    message = _load_error(llama)
    assert name in message and str(dtype) in message and "floating" in message, message


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_other_float_dtypes_are_cast(llama, dtype):
    _edit_tensors(llama, _set_tensor(NORM, lambda t: t.to(dtype)))
    loaded = load_checkpoint(llama, CPU, torch.float32, check_finite=True)
    assert dict(loaded.model.named_parameters())[NORM].dtype == torch.float32


def _poison(value: float, index: int = 3):
    def make(t):
        t = t.clone()
        t.view(-1)[index] = value
        return t

    return make


@pytest.mark.parametrize("name", [NORM, K_PROJ, "lm_head.weight"])
@pytest.mark.parametrize("value", [NAN, INF, -INF], ids=["nan", "inf", "-inf"])
def test_non_finite_weight_is_refused(llama, name, value):
    _edit_tensors(llama, _set_tensor(name, _poison(value)))
    message = _load_error(llama, check_finite=True)
    assert name in message and "NaN or Inf" in message, message


def test_finite_check_is_off_unless_asked(llama, monkeypatch):
    """The check costs one more pass over the weights: off by default, on with the
    keyword or GRAPHRT_CHECK_FINITE=1."""
    _edit_tensors(llama, _set_tensor(NORM, _poison(NAN)))
    monkeypatch.delenv(CHECK_FINITE_ENV, raising=False)
    load_checkpoint(llama, CPU, torch.float32)
    monkeypatch.setenv(CHECK_FINITE_ENV, "1")
    assert NORM in _load_error(llama)
    assert load_checkpoint(llama, CPU, torch.float32, check_finite=False) is not None


def test_cli_check_weights_refuses_a_nan_weight_in_one_line(llama, capsys, monkeypatch):
    _edit_tensors(llama, _set_tensor(K_PROJ, _poison(NAN)))
    monkeypatch.delenv(CHECK_FINITE_ENV, raising=False)
    argv = ["generate", "--model", str(llama), "--prompt-ids", "1,2", "--device", "cpu"]
    argv += ["--runner", "eager", "--max-new-tokens", "2", "--json"]
    assert main([*argv, "--check-weights"]) == 3
    captured = capsys.readouterr()
    assert captured.out == "" and K_PROJ in cli_error_line(captured.err), captured.err
    # Unchecked by default: it loads, and its first step's NaN logits fail the request in
    # one line (issue 22: no silent garbage), the request in the JSON with reason error.
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert "logits held NaN or Inf" in cli_error_line(captured.err)
    assert json.loads(captured.out)["requests"][0]["finish_reason"] == "error"


def test_finite_check_env_value_must_be_a_switch(llama, monkeypatch):
    monkeypatch.setenv(CHECK_FINITE_ENV, "maybe")
    with pytest.raises(UsageError, match=CHECK_FINITE_ENV):
        load_checkpoint(llama, CPU, torch.float32)


def test_finite_check_survives_an_overflowing_sum(llama):
    """The fast check sums the tensor; a float16 sum past 65504 is not a bad weight."""
    _edit_tensors(llama, _set_tensor(NORM, lambda t: torch.full_like(t, 60000.0).half()))
    loaded = load_checkpoint(llama, CPU, torch.float32, check_finite=True)
    assert torch.all(dict(loaded.model.named_parameters())[NORM] == 60000.0)


def test_integer_index_table_still_loads(gemma4_assistant_ordered):
    """The assistant's centroid ordering is an integer table: it loads as one."""
    loaded = load_checkpoint(gemma4_assistant_ordered.path, CPU, torch.float32, check_finite=True)
    table = loaded.model.masked_embedding.token_ordering
    assert table.dtype == torch.long
    expected = gemma4_assistant_ordered.hf.masked_embedding.token_ordering
    assert torch.equal(table, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool])
def test_integer_index_table_refuses_other_kinds(gemma4_assistant_ordered, tmp_path, dtype):
    path = Path(shutil.copytree(gemma4_assistant_ordered.path, tmp_path / "assistant"))
    name = "masked_embedding.token_ordering"
    _edit_tensors(path, _set_tensor(name, lambda t: t.to(dtype)))
    message = _load_error(path)
    assert name in message and "integer" in message, message


# ---- index files: confined to the checkpoint directory ------------------------------

INDEX = "model.safetensors.index.json"


def _first_shard(path: Path) -> str:
    return sorted(set(json.loads((path / INDEX).read_text())["weight_map"].values()))[0]


def _repoint(path: Path, old: str, new: str) -> None:
    index = json.loads((path / INDEX).read_text())
    index["weight_map"] = {k: new if v == old else v for k, v in index["weight_map"].items()}
    (path / INDEX).write_text(json.dumps(index))


def test_sharded_checkpoint_loads(sharded):
    assert len(json.loads((sharded / INDEX).read_text())["weight_map"]) > 1
    load_checkpoint(sharded, CPU, torch.float32, check_finite=True)


@pytest.mark.parametrize("escape", ["parent", "absolute", "symlink"])
def test_index_cannot_reach_outside_the_checkpoint(sharded, tmp_path, escape):
    """A valid shard outside the directory is still refused, before it is opened."""
    shard = _first_shard(sharded)
    outside = tmp_path / "other" / shard
    outside.parent.mkdir()
    shutil.move(sharded / shard, outside)
    if escape == "parent":
        name = f"../other/{shard}"
    elif escape == "absolute":
        name = str(outside)
    else:
        name = shard
        (sharded / shard).symlink_to(outside)
    _repoint(sharded, shard, name)
    message = _load_error(sharded)
    assert INDEX in message and repr(name) in message, message


def test_weight_file_symlink_outside_is_refused(llama, tmp_path):
    outside = tmp_path / "elsewhere.safetensors"
    shutil.move(llama / "model.safetensors", outside)
    (llama / "model.safetensors").symlink_to(outside)
    message = _load_error(llama)
    assert "model.safetensors" in message and "outside" in message, message


def test_weight_files_that_cannot_be_read_are_named_for_what_they_are(llama, monkeypatch):
    """No index: not 'named in the index is missing'. A permission problem: not
    safetensors' 'No such file or directory'."""
    weights = llama / "model.safetensors"
    weights.rename(llama / "moved.safetensors")
    weights.symlink_to("gone.safetensors")  # dangling, inside the checkpoint
    assert "is a symlink to 'gone.safetensors', which does not exist" in _load_error(llama)
    weights.unlink()
    weights.mkdir()
    message = _load_error(llama)
    assert message.endswith("model.safetensors is not a file"), message
    weights.rmdir()
    (llama / "moved.safetensors").rename(weights)
    real_access = os.access
    monkeypatch.setattr(  # unreadable (root reads anything: simulated)
        os, "access", lambda f, mode: Path(f).name != weights.name and real_access(f, mode)
    )
    assert _load_error(llama).endswith("model.safetensors: permission denied")


def test_hub_cache_snapshot_symlinks_load(llama_tied, tmp_path):
    """The Hugging Face cache layout: a snapshot's files link into the repo's blobs/. Each
    is read through its link: the weights, config.json, generation_config.json's eos ids."""
    repo = tmp_path / "models--org--tiny"
    snapshot, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for i, f in enumerate(sorted(llama_tied.path.iterdir())):
        blob = blobs / f"blob{i}"
        shutil.copy(f, blob)
        (snapshot / f.name).symlink_to(Path("..", "..", "blobs", blob.name))
    _edit_json(snapshot / "generation_config.json", {"eos_token_id": [2, 7]})  # config's: 2
    assert all(f.is_symlink() for f in snapshot.iterdir())
    loaded = load_checkpoint(snapshot, CPU, torch.float32)
    direct = load_checkpoint(llama_tied.path, CPU, torch.float32)
    assert loaded.config == direct.config and loaded.eos_token_ids == (2, 7)
    weights, expected = loaded.model.state_dict(), direct.model.state_dict()
    assert weights.keys() == expected.keys()
    assert all(torch.equal(weights[k], expected[k]) for k in expected)


BAD_INDEXES = {
    "not-json": "{not json",
    "not-object": "[1, 2]",
    "no-weight-map": "{}",
    "weight-map-list": json.dumps({"weight_map": ["model-00001-of-00002.safetensors"]}),
    "weight-map-int-values": json.dumps({"weight_map": {NORM: 1}}),
}


@pytest.mark.parametrize("text", BAD_INDEXES.values(), ids=BAD_INDEXES.keys())
def test_malformed_index_is_refused(sharded, text):
    (sharded / INDEX).write_text(text)
    assert INDEX in _load_error(sharded)


def test_index_naming_a_pickle_is_refused(sharded):
    shard = _first_shard(sharded)
    _repoint(sharded, shard, "pytorch_model.bin")
    message = _load_error(sharded)
    assert "pytorch_model.bin" in message and ".safetensors" in message, message


# ---- the CLI: exit status 3, one line, no traceback ----------------------------------


def _config_edit(**changes):
    return lambda path: _edit_json(path / "config.json", changes)


def _tensor_edit(name: str, make):
    return lambda path: _edit_tensors(path, _set_tensor(name, make))


CLI_CASES = {
    "bool-string": (_config_edit(tie_word_embeddings="false"), "'tie_word_embeddings'"),
    "eps-nan": (_config_edit(rms_norm_eps=NAN), "'rms_norm_eps'"),
    "unsupported-act": (_config_edit(hidden_act="swish"), "'hidden_act'"),
    "int-weight": (_tensor_edit(NORM, lambda t: t.to(torch.int32)), NORM),
    "nan-weight": (_tensor_edit(K_PROJ, _poison(NAN)), K_PROJ),
}


@pytest.mark.parametrize(("break_it", "needle"), CLI_CASES.values(), ids=CLI_CASES.keys())
def test_cli_exits_3_with_one_line(llama, capsys, monkeypatch, break_it, needle):
    monkeypatch.setenv(CHECK_FINITE_ENV, "1")
    break_it(llama)
    argv = ["generate", "--model", str(llama), "--prompt-ids", "1,2,3", "--device", "cpu"]
    assert main(argv) == 3
    captured = capsys.readouterr()
    assert captured.out == ""
    assert needle in cli_error_line(captured.err), captured.err


def test_cli_index_escape_exits_3(sharded, capsys):
    _repoint(sharded, _first_shard(sharded), "../../other/model.safetensors")
    argv = ["generate", "--model", str(sharded), "--prompt-ids", "1,2,3", "--device", "cpu"]
    assert main(argv) == 3
    assert "../../other/model.safetensors" in cli_error_line(capsys.readouterr().err)


def test_load_model_checks_too(llama):
    """The Python API goes through the same checks."""
    _edit_json(llama / "config.json", {"mlp_bias": "no"})
    with pytest.raises(CheckpointError, match="'mlp_bias'"):
        load_model(str(llama), CPU, torch.float32)
