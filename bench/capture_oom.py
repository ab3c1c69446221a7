"""Capture under a memory cap (issue 10, item 5): the largest buckets fail to capture,
the runner drops them, and generation gives the eager engine's tokens.

    python bench/capture_oom.py [--model random:llama-1b] [--dtype float32] [--out oom.json]

1. An eager engine serves a staggered schedule (32 requests stopping at different steps:
   decode batches from 32 down to 1).
2. For growing headroom, a graph engine is built whose capture runs under
   ``torch.cuda.set_per_process_memory_fraction``: the cap is the memory reserved when
   the capture starts (weights, KV pool) plus the headroom, and it is lifted once the
   capture ends, so only captures can run out of memory. The engine then serves the same
   schedule. Reported per headroom: buckets captured and dropped (with the error), graph
   memory, decode steps on graphs and eagerly, tokens equal to the eager run's.
float32 by default, where tokens do not hinge on kernel tiling (a padded batch may pick
another GEMV tiling than the unpadded eager one).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time

import torch

from graphrt import devices
from graphrt.core.engine import Engine, EngineConfig, SamplingParams
from graphrt.core.errors import GraphrtError, out_of_memory
from graphrt.core.models import load_model
from graphrt.core.models.config import parse_dtype
from graphrt.core.runners.graph import GraphRunner

REQUESTS = 32
MiB = 1 << 20


def schedule(vocab: int) -> tuple[list[list[int]], list[SamplingParams]]:
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (4 + i,), generator=gen).tolist() for i in range(REQUESTS)]
    params = [SamplingParams(max_new_tokens=2 + i, ignore_eos=True) for i in range(REQUESTS)]
    return prompts, params


def serve(engine: Engine, prompts, params) -> tuple[list[list[int]], int]:
    """-> every request's output ids, and how many requests finished with an error."""
    reqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    while engine.has_work:
        engine.step()
    return [r.output_ids for r in reqs], sum(r.error is not None for r in reqs)


def config(runner: str) -> EngineConfig:
    return EngineConfig(
        max_running_requests=REQUESTS, max_context_len=256, kv_pool_tokens=REQUESTS * 256,
        runner=runner,
    )  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="random:llama-1b")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--headroom-mib", default="0,16,32,64,128,256,1024")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    device = devices.current("cuda")
    loaded = load_model(args.model, device, parse_dtype(args.dtype))
    prompts, params = schedule(loaded.model.vocab_size)
    total = torch.cuda.get_device_properties(0).total_memory

    eager = Engine(loaded, config("eager"), device)
    reference, errors = serve(eager, prompts, params)
    assert not errors, "the eager reference run failed a step"
    eager.cleanup()
    del eager
    gc.collect()
    torch.cuda.empty_cache()

    capture = GraphRunner.capture
    caps: list[float] = []

    def capped_capture(runner: GraphRunner) -> None:  # the cap holds during capture only
        caps.append((torch.cuda.memory_reserved() + headroom * MiB) / total)
        torch.cuda.set_per_process_memory_fraction(caps[-1])
        try:
            capture(runner)
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0)

    GraphRunner.capture = capped_capture
    runs = []
    for headroom in map(int, args.headroom_mib.split(",")):
        caps.clear()
        run = {"headroom_mib": headroom}
        start = time.perf_counter()
        engine = None
        try:
            engine = Engine(loaded, config("graph"), device)
            tokens, errors = serve(engine, prompts, params)
            runner = engine.graph_runner
            run.update(
                cap_bytes=[int(c * total) for c in caps],
                graph_memory_bytes=engine.stats.graph_memory_bytes,
                captured=runner.captured_sizes,
                dropped=runner.dropped_buckets,
                graph_steps=engine.stats.graph_steps,
                eager_steps=engine.stats.eager_steps,
                tokens_equal=tokens == reference,
                requests_differing=sum(a != b for a, b in zip(tokens, reference)),
                failed_requests=errors,
            )
        except (GraphrtError, RuntimeError) as e:
            if not isinstance(e, GraphrtError) and not out_of_memory(e):
                raise
            run["error"] = f"{type(e).__name__}: {e}".splitlines()[0]
        finally:
            if engine is not None:
                engine.cleanup()
            del engine
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.set_per_process_memory_fraction(1.0)
        run["wall_s"] = time.perf_counter() - start
        runs.append(run)
        print(json.dumps(run), file=sys.stderr)

    print(
        "\n| headroom MiB | captured | dropped | graph MiB | graph steps | eager steps | = eager |"
    )
    print("|---:|---|---|---:|---:|---:|---|")
    for r in runs:
        if "error" in r:
            print(f"| {r['headroom_mib']} | - | {r['error'][:60]} | - | - | - | - |")
            continue
        print(
            f"| {r['headroom_mib']} | {r['captured']} | {sorted(r['dropped'])} | "
            f"{r['graph_memory_bytes'] / MiB:.0f} | {r['graph_steps']} | {r['eager_steps']} | "
            f"{r['tokens_equal']} |"
        )
    if args.out:
        meta = {
            "model": args.model, "dtype": args.dtype, "device": torch.cuda.get_device_name(),
            "torch": torch.__version__, "total_bytes": total,
        }  # fmt: skip
        with open(args.out, "w") as f:
            json.dump({**meta, "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
