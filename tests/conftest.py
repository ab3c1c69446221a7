"""Session fixtures: tiny transformers checkpoints, built and saved once per run."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

# `from helpers import ...` must work under any --import-mode (importlib does
# not put test directories on sys.path) and from nox.
_TESTS_DIR = str(Path(__file__).resolve().parent)
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)

from helpers import (  # noqa: E402
    FAIL_CAPTURES,
    GEMMA4_WINDOW,
    LLAMA3_ROPE,
    MISTRAL_WINDOW,
    TINY,
    Checkpoint,
    GraphWitness,
    load_bench,
    make_checkpoint,
)


def _xdist_groups_apply() -> bool:
    """Whether a test's node id follows ``_nodeid``, which pytest-xdist 3.8 rewrites to
    apply an xdist_group (conftest's ``group_by_file``; the CUDA lane's --dist loadgroup).
    pytest 9.1 reads it (the device's); 9.2 builds the id otherwise, and the groups would
    be dropped in silence, every test scheduled alone."""
    from _pytest.nodes import Node

    probe = object.__new__(Node)
    probe._nodeid = "probe@group"
    try:
        return probe.nodeid == "probe@group"
    except AttributeError:
        return False


# Set to 1, every graph capture raises, here and in every process the tests start, so
# graph runners fall back to eager steps with a warning: each test marked ``graphs`` must
# then fail (tests/test_graphs_required.py).
_FAIL_CAPTURES_DIR = Path(__file__).resolve().parent / "fail_captures"


def pytest_configure(config):
    if config.getoption("dist", None) == "loadgroup" and not _xdist_groups_apply():
        raise pytest.UsageError(
            f"--dist loadgroup: pytest-xdist cannot group tests under pytest "
            f"{pytest.__version__} (it renames items, which pytest 9.2 no longer reads); "
            "run with --dist loadfile, or pytest below 9.2"
        )
    if os.environ.get(FAIL_CAPTURES) != "1":
        return
    # Child processes (TP ranks, CLI runs) run the folder's sitecustomize at start-up.
    path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(_FAIL_CAPTURES_DIR) + (os.pathsep + path if path else "")
    spec = importlib.util.spec_from_file_location(
        "fail_captures", _FAIL_CAPTURES_DIR / "sitecustomize.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # patches this process (idempotent)


GraphWitness.install()


def _share_the_gpu() -> None:
    """The CUDA lane's workers (bench/h200.sh runs several) share one GPU: an engine left
    to its default KV pool, a share of free memory (CudaDevice.kv_memory_fraction), would
    leave the next worker none. A tenth of what is free each."""
    from graphrt.devices.cuda import CudaDevice

    CudaDevice.kv_memory_fraction = 0.1


_share_the_gpu()
_GRAPHS_AT_SETUP: dict[str, tuple[int, int, int]] = {}  # replays, captures, drops


def _graph_counts() -> tuple[int, int, int]:
    return GraphWitness.replays, GraphWitness.captures, GraphWitness.drops


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    _GRAPHS_AT_SETUP[item.nodeid] = _graph_counts()  # function fixtures capture here
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    outcome = yield
    at_setup = _GRAPHS_AT_SETUP.pop(item.nodeid, _graph_counts())
    if outcome.excinfo is not None or not item.get_closest_marker("graphs"):
        return
    # A test about capture itself must capture; every other graphs test must replay, but
    # one whose graphs a shared fixture built may replay none in its own run. Drops still
    # count: a shared fixture captures in the setup of the first test that uses it, so its
    # drops fail that test where it is marked graphs (in a run where an unmarked test uses
    # the fixture first, they go unseen).
    kind, index = ("captured", 1) if item.get_closest_marker("graphs_capture") else ("replayed", 0)
    now = _graph_counts()
    why = None
    if now[index] == at_setup[index] and not item.get_closest_marker("graphs_shared"):
        why = (
            f"marked graphs, but no graph was {kind} in this test's process while it "
            "ran (graphs a child process replayed: report them with "
            "helpers.GraphWitness.saw; a shared fixture's: mark the test graphs_shared)"
        )
    elif now[2] > at_setup[2] and not item.get_closest_marker("graphs_drops"):
        # Some sizes then ran on a larger bucket or eagerly: the replay count above cannot
        # see it, and a capture broken at one size would pass as a graph run.
        why = (
            f"marked graphs, but {now[2] - at_setup[2]} bucket capture(s) failed and were "
            "dropped while it ran (the warning says why; a test about dropped buckets: mark "
            "it graphs_drops)"
        )
    if why is not None:
        try:  # pytest.fail's exception without a traceback: the test's frames are gone
            pytest.fail(why, pytrace=False)
        except pytest.fail.Exception as failure:
            outcome.force_exception(failure)


# Before pytest-xdist's own hook, which reads the xdist_group marks added here.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    # Under pytest-xdist a long test that starts last leaves the other workers idle while
    # it runs: the forced-failure rerun first (the longest test), then the other slow ones;
    # a stable sort keeps the rest in order (noxfile runs xdist without reordering).
    def start_late(item) -> tuple[bool, bool]:
        return item.path.name != "test_graphs_required.py", not item.get_closest_marker("slow")

    items.sort(key=start_late)
    group_by_file(items)


def group_by_file(items) -> None:
    """Under ``--dist loadgroup`` (the CUDA lane: bench/h200.sh) a test runs on the worker of
    its file's other tests, as under loadfile, so a module's costly fixtures are built once,
    unless marked ``own_worker``: one that is slow alone, scheduled by itself. The CUDA
    lane's kernel tests of tests/test_triton_fused.py took about 550 s on one worker (stops
    57-63's slowest 25) and cut the lane at its limit (stops 84 and 86). Other --dist modes
    ignore the marks."""
    for item in items:
        if not item.get_closest_marker("own_worker"):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


@pytest.fixture(autouse=True)
def _engine_step_failures_fail_the_test(request, monkeypatch):
    """``Engine.step`` turns a step that raises into failed requests and carries on (a
    server must); in the tests such a failure would hide behind shorter outputs, so it
    fails the test, except in tests that inject failures (marker ``step_failures``)."""
    if request.node.get_closest_marker("step_failures"):
        return
    from graphrt.core.engine.engine import Engine

    real_fail = Engine._fail

    def fail_loudly(self, reqs, error):
        real_fail(self, reqs, error)
        raise AssertionError(f"an engine step failed: {error!r}") from error

    monkeypatch.setattr(Engine, "_fail", fail_loudly)


def _save(tmp_path_factory, name: str, config, **kwargs) -> Checkpoint:
    return make_checkpoint(tmp_path_factory.mktemp(name), config, **kwargs)


@pytest.fixture(scope="session")
def oracles():
    """bench/oracles.py, the benchmarks' oracle drafters."""
    return load_bench("oracles")


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
def llama_odd_vocab(tmp_path_factory) -> Checkpoint:
    from transformers import LlamaConfig

    # A vocabulary no rank count divides: tensor parallelism pads it (tied head and embedding).
    cfg = LlamaConfig(**{**TINY, "vocab_size": 301}, tie_word_embeddings=True)
    return _save(tmp_path_factory, "llama_odd_vocab", cfg, seed=8)


@pytest.fixture(scope="session")
def llama_mqa(tmp_path_factory) -> Checkpoint:
    from transformers import LlamaConfig

    # One KV head: under tensor parallelism every rank holds a replica of it.
    cfg = LlamaConfig(**{**TINY, "num_key_value_heads": 1}, tie_word_embeddings=False)
    return _save(tmp_path_factory, "llama_mqa", cfg, seed=7)


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


# Long-context twins (issue 21: parity at a 2k-token prompt): the tiny shapes with room
# for 4,096 positions; Llama with its llama3 rope scaling, Mistral with a 512-token window.
LONG = {**TINY, "max_position_embeddings": 4096}


@pytest.fixture(scope="session")
def llama_long(tmp_path_factory) -> Checkpoint:
    from transformers import LlamaConfig

    cfg = LlamaConfig(**LONG, tie_word_embeddings=False, rope_scaling=dict(LLAMA3_ROPE))
    return _save(tmp_path_factory, "llama_long", cfg, seed=41)


@pytest.fixture(scope="session")
def mistral_long(tmp_path_factory) -> Checkpoint:
    from transformers import MistralConfig

    cfg = MistralConfig(**LONG, sliding_window=512, tie_word_embeddings=False)
    return _save(tmp_path_factory, "mistral_long", cfg, seed=42)


@pytest.fixture(scope="session")
def llama_sharded(tmp_path_factory) -> Checkpoint:
    from transformers import LlamaConfig

    cfg = LlamaConfig(**TINY, tie_word_embeddings=False)
    # ~100 KB shards: the 300x64 float32 embedding alone is 77 KB, so several files.
    return _save(tmp_path_factory, "llama_sharded", cfg, seed=6, max_shard_size="100KB")


# ---- Gemma 4 --------------------------------------------------------------------


def _save_gemma4(tmp_path_factory, name: str, model_class, config, seed: int) -> Checkpoint:
    """Like helpers.make_checkpoint, for Gemma 4 classes AutoModelForCausalLM does not pick;
    also perturbs ``layer_scalar`` (a buffer, initialised to 1) so that it matters."""
    import torch

    torch.manual_seed(seed)
    hf = model_class(config).eval()
    with torch.no_grad():
        for pname, param in hf.named_parameters():
            if "norm" in pname:
                param.add_(torch.randn_like(param) * 0.1)
        for bname, buf in hf.named_buffers():
            if bname.endswith("layer_scalar"):
                buf.uniform_(0.5, 1.5)
    hf.generation_config.eos_token_id = None
    path = tmp_path_factory.mktemp(name)
    hf.save_pretrained(path)
    return Checkpoint(Path(path), hf)


@pytest.fixture(scope="session")
def gemma4_tiny(tmp_path_factory) -> Checkpoint:
    """E2B-shaped Gemma4ForCausalLM: per-layer inputs, KV sharing over the last 3 layers
    (a full producer that is not the last unshared layer), double-wide MLP on sharing
    layers, wider full-attention heads with partial (proportional) rope, softcapping."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    s, f = "sliding_attention", "full_attention"
    cfg = Gemma4TextConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=7,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        layer_types=[s, f, s, s, f, s, f],
        sliding_window=GEMMA4_WINDOW,
        num_kv_shared_layers=3,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=300,
        use_double_wide_mlp=True,
        final_logit_softcapping=30.0,
        max_position_embeddings=256,
    )
    return _save_gemma4(tmp_path_factory, "gemma4_tiny", Gemma4ForCausalLM, cfg, seed=21)


@pytest.fixture(scope="session")
def gemma4_multimodal(tmp_path_factory) -> Checkpoint:
    """31B-shaped text model saved as a Gemma4ForConditionalGeneration (no vision/audio
    towers): K = V on full layers with their own KV head count, no per-layer inputs, no
    KV sharing (transformers 5.24 cannot run sharing without per-layer inputs: its
    _maybe_slice_kv_shared_inputs slices the absent per-layer inputs)."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    s, f = "sliding_attention", "full_attention"
    text = dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        layer_types=[s, f, s, s, f],
        sliding_window=GEMMA4_WINDOW,
        num_kv_shared_layers=0,
        hidden_size_per_layer_input=0,
        final_logit_softcapping=30.0,
        max_position_embeddings=256,
    )
    cfg = Gemma4Config(text_config=text, vision_config=None, audio_config=None)
    return _save_gemma4(
        tmp_path_factory, "gemma4_multimodal", Gemma4ForConditionalGeneration, cfg, seed=22
    )


# What an assistant for gemma4_tiny must match (its KV shapes and width).
GEMMA4_TINY_SHAPES = dict(
    vocab=300, hidden=64, kv_heads=2, head_dim=16, global_head_dim=32, window=GEMMA4_WINDOW
)


def _save_assistant(tmp_path_factory, name: str, target: dict, seed: int, **kwargs) -> Checkpoint:
    """A Gemma4AssistantForCausalLM made by transformers for a target with ``target_text``'s
    shapes (``target``: vocab, hidden, kv_heads, head_dim, global_head_dim, window): 2 layers
    (sliding, full) reading its KV, hidden 48. Weights are scaled
    up so its drafts are confident (ties between logits would make argmax order-dependent)."""
    import torch
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM

    text = dict(
        model_type="gemma4_text",
        vocab_size=target["vocab"],
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=target["kv_heads"],
        head_dim=target["head_dim"],
        global_head_dim=target["global_head_dim"],
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=target["window"],
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0,
        max_position_embeddings=256,
    )
    cfg = Gemma4AssistantConfig(text_config=text, backbone_hidden_size=target["hidden"], **kwargs)
    torch.manual_seed(seed)
    hf = Gemma4AssistantForCausalLM(cfg).eval()
    with torch.no_grad():
        for pname, param in hf.named_parameters():
            if "norm" in pname or "layer_scalar" in pname:
                param.add_(torch.randn_like(param) * 0.1)
            elif param.dim() == 2:
                param.mul_(8.0)
        if cfg.use_ordered_embeddings:
            order = torch.randperm(
                text["vocab_size"], generator=torch.Generator().manual_seed(seed)
            )
            hf.masked_embedding.token_ordering.copy_(order)
    path = tmp_path_factory.mktemp(name)
    hf.save_pretrained(path)
    return Checkpoint(path, hf)


@pytest.fixture(scope="session")
def gemma4_assistant(gemma4_tiny, tmp_path_factory) -> Checkpoint:
    """The MTP assistant for gemma4_tiny (transformers' Gemma4AssistantForCausalLM)."""
    return _save_assistant(tmp_path_factory, "gemma4_assistant", GEMMA4_TINY_SHAPES, 31)


@pytest.fixture(scope="session")
def gemma4_assistant_ordered(gemma4_tiny, tmp_path_factory) -> Checkpoint:
    """The same shape with centroid-ordered embeddings (use_ordered_embeddings)."""
    return _save_assistant(
        tmp_path_factory,
        "gemma4_assistant_ordered",
        GEMMA4_TINY_SHAPES,
        32,
        use_ordered_embeddings=True,
        num_centroids=10,
        centroid_intermediate_top_k=3,
    )


@pytest.fixture(scope="session")
def gemma4_tiny_vocab(tmp_path_factory) -> tuple[Checkpoint, Checkpoint]:
    """A vocabulary-8 Gemma 4 target and its assistant, for the sampling statistics."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    s, f = "sliding_attention", "full_attention"
    cfg = Gemma4TextConfig(
        vocab_size=8,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        global_head_dim=16,
        layer_types=[s, s, f],
        sliding_window=4,
        num_kv_shared_layers=0,
        hidden_size_per_layer_input=4,
        vocab_size_per_layer_input=8,
        final_logit_softcapping=30.0,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    target = _save_gemma4(tmp_path_factory, "gemma4_vocab8", Gemma4ForCausalLM, cfg, seed=41)
    shapes = dict(vocab=8, hidden=32, kv_heads=1, head_dim=16, global_head_dim=16, window=4)
    drafter = _save_assistant(tmp_path_factory, "gemma4_vocab8_assistant", shapes, 42)
    return target, drafter
