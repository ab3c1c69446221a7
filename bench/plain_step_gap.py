"""Why auto's plain steps cost more than the plain engine's (issue 20): both engines on the
embedded pair, the auto engine forced to plain steps, timed alternately, then 20 steps of
each under the profiler (device kernels, host ops) and the difference of their kernels.

Run: python bench/plain_step_gap.py [tokens, default 300] [reps, default 5]
"""

from __future__ import annotations

import statistics
import sys
from collections import Counter

import torch
from tokenizers import Tokenizer

from graphrt import devices
from graphrt.core.bench.decode import generate_tokens_per_s
from graphrt.core.engine import Engine, EngineConfig, SamplingParams
from graphrt.core.models import load_model
from graphrt.core.pretrained import ASSISTANT_DIR, TARGET_DIR
from graphrt.spec import MTPDecoding, SpecConfig


def kernels(engine, prompt, steps=21):
    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    engine.generate([prompt], SamplingParams(max_new_tokens=steps, ignore_eos=True))
    with torch.profiler.profile(activities=acts) as prof:
        engine.generate([prompt], SamplingParams(max_new_tokens=steps, ignore_eos=True))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    dev, host = Counter(), Counter()
    counts = Counter()
    for e in prof.key_averages():
        if e.device_time_total > 0 and e.self_device_time_total > 0:
            dev[e.key] += e.self_device_time_total
            counts[e.key] += e.count
        host[e.key] += e.self_cpu_time_total
    return dev, counts, host, prof


def main() -> None:
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    device = devices.current(sys.argv[3] if len(sys.argv) > 3 else "cuda")
    dtype = torch.bfloat16 if device.name == "cuda" else torch.float32
    target = load_model(str(TARGET_DIR), device, dtype)
    drafter = load_model(str(ASSISTANT_DIR), device, dtype)
    prompt = Tokenizer.from_file(str(TARGET_DIR / "tokenizer.json")).encode("def fibonacci(n):").ids
    cfg = EngineConfig(max_running_requests=8)
    engines = {
        "plain": Engine(target, cfg, device),
        "auto-plain": Engine(
            target, cfg, device, MTPDecoding(drafter, SpecConfig(5, adaptive=True))
        ),
    }
    params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    for engine in engines.values():
        engine.generate([prompt], params)
    engines["auto-plain"].strategy.force_step(0)
    engines["auto-plain"].generate([prompt], params)
    speeds = {n: [] for n in engines}
    for _ in range(reps):
        for n, e in engines.items():
            speeds[n].append(generate_tokens_per_s(e, [prompt], params))
    # The plain graphs alone: replay each engine's bucket-1 decode graph back to back.
    for n, e in engines.items():
        s = e.strategy.plain if n != "plain" else e.strategy
        runner = s.graph_runner
        print(n, "graph buckets", getattr(runner, "buckets", None))
    for n, runs in speeds.items():
        med = statistics.median(runs)
        print(
            f"{n:<11} {med:8.0f} tok/s  {1000 / med:.3f} ms/step  ({min(runs):.0f}..{max(runs):.0f})"
        )
    profs = {n: kernels(e, prompt) for n, e in engines.items()}
    for n, (dev, counts, _host, prof) in profs.items():
        print(
            f"---- {n}: device us over 20 steps: {sum(dev.values()):.0f}, kernels {sum(counts.values())}"
        )
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))
    (da, ca, ha, _), (db, cb, hb, _) = profs["plain"], profs["auto-plain"]
    print("---- kernels: plain vs auto-plain (count, us) where they differ")
    for k in sorted(set(da) | set(db), key=lambda k: -abs(db.get(k, 0) - da.get(k, 0)))[:25]:
        if ca.get(k) != cb.get(k) or abs(da.get(k, 0) - db.get(k, 0)) > 5:
            print(
                f"  {ca.get(k, 0):5d} {da.get(k, 0):9.0f} | {cb.get(k, 0):5d} {db.get(k, 0):9.0f}  {k[:90]}"
            )
    print("---- host ops: plain vs auto-plain (us) largest differences")
    for k in sorted(set(ha) | set(hb), key=lambda k: -abs(hb.get(k, 0) - ha.get(k, 0)))[:20]:
        print(f"  {ha.get(k, 0):9.0f} | {hb.get(k, 0):9.0f}  {k[:90]}")


if __name__ == "__main__":
    main()
