"""Compiling ahead (issue 21, cold start): before its first capture the engine hands the
backend every bucket's forward of every runner it is about to capture, in one go (CUDA
compiles their Triton kernels in parallel, devices/cuda/compile_ahead.py); graphs captured
later (a speculative variant first needed by some step) get theirs before their own
capture. The dry runs leave nothing behind: tokens equal an eager engine's."""

from __future__ import annotations

import pytest
import torch
from helpers import CPU, HAS_TRITON, cpu_engine, standin_device

from graphrt.core.engine import SamplingParams
from graphrt.core.models import load_model
from graphrt.core.runners.graph import GraphRunner
from graphrt.devices.cuda.graph import CudaFullGraphBackend
from graphrt.spec import MTPDecoding, SpecConfig

BUCKETS = (1, 2, 4)


@pytest.fixture
def events(monkeypatch):
    """("dry", runner, size) per dry run handed out and run, ("capture", runner) per
    capture, in order; the stand-in backend runs the dry runs for real (no Triton here)."""
    log: list[tuple] = []
    dry_runs, capture = GraphRunner.dry_runs, GraphRunner.capture

    def recording_dry_runs(self):
        for size, run in zip(reversed(self.buckets), dry_runs(self), strict=True):
            yield lambda run=run, size=size: (run(), log.append(("dry", self, size)))

    def recording_capture(self):
        log.append(("capture", self))
        capture(self)

    def compile_ahead(self, runs):
        for run in runs:
            run()

    monkeypatch.setattr(GraphRunner, "dry_runs", recording_dry_runs)
    monkeypatch.setattr(GraphRunner, "capture", recording_capture)
    monkeypatch.setattr(CudaFullGraphBackend, "compile_ahead", compile_ahead)
    return log


def _assert_compiled_before_captured(log: list[tuple]) -> list[GraphRunner]:
    """Every capture's runner ran dry at each of its buckets before it, and the first
    capture of each group comes after every dry run of that group. -> captured runners."""
    captured = [event[1] for event in log if event[0] == "capture"]
    assert captured
    for i, event in enumerate(log):
        if event[0] != "capture":
            continue
        runner = event[1]
        dry = [e[2] for e in log[:i] if e[0] == "dry" and e[1] is runner]
        assert dry == list(reversed(runner.buckets)), (runner.shape, dry)
    return captured


def _engine(loaded, strategy=None, **config):
    config = dict(
        runner="graph", graph_backend="cuda-full", graph_buckets=BUCKETS,
        max_running_requests=4, max_context_len=48, **config,
    )  # fmt: skip
    return cpu_engine(loaded, strategy, standin_device(), **config)


def _tokens(engine, prompts, params):
    reqs = [engine.add_request(p, params) for p in prompts]
    engine.run_until_finished(reqs)
    return [r.output_ids for r in reqs]


PROMPTS = [[5, 6, 7], [9, 10], [3, 4, 11, 12], [8]]


@pytest.mark.graphs
def test_plain_decode_buckets_run_dry_before_capture_and_leave_no_trace(events, llama_gqa_untied):
    loaded = load_model(str(llama_gqa_untied.path), CPU, torch.float32)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    engine = _engine(loaded)
    (runner,) = _assert_compiled_before_captured(events)
    assert runner is engine.graph_runner
    # Every bucket ran dry once, all before the one capture.
    assert [e[0] for e in events] == ["dry"] * len(BUCKETS) + ["capture"]
    got = _tokens(engine, PROMPTS, params)
    assert engine.stats.graph_steps > 0 and engine.graph_runner.replays_per_size()
    assert got == _tokens(cpu_engine(loaded, max_context_len=48), PROMPTS, params)


@pytest.mark.graphs
def test_first_prompts_prefill_dry_after_the_buckets_and_leave_no_trace(
    events, monkeypatch, llama_gqa_untied
):
    """Beside its graphs' buckets, last, the engine hands the backend prefills of a first
    prompt (``DRY_PREFILL_PROMPTS``: one request, and two) on throwaway requests, all
    before the first capture. They leave nothing behind: the first requests get the
    request and KV slots an eager engine gives them, and the same tokens."""
    from graphrt.core.engine import prefill

    dry_prefill = prefill._dry_prefill

    def recording(ledger, forward, device, lens):
        dry_prefill(ledger, forward, device, lens)
        events.append(("prefill", tuple(lens)))

    monkeypatch.setattr(prefill, "_dry_prefill", recording)
    loaded = load_model(str(llama_gqa_untied.path), CPU, torch.float32)
    engine = _engine(loaded)
    prefills = [("prefill", lens) for lens in prefill.DRY_PREFILL_PROMPTS]
    assert [e[0] for e in events] == ["dry"] * len(BUCKETS) + ["prefill"] * 2 + ["capture"]
    assert events[len(BUCKETS) : -1] == prefills
    eager = cpu_engine(loaded, max_context_len=48)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    placed = []
    for e in (engine, eager):
        reqs = [e.add_request(p, params) for p in PROMPTS]
        e.step()  # the prefill: request slots, and each prompt's KV slots in the table
        placed.append(
            [(r.req_slot, e.req_pool.host[r.req_slot, : r.kv_len].tolist()) for r in reqs]
        )
        e.run_until_finished(reqs)
        placed.append([r.output_ids for r in reqs])
    assert placed[0] == placed[2] and placed[1] == placed[3]
    assert engine.stats.graph_steps > 0


@pytest.mark.graphs
@pytest.mark.parametrize("one_graph", [True, False], ids=["one-graph", "two-graph"])
def test_speculative_runners_run_dry_together_and_lazy_ones_before_their_capture(
    events, gemma4_tiny, gemma4_assistant, one_graph
):
    target = load_model(str(gemma4_tiny.path), CPU, torch.float32)
    drafter = load_model(str(gemma4_assistant.path), CPU, torch.float32)
    engine = _engine(target, MTPDecoding(drafter, SpecConfig(2, 1, one_graph=one_graph)))
    setup = _assert_compiled_before_captured(events)
    # The round's graph; or the target's verify and the draft loop.
    assert len(setup) == (1 if one_graph else 2)
    first_capture = next(i for i, e in enumerate(events) if e[0] == "capture")
    assert {e[1] for e in events[:first_capture]} == set(setup)  # all dry, then captures
    # A sampled request needs graphs start-up left uncaptured: they run dry first too.
    sampled = SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=0.8, seed=4)
    before = len(events)
    got = _tokens(engine, PROMPTS[:2], sampled)
    later = _assert_compiled_before_captured(events[before:])
    assert later and not set(later) & set(setup)
    assert engine.stats.spec_rounds == engine.stats.graph_rounds > 0
    eager = cpu_engine(target, MTPDecoding(drafter, SpecConfig(2, 1)), max_context_len=48)
    assert got == _tokens(eager, PROMPTS[:2], sampled)


@pytest.mark.graphs
@pytest.mark.parametrize("one_graph", [True, False], ids=["one-graph", "two-graph"])
def test_a_rounds_dry_run_indexes_nothing_by_its_tails_garbage(
    monkeypatch, gemma4_tiny, gemma4_assistant, one_graph
):
    """A dry run computes from garbage (devices/cuda/compile_ahead.py's HAZARD): on CUDA the
    round's tail is one Triton kernel, which a dry run compiles and does not run, so its
    packed row holds whatever the allocator left there. What the graph computes after the
    tail must index nothing by it (an index out of range is a device assert that ends the
    process: stop 71's next-step columns gathered by its accepted counts did). Here the
    dry runs' tails return such a row, of values far out of every range; the dry runs
    must pass, and the graphs captured after them give the eager engine's tokens."""
    from graphrt.spec import round_graph, verify

    garbage = []  # the rows handed out

    def garbage_tail(real):
        def tail(*args, **kwargs):
            packed = real(*args, **kwargs)
            garbage.append(torch.randint(-(2**40), 2**40, packed.shape, dtype=packed.dtype))
            return garbage[-1]

        return tail

    def compile_ahead(self, runs):
        with monkeypatch.context() as m:
            for module in (round_graph, verify):
                m.setattr(module, "round_tail", garbage_tail(module.round_tail))
            for run in runs:
                run()

    monkeypatch.setattr(CudaFullGraphBackend, "compile_ahead", compile_ahead)
    target = load_model(str(gemma4_tiny.path), CPU, torch.float32)
    drafter = load_model(str(gemma4_assistant.path), CPU, torch.float32)
    engine = _engine(target, MTPDecoding(drafter, SpecConfig(2, 1, one_graph=one_graph)))
    assert len(garbage) == len(BUCKETS)  # each bucket's round (or verify) graph ran dry
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    got = _tokens(engine, PROMPTS, params)
    assert engine.stats.spec_rounds == engine.stats.graph_rounds > 0
    eager = cpu_engine(target, MTPDecoding(drafter, SpecConfig(2, 1)), max_context_len=48)
    assert got == _tokens(eager, PROMPTS, params)


# ---- on the GPU: the real thing, from empty caches, in a fresh process -------------------

PROBE = r"""
import json, sys, threading
import torch, triton.compiler, triton.runtime.build
compiles = {"ahead": 0, "setup": 0, "run": [], "launchers_ahead": 0, "launchers_main": []}
phase = {"now": None}
real = triton.compiler.compile
real_build = triton.runtime.build._build

def counting_build(name, *args, **kwargs):
    # gcc building a C module (cache misses only): kernels' launchers, first launches'
    if name == "__triton_launcher" and phase["now"] is not None:
        if threading.current_thread() is threading.main_thread():
            compiles["launchers_main"].append(phase["now"])
        else:
            compiles["launchers_ahead"] += 1
    return real_build(name, *args, **kwargs)

triton.runtime.build._build = counting_build

def counting(src, *args, **kwargs):
    on_pool = threading.current_thread() is not threading.main_thread()
    if phase["now"] == "setup":
        compiles["ahead" if on_pool else "setup"] += 1
    elif phase["now"] == "run":  # the first prompts' prefill and the steps after it
        compiles["run"].append(getattr(getattr(src, "fn", None), "__name__", "?"))
    return real(src, *args, **kwargs)

triton.compiler.compile = counting
from graphrt.core.engine import Engine, EngineConfig, SamplingParams
from graphrt.core.models import load_model
from graphrt.devices.cuda import CudaDevice

device = CudaDevice()
loaded = load_model(sys.argv[1], device, torch.float32)
config = dict(max_running_requests=4, max_context_len=64)
phase["now"] = "setup"
engine = Engine(loaded, EngineConfig(runner="graph", graph_buckets=(1, 2, 4), **config), device)
phase["now"] = None
prompts = [[5, 6, 7], [9, 10], [3, 4, 11, 12], [8]]
params = SamplingParams(max_new_tokens=8, ignore_eos=True)
phase["now"] = "run"
graph = [r.output_ids for r in engine.generate(prompts, params)]
phase["now"] = None
steps = engine.stats.graph_steps
eager = Engine(loaded, EngineConfig(runner="eager", **config), device)
print(json.dumps(dict(compiles, graph=graph, graph_steps=steps,
                      eager=[r.output_ids for r in eager.generate(prompts, params)])))
"""


def _builds_launchers() -> bool:
    """Whether this Triton builds a C launcher a kernel signature (gcc; up to 3.6)."""
    import inspect

    from triton.backends.nvidia import driver

    return "__triton_launcher" in inspect.getsource(driver.CudaLauncher)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cuda_engine_compiles_every_kernel_ahead_on_threads(llama_gqa_untied, tmp_path):
    """From empty Triton and GEMV-tuner caches: while the engine sets up, every Triton
    kernel compiles, and its C launcher builds, on the compile-ahead pool's threads, none on
    the main thread (the warm-ups and captures find them all), and none when the first prompts prefill and
    decode (their prefill ran dry beside the graphs: ``DRY_PREFILL_PROMPTS``); the graphs
    then give the eager engine's tokens."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"),
               GRAPHRT_CACHE_DIR=str(tmp_path / "graphrt"))  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(llama_gqa_untied.path)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["ahead"] > 0 and result["setup"] == 0, result
    assert result["run"] == [], f"compiled at the first prefill or step: {result['run']}"
    # Their C launchers (gcc, about 0.3 s each) were built on the pool too, not at the
    # first launches on the main thread (the captures, the first prefill). Triton 3.7
    # launches through one launcher it builds with the driver: no launcher builds at all.
    assert result["launchers_main"] == [], result
    if _builds_launchers():
        assert result["launchers_ahead"] > 0, result
    assert result["graph_steps"] > 0
    assert result["graph"] == result["eager"]


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_compile_ahead_runs_each_dry_and_restores_launches(caplog):
    """compile_ahead calls each run once with launches compile-only (dry() is True), puts
    Triton's launch back after, stops at a failing run with one warning instead of failing
    the engine, and runs nothing inside another caller's async compile mode."""
    from concurrent.futures import ThreadPoolExecutor

    from triton.runtime._async_compile import AsyncCompileMode
    from triton.runtime.jit import JITFunction

    from graphrt.devices.cuda import compile_ahead as ahead

    launch = JITFunction.run
    seen = []

    def run(i):
        seen.append((i, ahead.dry(), JITFunction.run is not launch))
        if i == 2:
            raise RuntimeError("a forward that cannot run dry")

    assert ahead.compile_ahead((lambda i=i: run(i)) for i in range(4)) == 0  # nothing queued
    assert seen == [(0, True, True), (1, True, True), (2, True, True)]  # stopped at 2
    assert "compiling ahead stopped" in caplog.text
    assert JITFunction.run is launch and not ahead.dry()
    seen.clear()
    with ThreadPoolExecutor(1) as pool, AsyncCompileMode(pool):
        assert ahead.compile_ahead([lambda: run(0)]) == 0
    assert seen == []


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_launchers_build_once_per_signature_on_the_pool(monkeypatch, caplog):
    """After the compiles, each distinct launcher (a kernel's signature and tensor
    descriptors) is built once, on the pool's threads, not the caller's; a build that fails
    is left to the kernel's first launch (logged, not raised)."""
    import logging
    import threading
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    from triton.runtime.driver import driver

    from graphrt.devices.cuda import compile_ahead as ahead

    built = []

    def launcher_cls(src, metadata):
        built.append((src.signature["x"], threading.current_thread().name))
        if src.signature["x"] == "*bf16":
            raise RuntimeError("gcc failed")

    monkeypatch.setattr(driver, "_active", SimpleNamespace(launcher_cls=launcher_cls))

    def kernel(x, block):  # two constexpr values of one signature share a launcher
        signature = {"x": x, "n": "i32", "BLOCK": "constexpr"}
        return SimpleNamespace(src=SimpleNamespace(signature=signature, constants={"BLOCK": block}),
                               metadata=SimpleNamespace(tensordesc_meta=None), name=x)  # fmt: skip

    kernels = [kernel("*fp32", 16), kernel("*fp32", 32), kernel("*bf16", 16), None]
    with caplog.at_level(logging.DEBUG, logger=ahead.__name__):
        with ThreadPoolExecutor(2, thread_name_prefix="triton-compile") as pool:
            ahead._build_launchers(pool, kernels)
    assert sorted(x for x, _ in built) == ["*bf16", "*fp32"]
    assert all(name.startswith("triton-compile") for _, name in built)
    assert "launcher of *bf16 not built ahead: gcc failed" in caplog.text
