"""Prefill throughput: graphrt against transformers on the same weights (issue 21).

For each prompt length, one request of random tokens: graphrt's engine prefills it and
emits its first token (``Engine.generate`` of one token; prefill steps of
``max_prefill_tokens`` each, so a 32k prompt runs in chunks), and transformers runs one
forward of the same weights with its sdpa attention and ``logits_to_keep=1``. Medians of
``--repeats`` timed runs after a warm-up, each ended by a device synchronise; prompt
tokens a second and the ratio graphrt / transformers. Prints a table and writes JSON.

Run on the device: python bench/prefill.py [--model random:llama-1b] [--lens 512,8192,32768]
``--profile``: also where graphrt's prefill time goes at each length (torch.profiler:
the kernels by device time, and the step's host time).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from graphrt import devices
from graphrt.core.bench.peer_hf import build_hf_model, hf_config
from graphrt.core.engine import Engine, EngineConfig, SamplingParams
from graphrt.core.models import load_model


def timed(fn, device, repeats: int) -> float:
    """Median seconds of ``fn`` after one warm-up run."""
    fn()
    device.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        device.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def profile(name: str, n: int, fn, device, rows: int = 12) -> None:
    """One run of ``fn`` under torch.profiler: its top kernels by device time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        fn()
        device.synchronize()
        wall = (time.perf_counter() - start) * 1e3
    kernels = torch.autograd.DeviceType.CUDA
    events = [e for e in prof.key_averages() if e.device_type == kernels]
    events = sorted(events, key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in events) / 1e3
    print(f"-- {name} prefill of {n} tokens: {wall:.1f} ms wall (profiled), kernels "
          f"{total:.1f} ms of device time")  # fmt: skip
    for e in events[:rows]:
        print(f"   {e.device_time_total / 1e3:8.2f} ms {e.count:5d}x  {e.key[:90]}")
    host = sorted(
        (e for e in prof.key_averages() if e.device_type != kernels),
        key=lambda e: -e.self_cpu_time_total,
    )
    print("   host ops by self CPU time:")
    for e in host[:rows]:
        print(f"   {e.self_cpu_time_total / 1e3:8.2f} ms {e.count:5d}x  {e.key[:90]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:llama-1b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--lens", default="512,8192,32768")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None)
    parser.add_argument("--profile", action="store_true", help="kernels by device time")
    args = parser.parse_args()
    device = devices.current()
    dtype = getattr(torch, args.dtype)
    lens = [int(n) for n in args.lens.split(",")]
    loaded = load_model(args.model, device, dtype)
    context = max(lens) + 1
    engine = Engine(
        loaded,
        EngineConfig(max_running_requests=1, max_context_len=context, kv_pool_tokens=context),
        device,
    )
    hf, _ = build_hf_model(hf_config(args.model), loaded.model, device.torch_device(), dtype)
    vocab = loaded.model.vocab_size
    one = SamplingParams(max_new_tokens=1, ignore_eos=True)
    rows = []
    for n in lens:
        prompt = torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(n))
        ids = prompt.to(device.torch_device()).unsqueeze(0)
        tokens = prompt.tolist()
        ours = timed(lambda t=tokens: engine.generate([t], one), device, args.repeats)

        def theirs(ids=ids):
            with torch.no_grad():
                hf(ids, logits_to_keep=1, use_cache=False)

        peer = timed(theirs, device, args.repeats)
        if args.profile:
            for name, fn in (("graphrt", lambda t=tokens: engine.generate([t], one)),
                             ("transformers", theirs)):  # fmt: skip
                profile(name, n, fn, device)
        rows.append(
            dict(prompt=n, graphrt_ms=ours * 1e3, transformers_ms=peer * 1e3,
                 graphrt_tok_s=n / ours, transformers_tok_s=n / peer, ratio=peer / ours)
        )  # fmt: skip
        print(
            f"{n:>6} graphrt {ours * 1e3:8.1f} ms {n / ours:10.0f} tok/s | transformers "
            f"{peer * 1e3:8.1f} ms {n / peer:10.0f} tok/s | {peer / ours:.2f}x",
            flush=True,
        )
    if args.out:
        meta = dict(model=args.model, dtype=args.dtype, device=device.describe(),
                    torch=torch.__version__,
                    max_prefill_tokens=engine.config.max_prefill_tokens)  # fmt: skip
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
