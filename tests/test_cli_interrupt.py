"""Nothing produced is lost (issue 22): a single prompt streams its text as it decodes, and
SIGINT or SIGTERM during a run prints everything generated so far (finish reason
``interrupted``) before one error line, exit 130 or 143; a SIGINT during start-up is one
line too. Real processes on the embedded pair, whose tokenizer makes text."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import sigint_default

from graphrt.core.cli.main import main

PROMPT = "def fibonacci(n):"
MAX_NEW = 2000  # seconds of decoding even on an idle machine: the signal lands mid-run
LONG = ["--max-new-tokens", str(MAX_NEW), "--ignore-eos", "--no-draft"]


def _start(*args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "graphrt.core.cli.main", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        preexec_fn=sigint_default,
    )


def _read_until_streaming(proc: subprocess.Popen, prompt: str) -> bytes:
    """stdout until text past the prompt has arrived, the process still running."""
    seen = b""
    while len(seen) <= len(prompt.encode()) + 16:
        chunk = os.read(proc.stdout.fileno(), 4096)
        assert chunk, "stdout closed before any text streamed"
        seen += chunk
    assert proc.poll() is None, "the run ended before its text arrived: nothing streamed"
    return seen


def test_one_prompt_streams_the_same_text_the_json_holds(capsys):
    args = ["generate", "--prompt", PROMPT, "--max-new-tokens", "24", "--no-draft"]
    assert main(args) == 0
    streamed = capsys.readouterr().out
    assert main([*args, "--json"]) == 0
    request = json.loads(capsys.readouterr().out)["requests"][0]
    assert request["finish_reason"] == "length"
    # The prompt's text, the continuation as it streamed, then the request's header line.
    text, header = streamed.split("\n[0] ", 1)
    assert text == PROMPT + request["text"]
    assert header.startswith("9 prompt tokens, 24 generated, finished: length")


def test_sigterm_mid_run_prints_what_was_generated_then_one_line():
    proc = _start("generate", "--prompt", PROMPT, *LONG)
    early = _read_until_streaming(proc, PROMPT)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    out, err = (early + out).decode(), err.decode()
    assert proc.returncode == 143, err
    assert out.startswith(PROMPT)
    header = next(line for line in out.splitlines() if line.startswith("[0] "))
    assert header.endswith("finished: interrupted")
    generated = int(header.split(", ")[1].split()[0])
    assert 0 < generated < MAX_NEW
    assert "tok/s decoding" in out  # the summary line too
    assert err.strip().splitlines()[-1] == "graphrt: terminated (SIGTERM)"
    assert "Traceback" not in err


def test_sigint_mid_run_keeps_the_json():
    proc = _start("generate", "--prompt", PROMPT, "--prompt", "import os", *LONG, "--json")
    while b"set up the engine" not in (line := proc.stderr.readline()):
        assert line, "the run ended before its engine was set up"
    time.sleep(2.0)  # decode steps (each a few ms; tens on a loaded machine)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err.decode()
    requests = json.loads(out)["requests"]
    assert [r["finish_reason"] for r in requests] == ["interrupted"] * 2
    assert all(0 < len(r["output_ids"]) < MAX_NEW for r in requests)
    assert err.decode().strip().splitlines()[-1] == "graphrt: interrupted"


def _importing_torch(pid: int) -> bool:
    """Whether the process has torch's library mapped (Linux): it is importing torch."""
    with open(f"/proc/{pid}/maps") as f:
        return "libtorch" in f.read()


@pytest.mark.parametrize(
    "argv",
    [["info"], ["generate", "--model", "random:llama-tiny", "--prompt-ids", "1,2"]],
    ids=["info", "generate"],
)
def test_sigint_during_start_up_is_one_line(argv):
    """Ctrl-C while main() imports torch: one line. The signal is sent once torch's
    library is mapped, so it lands inside main however loaded the machine is."""
    proc = _start(*argv)
    while not _importing_torch(proc.pid):
        assert proc.poll() is None, f"{argv[0]} ended before it imported torch"
        time.sleep(0.002)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert err.decode().strip() == "graphrt: interrupted"


# A child that sends itself SIGINT while main's module imports its argument parser: after
# the console script or `python -m` started, before main() runs.
_SIGINT_WHILE_IMPORTING = """
import builtins, os, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # as a terminal's Ctrl-C finds it
real_import = builtins.__import__
def interrupting_import(name, *args, **kwargs):
    if name == "graphrt.core.cli.args":
        os.kill(os.getpid(), signal.SIGINT)
    return real_import(name, *args, **kwargs)
builtins.__import__ = interrupting_import
sys.argv = ["graphrt", "info"]
"""
_CONSOLE_SCRIPT = "from graphrt.core.cli.start_up import run\nsys.exit(run())"
_PYTHON_M = "import runpy\nrunpy.run_module('graphrt.core.cli.main', run_name='__main__')"


@pytest.mark.parametrize("start", [_CONSOLE_SCRIPT, _PYTHON_M], ids=["console-script", "python-m"])
def test_sigint_before_main_runs_is_one_line(start):
    """The window the test above cannot hit by timing: main's module still importing."""
    proc = subprocess.run(
        [sys.executable, "-c", _SIGINT_WHILE_IMPORTING + start],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert (proc.returncode, proc.stderr, proc.stdout) == (130, "graphrt: interrupted\n", "")
