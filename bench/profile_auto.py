"""`--spec-steps auto` against `--no-draft` and fixed rounds, side by side (issue 20).

The embedded pair (bf16 on a GPU, float32 on the CPU), one request of the README's first
prompt, in one process: a plain engine, an auto engine and a rounds-of-5 engine, each
warmed up, then ``reps`` generate calls of each in turn (the machine's drift and noise
fall on all three alike). Prints each engine's decoding tokens/s (median over the reps),
the ratio to plain, and auto's steps by draft length; with PROFILE=1, then profiles 20
steps of each (host operators, device kernels) into the log. FORCED=1 adds an auto engine
forced to rounds of 5 (auto's machinery without its choice: "auto=5"). LENGTHS=1,2,3 adds
an engine of each of those fixed lengths ("spec 1", ...). INVARIANT=1 adds
a plain and an auto engine on a target loaded with batch-invariant matmuls ("... inv"),
and says whether each auto engine wrote its plain twin's tokens. BUSY=1 then runs each
engine once more under torch.profiler: the GPU's share of the wall (host- or
device-bound?).

Run: python bench/profile_auto.py [max new tokens, default 400] [device, default cuda]
[reps, default 5]
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch
from tokenizers import Tokenizer

from graphrt import devices
from graphrt.core.bench.decode import generate_tokens_per_s
from graphrt.core.engine import Engine, EngineConfig, SamplingParams
from graphrt.core.models import load_model
from graphrt.core.pretrained import ASSISTANT_DIR, TARGET_DIR
from graphrt.spec import MTPDecoding, SpecConfig

PROMPT = "def fibonacci(n):"


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of ``(start, end)`` intervals (microseconds in, seconds out)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total * 1e-6


def device_share(name: str, engine: Engine, prompt: list[int], params: SamplingParams) -> str:
    """One generate under torch.profiler: the wall a token, the GPU's busy time a token (the
    union of its kernels' intervals) and their ratio, near 1 where the steps are
    device-bound, well under 1 where the host is (BUSY=1)."""
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        start = time.perf_counter()
        engine.generate([prompt], params)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    kernels = [
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start
    ]
    busy, tokens = busy_seconds(kernels), params.max_new_tokens
    return (
        f"  {name:<9} wall {wall * 1e3 / tokens:.3f} ms a token, GPU busy "
        f"{busy * 1e3 / tokens:.3f} ({busy / wall:.2f} of the wall), "
        f"{len(kernels) / tokens:.0f} kernels a token"
    )


def profile(name: str, engine: Engine, prompt: list[int]) -> None:
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        engine.generate([prompt], SamplingParams(max_new_tokens=21, ignore_eos=True))
        torch.cuda.synchronize()
    print(f"---- {name}: top host ops over 20 steps")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    print(f"---- {name}: top device ops")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15))


def main() -> None:
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 400
    device = devices.current(sys.argv[2] if len(sys.argv) > 2 else "cuda")
    reps = int(sys.argv[3]) if len(sys.argv) > 3 else 5
    dtype = torch.bfloat16 if device.name == "cuda" else torch.float32
    target = load_model(str(TARGET_DIR), device, dtype)
    drafter = load_model(str(ASSISTANT_DIR), device, dtype)
    prompt = Tokenizer.from_file(str(TARGET_DIR / "tokenizer.json")).encode(PROMPT).ids
    cfg = EngineConfig(max_running_requests=8)
    engines = {
        "no-draft": Engine(target, cfg, device),
        "auto": Engine(target, cfg, device, MTPDecoding(drafter, SpecConfig(5, adaptive=True))),
        "spec 5": Engine(target, cfg, device, MTPDecoding(drafter, SpecConfig(5))),
    }
    for steps in filter(None, os.environ.get("LENGTHS", "").split(",")):
        engines[f"spec {steps}"] = Engine(
            target, cfg, device, MTPDecoding(drafter, SpecConfig(int(steps)))
        )
    if os.environ.get("FORCED") == "1":  # auto's machinery, its choice fixed at rounds of 5
        forced = Engine(target, cfg, device, MTPDecoding(drafter, SpecConfig(5, adaptive=True)))
        forced.strategy.force_step(5)
        engines["auto=5"] = forced
    if os.environ.get("INVARIANT") == "1":
        invariant = load_model(str(TARGET_DIR), device, dtype, batch_invariant=True)
        engines["no-draft inv"] = Engine(invariant, cfg, device)
        engines["auto inv"] = Engine(
            invariant, cfg, device, MTPDecoding(drafter, SpecConfig(5, adaptive=True))
        )
    params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    outputs = {}
    speeds: dict[str, list[float]] = {name: [] for name in engines}
    for name, engine in engines.items():  # warm: lazy compiles and captures, first touches
        outputs[name] = engine.generate([prompt], params)[0].output_ids
    for _ in range(reps):
        for name, engine in engines.items():
            speeds[name].append(generate_tokens_per_s(engine, [prompt], params))
    chooser = engines["auto"].strategy.chooser
    lines = [f"{device.name}, {dtype}, {tokens} tokens, batch 1, median of {reps} runs each:"]
    base = statistics.median(speeds["no-draft"])
    for name, runs in speeds.items():
        median = statistics.median(runs)
        spread = f"{min(runs):.0f}..{max(runs):.0f}"
        lines.append(f"  {name:<9} {median:7.0f} tok/s ({spread})  {median / base:.2f}x no-draft")
    lines.append(f"  auto steps by draft length (0 = plain): {chooser.steps_by_count}")
    lines.append(f"  auto: {chooser.explain()}")
    for plain, auto in (("no-draft", "auto"), ("no-draft inv", "auto inv")):
        if auto in outputs:
            a, b = outputs[plain], outputs[auto]
            first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
            said = (
                "all equal" if first is None and len(a) == len(b) else f"first differs at {first}"
            )
            lines.append(f"  {auto} against {plain}'s {len(a)} tokens: {said}")
    if os.environ.get("BUSY") == "1" and device.name == "cuda":  # under its profiler
        lines += [device_share(name, engine, prompt, params) for name, engine in engines.items()]
    if os.environ.get("PROFILE") == "1" and device.name == "cuda":
        for name, engine in engines.items():  # last: the profiler slows later launches
            profile(name, engine, prompt)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
