"""`graphrt bench --draft`: the speculative bench's command-line side (tables, JSON, plot)."""

from __future__ import annotations

import argparse
from pathlib import Path

from graphrt.core.bench.plot import plot_spec_throughput
from graphrt.core.cli.bench import report_for, versions, write_result
from graphrt.core.errors import UsageError
from graphrt.core.models import load_model
from graphrt.core.models.loader import read_hf_config
from graphrt.core.models.presets import preset_hf_config
from graphrt.core.parallel.group import SINGLE, TPGroup
from graphrt.spec.bench import (
    SpecBenchConfig,
    bench_engines,
    hf_assisted_tokens_per_s,
    result_json,
    run_spec_bench,
)
from graphrt.spec.config import SpecConfig

HEADER = (
    f"{'bs':>4} {'decode':>8} {'draft':>8} {'draft eager':>11} {'verify':>8} {'verify eager':>12} "
    f"{'round':>8} {'gap':>6} {'accept':>6} {'spec tok/s':>10} {'decode tok/s':>12} {'hf tok/s':>8}"
)


def _hf_config(source: str) -> dict:
    if source.startswith("random:"):
        return preset_hf_config(source.removeprefix("random:"))
    return read_hf_config(Path(source))


def run_spec_bench_cli(args: argparse.Namespace, device, dtype, tp: TPGroup = SINGLE) -> int:
    # run_bench checked --runners and --out before dispatching here.
    if not device.graph_backends():
        raise UsageError(f"device '{device.name}' has no graph backend to benchmark")
    log = report_for(args)
    spec = SpecConfig(args.spec_steps, args.spec_topk, args.spec_draft_tokens)
    cfg = SpecBenchConfig(
        batch_sizes=tuple(args.batch_sizes),
        prompt_len=args.prompt_len,
        steps=args.steps,
        warmup=args.warmup,
        seed=args.seed,
    )
    target = load_model(args.model, device, dtype, check_finite=args.check_weights, tp=tp)
    # They share KV: the drafter in the target's dtype.
    drafter = load_model(
        args.draft, device, dtype or target.dtype, check_finite=args.check_weights, tp=tp
    )
    log(
        f"graphrt bench: {args.model} + {args.draft} {str(dtype).removeprefix('torch.')} on "
        f"{device.describe()}, steps {spec.num_steps}, topk {spec.topk}; capturing graphs..."
    )
    spec_engine, plain_engine = bench_engines(target, drafter, device, spec, cfg)
    log(
        f"captured in {spec_engine.stats.capture_time_s:.2f} s (speculative) and "
        f"{plain_engine.stats.capture_time_s:.2f} s (decode)"
    )
    hf_peer = None
    if "hf" in args.runners:

        def hf_peer():
            return hf_assisted_tokens_per_s(
                _hf_config(args.model), target, _hf_config(args.draft), drafter, spec,
                cfg.prompt_len, 64, device.torch_device(), device.synchronize,
            )  # fmt: skip

    results = run_spec_bench(spec_engine, plain_engine, cfg, device.synchronize, hf_peer, log)
    result = result_json(
        results,
        model=args.model,
        draft=args.draft,
        device=device.name,
        device_name=device.describe(),
        dtype=str(dtype).removeprefix("torch."),
        prompt_len=cfg.prompt_len,
        spec_steps=spec.num_steps,
        spec_topk=spec.topk,
        spec_draft_tokens=spec.num_draft_tokens,
        versions=versions(device),
        capture_time_s=round(spec_engine.stats.capture_time_s, 3),
        graph_memory_bytes=spec_engine.stats.graph_memory_bytes,
    )
    log(HEADER)
    for r in results:
        log(_row(r))
    return write_result(result, args, plot_spec_throughput, log)


def _fmt(x, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def _row(r) -> str:
    return (
        f"{r.batch_size:>4} {_fmt(r.decode_ms):>8} {_fmt(r.draft_ms):>8} "
        f"{_fmt(r.draft_eager_ms, '.2f'):>11} {_fmt(r.verify_ms):>8} "
        f"{_fmt(r.verify_eager_ms, '.2f'):>12} {_fmt(r.round_ms):>8} {_fmt(r.graph_gap_ms):>6} "
        f"{_fmt(r.accept_length_mean, '.2f'):>6} {_fmt(r.spec_tokens_per_s, '.1f'):>10} "
        f"{_fmt(r.decode_tokens_per_s, '.1f'):>12} {_fmt(r.hf_assisted_tokens_per_s, '.2f'):>8}"
    )
