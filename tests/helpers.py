"""Test helpers: tiny transformers checkpoints, a matching tokenizer, error metrics.

Imported as ``from helpers import ...``; tests/conftest.py puts this directory
on ``sys.path`` so that works under every pytest import mode and from nox.
"""

from __future__ import annotations

import atexit
import functools
import importlib.metadata
import importlib.util
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

# Small enough that every model forward takes milliseconds on 2 CPU cores.
VOCAB = 300
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
CPU = torch.device("cpu")
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # head_dim 16: wavelengths 6.3 .. 2e4 fall in all three llama3 bands (<16, 16..64, >64).
    "original_max_position_embeddings": 64,
}
MISTRAL_WINDOW = 8
GEMMA4_WINDOW = 6  # shorter than every parity prompt (9-20 tokens): prefill itself slides
# Set to 1: every graph capture fails (tests/fail_captures, tests/test_graphs_required.py).
FAIL_CAPTURES = "GRAPHRT_TEST_FAIL_CAPTURES"


@dataclass(frozen=True)
class Checkpoint:
    path: Path  # directory holding config.json + safetensors
    hf: Any  # the transformers model it was saved from (float32, eval)


BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_bench(name: str) -> ModuleType:
    """bench/``name``.py, loaded by its path (bench/ holds scripts, not a package), afresh
    each call. Registered in ``sys.modules`` under its name: its dataclasses look their
    module up there. bench/ is on ``sys.path`` while it loads, for its sibling imports
    (``from oracles import ...``)."""
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    sys.path.insert(0, str(BENCH))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
    return module


# What `graphrt generate` may print on stderr before an error: its phase lines.
_STATUS_LINE = re.compile(r"[^\n]+: \d+\.\d s")


def cli_error_line(err: str) -> str:
    """The CLI's one error line, last on stderr; before it only phase lines ("loaded ...:
    0.1 s"): no traceback, no second error."""
    *status, error = err.strip().splitlines()
    assert error.startswith("graphrt: error:"), err
    assert all(_STATUS_LINE.fullmatch(line) for line in status), err
    return error


def make_checkpoint(
    path: Path, config: Any, seed: int = 0, max_shard_size: str | None = None
) -> Checkpoint:
    """Random transformers model for ``config``, saved to ``path``.

    Norm weights and biases are perturbed away from their 1/0 init, so a
    runtime that forgets a norm or a bias does not pass by accident.
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "norm" in name or "bias" in name:
                param.add_(torch.randn_like(param) * 0.1)
    # Parity runs generate exactly max_new_tokens, like graphrt's ignore_eos.
    hf.generation_config.eos_token_id = None
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    hf.save_pretrained(path, **kwargs)
    return Checkpoint(Path(path), hf)


def make_tokenizer(directory: str | Path, vocab_size: int) -> Path:
    """Write ``directory/tokenizer.json``: a whitespace WordLevel tokenizer of ``vocab_size`` ids.

    Ids 0, 1, 2 are ``<unk>``, ``<s>``, ``</s>`` (transformers' Llama defaults for
    unk/bos/eos); then a few English words, then ``w<i>`` fillers.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = ["<unk>", "<s>", "</s>"]
    words = ["hello", "world", "the", "a", "of", "and", "to", "is", "in", "it", "cat", "dog"]
    vocab = (specials + words)[:vocab_size]
    vocab += [f"w{i}" for i in range(vocab_size - len(vocab))]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(specials[: min(3, vocab_size)])
    out = Path(directory) / "tokenizer.json"
    tokenizer.save(str(out))
    return out


def assert_engine_idle(engine) -> None:
    """No request left anywhere, every KV slot, request row and reservation returned."""
    assert not engine.running and not engine.waiting
    assert engine.kv_pool.available() == engine.kv_pool.num_slots
    assert engine.req_pool.available() == engine.config.max_running_requests
    assert engine.ledger.reserved_tokens == 0


def folder_conftest(config):
    """This folder's conftest as pytest loaded it (`import conftest` may find another)."""
    path = str(Path(__file__).with_name("conftest.py"))
    (conftest,) = [
        p for p in config.pluginmanager.get_plugins() if getattr(p, "__file__", None) == path
    ]
    return conftest


class ProbeItem:
    """A test item as conftest's hooks see it: its id, its marks, and add_marker."""

    def __init__(self, nodeid: str, *marks: str):
        self.nodeid = nodeid
        self.marks = [getattr(pytest.mark, name).mark for name in marks]

    def get_closest_marker(self, name: str):
        return next((m for m in self.marks if m.name == name), None)

    def add_marker(self, mark) -> None:
        self.marks.append(mark.mark)


class GraphWitness:
    """Counts the graphs this process replayed and captured, through the two methods every
    device backend's graphs pass (``ExecutionBackend.replay`` and
    ``GraphRunner.capture_one_shape``; conftest installs the counts at start-up): a test
    marked ``graphs`` that passes with no replay is failed (conftest's
    ``pytest_runtest_call``), so a capture that degraded to eager steps, or graphs captured
    and never replayed, cannot pass as a graph run; a test about capture itself (marked
    ``graphs_capture`` too) must capture. A test whose graphs run in processes it starts
    reports their replays and dropped buckets with ``saw`` (the child installs the counts
    itself); one whose graphs a fixture other tests share built is marked ``graphs_shared``
    as well, and tests/test_graphs_required.py runs those with every capture failing. A
    graphs test in whose process a bucket's capture failed, shared fixtures' setup
    included, is failed too (some sizes then ran on another bucket or eagerly, unseen by
    the replay count), unless marked ``graphs_drops``: a test about dropped buckets."""

    replays = 0
    captures = 0
    drops = 0  # buckets whose capture failed and now run otherwise (GraphRunner._drop_bucket)

    @classmethod
    def saw(cls, replays: int, drops: int) -> None:
        """Graph replays and dropped buckets a child process reports (a TP rank's)."""
        cls.replays += replays
        cls.drops += drops

    @classmethod
    def install(cls) -> None:
        from graphrt.core.runners.backend import ExecutionBackend
        from graphrt.core.runners.graph import GraphRunner

        for owner, name, counter in (
            (ExecutionBackend, "replay", "replays"),
            (GraphRunner, "capture_one_shape", "captures"),
            (GraphRunner, "_drop_bucket", "drops"),
        ):
            real = getattr(owner, name)

            def counted(*args, _real=real, _counter=counter, **kwargs):
                out = _real(*args, **kwargs)
                # after the call: a capture or replay that raised is not counted
                setattr(cls, _counter, getattr(cls, _counter) + 1)
                return out

            setattr(owner, name, functools.wraps(real)(counted))


def cpu_engine(loaded, strategy=None, device=None, **config):
    """An Engine on the CPU (eager unless ``runner="graph"``) over ``loaded``."""
    from graphrt.core.engine import Engine, EngineConfig
    from graphrt.devices.cpu import CpuDevice

    config = EngineConfig(**{"runner": "eager", **config})
    return Engine(loaded, config, device or CpuDevice(), strategy)


def rounds_ahead_engine(target, drafter):
    """An engine of rounds of 2 on the stand-in device's one-graph rounds (compiled on the
    CPU), each launched ahead of the read before it: batches of 2 at most, context 32."""
    from graphrt.spec import MTPDecoding, SpecConfig

    return cpu_engine(
        target, MTPDecoding(drafter, SpecConfig(num_steps=2)), standin_device(),
        runner="graph", graph_backend="cuda-full", graph_buckets=(2,), max_context_len=32,
        overlap=True,
    )  # fmt: skip


def chi2_quantile(df: int, z: float = 3.09) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z 3.09: p = 0.999)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2_stat(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic over the cells expected 5 times or more, and their count."""
    expected = probs.double() * counts.sum()
    keep = expected >= 5
    stat = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum().item()
    return stat, int(keep.sum())


# Ops that read a tensor's value to the host (item(), int(t), a 0-dim tensor used as an
# index, nonzero): on a GPU each is a wait on the device. tolist() and .cpu(), the engine's
# one intended read a step, dispatch none of them on the CPU.
HOST_READS = frozenset({"aten::_local_scalar_dense", "aten::nonzero", "aten::is_nonzero"})


def host_reads(run) -> list[str]:
    """The HOST_READS ops ``run()`` dispatches, seen through torch.profiler (not a dispatch
    mode: torch's CausalBias cannot be made under one)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run()
    names = [event.name for event in prof.events()]
    assert "aten::empty" in names or "aten::add" in names  # (it records aten ops)
    return [name for name in names if name in HOST_READS]


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max|a - b| / max|b|: the parity metric of DESIGN.md ("within 1e-4 relative")."""
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def random_prompts(lengths, seed: int = 0, vocab: int = VOCAB) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    # Ids from 3 up: never the bos/eos/unk ids of the tiny configs.
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def hf_greedy(
    hf: Any, prompt: list[int], max_new_tokens: int
) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy continuation of one prompt: (tokens, per-step logits (vocab,))."""
    ids = torch.tensor([prompt])
    out = hf.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out.sequences[0, len(prompt) :].tolist(), [step[0] for step in out.logits]


def exact_interpreter_dots() -> None:
    """Make the Triton interpreter's float32 ``tl.dot`` sum in float64, then round: the
    same bits for a row whatever the rows beside it. The interpreter's dots are numpy
    matmuls, and OpenBLAS's float32 kernels give a row other bits at other row counts on
    some CPUs and builds (numpy 2.4.6 with OPENBLAS_CORETYPE=Haswell: 2 rows against 8),
    so a width-invariance check would test the BLAS, not the kernel's schedule. The
    online softmax and the split combine stay float32: a schedule that differs still
    shows. Call it in the interpreter's subprocess, before any kernel runs."""
    import numpy as np
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    plain = InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if not (a.data.dtype == b.data.dtype == d.data.dtype == np.float32):
            return plain(self, a, b, d, input_precision, max_num_imprecise_acc)
        exact = np.matmul(a.data.astype(np.float64), b.data.astype(np.float64))
        return TensorHandle(exact.astype(np.float32) + d.data, d.dtype.scalar)

    InterpreterBuilder.create_dot = create_dot


_INTERPRETER: subprocess.Popen | None = None  # this process's interpreter_server.py


def run_under_triton_interpreter(test_file: str, *args: str) -> Any:
    """Run ``test_file`` as a script (with ``args``) with TRITON_INTERPRET=1 and return the
    JSON it prints last.

    The interpreter must be switched on before triton is first imported, and other tests
    in this process may already have imported it: hence another process. One server per
    pytest process forks a child for each script (tests/interpreter_server.py), so that
    scripts do not each start Python and import torch.
    """
    global _INTERPRETER
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    if _INTERPRETER is None or _INTERPRETER.poll() is not None:
        server = str(Path(__file__).with_name("interpreter_server.py"))
        _INTERPRETER = subprocess.Popen(
            [sys.executable, server],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        atexit.register(_stop_interpreter, _INTERPRETER)
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp, "out"), Path(tmp, "err")
        argv = [str(Path(test_file).resolve()), *args]
        request = {"argv": argv, "env": env, "out": str(out), "err": str(err), "timeout": 600}
        _INTERPRETER.stdin.write(json.dumps(request) + "\n")
        _INTERPRETER.stdin.flush()
        reply = _INTERPRETER.stdout.readline()
        assert reply, "the interpreter server ended"  # (its traceback went to stderr)
        status = json.loads(reply)["status"]
        assert status == 0, f"exit {status}: " + err.read_text()[-6000:]
        return json.loads(out.read_text().strip().splitlines()[-1])


def _stop_interpreter(server: subprocess.Popen) -> None:
    """At exit: the server ends when its stdin closes."""
    server.stdin.close()
    server.wait(timeout=30)


class OracleDraftRunner:
    """Stands in for the drafter to exercise acceptance: proposes each request's true greedy
    continuation, except where ``wrong(request, position, step)`` says to propose a wrong
    token (then, with topk > 1, the right one ranks second, so it sits on a side branch)."""

    def __init__(self, engine, truth: dict[int, list[int]], topk: int):
        self.engine, self.truth, self.topk = engine, truth, topk
        self.step = 0

    def execute(self, batch):
        from graphrt.core.runners import RunnerOutput

        # A round's first step feeds the target's seed hiddens; later steps feed this
        # oracle's own, zeros: so rounds of any length (--spec-steps auto) count right.
        self.step = 0 if bool(batch.spec_info.hidden.any()) else self.step + 1
        step = self.step
        vocab = self.engine.loaded.model.vocab_size
        dev = self.engine.torch_device
        logits = torch.full((batch.num_tokens, vocab), -10.0, device=dev)
        for row, (slot, pos, tok) in enumerate(
            zip(batch.req_pool_indices.tolist(), batch.positions.tolist(), batch.input_ids.tolist())
        ):
            seq = self.truth[slot]
            on_path = pos + step < len(seq) and seq[pos + step] == tok
            nxt = (
                seq[pos + step + 1]
                if on_path and pos + step + 1 < len(seq)
                else (tok * 7 + 1) % vocab
            )
            wrong = (slot * 5 + pos * 3 + step) % 4 == 0
            bad = (nxt + 1 + step) % vocab
            logits[row, bad if wrong else nxt] = 5.0
            if self.topk > 1:
                logits[row, nxt if wrong else bad] = 4.0
        hidden = torch.zeros(
            batch.num_tokens, self.engine.loaded.model.config.hidden_size, device=dev
        )
        if batch.greedy_only:  # a chain's step: its argmax tokens, as forward_model gives
            return RunnerOutput(logits=None, hidden=hidden, tokens=logits.argmax(dim=-1))
        return RunnerOutput(logits=logits, hidden=hidden)


# Skip markers shared by the Triton kernel tests.
HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(
    not HAS_TRITON, reason="triton is not installed (pip install triton, or graphrt[cuda])"
)
# Triton < 3.7's interpreter turns runtime loop bounds into ints with int(ndarray), which
# numpy 2.4 refuses for 1-element arrays (3.7 squeezes first); the CPU lane pins 3.7.1.
OLD_INTERPRETER = HAS_TRITON and tuple(
    int(part) for part in importlib.metadata.version("triton").split(".")[:2]
) < (3, 7)
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


def standin_device(capture_safe: bool = True):
    """A CPU device whose graph backends are the real CUDA (``cuda-full``,
    ``cuda-breakable``) and NPU (``npu``) backends over the stand-in device module of
    tests/conformance/standin.py: graphrt's capture and replay logic, on CPU tensors.
    ``capture_safe=False``: the attention a breakable backend pairs with (host lengths)."""
    from conformance.standin import StandInGraphModule

    from graphrt.core.attention import TorchAttentionBackend
    from graphrt.devices.cpu import CpuDevice
    from graphrt.devices.cuda.graph import CudaBreakableGraphBackend, CudaFullGraphBackend
    from graphrt.devices.npu.graph import NpuGraphBackend

    class StandInDevice(CpuDevice):
        def _graph_backend_factories(self):
            return {
                "cuda-full": lambda: CudaFullGraphBackend(StandInGraphModule()),
                "cuda-breakable": lambda: CudaBreakableGraphBackend(StandInGraphModule()),
                "npu": lambda: NpuGraphBackend(StandInGraphModule()),
            }

        def create_attention_backend(self, kv_pool, req_to_token_pool):
            return TorchAttentionBackend(kv_pool, req_to_token_pool, capture_safe=capture_safe)

    return StandInDevice()


def join_gloo(rank: int, size: int, port: int):
    """In a spawned test process: become rank ``rank`` of ``size`` over gloo on this host,
    one thread each (the CPU lane has 2 cores). -> its TPGroup."""
    from graphrt.core.parallel import init_tp

    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    return init_tp("gloo", timeout_s=60)


def selected_params(session, module: str, name: str) -> set:
    """The values of parameter ``name`` among the selected tests of ``module`` (a module
    name): a fixture serving every value computes only what the run asks for (a ``-m``
    selection such as tests/test_graphs_required.py's)."""
    values = set()
    for item in session.items:
        callspec = getattr(item, "callspec", None)
        if item.module.__name__ == module and callspec is not None and name in callspec.params:
            values.add(callspec.params[name])
    return values


def cycling_chooser(max_steps: int, order: tuple[int, ...], capture_anytime: bool = True):
    """`--spec-steps auto` with its choice scripted: the lengths of ``order`` in turn (0: a
    plain step), skipping those refused (by the graph memory cap; and, unless
    ``capture_anytime``, lengths a short closed batch would capture: ``pays_a_capture``)."""
    from graphrt.spec.adaptive import DraftChooser

    class CyclingChooser(DraftChooser):
        def __init__(self):
            super().__init__(max_steps)
            self.step = 0

        def pays_a_capture(self, reqs):
            return capture_anytime or super().pays_a_capture(reqs)

        def choose(self, bucket, reqs, refused=frozenset(), closed=False):
            while True:
                self.step += 1
                steps = order[(self.step - 1) % len(order)]
                if steps not in refused:
                    return steps

    return CyclingChooser()


def sigint_default() -> None:
    """``preexec_fn`` for a child that must stop on SIGINT: a lane started in the
    background (`cmd &` in a script) inherits SIGINT ignored, and Python then keeps
    ignoring it, as nohup intends; a terminal's Ctrl-C reaches it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def spy_launches(engine, monkeypatch) -> tuple[list[int], list[int]]:
    """Spy on the strategy's launches; -> (batch sizes of every step launched, of those fed
    by a step's device tokens: launched ahead). A launch that declined (None: the engine
    then decodes the step) counts in neither."""
    every, ahead, launch = [], [], engine.strategy.launch

    def spy(reqs, last_tokens=None, kv_lens=None, in_flight=0):
        step = launch(reqs, last_tokens, kv_lens, in_flight)
        if step is not None:
            every.append(len(reqs))
            if last_tokens is not None:
                ahead.append(len(reqs))
        return step

    monkeypatch.setattr(engine.strategy, "launch", spy)
    return every, ahead
