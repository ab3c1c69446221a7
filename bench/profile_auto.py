"""Why `--spec-steps auto`'s plain steps cost more than a plain engine's (issue 20).

Runs the embedded pair (bf16, one request) in the given modes: a plain engine, an auto
engine, an auto engine forced to plain steps, rounds of 5 steps; times every decode step
by kind; with PROFILE=1 then profiles 20 steps of each (host operators, device kernels).

Run on the device: python bench/profile_auto.py [max new tokens, default 400] [device]
[modes, default plain,auto,forced,spec5]
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

from graphrt import devices
from graphrt.core.engine import Engine, EngineConfig, SamplingParams
from graphrt.core.models import load_model
from graphrt.core.pretrained import ASSISTANT_DIR, TARGET_DIR
from graphrt.spec import MTPDecoding, SpecConfig

PROMPT = [2, 1596, 897, 2369, 2367, 1473]  # within the pair's 4096-token vocabulary


def timed_engine(engine: Engine) -> dict[str, list[float]]:
    """Wrap the strategy's decode: every step's wall time, by kind."""
    times: dict[str, list[float]] = {"round": [], "plain": []}
    decode = engine.strategy.decode

    def wrapped(reqs):
        start = time.perf_counter()
        outcome = decode(reqs)
        kind = "round" if outcome.rounds else "plain"
        times[kind].append(time.perf_counter() - start)
        return outcome

    engine.strategy.decode = wrapped
    return times


def run(name: str, make, tokens: int, profile: bool) -> str:
    engine = make()
    params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    engine.generate([PROMPT], params)  # warm: lazy compiles, first touches
    times = timed_engine(engine)
    engine.generate([PROMPT], params)
    line = f"{name:<22}"
    for kind, seconds in times.items():
        if seconds:
            line += f" {kind}: {len(seconds)} x {statistics.median(seconds) * 1e3:.3f} ms"
    line += (
        f" | {engine.stats.tokens_per_s:.0f} tok/s, graph {engine.stats.graph_steps}"
        f" eager {engine.stats.eager_steps}"
    )
    print(line, flush=True)
    if profile:
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            engine.generate([PROMPT], SamplingParams(max_new_tokens=21, ignore_eos=True))
            torch.cuda.synchronize()
        print(f"---- {name}: top host ops over 20 steps")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        print(f"---- {name}: top device ops")
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15))
    engine.cleanup()
    return line


MODES = ("plain", "auto", "forced", "spec5")


def main() -> None:
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 400
    device = devices.current(sys.argv[2] if len(sys.argv) > 2 else "cuda")
    modes = (sys.argv[3] if len(sys.argv) > 3 else ",".join(MODES)).split(",")
    # The profiler stays subscribed to the device's launches after it ran: timings taken
    # after a profile are slower (0.33 -> 0.41 ms a plain step, H200). Profile last.
    profile = os.environ.get("PROFILE") == "1" and device.name == "cuda"
    target = load_model(str(TARGET_DIR), device, torch.bfloat16)
    drafter = load_model(str(ASSISTANT_DIR), device, torch.bfloat16)
    cfg = EngineConfig(max_running_requests=8)

    def auto(force_plain: bool):
        def make():
            strategy = MTPDecoding(drafter, SpecConfig(num_steps=5, adaptive=True))
            engine = Engine(target, cfg, device, strategy)
            if force_plain:
                strategy.chooser.choose = lambda bucket, reqs: 0
            return engine

        return make

    makers = {
        "plain": lambda: Engine(target, cfg, device),
        "auto": auto(False),
        "forced": auto(True),
        "spec5": lambda: Engine(target, cfg, device, MTPDecoding(drafter, SpecConfig(5))),
    }
    lines = [run(mode, makers[mode], tokens, False) for mode in modes]
    if profile:
        for mode in modes:
            run(mode, makers[mode], 20, True)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
