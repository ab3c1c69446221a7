"""`graphrt bench`: the decode step per batch size (eager, graph, the transformers peer)
or, with ``--draft``, the pieces of a speculative round. The benches live in
graphrt.core.bench; this file is their composition root: it maps flags onto them and,
for ``--draft``, builds the speculative strategy (graphrt.spec), as `graphrt generate`
does."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from graphrt import devices
from graphrt.core.bench.decode import (
    DecodeBenchConfig,
    DecodeBenchResult,
    make_engine,
    run_decode_bench,
)
from graphrt.core.bench.output import header, report_for, write_result
from graphrt.core.bench.peer_hf import (
    HFPeer,
    hf_assisted_tokens_per_s,
    hf_config,
    hf_peer_problem,
)
from graphrt.core.bench.plot import plot_context_sweep, plot_latency, plot_spec_throughput
from graphrt.core.bench.rounds import (
    RoundBenchConfig,
    result_json,
    round_engines,
    run_round_bench,
    table,
)
from graphrt.core.cli.args import check_environment, spec_config_args
from graphrt.core.errors import UsageError
from graphrt.core.models import load_model
from graphrt.core.models.config import parse_dtype
from graphrt.core.parallel.group import TPGroup
from graphrt.core.parallel.launch import check_runner, join
from graphrt.spec import SpecConfig, load_drafting


def check_bench_args(args: argparse.Namespace, tp_size: int) -> None:
    """The checks that need no device and no model. ``--tp N`` runs them in the launcher
    too (cli.main), so a bad flag is refused before N ranks start."""
    unknown = set(args.runners) - {"eager", "graph", "hf"}
    if unknown:
        raise UsageError(
            f"unknown runner(s) {', '.join(sorted(unknown))}; choose from eager, graph, hf"
        )
    out = Path(args.out).resolve()
    # Before the benchmark runs, not after: its results would be lost.
    if not out.parent.is_dir():
        raise UsageError(f"--out: directory {str(out.parent)!r} does not exist")
    if not os.access(out.parent, os.W_OK) or out.is_dir():
        raise UsageError(f"--out: cannot write {str(out)!r}")
    if tp_size > 1 and "hf" in args.runners:
        raise UsageError(
            "the transformers peer runs on one device: drop hf from --runners with --tp"
        )
    if args.draft is not None and len(args.prompt_len) > 1:
        raise UsageError("--draft times one prompt length: give --prompt-len one number")
    if args.long_row is not None and (args.draft is not None or "hf" in args.runners):
        raise UsageError(
            "--long-row times graphrt's decode steps only: drop --draft and hf from --runners"
        )
    if args.long_row is not None and args.long_row <= max(args.prompt_len):
        raise UsageError(
            f"--long-row {args.long_row} is not longer than --prompt-len {max(args.prompt_len)}"
        )


def run_bench(args: argparse.Namespace) -> int:
    device = devices.current(args.device)
    check_environment(device)
    runners = tuple(args.runners)
    dtype = device.default_dtype() if args.dtype == "auto" else parse_dtype(args.dtype)
    tp = join(args.tp, device)  # the group of one unless this is a rank of a --tp job
    check_bench_args(args, tp.size)
    if "graph" in runners:
        check_runner(device, "graph", tp)
    if args.draft is not None:
        return _run_round_bench(args, device, dtype, tp)
    log = report_for(args)
    loaded = load_model(
        args.model, device, dtype, check_finite=args.check_weights, tp=tp,
        batch_invariant=args.batch_invariant,
    )  # fmt: skip
    if len(args.prompt_len) == 1:
        result = _decode_bench(args, device, dtype, tp, loaded, args.prompt_len[0], log)
        return write_result(result, args, plot_latency, log)
    # A context sweep: each length on an engine of its own (its pool and graphs sized
    # for that context), released before the next.
    sweep = []
    for prompt_len in args.prompt_len:
        log(f"== prompt {prompt_len}")
        sweep.append(_decode_bench(args, device, dtype, tp, loaded, prompt_len, log))
    result = {**header(args, device, dtype, list(args.prompt_len), loaded), "sweep": sweep}
    return write_result(result, args, plot_context_sweep, log)


def _decode_bench(
    args: argparse.Namespace, device, dtype, tp: TPGroup, loaded, prompt_len: int, log
) -> dict:
    """The decode bench's JSON at one prompt length."""
    runners = tuple(args.runners)
    cfg = DecodeBenchConfig(
        batch_sizes=tuple(args.batch_sizes),
        prompt_len=prompt_len,
        runners=runners,
        steps=args.steps,
        warmup=args.warmup,
        max_running_requests=args.max_running_requests,
        seed=args.seed,
        max_context_len=args.max_context_len,
        long_row=args.long_row,
    )
    graphs = "graph" in runners
    log(
        f"graphrt bench: {args.model} {str(dtype).removeprefix('torch.')} on {device.describe()}"
        + (f" x {tp.size} (tensor parallel)" if tp.size > 1 else "")
        + (f"; one row of {cfg.long_row} tokens a batch" if cfg.long_row else "")
        + "; capturing graphs..."
    )
    engine = make_engine(loaded, device, cfg, graphs, args.graph_backend)
    graph_backend = engine.graph_backend
    hf_peer = None
    peer_problem = hf_peer_problem(loaded.model) if "hf" in runners else None
    if peer_problem:
        log(f"transformers peer skipped for {args.model}: {peer_problem}")
    elif "hf" in runners:
        hf_cfg = hf_config(args.model)

        def hf_peer():  # built only after graphrt's own timings (see run_decode_bench)
            return HFPeer(hf_cfg, loaded.model, device.torch_device(), dtype)

    batches, bandwidth, weights = run_decode_bench(
        engine, cfg, device.synchronize, hf_peer, report=log
    )
    result = DecodeBenchResult(
        **header(args, device, dtype, prompt_len, loaded),
        max_context_len=engine.max_context_len,
        long_row=cfg.long_row,
        tp=tp.size,
        copy_bandwidth_gbps=round(bandwidth, 1),
        weight_bytes=weights,
        kv_bytes_per_token=engine.kv_pool.bytes_per_token,
        capture_time_s=engine.stats.capture_time_s if graph_backend else None,
        graph_memory_bytes=engine.stats.graph_memory_bytes if graph_backend else None,
        captured_sizes=engine.stats.captured_sizes,
        graph_backend=graph_backend.name if graph_backend else None,
        attention_backend=engine.attn_backend.name,
        batches=batches,
    ).to_json()
    if graph_backend:
        log(
            f"captured {len(result['captured_sizes'])} graphs (bs {result['captured_sizes'][0]}.."
            f"{result['captured_sizes'][-1]}) in {result['capture_time_s']:.2f} s, "
            f"graph memory {result['graph_memory_bytes'] / 2**20:.1f} MiB; copy bandwidth {bandwidth:.0f} GB/s; "
            f"host {result['host_launch_us']:.1f} us a launch"
        )
    engine.cleanup()  # its graphs; the pool goes with the engine
    return result


def _run_round_bench(args: argparse.Namespace, device, dtype, tp: TPGroup) -> int:
    if not device.graph_backends():
        raise UsageError(f"device '{device.name}' has no graph backend to benchmark")
    log = report_for(args)
    # The round bench times rounds: auto's rounds, always (no plain steps between).
    spec = SpecConfig(**{**spec_config_args(args), "adaptive": False})
    cfg = RoundBenchConfig(
        batch_sizes=tuple(args.batch_sizes),
        prompt_len=args.prompt_len[0],
        steps=args.steps,
        warmup=args.warmup,
        seed=args.seed,
        max_context_len=args.max_context_len,
    )
    target = load_model(
        args.model, device, dtype, check_finite=args.check_weights, tp=tp,
        batch_invariant=args.batch_invariant,
    )  # fmt: skip
    drafting = load_drafting(args.draft, target, device, spec, args.check_weights, tp)
    log(
        f"graphrt bench: {args.model} + {args.draft} {str(dtype).removeprefix('torch.')} on "
        f"{device.describe()}, steps {spec.num_steps}, topk {spec.topk}; capturing graphs..."
    )
    spec_engine, plain_engine = round_engines(target, drafting, device, cfg)
    log(
        f"captured in {spec_engine.stats.capture_time_s:.2f} s (speculative) and "
        f"{plain_engine.stats.capture_time_s:.2f} s (decode)"
    )
    hf_peer = None
    if "hf" in args.runners:

        def hf_peer():
            return hf_assisted_tokens_per_s(
                hf_config(args.model), target, hf_config(args.draft), drafting.drafter,
                spec.num_steps,
                cfg.prompt_len, 64, device.torch_device(), device.synchronize,
            )  # fmt: skip

    results = run_round_bench(spec_engine, plain_engine, cfg, device.synchronize, hf_peer, log)
    # What ran: one graph a round, or two (asked for, or a breakable backend's).
    round_graphs = "one" if drafting.longest.round is not None else "two"
    result = result_json(
        results,
        **header(args, device, dtype, cfg.prompt_len, target),
        draft=args.draft,
        spec_steps=spec.num_steps,
        spec_topk=spec.topk,
        spec_draft_tokens=spec.num_draft_tokens,
        round_graphs=round_graphs,
        max_context_len=spec_engine.max_context_len,
        capture_time_s=round(spec_engine.stats.capture_time_s, 3),
        graph_memory_bytes=spec_engine.stats.graph_memory_bytes,
    )
    for line in table(results):
        log(line)
    return write_result(result, args, plot_spec_throughput, log)
