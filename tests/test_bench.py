"""`graphrt bench`: the decode bench (the bytes a step reads, its floor, its JSON) and
the speculative round bench (`--draft`: every piece of a round, its peer, its plot)."""

from __future__ import annotations

import dataclasses
import itertools
import json
from types import SimpleNamespace

import pytest
import torch
from helpers import CPU, cli_error_line

from graphrt.core.bench import decode
from graphrt.core.bench.decode import DecodeBenchConfig, make_engine, run_decode_bench
from graphrt.core.bench.peer_hf import hf_assisted_tokens_per_s, hf_peer_problem
from graphrt.core.bench.plot import plot_context_sweep, plot_spec_throughput
from graphrt.core.bench.rounds import (
    RoundBenchConfig,
    gap_ms,
    replay_events,
    result_json,
    round_engines,
    run_round_bench,
    table,
)
from graphrt.core.bench.timing import achieved_gbps, floor_ms, step_bytes_read
from graphrt.core.engine import SamplingParams
from graphrt.core.models import load_model
from graphrt.core.models.loader import read_hf_config
from graphrt.spec import MTPDecoding, SpecConfig

F32 = 4  # bytes: the models below load in float32
BF16 = 2  # bytes: the KV pool dtype the byte counts are asked for


def saved_config(checkpoint) -> SimpleNamespace:
    """The checkpoint's config.json as attributes (transformers' config objects refuse
    global reads of Gemma 4's per-layer fields)."""
    return SimpleNamespace(**json.loads((checkpoint.path / "config.json").read_text()))


def llama_weights_by_hand(c) -> int:
    """Elements every Llama decode step multiplies by: projections, norms, one LM head."""
    hidden, head_dim = c.hidden_size, c.hidden_size // c.num_attention_heads
    q, kv = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim
    layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * c.intermediate_size + 2 * hidden
    return c.vocab_size * hidden + c.num_hidden_layers * layer + hidden


def gemma4_head_dims(c) -> list[int]:
    """Each layer's head dim: transformers 5.24 saves the full layers' own under
    per_layer_config, earlier releases as global_head_dim."""
    per_layer = getattr(c, "per_layer_config", None) or {}
    full = getattr(c, "global_head_dim", c.head_dim)
    return [
        per_layer.get(str(i), {}).get("head_dim", c.head_dim if t == "sliding_attention" else full)
        for i, t in enumerate(c.layer_types)
    ]


@pytest.mark.parametrize("fixture", ["llama_tied", "llama_gqa_untied"])
def test_llama_step_reads_every_weight_once_and_gathers_untied_embedding_rows(fixture, request):
    checkpoint = request.getfixturevalue(fixture)
    c = saved_config(checkpoint)
    model = load_model(str(checkpoint.path), CPU, torch.float32).model
    seq_lens = [5, 9, 1]
    read = step_bytes_read(model, seq_lens, torch.bfloat16)

    # Tied: the embedding is the LM head, read whole once. Untied: the head is read
    # whole and the embedding only gathers one row per request.
    assert read.weights == llama_weights_by_hand(c) * F32
    gathered = 0 if c.tie_word_embeddings else len(seq_lens) * c.hidden_size * F32
    assert read.gathered == gathered
    head_dim = c.hidden_size // c.num_attention_heads
    kv_per_token = c.num_hidden_layers * c.num_key_value_heads * head_dim * 2 * BF16
    assert read.kv == sum(seq_lens) * kv_per_token
    assert read.total == read.weights + read.gathered + read.kv


def test_gemma4_step_gathers_per_layer_rows_caps_sliding_kv_and_counts_sharing_layers(
    gemma4_tiny,
):
    c = saved_config(gemma4_tiny)
    model = load_model(str(gemma4_tiny.path), CPU, torch.float32).model
    seq_lens = [3, 10]  # the window (6) caps only the second request
    read = step_bytes_read(model, seq_lens, torch.bfloat16)

    hidden, heads, kv_heads, ple = (
        c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.hidden_size_per_layer_input
    )  # fmt: skip
    layers, first_shared = c.num_hidden_layers, c.num_hidden_layers - c.num_kv_shared_layers
    head_dims = gemma4_head_dims(c)
    assert head_dims == [16, 32, 16, 16, 32, 16, 32]  # sliding layers 16, full ones 32

    # Weights: the tied embedding once (it is the LM head), never the per-layer table.
    weights = c.vocab_size * hidden + hidden * layers * ple + ple + hidden  # + projection, norms
    for i, d in enumerate(head_dims):
        sharing = i >= first_shared  # no K/V projection, K norm; a double-wide MLP
        attn = hidden * heads * d * 2 + d  # q and o projections, q norm
        if not sharing:
            attn += hidden * 2 * kv_heads * d + d  # k, v projections, k norm (v's has no scale)
        mlp = 3 * hidden * c.intermediate_size * (2 if sharing else 1)
        per_layer_input = 2 * hidden * ple + hidden
        weights += attn + mlp + 4 * hidden + per_layer_input + 1  # 4 norms, layer_scalar
    assert read.weights == weights * F32

    # The per-layer table (vocab x layers * ple) gathers one row per request.
    assert read.gathered == len(seq_lens) * layers * ple * F32
    assert c.vocab_size_per_layer_input * layers * ple * F32 > 100 * read.gathered

    # KV: every layer reads, sharing ones included; sliding layers at most the window.
    window = c.sliding_window
    kv = 0
    for t, d in zip(c.layer_types, head_dims):
        tokens = sum(min(s, window) if t == "sliding_attention" else s for s in seq_lens)
        kv += tokens * kv_heads * d * 2 * BF16
    assert read.kv == kv
    assert (window, sum(seq_lens)) == (6, 13)  # the numbers above: 3 + 6 sliding, 13 full


def test_floor_and_achieved_bandwidth():
    assert floor_ms(2_000_000_000, bandwidth_gbps=1000.0) == pytest.approx(2.0)
    assert achieved_gbps(2_000_000_000, ms=4.0) == pytest.approx(500.0)
    assert achieved_gbps(2_000_000_000, ms=None) is None


def test_transformers_peer_is_skipped_for_sliding_window_models(llama_tied, gemma4_tiny):
    """transformers' sliding StaticCache recompiles the compiled peer every decode step."""
    assert hf_peer_problem(load_model(str(llama_tied.path), CPU, torch.float32).model) is None
    gemma4 = load_model(str(gemma4_tiny.path), CPU, torch.float32).model
    assert "recompile" in hf_peer_problem(gemma4)


def standin_graph_device():
    """A CPU device whose graph backend is the stand-in CUDA graph (no compile)."""
    from graphrt.devices.cpu import CpuDevice
    from graphrt.devices.cuda.graph import CudaFullGraphBackend

    class GraphDevice(CpuDevice):
        def _graph_backend_factories(self):
            from conformance.standin import StandInGraphModule

            return {"standin": lambda: CudaFullGraphBackend(module=StandInGraphModule())}

    return GraphDevice()


@pytest.mark.graphs
def test_decode_bench_reports_bytes_floor_bandwidth_and_kernels(monkeypatch, gemma4_tiny):
    monkeypatch.setattr(decode, "copy_bandwidth_gbps", lambda *a: 10.0)  # skips a 1 GiB copy
    loaded = load_model(str(gemma4_tiny.path), CPU, torch.float32)
    cfg = DecodeBenchConfig(
        batch_sizes=(1, 2), prompt_len=8, steps=2, warmup=1, max_running_requests=2
    )
    engine = make_engine(loaded, standin_graph_device(), cfg, graphs=True)
    # Prompts longer than a prefill step: the bench prefills them chunk by chunk first.
    engine.config = dataclasses.replace(engine.config, max_prefill_tokens=5)
    # Device times as a GPU's profiler would give them: the checked greedy pick (measured
    # first) 10 us, the bare argmax 4 us; each call must run what it times.
    times = iter([0.010, 0.004] * len(cfg.batch_sizes))
    monkeypatch.setattr(decode, "device_ms", lambda fn, *a: (fn(), next(times))[1])
    monkeypatch.setattr(decode, "kernel_activity", lambda device: "a profiler activity")
    lines = []
    results, bandwidth, _ = run_decode_bench(engine, cfg, lambda: None, report=lines.append)

    assert bandwidth == 10.0 and [r.batch_size for r in results] == [1, 2]
    for r in results:
        seq_lens = [cfg.prompt_len + 1] * r.batch_size  # the prompt and the new token
        read = step_bytes_read(loaded.model, seq_lens, engine.kv_pool.dtype)
        assert (r.weight_bytes_read, r.gathered_bytes_read, r.kv_bytes_read) == (
            read.weights, read.gathered, read.kv
        )  # fmt: skip
        assert r.bytes_read == read.total
        assert r.floor_ms == pytest.approx(read.total / 10e9 * 1e3)
        assert r.graph_ms > 0 and r.eager_ms > 0
        assert r.graph_over_floor == pytest.approx(r.graph_ms / r.floor_ms)
        assert r.graph_gbps == pytest.approx(read.total / r.graph_ms / 1e6)
        assert r.eager_gbps == pytest.approx(read.total / r.eager_ms / 1e6)
        assert r.graph_kernels is None and r.eager_kernels is None  # the CPU has no kernels
        assert r.nan_check_ms == pytest.approx(0.006)
    check = next(line for line in lines if line.startswith("NaN/Inf check"))
    share = 100 * 0.006 / results[0].graph_ms
    assert f"bs 1 6.0 us ({share:.2f}% of the graph step)" in check
    assert results[1].kv_bytes_read == 2 * results[0].kv_bytes_read
    assert results[1].gathered_bytes_read == 2 * results[0].gathered_bytes_read
    assert lines[-4] == decode.HEADER and "kernels g/e" in decode.HEADER
    assert lines[-2].split()[-1] == "-/-"  # kernels: none seen on the CPU


def _cli_bench(monkeypatch, out, prompt_len: str, *more: str) -> dict:
    """`graphrt bench` of random:llama-tiny, eager, on the CPU, batches 1 and 2, with the
    flags ``more`` -> its JSON."""
    from graphrt.core.cli.main import main

    monkeypatch.setattr(decode, "copy_bandwidth_gbps", lambda *a: 10.0)  # skips a 1 GiB copy
    argv = ["bench", "--model", "random:llama-tiny", "--device", "cpu", "--runners", "eager"]
    argv += ["--batch-sizes", "1,2", "--prompt-len", prompt_len, "--steps", "2", "--warmup", "1"]
    assert main([*argv, *more, "--out", str(out), "--no-plot"]) == 0
    return json.loads(out.read_text())


def test_cli_bench_writes_the_new_fields(monkeypatch, tmp_path):
    result = _cli_bench(monkeypatch, tmp_path / "bench.json", "8")
    fields = {"bytes_read", "weight_bytes_read", "gathered_bytes_read", "kv_bytes_read",
              "floor_ms", "graph_over_floor", "graph_gbps", "eager_gbps", "graph_kernels",
              "eager_kernels"}  # fmt: skip
    for batch in result["batches"]:
        assert fields <= set(batch)
        assert batch["eager_gbps"] > 0 and batch["graph_gbps"] is None
        assert batch["eager_kernels"] is None
        assert batch["nan_check_ms"] is None  # no device time on the CPU: nothing claimed
    # The host's speed now, beside the figures it bounds: a few us a launch on any host
    # (not the 1,000 launches' total, not ms).
    assert 0 < result["host_launch_us"] < 1000
    # Which kernels ran: llama-tiny (hidden 64) asks for batch-invariant ones by default,
    # and the CPU's torch ops promise nothing.
    assert result["batch_invariant"] is False


def test_cli_bench_sizes_the_context_as_asked_and_the_pool_for_its_requests(monkeypatch, tmp_path):
    """``--max-context-len``: the engine's context (what sizes decode attention's scratch,
    as a server's), raised to what the timed requests need, the model's at most; the KV
    pool stays sized for the requests."""
    from graphrt.core.engine import Engine

    pools = []
    real_init = Engine.__init__

    def spy(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        pools.append(self.kv_plan.slots)

    monkeypatch.setattr(Engine, "__init__", spy)
    out = tmp_path / "bench.json"
    needed = 8 + 2 + 1 + 8  # prompt, timed steps, warm-up, margin (make_engine)
    assert _cli_bench(monkeypatch, out, "8")["max_context_len"] == needed
    asked = _cli_bench(monkeypatch, out, "8", "--max-context-len", "512")
    assert asked["max_context_len"] == 512
    assert _cli_bench(monkeypatch, out, "8", "--max-context-len", "4")["max_context_len"] == needed
    # llama-tiny's own context is 1,024 tokens: no more.
    assert _cli_bench(monkeypatch, out, "8", "--max-context-len", "4096")["max_context_len"] == 1024
    assert pools == [2 * needed] * 4  # batch 2's requests, whatever the context
    # The timings' inputs are the same: the same bytes read at every context.
    assert [b["kv_bytes_read"] for b in asked["batches"]] == [
        b["kv_bytes_read"] for b in _cli_bench(monkeypatch, out, "8")["batches"]
    ]


def test_cli_bench_long_row_puts_one_long_request_in_every_batch(monkeypatch, tmp_path, capsys):
    """``--long-row N``: each batch's first request is prefilled to N tokens, the others to
    the prompt length (a server's mixed batch); the context and pool grow for it, the bytes
    a step reads count its keys, and the JSON says so. Flags it cannot serve are refused."""
    from graphrt.core.cli.main import main

    out = tmp_path / "bench.json"
    alike = _cli_bench(monkeypatch, out, "8")
    mixed = _cli_bench(monkeypatch, out, "8", "--long-row", "40")
    needed = 40 + 2 + 1 + 8  # the long prompt, timed steps, warm-up, margin (make_engine)
    assert mixed["long_row"] == 40 and alike["long_row"] is None
    assert mixed["max_context_len"] == needed
    one_row = alike["batches"][0]["kv_bytes_read"]  # batch 1: 8 + 1 keys a step
    assert one_row % (8 + 1) == 0
    kv_token = one_row // (8 + 1)
    for a, m in zip(alike["batches"], mixed["batches"], strict=True):
        assert m["kv_bytes_read"] - a["kv_bytes_read"] == (40 - 8) * kv_token
        assert m["eager_ms"] > 0
    refusals = {
        ("--runners", "eager,hf"): "--long-row times graphrt's decode steps only",
        ("--draft", "random:llama-tiny"): "--long-row times graphrt's decode steps only",
        ("--prompt-len", "8,40"): "--long-row 40 is not longer than --prompt-len 40",
    }
    for flags, said in refusals.items():
        argv = ["bench", "--device", "cpu", "--long-row", "40", *flags, "--out", str(out)]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert cli_error_line(err).startswith(f"graphrt: error: {said}")
        assert "Traceback" not in err


def test_round_bench_engines_take_the_asked_context_and_a_pool_for_their_requests(monkeypatch):
    from graphrt.core.bench import rounds

    class FiveSlots:  # a strategy whose rounds hold 5 slots beyond a request's own
        def extra_kv_slots(self) -> int:
            return 5

    monkeypatch.setattr(rounds, "Engine", lambda target, config, device, strategy=None: config)
    cfg = RoundBenchConfig(batch_sizes=(1, 4), prompt_len=12, steps=2, warmup=1)
    needed = 12 + (1 + 2 + 4) * 5 + 8  # prompt, rounds of up to 5 tokens, margin
    for asked, context in ((None, needed), (10, needed), (4096, 4096)):
        spec, plain = rounds.round_engines(
            None, FiveSlots(), None, dataclasses.replace(cfg, max_context_len=asked)
        )
        assert spec.max_context_len == plain.max_context_len == context
        assert spec.kv_pool_tokens == 4 * (needed + 5)


def test_cli_bench_sweeps_prompt_lengths_into_one_json(monkeypatch, tmp_path, capsys):
    """``--prompt-len 8,24``: each length on its own engine, one JSON with a result per
    length (its KV read grows with it)."""
    from graphrt.core.cli.main import main

    out = tmp_path / "sweep.json"
    result = _cli_bench(monkeypatch, out, "8,24")
    assert result["prompt_len"] == [8, 24]
    assert [r["prompt_len"] for r in result["sweep"]] == [8, 24]
    short, long = ([b["kv_bytes_read"] for b in r["batches"]] for r in result["sweep"])
    assert all(k2 == k1 * 25 // 9 for k1, k2 in zip(short, long))  # 9 and 25 cached tokens
    # The round bench times one length: said in one line, before any model loads.
    argv = ["bench", "--model", "random:llama-tiny", "--draft", "random:gemma4-e2b-assistant",
            "--device", "cpu", "--prompt-len", "8,24", "--out", str(out)]  # fmt: skip
    capsys.readouterr()
    assert main(argv) == 2
    assert cli_error_line(capsys.readouterr().err) == (
        "graphrt: error: --draft times one prompt length: give --prompt-len one number"
    )


def test_a_context_sweep_plots_each_batch_against_the_prompt_length(tmp_path):
    pytest.importorskip("matplotlib")  # the bench extra's; not in the CPU lane
    batch = {"batch_size": 1, "graph_ms": 1.0, "eager_ms": 2.0, "floor_ms": 0.5}
    sweep = [{"batches": [{**batch, "graph_ms": 1.0 + n / 1024}]} for n in (512, 8192)]
    result = {"model": "m", "dtype": "bfloat16", "device_name": "d", "prompt_len": [512, 8192]}
    png = tmp_path / "sweep.png"
    assert plot_context_sweep({**result, "sweep": sweep}, png)
    assert png.stat().st_size > 0


@pytest.mark.graphs
@pytest.mark.parametrize("round_graphs", ["two", "one"])
def test_round_bench_times_every_piece_of_a_round(
    gemma4_tiny, gemma4_assistant, tmp_path, round_graphs
):
    """`graphrt bench --draft`'s measurements on stand-in graphs, and the transformers
    assisted-generation peer on the same weights. Rounds on two graphs time the draft loop
    and verify apart; on one graph a round (the default) the whole round is the piece."""
    target = load_model(str(gemma4_tiny.path), CPU, torch.float32)
    drafter = load_model(str(gemma4_assistant.path), CPU, torch.float32)
    spec = SpecConfig(num_steps=3, topk=1, one_graph=round_graphs == "one")
    cfg = RoundBenchConfig(batch_sizes=(1, 2), prompt_len=12, steps=2, warmup=1)
    engines = round_engines(target, MTPDecoding(drafter, spec), standin_graph_device(), cfg)

    def peer():
        configs = [read_hf_config(c.path) for c in (gemma4_tiny, gemma4_assistant)]
        args = (configs[0], target, configs[1], drafter, spec.num_steps, 12, 8, CPU, lambda: None)
        return hf_assisted_tokens_per_s(*args)

    results = run_round_bench(*engines, cfg, lambda: None, peer, report=lambda *a: None)
    assert [r.batch_size for r in results] == [1, 2]
    for r in results:
        pieces = ["draft", "draft_eager", "verify", "verify_eager"] if round_graphs == "two" else []
        assert list(r.pieces_ms) == pieces
        assert all(ms > 0 for ms in r.pieces_ms.values()), r.pieces_ms
        assert r.decode_ms > 0 and r.round_ms > 0 and r.decode_step_ms > 0
        assert r.break_even_accept_length == pytest.approx(r.round_ms / r.decode_step_ms)
        assert r.decode_tokens_per_s == pytest.approx(r.batch_size / r.decode_step_ms * 1e3)
        assert r.graph_gap_ms is None  # the CPU has no events
        assert 1.0 <= r.accept_length_mean <= spec.num_steps + 1
        # Unrounded: what the measured round time gives at every accept length.
        at_length = r.tokens_per_s_at_accept_length
        per_round = r.batch_size / r.round_ms * 1e3
        assert at_length == pytest.approx([per_round * n for n in range(1, spec.num_steps + 2)])
        assert r.spec_tokens_per_s == pytest.approx(per_round * r.accept_length_mean)
    assert results[0].hf_assisted_tokens_per_s > 0 and results[1].hf_assisted_tokens_per_s is None
    assert len(table(results)) == 3
    assert ("draft eager" in table(results)[0]) is (round_graphs == "two")
    out = result_json(results, model="t", draft="d", device_name="cpu", dtype="float32",
                      spec_steps=3, spec_topk=1)  # fmt: skip
    issue_fields = {"batch_size", "decode_ms", "decode_step_ms", "round_ms",
                    "break_even_accept_length", "accept_length_mean",
                    "spec_tokens_per_s", "decode_tokens_per_s", "hf_assisted_tokens_per_s"}  # fmt: skip
    if round_graphs == "two":
        issue_fields |= {"draft_ms", "draft_eager_ms", "verify_ms", "verify_eager_ms"}
    assert issue_fields <= set(out["batches"][0])
    # The plain step timed on graphs, a step a call, at each batch size.
    assert engines[1].stats.graph_steps == len(cfg.batch_sizes) * (cfg.warmup + cfg.steps)
    engine = engines[0]
    assert engine.stats.graph_rounds == engine.stats.spec_rounds > 0  # rounds on graphs
    assert engine.kv_pool.available() == engine.kv_pool.num_slots  # verify's slots freed
    png = tmp_path / "spec.png"
    if plot_spec_throughput(out, png):
        assert png.stat().st_size > 10_000


@pytest.mark.graphs
def test_replay_events_are_recorded_around_every_replay_through_the_backends_observer(
    monkeypatch,
):
    """The round bench's device idle time between graphs: events around each replay,
    recorded through ``replay_observer`` (no patching of ``replay``), which it resets."""
    clock = itertools.count()

    class Event:  # the CPU has no device events: these read a counter when recorded
        def __init__(self, device, enable_timing):
            self.at = None

        def record(self):
            self.at = next(clock)

        def elapsed_time(self, later):
            return later.at - self.at

    monkeypatch.setattr(torch, "Event", Event)
    cfg = DecodeBenchConfig(batch_sizes=(1,), prompt_len=4, max_running_requests=1)
    loaded = load_model("random:llama-tiny", CPU, torch.float32)
    engine = make_engine(loaded, standin_graph_device(), cfg, graphs=True)
    engine.add_request([1, 2, 3, 4], SamplingParams(max_new_tokens=8, ignore_eos=True))
    engine.step()  # the prefill, eager
    backend = engine.graph_backend
    with replay_events(backend, engine.torch_device) as events:
        engine.step()
        engine.step()
    assert backend.replay_observer is None
    (key, count), *_ = backend.replays.items()
    assert [k for k, _, _ in events] == [key, key] and count == 2
    # The clock: 0 the probe, then (1, 2) and (3, 4) around the two replays.
    assert [(start.at, end.at) for _, start, end in events] == [(1, 2), (3, 4)]
    assert gap_ms(events) == 1


def test_cuda_names_its_collective_kernels_and_nothing_else():
    import re

    from graphrt.devices.cuda import CudaDevice

    pattern = re.compile(CudaDevice.collective_kernels, re.IGNORECASE)
    for kernel in (
        "ncclDevKernel_AllReduce_Sum_bf16_RING_LL",
        "ncclKernel_AllGather_RING_LL_Sum_int8_t",
    ):
        assert pattern.search(kernel)
    for kernel in (
        "gemv_kernel",
        "_fused_add_rmsnorm",
        "paged_decode_attention",
        "cutlass_80_wmma",
    ):
        assert not pattern.search(kernel)


def test_results_that_cannot_be_written_go_to_stdout(capsys):
    """--out passed the checks before the run but cannot be written after it (/proc takes
    no new files): the results print as JSON on stdout, then one error line (exit 1)."""
    from graphrt.core.bench.output import write_result
    from graphrt.core.errors import GraphrtError

    result = {"model": "random:llama-tiny", "batches": [{"batch_size": 1, "graph_ms": 1.0}]}
    args = SimpleNamespace(out="/proc/graphrt-bench.json", plot=True, json=False)
    with pytest.raises(GraphrtError, match=r"--out: cannot write '/proc/graphrt-bench.json'"):
        write_result(result, args, plot=lambda *a: pytest.fail("no plot without JSON"), log=print)
    assert json.loads(capsys.readouterr().out) == result


def test_a_bench_whose_out_cannot_be_written_prints_its_results_through_the_cli(capsys):
    """The same through `graphrt bench`: the benchmark runs, its results reach stdout."""
    from graphrt.core.cli.main import main

    argv = ["bench", "--device", "cpu", "--model", "random:llama-tiny", "--runners", "eager",
            "--batch-sizes", "1", "--prompt-len", "8", "--steps", "2", "--warmup", "1",
            "--out", "/proc/graphrt-bench.json"]  # fmt: skip
    status = main(argv)
    out, err = capsys.readouterr()
    assert status == 1
    result = json.loads(out[out.index("{") :])  # after the human-readable report
    assert [b["batch_size"] for b in result["batches"]] == [1] and result["batches"][0][
        "eager_ms"
    ] > 0
    assert cli_error_line(err).startswith(
        "graphrt: error: --out: cannot write '/proc/graphrt-bench.json'"
    )
    assert "Traceback" not in err


def test_a_missing_plotting_library_is_said_not_silent(tmp_path, capsys):
    from graphrt.core.bench.output import write_result

    args = SimpleNamespace(out=str(tmp_path / "bench.json"), plot=True, json=False)
    assert write_result({"batches": []}, args, plot=lambda *a: False, log=print) == 0
    err = capsys.readouterr().err
    assert "graphrt: warning: no plot written (bench.json" not in err  # the PNG's name
    assert "no plot written (bench.png): matplotlib is not installed" in err


def test_host_launch_us_is_the_median_host_time_of_one_launch():
    """timing.host_launch_us: five runs of 1,000 launches, each timed alone, the median of
    their per-launch times in us; the device synchronised before each run and after."""
    from graphrt.core.bench import timing

    ticks = iter([0.0, 0.004, 1.0, 1.002, 2.0, 2.010, 3.0, 3.003, 4.0, 4.005])
    syncs = []
    cpu = torch.device("cpu")
    assert timing.host_launch_us(cpu, lambda: syncs.append(1), clock=lambda: next(ticks)) == 4.0
    assert len(syncs) == 6


@pytest.mark.parametrize("drafting", [False, True], ids=["plain", "rounds"])
def test_steady_tokens_per_s_keeps_every_slot_busy(gemma4_tiny, gemma4_assistant, drafting):
    """decode.steady_tokens_per_s: every decode step (or round) runs the whole batch, each
    finished request replaced by the next prompt, until two requests a slot finished;
    the rest are aborted with their KV freed, and the tokens counted are the engine's."""
    from graphrt import devices
    from graphrt.core.engine import Engine, EngineConfig

    target = load_model(str(gemma4_tiny.path), CPU, torch.float32)
    strategy = None
    if drafting:
        drafter = load_model(str(gemma4_assistant.path), CPU, torch.float32)
        strategy = MTPDecoding(drafter, SpecConfig(num_steps=2))
    engine = Engine(target, EngineConfig(max_running_requests=3), devices.current("cpu"), strategy)
    batches, decode_step = [], engine.strategy.decode

    def spy(reqs):
        batches.append(len(reqs))
        return decode_step(reqs)

    engine.strategy.decode = spy
    made, add_requests, add_request = [], engine.add_requests, engine.add_request
    engine.add_requests = lambda *a: made.extend(add_requests(*a)) or made[:]
    engine.add_request = lambda *a: made.append(add_request(*a)) or made[-1]
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    tokens = engine.stats.decoded_tokens
    params = SamplingParams(max_new_tokens=5, ignore_eos=True)
    assert decode.steady_tokens_per_s(engine, prompts, params, turns=2) > 0
    assert batches and set(batches) == {3}  # never a shrinking tail
    assert all(r.finished for r in made)
    assert sum(len(r.output_ids) == 5 for r in made) >= 6  # two turns a slot, whole
    assert [r.prompt_ids for r in made[:4]] == [*prompts, prompts[0]]  # replaced in turn
    assert not engine.running and not engine.waiting
    assert engine.kv_pool.available() == engine.kv_pool.num_slots  # the aborted freed theirs
    assert engine.stats.decoded_tokens - tokens >= 6 * 4  # each finished one: 4 decode tokens
