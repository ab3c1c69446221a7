"""Is the README's command host- or device-bound (issue 20)? The embedded pair in bf16 on
CUDA, as the CLI loads it, in one process: plain steps (`--no-draft`), auto and rounds of
5, each warmed up, then one 400-token generate of each under torch.profiler. Prints, per
engine, the wall time a token, the GPU's busy time a token (the union of its kernels'
intervals), their ratio (the device's share of the wall: near 1 device-bound, well under
1 host-bound), and kernels a token.

Run: python bench/gpu_busy.py [tokens, default 400]
"""

from __future__ import annotations

import sys
import time

import torch
from tokenizers import Tokenizer

from graphrt import devices
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


def main() -> None:
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 400
    device = devices.current("cuda")
    target = load_model(str(TARGET_DIR), device, batch_invariant=None)  # the CLI's default
    drafter = load_model(str(ASSISTANT_DIR), device, target.dtype)
    prompt = Tokenizer.from_file(str(TARGET_DIR / "tokenizer.json")).encode(PROMPT).ids
    cfg = EngineConfig(max_running_requests=8)
    engines = {
        "no-draft": Engine(target, cfg, device),
        "auto": Engine(target, cfg, device, MTPDecoding(drafter, SpecConfig(5, adaptive=True))),
        "spec 5": Engine(target, cfg, device, MTPDecoding(drafter, SpecConfig(5))),
    }
    params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    print(
        f"{torch.cuda.get_device_name()}, batch invariant {target.batch_invariant}, {tokens} tokens"
    )
    for name, engine in engines.items():
        engine.generate([prompt], params)  # warm
        engine.generate([prompt], params)
        torch.cuda.synchronize()
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            start = time.perf_counter()
            engine.generate([prompt], params)
            torch.cuda.synchronize()
            wall = time.perf_counter() - start
        kernels = [
            (e.time_range.start, e.time_range.end)
            for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA
            and e.time_range.end > e.time_range.start
        ]
        busy = busy_seconds(kernels)
        print(
            f"  {name:<9} wall {wall * 1e3 / tokens:.3f} ms a token, GPU busy "
            f"{busy * 1e3 / tokens:.3f} ({busy / wall:.2f} of the wall), "
            f"{len(kernels) / tokens:.0f} kernels a token"
        )


if __name__ == "__main__":
    main()
