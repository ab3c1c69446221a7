"""The `graphrt` command: the generate contract, its JSON, and one-line errors."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import cli_error_line, hf_greedy, make_tokenizer

from graphrt.core.cli import version
from graphrt.core.cli.args import build_parser
from graphrt.core.cli.main import main

ROOT = Path(__file__).resolve().parents[1]

STATS_KEYS = {
    "device",
    "runner",
    "overlap",
    "launched_ahead",
    "tp",
    "batch_invariant",
    "graph_steps",
    "eager_steps",
    "captured_sizes",
    "tokens_per_s",
    "capture_time_s",
    "lazy_capture_s",
    "compile_time_s",
    "prefill_time_s",
    "graph_memory_bytes",
}


@pytest.fixture(scope="module")
def ckpt_with_tokenizer(llama_gqa_untied, tmp_path_factory):
    """The parity Llama checkpoint plus a tokenizer.json covering its vocabulary."""
    path = tmp_path_factory.mktemp("cli_llama")
    shutil.copytree(llama_gqa_untied.path, path, dirs_exist_ok=True)
    make_tokenizer(path, llama_gqa_untied.hf.config.vocab_size)
    return path, llama_gqa_untied.hf


def run_json(capsys, *argv: str) -> dict:
    # Eager unless a test asks for graphs: CPU graphs cost seconds of compilation.
    runner = [] if "--runner" in argv else ["--runner", "eager"]
    assert main(["generate", *argv, *runner, "--json"]) == 0
    captured = capsys.readouterr()
    return json.loads(captured.out)  # exactly one JSON object, nothing else on stdout


def test_generate_json_matches_transformers(capsys, ckpt_with_tokenizer):
    path, hf = ckpt_with_tokenizer
    prompts = [[5, 17, 42, 99, 7], [250, 3, 8, 61, 12, 33, 140, 11, 9]]
    out = run_json(
        capsys,
        "--model", str(path),
        "--prompt-ids", ",".join(map(str, prompts[0])),
        "--prompt-ids", ",".join(map(str, prompts[1])),
        "--max-new-tokens", "12", "--ignore-eos", "--device", "cpu", "--dtype", "float32",
    )  # fmt: skip
    assert set(out) == {"requests", "stats"}
    assert set(out["stats"]) == STATS_KEYS
    assert out["stats"]["device"] == "cpu" and out["stats"]["runner"] == "eager"
    assert out["stats"]["overlap"] is False  # off by default
    assert out["stats"]["capture_time_s"] == 0 and out["stats"]["graph_memory_bytes"] == 0
    assert out["stats"]["graph_steps"] == 0 and out["stats"]["captured_sizes"] == []
    assert out["stats"]["eager_steps"] == 12  # one prefill step + 11 decode steps
    assert out["stats"]["tokens_per_s"] > 0
    for prompt, req in zip(prompts, out["requests"]):
        assert req["prompt_ids"] == prompt
        assert req["output_ids"] == hf_greedy(hf, prompt, 12)[0]
        assert isinstance(req["text"], str)


def test_overlap_flags_set_it_either_way_and_leave_it_to_the_device_unset():
    parse = build_parser().parse_args
    base = ["generate", "--model", "m", "--prompt-ids", "1"]
    assert parse(base).overlap is None  # the device's default (on for cuda)
    assert parse([*base, "--overlap"]).overlap is True
    assert parse([*base, "--no-overlap"]).overlap is False


def test_generate_overlap_gives_transformers_tokens(capsys, ckpt_with_tokenizer):
    """--overlap (plain steps launched before the last one's tokens are read): the same
    tokens as transformers, and no step beyond the ones the tokens need (the last step of
    a request whose length ends is followed by none)."""
    path, hf = ckpt_with_tokenizer
    prompts = [[5, 17, 42, 99, 7], [250, 3, 8]]
    argv = ["--model", str(path), "--max-new-tokens", "9", "--ignore-eos", "--overlap"]
    for p in prompts:
        argv += ["--prompt-ids", ",".join(map(str, p))]
    out = run_json(capsys, *argv)
    assert out["stats"]["eager_steps"] == 9  # one prefill step + 8 decode steps
    assert out["stats"]["overlap"] is True
    assert out["stats"]["launched_ahead"] == 7  # each decode step behind the first
    for prompt, req in zip(prompts, out["requests"]):
        assert req["output_ids"] == hf_greedy(hf, prompt, 9)[0]


@pytest.mark.graphs
def test_graph_runner_matches_eager_the_cpu_default_and_transformers(capsys, ckpt_with_tokenizer):
    """On CPU no --runner means eager (compiling costs more than a short job saves);
    --runner graph runs every fitting decode step on its compiled bucket, and what it
    prints agrees with eager, the default and transformers. One compile: each costs
    tens of seconds of the CPU lane."""
    path, hf = ckpt_with_tokenizer
    prompts = [[5, 17, 42, 99, 7], [250, 3, 8], [11, 12, 13, 14, 15, 16, 17]]
    argv = ["--model", str(path), "--max-new-tokens", "10", "--ignore-eos", "--graph-bs", "4"]
    for p in prompts:
        argv += ["--prompt-ids", ",".join(map(str, p))]
    graph = run_json(capsys, *argv, "--runner", "graph")
    assert main(["generate", *argv, "--json"]) == 0  # no --runner: the device default
    default = json.loads(capsys.readouterr().out)
    eager = run_json(capsys, *argv, "--runner", "eager")
    assert default["stats"]["runner"] == "eager" and graph["stats"]["runner"] == "graph"
    assert default["stats"]["compile_time_s"] == 0.0
    assert graph["stats"]["compile_time_s"] > 0  # the bucket compiled at its first step
    assert graph["stats"]["captured_sizes"] == [4]
    assert graph["stats"]["graph_steps"] == 9 and graph["stats"]["eager_steps"] == 1  # prefill
    outputs = {
        name: [r["output_ids"] for r in run["requests"]]
        for name, run in (("graph", graph), ("default", default), ("eager", eager))
    }
    outputs["transformers"] = [hf_greedy(hf, prompt, 10)[0] for prompt in prompts]
    assert all(ids == outputs["transformers"] for ids in outputs.values()), outputs


def test_prompt_text_is_tokenized_and_output_decoded(capsys, ckpt_with_tokenizer):
    from tokenizers import Tokenizer

    path, hf = ckpt_with_tokenizer
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    out = run_json(capsys, "--model", str(path), "--prompt", "hello world the cat", "--prompt-ids", "4,5",
                   "--max-new-tokens", "6", "--ignore-eos")  # fmt: skip
    first, second = out["requests"]
    assert first["prompt_ids"] == tok.encode("hello world the cat").ids
    assert second["prompt_ids"] == [4, 5]  # requests keep the order the flags were given in
    assert first["output_ids"] == hf_greedy(hf, first["prompt_ids"], 6)[0]
    assert first["text"] == tok.decode(first["output_ids"], skip_special_tokens=True)


def test_random_preset_runs_and_has_no_text(capsys):
    out = run_json(capsys, "--model", "random:llama-tiny", "--prompt-ids", "1,2,3", "--max-new-tokens", "5",
                   "--ignore-eos")  # fmt: skip
    (req,) = out["requests"]
    assert len(req["output_ids"]) == 5 and req["text"] is None
    assert all(0 <= t < 512 for t in req["output_ids"])


def test_readable_output_without_json(capsys):
    assert (
        main(
            [
                "generate",
                "--model",
                "random:llama-tiny",
                "--prompt-ids",
                "1,2",
                "--max-new-tokens",
                "3",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "output_ids:" in out and "tok/s" in out
    with pytest.raises(json.JSONDecodeError):
        json.loads(out)


def test_info_names_device_and_versions(capsys):
    assert main(["info", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "device:" in out and "cpu" in out
    assert torch.__version__ in out


GRAPH = ["--prompt-ids", "1", "--runner", "graph"]


@pytest.mark.parametrize(
    ("argv", "needle", "status"),
    [
        (["--prompt-ids", "1,2,999999"], "outside the vocabulary", 1),
        (["--prompt-ids", ""], "empty prompt", 1),
        (
            ["--prompt-ids", ",".join(["5"] * 9), "--max-context-len", "8"],
            "longer than the context (8): --max-context-len (max_context_len) raises it",
            1,
        ),
        (["--prompt", "hi"], "tokenizer.json", 1),
        ([], "no prompt", 1),
        ([*GRAPH, "--graph-backend", "bogus"], "offers compile", 2),
        ([*GRAPH, "--graph-bs", "64", "--max-running-requests", "8"], "no graph batch size", 2),
        (["--prompt-ids", "1", "--device", "npu"], "graphrt[npu]", 4),
        # Sizes that cannot be allocated: one line and status 5, before any step.
        (["--prompt-ids", "1", "--kv-pool-tokens", str(2**31 - 1)], "do not fit in cpu memory", 5),
    ],
)
def test_bad_input_is_one_line_error(capsys, argv, needle, status):
    """Exit status by kind (graphrt.core.errors): 1 request, 2 usage, 4 device, 5 memory."""
    runner = [] if "--runner" in argv else ["--runner", "eager"]
    assert main(["generate", "--model", "random:llama-tiny", *argv, *runner]) == status
    captured = capsys.readouterr()
    assert captured.out == ""  # nothing half-printed on stdout
    assert needle in cli_error_line(captured.err), captured.err


def test_bad_checkpoints_are_one_line_errors(capsys, tmp_path, llama_tied):
    missing = tmp_path / "nope"
    malformed = tmp_path / "malformed"
    malformed.mkdir()
    (malformed / "config.json").write_text("{not json")
    no_weights = tmp_path / "no_weights"
    shutil.copytree(llama_tied.path, no_weights)
    for f in no_weights.glob("*.safetensors"):
        f.unlink()
    for path, needle in [
        (missing, "does not exist"),
        (malformed, "not valid JSON"),
        (no_weights, "no safetensors"),
    ]:
        assert main(["generate", "--model", str(path), "--prompt-ids", "1"]) == 3  # checkpoint
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], err


def test_console_script_error_has_no_traceback(tmp_path):
    # The real entry point in a subprocess: exit status and stderr as a user sees them.
    proc = subprocess.run(
        [sys.executable, "-m", "graphrt.core.cli.main", "generate", "--model", str(tmp_path / "missing"),
         "--prompt-ids", "1"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 3  # a bad checkpoint's status
    assert "Traceback" not in proc.stderr
    assert (
        proc.stderr.strip().startswith("graphrt: error:")
        and len(proc.stderr.strip().splitlines()) == 1
    )
    assert proc.stdout == ""


def test_usage_error_exits_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(
            [
                "generate",
                "--model",
                "random:llama-tiny",
                "--max-new-tokens",
                "0",
                "--prompt-ids",
                "1",
            ]
        )
    assert exc.value.code == 2


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["generate", "--max-new-tokens", "0", "--prompt-ids", "1"], "--max-new-tokens"),
        (["generate", "--prompt-ids", "1,,2"], "'1,,2'"),  # a typo, not [1, 2]
        (["generate", "--bogus-flag"], "unrecognized arguments: --bogus-flag"),
        (["bench", "--runners", ""], "runners are eager, graph, hf"),
        (["bench", "--runners", "graph,fast"], "runners are eager, graph, hf"),
        # Sampling flags are refused while parsing, before anything loads.
        (["generate", "--temperature", "nan"], "--temperature: must be finite"),
        (["generate", "--temperature", "inf"], "--temperature: must be finite"),
        (["generate", "--temperature", "1e-40"], "too small to sample with"),  # NaN probabilities
    ],
)
def test_usage_errors_are_one_line_with_exit_2(capsys, argv, needle):
    """argparse's value errors too: one line naming the problem, not the usage block."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("graphrt: error:") and needle in err[0], err


@pytest.mark.parametrize(
    "flags, needle, status",
    [
        (["--device", "bogus"], "known devices are cpu", 4),  # plugin names are listed too
    ],
)
def test_bad_values_are_one_line_errors_before_any_work(capsys, flags, needle, status):
    argv = ["generate", "--model", "random:llama-tiny", "--prompt-ids", "1", *flags]
    assert main(argv) == status
    captured = capsys.readouterr()
    assert captured.out == ""
    assert needle in cli_error_line(captured.err), captured.err


def test_any_integer_seed_runs(capsys):
    """--seed beyond 64 bits (was: a RuntimeError from the generator) seeds modulo 2^64."""
    argv = ["--model", "random:llama-tiny", "--prompt-ids", "1", "--temperature", "0.8"]
    out = run_json(capsys, *argv, "--seed", str(2**70), "--max-new-tokens", "3")
    assert len(out["requests"][0]["output_ids"]) == 3


def test_info_into_a_closed_pipe_exits_quietly():
    """`graphrt info | head -1`: the reader is gone before info writes; no traceback."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # nobody will read: every write raises BrokenPipeError
    proc = subprocess.run(
        [sys.executable, "-m", "graphrt.core.cli.main", "info"],
        stdout=write_end,
        stderr=subprocess.PIPE,
        text=True,
        timeout=120,
    )
    os.close(write_end)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr


def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    out = capsys.readouterr().out.strip()
    assert out == f"graphrt {version.package_version()}"
    assert re.fullmatch(r"graphrt \d+\.\d+\.\d+\S*", out), out


def test_version_falls_back_to_the_source_trees_pyproject(monkeypatch, tmp_path):
    def not_installed(name):
        raise version.importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(version.importlib.metadata, "version", not_installed)
    assert re.fullmatch(
        r"\d+\.\d+\.\d+\S* \(source tree, not installed\)", version.package_version()
    )
    monkeypatch.setattr(version, "PYPROJECT", tmp_path / "missing.toml")
    assert version.package_version() == "unknown (not installed)"


def _help(capsys, command: str) -> str:
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    return capsys.readouterr().out


def _flag_help(help_text: str, flag: str) -> str:
    """One flag's help paragraph, its wrapped lines joined by single spaces."""
    block = re.search(rf"^  {re.escape(flag)}\b.*?(?=^  -|\Z)", help_text, re.M | re.S)
    assert block, f"{flag} missing from help:\n{help_text}"
    return " ".join(block[0].split())


def test_generate_help_shows_defaults_and_seeding(capsys):
    text = _help(capsys, "generate")
    assert "(default: 32)" in _flag_help(text, "--max-new-tokens")
    assert "(default: 32)" in _flag_help(text, "--max-running-requests")
    seed = _flag_help(text, "--seed")
    assert "(default: 0)" in seed
    assert "sampling is seeded with 0 unless --seed is given" in seed


def test_bench_help_shows_defaults(capsys):
    text = _help(capsys, "bench")
    assert "(default: random:llama-1b)" in _flag_help(text, "--model")
    assert "(default: 512)" in _flag_help(text, "--prompt-len")
    assert "(default: bench-decode.json)" in _flag_help(text, "--out")
    assert "(default: 1,8,32,64)" in _flag_help(text, "--batch-sizes")
    assert "(default: 256)" in _flag_help(text, "--max-running-requests")


def test_every_flag_with_a_default_says_it_in_help():
    parser = build_parser()
    # argparse keeps subparsers on a private attribute; only this test reaches in.
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for command, subparser in sub.choices.items():
        for action in subparser._actions:
            if action.required or action.default == argparse.SUPPRESS:
                continue  # --model of generate; --help
            if isinstance(action.default, bool) or action.dest == "prompts":
                continue  # on/off switches; --prompt / --prompt-ids, one of which is required
            assert "default" in (action.help or ""), f"{command} {action.option_strings[0]}"


def test_generate_prints_no_numpy_warning():
    # torch warns "Failed to initialize NumPy" on import when numpy is missing, and its
    # wheels do not require numpy: pyproject declares it so every install has it.
    proc = subprocess.run(
        [sys.executable, "-m", "graphrt.core.cli.main", "generate", "--model", "random:llama-tiny",
         "--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--runner", "eager", "--json"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "Failed to initialize NumPy" not in proc.stderr
    assert len(json.loads(proc.stdout)["requests"][0]["output_ids"]) == 2


def test_numpy_is_a_runtime_dependency():
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11+")
    with open(ROOT / "pyproject.toml", "rb") as f:
        dependencies = tomllib.load(f)["project"]["dependencies"]
    assert any(re.match(r"numpy\b", dep) for dep in dependencies), dependencies


def test_a_generate_of_n_prompts_captures_graphs_up_to_n(capsys):
    """A batch never grows past the prompts given: one prompt, one graph (issue 21); an
    explicit --graph-bs list is kept as given."""
    argv = ["--model", "random:llama-tiny", "--prompt-ids", "1,2", "--prompt-ids", "3"]
    out = run_json(capsys, *argv, "--max-new-tokens", "1", "--runner", "graph")
    assert out["stats"]["captured_sizes"] == [1, 2]
    out = run_json(
        capsys, *argv[:4], "--max-new-tokens", "1", "--runner", "graph", "--graph-bs", "4"
    )
    assert out["stats"]["captured_sizes"] == [4]
