"""Where a plain decode step's host time goes (issue 20/21): the embedded target on graphs,
each phase of the step wrapped in a host clock (no syncs added), at batch 1, 8 and 64.

Run: python bench/step_host.py [device, default cuda] [steps, default 200]
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict

import torch

from graphrt import devices
from graphrt.core.engine import Engine, EngineConfig, SamplingParams
from graphrt.core.engine import engine as engine_mod
from graphrt.core.engine import strategy as strategy_mod
from graphrt.core.engine.ledger import Ledger
from graphrt.core.models import load_model
from graphrt.core.pretrained import TARGET_DIR
from graphrt.core.runners import graph as graph_mod

TIMES: dict[str, float] = defaultdict(float)


def wrap(owner, name: str, label: str) -> None:
    inner = getattr(owner, name)

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            TIMES[label] += time.perf_counter() - start

    setattr(owner, name, timed)


def main() -> None:
    device = devices.current(sys.argv[1] if len(sys.argv) > 1 else "cuda")
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 200
    dtype = torch.bfloat16 if device.name == "cuda" else torch.float32
    target = load_model(str(TARGET_DIR), device, dtype)
    engine = Engine(target, EngineConfig(max_running_requests=64), device)
    wrap(engine_mod.Engine, "_decode_step", "decode step (all)")
    wrap(strategy_mod.StepContext, "decode_batch", " decode_batch")
    wrap(Ledger, "append_one", "  ledger.append_one")
    wrap(strategy_mod.StepContext, "forward", " forward")
    wrap(graph_mod.GraphRunner, "load_batch", "  load_batch")
    wrap(graph_mod, "real_rows", "  real_rows (clone)")
    wrap(strategy_mod, "sample_requests", " sample_requests (read)")
    wrap(engine_mod.Engine, "_emit", " emit")
    wrap(engine_mod.Engine, "_apply", " apply")
    wrap(engine_mod.Engine, "_capture_needed", " capture_needed")
    runner = engine.strategy.graph_runner
    if runner is not None:
        wrap(type(runner.backend), "replay", "  backend.replay")
        wrap(type(runner.backend), "update_inputs", "  backend.update_inputs")
    print(f"{device.name}, {dtype}; us a step (host clock), {steps} steps")
    for bs in (1, 8, 64):
        prompts = [[1 + i, 2, 3, 4] for i in range(bs)]
        params = SamplingParams(max_new_tokens=steps, ignore_eos=True)
        engine.generate(prompts, params)  # warm: captures
        TIMES.clear()
        start = time.perf_counter()
        engine.generate(prompts, params)
        wall = time.perf_counter() - start
        print(f"-- batch {bs}: generate {wall / steps * 1e6:.1f} us a step")
        for label, seconds in TIMES.items():
            print(f"  {label:<28} {seconds / (steps - 1) * 1e6:8.1f}")
    # Graph launch alone: the bucket-1 decode graph, 200 launches, host time each.
    if runner is None:
        return
    key = runner._make_graph_key(1)
    for sync in (False, True):
        t = time.perf_counter()
        for _ in range(200):
            runner.backend.replay(key)
            if sync:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        print(
            f"replay alone ({'sync each' if sync else 'no sync'}): {(time.perf_counter() - t) / 200 * 1e6:.1f} us"
        )


if __name__ == "__main__":
    main()
