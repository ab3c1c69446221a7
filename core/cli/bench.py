"""`graphrt bench`: decode step latency per batch size for eager, graph and the peer."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from graphrt import devices
from graphrt.core.bench.decode import (
    DecodeBenchConfig,
    DecodeBenchResult,
    make_engine,
    run_decode_bench,
)
from graphrt.core.bench.plot import plot_latency
from graphrt.core.bench.timing import attention_specs
from graphrt.core.errors import UsageError
from graphrt.core.models import load_model
from graphrt.core.models.config import parse_dtype
from graphrt.core.parallel.launch import check_runner, is_output_rank, join


def run_bench(args: argparse.Namespace) -> int:
    device = devices.current(args.device)
    torch_device = device.torch_device()
    runners = tuple(args.runners)
    unknown = set(runners) - {"eager", "graph", "hf"}
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
    dtype = device.default_dtype() if args.dtype == "auto" else parse_dtype(args.dtype)
    tp = join(args.tp, device)  # the group of one unless this is a rank of a --tp job
    if "graph" in runners:
        check_runner(device, "graph", tp)
    if not tp.is_single and "hf" in runners:
        raise UsageError(
            "the transformers peer runs on one device: drop hf from --runners with --tp"
        )
    if args.draft is not None:
        # The speculative bench lives beside speculative decoding (graphrt.spec).
        from graphrt.spec.bench_cli import run_spec_bench_cli

        return run_spec_bench_cli(args, device, dtype, tp)
    cfg = DecodeBenchConfig(
        batch_sizes=tuple(args.batch_sizes),
        prompt_len=args.prompt_len,
        runners=runners,
        steps=args.steps,
        warmup=args.warmup,
        max_running_requests=args.max_running_requests,
        seed=args.seed,
    )
    log = report_for(args)
    loaded = load_model(args.model, device, dtype, check_finite=args.check_weights, tp=tp)
    graphs = "graph" in runners
    log(
        f"graphrt bench: {args.model} {str(dtype).removeprefix('torch.')} on {device.describe()}"
        + (f" x {tp.size} (tensor parallel)" if tp.size > 1 else "")
        + "; capturing graphs..."
    )
    engine = make_engine(loaded, device, cfg, graphs, args.graph_backend)
    graph_backend = engine.graph_backend
    hf_peer = None
    peer_problem = hf_peer_problem(loaded.model) if "hf" in runners else None
    if peer_problem:
        log(f"transformers peer skipped for {args.model}: {peer_problem}")
    elif "hf" in runners:
        from graphrt.core.bench.peer_hf import HFPeer
        from graphrt.core.models.presets import preset_hf_config

        if not args.model.startswith("random:"):
            hf_cfg = json.loads((Path(args.model) / "config.json").read_text())
        else:
            hf_cfg = preset_hf_config(args.model.removeprefix("random:"))

        def hf_peer():  # built only after graphrt's own timings (see run_decode_bench)
            return HFPeer(hf_cfg, loaded.model, torch_device, dtype)

    batches, bandwidth, weights = run_decode_bench(
        engine, cfg, device.synchronize, hf_peer, report=log
    )
    result = DecodeBenchResult(
        model=args.model,
        device=device.name,
        device_name=device.describe(),
        dtype=str(dtype).removeprefix("torch."),
        tp=tp.size,
        prompt_len=cfg.prompt_len,
        versions=versions(device),
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
            f"graph memory {result['graph_memory_bytes'] / 2**20:.1f} MiB; copy bandwidth {bandwidth:.0f} GB/s"
        )
    return write_result(result, args, plot_latency, log)


def hf_peer_problem(model) -> str | None:
    """Why the compiled transformers peer cannot time ``model``'s decode step, or None."""
    if any(spec.sliding_window is not None for spec in attention_specs(model)):
        # StaticSlidingWindowLayer.cumulative_length_int (transformers 5.x): dynamo guards
        # on it, so the peer's column would time a recompile per step, not decoding.
        return (
            "its sliding-window layers keep their StaticCache length in a Python int that "
            "torch.compile guards on, so every decode step would recompile"
        )
    return None


def report_for(args: argparse.Namespace):
    """Where progress and tables go: stdout, stderr with ``--json``; nowhere on the ranks
    of a tensor-parallel job but rank 0."""
    if not is_output_rank():
        return lambda *a: None
    return (lambda *a: print(*a, file=sys.stderr)) if args.json else print


def write_result(result: dict, args: argparse.Namespace, plot, log) -> int:
    """The JSON at ``--out``, ``plot``'s PNG beside it, the JSON on stdout with ``--json``
    (rank 0 alone in a tensor-parallel job)."""
    if not is_output_rank():
        return 0
    out = Path(args.out)
    out.write_text(json.dumps(result, indent=2))
    log(f"wrote {out}")
    if args.plot and plot(result, out.with_suffix(".png")):
        log(f"wrote {out.with_suffix('.png')}")
    if args.json:
        print(json.dumps(result))
    return 0


def versions(device) -> dict[str, str]:
    found = device.library_versions()
    try:
        import importlib.metadata

        found["transformers"] = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        pass
    found["python"] = sys.version.split()[0]
    return found
