"""Bad input, probed (issue 22): a table of bad CLI flags, environment, checkpoints and
Python API calls, each of which must end in one line naming the problem, the
documented exit status (or a ``GraphrtError`` subclass from Python), no traceback; then
a seeded, bounded fuzz pass of random flag values and random config mutations holding
the same properties. The CLI runs in process (``main``), so a traceback would fail the
test as an exception."""

from __future__ import annotations

import dataclasses
import json
import random
import shutil

import pytest
import torch
from helpers import CPU, cli_error_line, needs_gpu

from graphrt import devices
from graphrt.core.cli.main import main
from graphrt.core.engine import Engine, EngineConfig, SamplingParams
from graphrt.core.errors import GraphrtError
from graphrt.core.models import load_model
from graphrt.spec import SpecConfig

TINY = ["generate", "--model", "random:llama-tiny", "--prompt-ids", "1,2,3"]
NOT_UTF8 = "def f(\udcff):"  # what Python makes of argv bytes that are not UTF-8


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        status = main(argv)
    except SystemExit as e:  # argparse's usage errors
        status = e.code
    out, err = capsys.readouterr()
    return status, out, err


# (argv, exit status, what the error line must say)
FLAG_CASES = [
    (TINY + ["--top-p", "1.5"], 2, "--top-p: must be in (0, 1]"),
    (TINY + ["--top-k", "-5"], 2, "--top-k: must be >= 0"),
    (TINY + ["--top-k", str(10**20), "--temperature", "0.5"], 2, "--top-k: must be at most"),
    (TINY + ["--max-new-tokens", str(10**12)], 2, "--max-new-tokens: must be at most"),
    (TINY + ["--temperature", "-1"], 2, "--temperature: must be >= 0"),
    (TINY + ["--temperature", "nan"], 2, "--temperature: must be finite"),
    (TINY + ["--max-new-tokens", "0"], 2, "--max-new-tokens: must be >= 1"),
    (TINY + ["--max-new-tokens", "ten"], 2, "--max-new-tokens: wants a whole number"),
    (TINY + ["--seed", "x"], 2, "--seed: wants a whole number"),
    (TINY + ["--spec-steps", "100"], 2, "--spec-steps: must be at most 16"),
    (["generate", "--model", "random:llama-tiny", "--prompt", NOT_UTF8], 2, "not valid UTF-8"),
    (
        ["generate", "--model", "random:llama-tiny", "--prompt", NOT_UTF8, "--tp", "2"],
        2,
        "not valid UTF-8",
    ),  # refused by the launcher, before any rank starts
    (TINY + ["--device", "nosuchdevice"], 4, "nosuchdevice"),
]


@pytest.mark.parametrize(
    "argv, status, says", FLAG_CASES, ids=[" ".join(c[0][3:]) for c in FLAG_CASES]
)
def test_bad_flags_get_one_line_and_their_status(argv, status, says, capsys):
    got, _, err = _run(argv, capsys)
    assert got == status, err
    line = cli_error_line(err)
    assert says in line and "_positive" not in line and "Traceback" not in err
    assert "rank" not in line  # refused by this process: a --tp job starts no rank for it


def test_bad_environment_is_refused_before_loading(monkeypatch, capsys):
    monkeypatch.setenv("GRAPHRT_CHECK_FINITE", "banana")
    status, _, err = _run(TINY, capsys)
    assert status == 2 and "GRAPHRT_CHECK_FINITE='banana'" in cli_error_line(err)
    assert "loaded" not in err  # nothing was loaded first


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"WORLD_SIZE": "x"}, "WORLD_SIZE"),
        ({"WORLD_SIZE": "2", "LOCAL_RANK": "-1"}, "LOCAL_RANK"),
        ({"WORLD_SIZE": "2", "RANK": "1.5"}, "RANK"),
    ],
    ids=["world", "local-rank", "rank"],
)
def test_a_malformed_job_environment_is_one_line(monkeypatch, capsys, env, named):
    """torchrun's variables, set by hand or by another launcher: named, exit 2."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    status, _, err = _run(TINY, capsys)
    assert status == 2 and f"environment variable {named}={env[named]!r}" in cli_error_line(err)


def test_more_tp_ranks_than_cores_are_refused_before_any_starts(monkeypatch, capsys):
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    status, _, err = _run(TINY + ["--tp", "100000"], capsys)
    assert status == 2
    assert "--tp 100000 starts 100000 processes on this host, which has 4 CPU cores" in (
        cli_error_line(err)
    )


def test_cuda_all_reduce_choice_is_checked_by_the_device(monkeypatch):
    from graphrt.devices.cuda import CudaDevice

    monkeypatch.setenv("GRAPHRT_ALL_REDUCE", "banana")
    with pytest.raises(GraphrtError, match="GRAPHRT_ALL_REDUCE='banana'"):
        CudaDevice().check_environment()


def test_a_cold_triton_cache_gets_one_status_line_before_loading(tmp_path, monkeypatch, capsys):
    """A first run compiles every kernel (16 s on a bare H200): said before the
    silence, once, and not when the cache holds anything."""
    pytest.importorskip("triton")
    from graphrt.devices.cpu import CpuDevice
    from graphrt.devices.cuda import CudaDevice

    cache = tmp_path / "triton-cache"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    assert "Triton's cache" in CudaDevice().startup_notice()  # missing
    cache.mkdir()
    assert str(cache) in CudaDevice().startup_notice()  # empty
    (cache / "entry").mkdir()
    assert CudaDevice().startup_notice() is None
    cache.joinpath("entry").rmdir()
    monkeypatch.setattr(CpuDevice, "startup_notice", CudaDevice.startup_notice)
    status, _, err = _run(TINY, capsys)
    lines = err.splitlines()
    assert status == 0 and lines[0].startswith("graphrt: compiling GPU kernels")
    assert lines[1].startswith("loaded random:llama-tiny")


def _copy(checkpoint, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(checkpoint.path, path)
    return path


def _edit_config(path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def test_bad_checkpoints_get_status_3(llama_gqa_untied, tmp_path, capsys):
    not_a_dir = tmp_path / "file.txt"
    not_a_dir.write_text("x")
    status, _, err = _run(["generate", "--model", str(not_a_dir), "--prompt-ids", "1"], capsys)
    assert status == 3 and "is not a directory" in cli_error_line(err)

    path = _copy(llama_gqa_untied, tmp_path)
    _edit_config(path, eos_token_id=10**6)
    status, _, err = _run(["generate", "--model", str(path), "--prompt-ids", "1"], capsys)
    assert status == 3 and "eos_token_id 1000000 is outside the vocabulary" in cli_error_line(err)

    _edit_config(path, eos_token_id=2, bos_token_id=10**6)
    status, _, err = _run(["generate", "--model", str(path), "--prompt-ids", "1"], capsys)
    assert status == 3 and "bos_token_id 1000000 is outside the vocabulary" in cli_error_line(err)


def test_a_broken_tokenizer_fails_text_prompts_only(llama_gqa_untied, tmp_path, capsys):
    path = _copy(llama_gqa_untied, tmp_path)
    (path / "tokenizer.json").write_text("{ not json")
    argv = ["generate", "--model", str(path), "--max-new-tokens", "2", "--runner", "eager"]
    status, _, err = _run([*argv, "--prompt", "hello"], capsys)
    assert status == 3 and "tokenizer.json" in cli_error_line(err)
    status, out, err = _run([*argv, "--prompt-ids", "5,6"], capsys)  # needs no tokenizer
    assert status == 0, err
    assert "graphrt: warning:" in err and "output_ids" in out


def test_flags_past_the_models_limits_are_clamped_aloud(capsys):
    argv = TINY + ["--max-context-len", "100000", "--max-new-tokens", "100000", "--ignore-eos"]
    status, out, err = _run(argv, capsys)
    assert status == 0, err
    warnings = [line for line in err.splitlines() if line.startswith("graphrt: warning:")]
    assert len(warnings) == 2
    assert "--max-context-len 100000" in warnings[0] and "--max-new-tokens 100000" in warnings[1]


# ---- Python API ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine():
    return Engine(load_model("random:llama-tiny", devices.current("cpu")),
                  EngineConfig(runner="eager"), devices.current("cpu"))  # fmt: skip


API_CASES = [
    ("load_model(None)", lambda e: load_model(None), "name"),
    ("load_model(3)", lambda e: load_model(3), "name"),
    ("load_model(dtype='x')", lambda e: load_model("random:llama-tiny", CPU, "x"), "dtype"),
    ("Engine('x')", lambda e: Engine("x"), "loaded"),
    ("Engine(config='x')", lambda e: Engine(e.loaded, "x"), "config"),
    ("Engine(device='cpu')", lambda e: Engine(e.loaded, None, "cpu"), "device"),
    ("Engine(strategy=1)", lambda e: Engine(e.loaded, None, None, 1), "strategy"),
    ("generate(None)", lambda e: e.generate(None), "prompts"),
    ("generate('abc')", lambda e: e.generate("abc"), "prompts"),
    ("generate([[1.5]])", lambda e: e.generate([[1.5]]), "token"),
    ("add_request(None)", lambda e: e.add_request(None), "prompt"),
    ("abort('x')", lambda e: e.abort("x"), "req"),
    ("SamplingParams(top_p=2)", lambda e: SamplingParams(top_p=2.0), "top_p"),
    ("SamplingParams(top_k=10**20)", lambda e: SamplingParams(top_k=10**20, temperature=0.5), "top_k"),
    ("SamplingParams(max_new_tokens='4')", lambda e: SamplingParams(max_new_tokens="4"), "max_new_tokens"),
    ("EngineConfig(max_running_requests='4')", lambda e: EngineConfig(max_running_requests="4"), "max_running_requests"),
    ("SpecConfig(num_steps='x')", lambda e: SpecConfig(num_steps="x"), "num_steps"),
    ("devices.current(5)", lambda e: devices.current(5), "name"),
]  # fmt: skip


@pytest.mark.parametrize(
    "call, names", [(c[1], c[2]) for c in API_CASES], ids=[c[0] for c in API_CASES]
)
def test_wrongly_typed_api_calls_raise_graphrt_errors_naming_the_argument(engine, call, names):
    with pytest.raises(GraphrtError) as caught:
        call(engine)
    assert names in str(caught.value)
    assert not engine.waiting and not engine.running  # nothing queued by a refused call


# ---- fuzz ------------------------------------------------------------------------------

FUZZ_FLAGS = ["--max-new-tokens", "--temperature", "--top-p", "--top-k", "--seed",
              "--spec-steps", "--max-context-len", "--max-running-requests", "--kv-pool-tokens"]  # fmt: skip
GOOD_VALUES = ["1", "2", "3", "4", "8", "64", "0.5", "0.9", "auto"]
BAD_VALUES = ["-1", "0", "1.5", "nan", "inf", "-inf", "abc", "", "1e309",
              "99999999999999999999", "0x10", " 4", "1" * 400]  # fmt: skip
DOCUMENTED = {0, 1, 2, 3, 4, 5}


def _holds(status, err: str) -> None:
    assert status in DOCUMENTED, (status, err)
    assert "Traceback" not in err
    if status:
        cli_error_line(err)  # the last line, the only error line


def test_fuzzed_flags_end_in_one_line_and_a_documented_status(capsys):
    rng = random.Random(22)
    statuses = []
    for _ in range(40):
        argv = TINY + ["--runner", "eager"]
        for flag in rng.sample(FUZZ_FLAGS, rng.randint(1, 3)):
            argv += [flag, rng.choice(GOOD_VALUES if rng.random() < 0.6 else BAD_VALUES)]
        if "--max-new-tokens" not in argv:
            argv += ["--max-new-tokens", "2"]
        status, _, err = _run(argv, capsys)
        _holds(status, err)
        statuses.append(status)
    assert statuses.count(0) >= 5 and statuses.count(2) >= 8  # runs, and refusals


CONFIG_KEYS = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "intermediate_size", "rms_norm_eps", "rope_theta",
               "max_position_embeddings", "eos_token_id", "bos_token_id", "tie_word_embeddings",
               "hidden_act", "architectures", "rope_scaling", "head_dim", "torch_dtype"]  # fmt: skip
CONFIG_VALUES = [None, "x", -1, 0, 1, 2, 4, 8, 64, 1.5, 1e30, float("nan"), [], {}, True, [1, "a"]]


def test_fuzzed_configs_end_in_one_line_and_a_documented_status(llama_gqa_untied, tmp_path, capsys):
    rng = random.Random(23)
    statuses = []
    for i in range(24):
        path = tmp_path / f"ckpt{i}"
        shutil.copytree(llama_gqa_untied.path, path)
        changes = {
            rng.choice(CONFIG_KEYS): rng.choice(CONFIG_VALUES) for _ in range(rng.randint(1, 2))
        }
        _edit_config(path, **changes)
        argv = ["generate", "--model", str(path), "--prompt-ids", "1,2", "--max-new-tokens", "2"]
        status, _, err = _run([*argv, "--runner", "eager"], capsys)
        _holds(status, err)
        assert status in (0, 3), (changes, err)  # a config is the checkpoint's problem
        statuses.append(status)
        shutil.rmtree(path)
    assert statuses.count(3) >= 8 and statuses.count(0) >= 2
    assert torch.get_default_dtype() == torch.float32


# ---- memory, checked before allocation ----------------------------------------------


@pytest.mark.parametrize("model", ["preset", "checkpoint"])
def test_a_model_larger_than_free_memory_is_refused_before_allocating(
    model, llama_gqa_untied, monkeypatch, capsys
):
    from graphrt.devices.cpu import CpuDevice

    monkeypatch.setattr(CpuDevice, "free_memory_bytes", lambda self: 1 << 10)  # 1 KiB free
    argv = TINY if model == "preset" else [*TINY[:2], str(llama_gqa_untied.path), *TINY[3:]]
    status, _, err = _run(argv, capsys)
    line = cli_error_line(err)
    assert status == 5 and "the model needs" in line and "0.0 GiB is free" in line


def test_a_checkpoint_that_surely_fits_skips_the_exact_sizing(llama_gqa_untied):
    """Under half the free memory by its headers (float32 elements): no meta-device build
    (whose first use imports torch's decompositions, seconds of every start-up)."""
    from graphrt.core.models.loader import _surely_fits

    path = llama_gqa_untied.path
    elements = sum(t.numel() for t in load_model(str(path), CPU, torch.float32).model.parameters())
    assert _surely_fits(path, 16 * elements) and not _surely_fits(path, 4 * elements)


def test_graphs_are_counted_in_the_memory_check(llama_gqa_untied, monkeypatch):
    """Free memory enough for the KV pool and the token table but not for the graphs'
    logits buffers (the largest batch's rows x vocabulary, float32): graphs are refused
    before anything is allocated, with the way out named; eager steps fit."""
    from helpers import standin_device

    from graphrt.core.errors import OutOfMemoryError

    loaded = load_model(str(llama_gqa_untied.path), CPU, torch.float32)
    config = EngineConfig(kv_pool_tokens=64, max_context_len=32, max_running_requests=8)
    spec = loaded.model.kv_layer_specs()
    pool = 64 * Engine._kv_bytes_per_token(spec, torch.float32) + 8 * 32 * 8
    logits = 8 * loaded.model.vocab_size * 4  # 8 rows of float32 logits
    device = standin_device()
    monkeypatch.setattr(type(device), "free_memory_bytes", lambda self: pool + logits // 2)
    with pytest.raises(OutOfMemoryError, match=r"and graphs \(at least .*--runner eager"):
        Engine(loaded, dataclasses.replace(config, runner="graph"), device)
    Engine(loaded, dataclasses.replace(config, runner="eager"), device)


def test_a_kv_pool_larger_than_free_memory_is_refused_before_allocating(capsys):
    status, _, err = _run(TINY + ["--kv-pool-tokens", str(2**31 - 1)], capsys)
    line = cli_error_line(err)
    assert status == 5 and "do not fit in cpu memory" in line and "GiB free" in line


# ---- no silent garbage ----------------------------------------------------------------


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, needs_gpu])]
)
def test_rows_with_nan_or_inf_logits_are_marked_and_minus_inf_is_not(device):
    """Greedy and sampled rows: the max reduction's NaN propagation must reach the mark
    wherever the NaN sits (before or after the row's largest finite logit)."""
    from graphrt.core.engine.request import SamplingParams
    from graphrt.core.engine.sampling import BAD_LOGITS, greedy_tokens, sample, sampling_rows

    inf, nan = float("inf"), float("nan")
    logits = torch.tensor(
        [[1.0, 2.0, 0.0], [1.0, nan, 3.0], [inf, 0.0, 1.0], [-inf, 5.0, 1.0], [nan, 9.0, 1.0],
         [4.0, 9.0, nan], [2.0, 2.0, 1.0]],
        device=device,
    )  # fmt: skip
    expected = [1, BAD_LOGITS, BAD_LOGITS, 1, BAD_LOGITS, BAD_LOGITS, 0]  # ties: the first
    assert greedy_tokens(logits).tolist() == expected  # greedy batches, verify's tail
    if device == "cuda":  # the decode graphs' greedy sampler: Triton's
        from graphrt.devices.cuda.ops import TRITON_OPS

        assert greedy_tokens(logits, TRITON_OPS).tolist() == expected
    greedy_rows = sampling_rows([SamplingParams()] * 7, [0] * 7, [0] * 7, torch.device(device))
    assert sample(logits, greedy_rows).tolist() == expected  # temperature-0 rows of a mix
    params = [SamplingParams(temperature=0.7, seed=1)] * 7
    drawn = sample(logits, sampling_rows(params, [1] * 7, [0] * 7, torch.device(device))).tolist()
    assert [t == BAD_LOGITS for t in drawn] == [t == BAD_LOGITS for t in expected]


def _poison(checkpoint, tmp_path, value: float):
    """A copy of the checkpoint with one layer's MLP weight holding ``value``."""
    from safetensors.torch import load_file, save_file

    path = _copy(checkpoint, tmp_path)
    file = next(path.glob("*.safetensors"))
    tensors = load_file(str(file))
    name = next(n for n in tensors if "mlp.down_proj.weight" in n)
    tensors[name][0, 0] = value
    save_file(tensors, str(file), metadata={"format": "pt"})
    return path


def test_nan_weights_fail_their_requests_in_one_line_not_token_0(
    llama_gqa_untied, tmp_path, capsys
):
    """Without --check-weights the weights load; the first step's logits are NaN, and the
    requests finish with an error (the JSON keeps them) instead of decoding token 0."""
    path = _poison(llama_gqa_untied, tmp_path, float("nan"))
    argv = ["generate", "--model", str(path), "--prompt-ids", "5,6,7", "--prompt-ids", "8"]
    status, out, err = _run([*argv, "--max-new-tokens", "4", "--runner", "eager", "--json"], capsys)
    assert status == 1
    assert "logits held NaN or Inf" in cli_error_line(err)
    requests = json.loads(out)["requests"]
    assert [r["finish_reason"] for r in requests] == ["error", "error"]
    assert all(r["output_ids"] == [] for r in requests)


def _nan_logits_in(mode, module, monkeypatch) -> None:
    """``module``'s forward_model, patched: the logits of ``mode`` batches turn NaN."""
    forward_model = module.forward_model

    def nan_logits(model, attn, batch, *args, **kwargs):
        out = forward_model(model, attn, batch, *args, **kwargs)
        if batch.mode is mode:
            out.logits[:] = float("nan")
        return out

    monkeypatch.setattr(module, "forward_model", nan_logits)


def test_nan_verify_logits_fail_speculative_rounds_too(gemma4_tiny, gemma4_assistant, monkeypatch):
    """Logits turn NaN in a round's verify forward (after a clean prefill): the rows are
    marked inside the round's tail, and the requests fail with the line, KV freed."""
    from graphrt.core.batch import ForwardMode
    from graphrt.core.runners import base as runners_base
    from graphrt.spec import MTPDecoding

    _nan_logits_in(ForwardMode.TARGET_VERIFY, runners_base, monkeypatch)
    cpu = devices.current("cpu")
    target = load_model(str(gemma4_tiny.path), cpu, torch.float32)
    drafter = load_model(str(gemma4_assistant.path), cpu, torch.float32)
    strategy = MTPDecoding(drafter, SpecConfig(num_steps=2))
    engine = Engine(target, EngineConfig(runner="eager"), cpu, strategy)
    reqs = engine.generate([[5, 6, 7], [9, 10]], SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert [len(r.output_ids) for r in reqs] == [1, 1]  # the prefill's token, then the error
    assert all(r.finish_reason.value == "error" and "NaN or Inf" in r.error for r in reqs)
    assert engine.kv_pool.available() == engine.kv_pool.num_slots


@pytest.mark.graphs
@pytest.mark.parametrize("overlap", [False, True])
def test_nan_decode_logits_on_graphs_are_marked_inside_the_graph(
    llama_gqa_untied, monkeypatch, overlap
):
    """Decode logits turn NaN (after a clean prefill) inside a replayed decode graph: the
    graph's own greedy tokens carry the mark, for greedy and for sampled requests.
    Launching ahead, the step behind the marked one takes a valid token in the mark's
    place, and its output is dropped with the failed requests."""
    from helpers import cpu_engine, standin_device

    from graphrt.core.batch import ForwardMode
    from graphrt.core.engine.sampling import BAD_LOGITS
    from graphrt.core.runners import graph as runners_graph

    _nan_logits_in(ForwardMode.DECODE, runners_graph, monkeypatch)  # the graphs' forward
    target = load_model(str(llama_gqa_untied.path), CPU, torch.float32)
    engine = cpu_engine(
        target, device=standin_device(), runner="graph", graph_backend="cuda-full",
        graph_buckets=(2,), max_context_len=32, overlap=overlap,
    )  # fmt: skip
    greedy = SamplingParams(max_new_tokens=4, ignore_eos=True)
    sampled = dataclasses.replace(greedy, temperature=0.8, seed=3)
    reqs = [engine.add_request([5, 6, 7], greedy), engine.add_request([9, 10], sampled)]
    engine.run_until_finished(reqs)  # one batch: a greedy and a sampled row
    # The one decode step replayed (and, launched ahead, the one behind it).
    assert engine.graph_runner.replays_per_size() == {2: 1 + overlap}
    assert engine.strategy.greedy_out[:2].tolist() == [BAD_LOGITS] * 2  # marked in the graph
    assert [len(r.output_ids) for r in reqs] == [1, 1]  # the prefill's token, then the error
    assert all(r.finish_reason.value == "error" and "NaN or Inf" in r.error for r in reqs)
    assert engine.kv_pool.available() == engine.kv_pool.num_slots


@pytest.mark.graphs
def test_nan_verify_logits_behind_a_round_launched_ahead_feed_a_valid_token(
    gemma4_tiny, gemma4_assistant, monkeypatch
):
    """Verify logits turn NaN in one-graph rounds launched ahead: the round behind a
    marked one takes a valid token in the mark's place (fed -1, its first embedding
    lookup fails here, a device assert on a GPU); the requests fail with the line, the
    round behind's rows are dropped and every KV slot is freed."""
    from helpers import rounds_ahead_engine

    from graphrt.core.batch import ForwardMode
    from graphrt.spec import round_graph

    _nan_logits_in(ForwardMode.TARGET_VERIFY, round_graph, monkeypatch)  # the round's graph
    target = load_model(str(gemma4_tiny.path), CPU, torch.float32)
    drafter = load_model(str(gemma4_assistant.path), CPU, torch.float32)
    engine = rounds_ahead_engine(target, drafter)
    reqs = engine.generate([[5, 6, 7], [9, 10]], SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert engine.stats.launched_ahead == 1  # a round behind the marked one, then the read
    assert engine.stats.graph_rounds == 2  # the marked round and the one behind it replayed
    assert [len(r.output_ids) for r in reqs] == [1, 1]  # the prefill's token, then the error
    assert all(r.finish_reason.value == "error" and "NaN or Inf" in r.error for r in reqs)
    assert engine._pending is None and engine.kv_pool.available() == engine.kv_pool.num_slots


API_VALUES = [None, "x", "", -1, 0, 1, 2, 3, 1.5, float("nan"), float("inf"), True, False, [],
              {}, [1], (1, 2), 10**30, -(10**30), b"ab", torch.tensor([1, 2])]  # fmt: skip
PARAM_FIELDS = [
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "ignore_eos",
    "speculate",
]
CONFIG_FIELDS = ["max_running_requests", "max_context_len", "kv_pool_tokens", "max_prefill_tokens",
                 "seed", "runner", "graph_buckets", "graph_padding", "graph_max_batch"]  # fmt: skip


def test_fuzzed_api_calls_raise_graphrt_errors_or_work(engine):
    """Random values (seeded, bounded) for SamplingParams, EngineConfig and generate's
    prompts: each call works or raises a GraphrtError subclass, never a raw TypeError,
    ValueError or a torch error, and leaves the engine idle."""
    rng = random.Random(24)
    outcomes = {"ok": 0, "refused": 0}
    for _ in range(150):
        what = rng.choice(["params", "config", "prompts"])
        try:
            if what == "params":
                fields = rng.sample(PARAM_FIELDS, rng.randint(1, 3))
                params = SamplingParams(**{f: rng.choice(API_VALUES) for f in fields})
                params = dataclasses.replace(params, max_new_tokens=min(params.max_new_tokens, 3))
                engine.generate([[1, 2]], params)
            elif what == "config":
                fields = rng.sample(CONFIG_FIELDS, rng.randint(1, 3))
                values = {"runner": "eager", **{f: rng.choice(API_VALUES) for f in fields}}
                config = EngineConfig(**values)
                Engine(engine.loaded, config, devices.current("cpu"))
            else:
                prompts = rng.choice([rng.choice(API_VALUES), [rng.choice(API_VALUES)]])
                engine.generate(prompts, SamplingParams(max_new_tokens=2))
            outcomes["ok"] += 1
        except GraphrtError:
            outcomes["refused"] += 1
        assert not engine.waiting and not engine.running
    assert outcomes["ok"] >= 10 and outcomes["refused"] >= 50, outcomes
