"""Differential random testing and a soak of graph replay (issue 10, items 6 and 7).

1. Differential: one seeded random schedule (arrivals at random steps, bursts and lulls,
   random prompt lengths and max_new_tokens, greedy and seeded sampled requests, eos
   stops, requests that run into the context's end) served in lockstep by an eager
   engine, a padded graph engine and an exact-size graph engine; every request's tokens
   must be the same on all three. Mismatches are counted, not fatal; the first few are
   kept with the seed, step and request that reproduce them, and for greedy requests the
   eager top-2 logit gap where they diverged (a gap near float rounding is a near-tie:
   kernels that sum in another order may pick either token).
2. Soak: one graph engine serving requests that come and go; device memory after warm-up
   and at the end, and graph captures after start-up (there must be none).

float32 throughout: bfloat16 eager and graph kernels are not bitwise comparable.
tests/test_differential.py runs the same driver (``run_schedule``) on the CPU. A test
driver, so it lives in tests/: run as a script, its folder is on ``sys.path``, which
imports the driver and, on the CPU, the tests' stand-in graph device.

    python tests/soak.py --device cuda --steps 10000 --out soak.json
    python tests/soak.py --device cpu --steps 300   # quick check, stand-in CUDA graphs
    (PYTHONPATH such that ``graphrt`` imports from this working tree)
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

# The driver sits beside this script (tests/, on sys.path when run as a script).
from differential import (
    GreedyMargin,
    RunResult,
    Schedule,
    ScheduleConfig,
    run_schedule,
    with_eos,
)

from graphrt.core.engine import Engine, EngineConfig
from graphrt.spec import MTPDecoding, SpecConfig

# ---- the script ------------------------------------------------------------------


def graph_device(name: str | None, graph_backend: str | None):
    """The graphrt device, the graph backend the graph engines use and its name in the
    report. On the CPU the default is the tests' stand-in CUDA graph (torch.compile takes
    many seconds per bucket there); ``--graph-backend compile`` runs the real one."""
    from graphrt import devices

    device = devices.current(name)
    if device.name != "cpu" or graph_backend not in (None, "cuda-full"):
        return device, graph_backend, graph_backend
    from helpers import standin_device  # beside this script, as the driver is

    return standin_device(), "cuda-full", "cuda-full (stand-in)"


def device_memory(device, reset_peak: bool = False) -> dict[str, int | None]:
    """Allocated, reserved and peak-allocated device bytes, the peak since the last reset
    (None where the device keeps no allocator statistics: the CPU)."""
    module = _allocator(device)
    if not hasattr(module, "memory_allocated"):
        return {"allocated": None, "reserved": None, "max_allocated": None}
    device.synchronize()
    stats = {
        "allocated": module.memory_allocated(),
        "reserved": module.memory_reserved(),
        "max_allocated": module.max_memory_allocated(),
    }
    if reset_peak:
        module.reset_peak_memory_stats()
    return stats


def _allocator(device):
    """``torch.cuda`` (``torch.xpu``, ``torch.npu``) for the device; None for the CPU."""
    module = getattr(torch, device.torch_device().type, None)
    return module if hasattr(module, "memory_allocated") else None


def count_captures(engine: Engine) -> Callable[[], int]:
    """Count the captures the engine's graph backend makes from now on. The backend
    keeps no counter, so its ``capture_one`` is wrapped (this instance only)."""
    backend, calls = engine.graph_backend, [0]
    capture_one = backend.capture_one

    def counted(*args, **kwargs):
        calls[0] += 1
        return capture_one(*args, **kwargs)

    backend.capture_one = counted
    keys = len(list(backend.keys()))
    # A capture behind the backend's back would still show as a new key.
    return lambda: max(calls[0], len(list(backend.keys())) - keys)


def main(argv: list[str] | None = None) -> int:
    from tqdm import tqdm

    from graphrt.core.models import load_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=None, help="graphrt device (default: probe)")
    ap.add_argument("--steps", type=int, default=10_000, help="decode steps of each phase")
    ap.add_argument("--model", default="random:llama-tiny")
    ap.add_argument(
        "--draft",
        default=None,
        help="a frozen-KV MTP assistant for --model: every engine decodes speculatively "
        "(e.g. the embedded pair, core/pretrained/gemma4-code-{target,assistant})",
    )
    ap.add_argument("--spec-steps", type=int, default=5)
    ap.add_argument("--spec-topk", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-running", type=int, default=16)
    ap.add_argument("--buckets", default="1,2,4,8,12,16")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--graph-backend", help="default: the device's (CPU: stand-in cuda-full)")
    ap.add_argument("--warmup", type=int, default=None, help="soak steps before memory is read")
    ap.add_argument("--keep", type=int, default=8, help="mismatches kept in detail")
    ap.add_argument("--out", type=Path, default=None, help="JSON results")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    device, backend_name, backend_label = graph_device(args.device, args.graph_backend)
    if device.name == "cpu":
        # A tiny model on one thread: on busy cores a second thread makes each small
        # matmul wait (16 ms against 25 us on 2 loaded cores).
        torch.set_num_threads(1)
    loaded = with_eos(load_model(args.model, device, torch.float32, seed=args.seed), 8)
    drafter = None if args.draft is None else load_model(args.draft, device, torch.float32)

    def strategy() -> MTPDecoding | None:  # one per engine: a strategy binds to its engine
        if drafter is None:
            return None
        return MTPDecoding(drafter, SpecConfig(args.spec_steps, args.spec_topk))

    config = dict(
        max_running_requests=args.max_running,
        max_context_len=args.context,
        kv_pool_tokens=args.max_running * args.context,
        graph_buckets=tuple(int(b) for b in args.buckets.split(",")),
        graph_backend=backend_name,
    )
    schedule = ScheduleConfig(
        vocab=loaded.model.vocab_size,
        max_context_len=args.context,
        max_running=args.max_running,
        prompt_len=(1, 48),
        new_tokens=(1, 48),
    )

    def bar(desc: str) -> tuple[Callable[[RunResult], None], Callable[[], None]]:
        progress = tqdm(total=args.steps, desc=desc, unit="step", file=sys.stderr)

        def update(result: RunResult) -> None:
            progress.update(min(result.decode_steps, args.steps) - progress.n)

        return update, progress.close

    # 1. Differential: eager (the reference), padded graphs, exact-size graphs.
    engines = {
        "eager": Engine(loaded, EngineConfig(runner="eager", **config), device, strategy()),
        "graph": Engine(loaded, EngineConfig(runner="graph", **config), device, strategy()),
        "graph-exact": Engine(
            loaded,
            EngineConfig(runner="graph", graph_padding=False, **config),
            device,
            strategy(),
        ),
    }
    captures = [count_captures(e) for e in engines.values() if e.graph_backend is not None]
    update, close = bar("differential")
    diff = run_schedule(
        engines,
        Schedule(dataclasses.replace(schedule, seed=args.seed)),
        args.steps,
        after_step=update,
        margin=GreedyMargin(loaded, device, args.context),
        keep=args.keep,
    )
    close()
    spec_rounds = {
        name: {"rounds": e.stats.spec_rounds, "graph_rounds": e.stats.graph_rounds,
               "accept_histogram": e.stats.accept_histogram}
        for name, e in engines.items()
    }  # fmt: skip
    for engine in engines.values():
        engine.cleanup()
    del engines  # engine and strategy refer to each other: collect, then return the memory
    gc.collect()
    if hasattr(_allocator(device), "empty_cache"):
        _allocator(device).empty_cache()

    # 2. Soak: one graph engine; memory after warm-up and at the end, captures after start.
    engine = Engine(loaded, EngineConfig(runner="graph", **config), device, strategy())
    captures.append(count_captures(engine))
    warmup = args.warmup if args.warmup is not None else max(1, args.steps // 20)
    memory: dict[str, dict] = {}
    update, close = bar("soak")

    def after_soak_step(result: RunResult) -> None:
        update(result)
        if result.decode_steps == warmup and "after_warmup" not in memory:
            memory["after_warmup"] = device_memory(device, reset_peak=True)

    soak = run_schedule(
        {"graph": engine},
        Schedule(dataclasses.replace(schedule, seed=args.seed + 1)),
        args.steps,
        after_step=after_soak_step,
    )
    close()
    memory["end"] = device_memory(device)
    report = {
        "device": device.describe(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "model": args.model,
        "draft": args.draft,
        "spec": None
        if drafter is None
        else {
            "steps": args.spec_steps,
            "topk": args.spec_topk,
            "differential": spec_rounds,
            "soak_accept_histogram": engine.stats.accept_histogram,
        },
        "dtype": "float32",
        "graph_backend": backend_label or engine.graph_backend.name,
        "buckets": list(config["graph_buckets"]),
        "steps": args.steps,
        "requests_served": diff.requests + soak.requests,
        "mismatches": diff.mismatches,
        "near_ties": diff.near_ties,
        "memory_allocated_after_warmup": memory.get("after_warmup", {}).get("allocated"),
        "memory_allocated_end": memory["end"]["allocated"],
        "memory_reserved_after_warmup": memory.get("after_warmup", {}).get("reserved"),
        "memory_reserved_end": memory["end"]["reserved"],
        "max_memory_allocated": memory["end"]["max_allocated"],  # since warm-up
        "warmup_steps": warmup,
        "captures_after_startup": sum(count() for count in captures),  # every graph engine
        "differential": diff.summary(),
        "soak": soak.summary(),
        "wall_s": round(time.perf_counter() - start, 1),
    }
    print_table(report)
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    # Near-ties are counted and shown, not failures: float rounding, not graphrt.
    ok = diff.mismatches == diff.near_ties and not diff.leaks and not soak.leaks
    return 0 if ok and report["captures_after_startup"] == 0 else 1


def print_table(r: dict) -> None:
    def mib(n: int | None) -> str:
        return "-" if n is None else f"{n / 2**20:.1f}"

    print(
        f"graphrt soak: {r['device']}, torch {r['torch']}, {r['model']} float32, "
        f"{r['graph_backend']} graphs {r['buckets']}"
    )
    print(
        f"{'phase':<13}{'steps':>8}{'decode':>8}{'requests':>10}{'mismatch':>10}"
        f"{'near-tie':>10}{'graph steps':>13}{'leaks':>7}{'wall s':>8}"
    )
    for phase in ("differential", "soak"):
        p = r[phase]
        graph = sum(v for k, v in p["graph_steps"].items() if k.startswith("graph"))
        print(
            f"{phase:<13}{p['steps']:>8}{p['decode_steps']:>8}{p['requests']:>10}"
            f"{p['mismatches']:>10}{p['near_ties']:>10}{graph:>13}{len(p['leaks']):>7}"
            f"{p['wall_s']:>8.1f}"
        )
    print(
        f"memory MiB: allocated after warm-up {mib(r['memory_allocated_after_warmup'])}, "
        f"at end {mib(r['memory_allocated_end'])}, max {mib(r['max_memory_allocated'])}; "
        f"reserved {mib(r['memory_reserved_after_warmup'])} -> {mib(r['memory_reserved_end'])}"
    )
    print(f"captures after start-up: {r['captures_after_startup']}; wall {r['wall_s']} s")
    for line in r["differential"]["mismatch_details"]:
        print("mismatch:", line)


if __name__ == "__main__":
    sys.exit(main())
