"""Where a decode step's time goes on a GPU: execute vs replay vs input loading,
and the kernels of one step (torch.profiler), for random:llama-1b in bf16.

Run on the device: python bench/profile_step.py [batch sizes, default 1,32]
"""

from __future__ import annotations

import sys

import torch

from graphrt import devices
from graphrt.core.bench.decode import DecodeBenchConfig, make_engine
from graphrt.core.bench.timing import median_ms
from graphrt.core.engine import SamplingParams
from graphrt.core.models import load_model


def main() -> None:
    sizes = [int(s) for s in (sys.argv[1] if len(sys.argv) > 1 else "1,32").split(",")]
    device = devices.current("cuda")
    loaded = load_model("random:llama-1b", device, torch.bfloat16)
    cfg = DecodeBenchConfig(batch_sizes=tuple(sizes), max_running_requests=max(sizes))
    engine = make_engine(loaded, device, cfg, graphs=True)
    print(f"ops={loaded.model.model.norm.ops.name} attention={engine.attn_backend.name}")
    for bs in sizes:
        profile_batch(engine, bs, device.synchronize)


def profile_batch(engine, bs: int, sync) -> None:
    params = SamplingParams(max_new_tokens=64, ignore_eos=True)
    reqs = [
        engine.add_request(torch.randint(0, 128256, (512,)).tolist(), params) for _ in range(bs)
    ]
    while engine.waiting:
        engine.step()
    batch = engine.build_decode_batch(reqs)
    runner = engine.graph_runner
    execute = median_ms(lambda: runner.execute(batch), sync, 100, 10)
    load = median_ms(lambda: runner.load_batch(batch), sync, 100, 10)
    runner.load_batch(batch)
    key, static = runner._loaded
    replay = median_ms(lambda: runner.backend.replay(key), sync, 100, 10)
    eager = median_ms(lambda: engine.eager_runner.execute(batch), sync, 20, 3)
    print(
        f"bs={bs}: execute {execute:.3f} ms | load_batch {load:.3f} | replay only {replay:.3f} | eager {eager:.3f}"
    )
    steps = [
        ("eager step", lambda: engine.eager_runner.execute(batch)),
        ("graph replay", lambda: runner.backend.replay(key)),
    ]
    for name, fn in steps:
        print_kernels(name, fn, sync)
    for r in reqs:
        engine.abort(r)


def print_kernels(name: str, fn, sync, top: int = 12) -> None:
    """Run ``fn`` once under torch.profiler: kernel count, GPU time, the costliest kernels."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        sync()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.self_device_time_total for e in events)
    count = sum(e.count for e in events)
    print(f"  {name}: {count} kernels, {total / 1e3:.3f} ms GPU time; top:")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:top]:
        print(f"    {e.self_device_time_total / 1e3:7.3f} ms  x{e.count:<4} {e.key[:90]}")


if __name__ == "__main__":
    main()
