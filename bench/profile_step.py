"""Where a decode step's time goes on a GPU: execute vs replay vs input loading, the
kernels of one graph replay (torch.profiler), and the tuned matmuls against cuBLAS.

Each model runs three times, side by side: with the CUDA device's ops as shipped (tuned
GEMV where it won, programmatic dependent launch where the card has it), the same
without PDL, and with every matmul on cuBLAS (the same fused elementwise ops).

Run on the device: python bench/profile_step.py [models, default random:llama-1b]
[batch sizes, default 1,32] [prompt length, default 512] [variants, default all three;
NAME:N runs a variant again, as its own engine: the first engine of a process replayed
llama-1b's step 2-4% faster than the next ones on an H100 (stop 65), so compare like
positions]
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import statistics
import sys

import torch

from graphrt import devices
from graphrt.core.bench.decode import DecodeBenchConfig, make_engine
from graphrt.core.bench.profile import device_trace
from graphrt.core.bench.timing import median_ms
from graphrt.core.engine import SamplingParams
from graphrt.core.models import load_model


def main() -> None:
    models = (sys.argv[1] if len(sys.argv) > 1 else "random:llama-1b").split(",")
    sizes = [int(s) for s in (sys.argv[2] if len(sys.argv) > 2 else "1,32").split(",")]
    prompt_len = int(sys.argv[3]) if len(sys.argv) > 3 else 512
    device = devices.current("cuda")
    from graphrt.devices.cuda import pdl

    tuned = device.model_ops()
    variants = {
        "tuned": (tuned, pdl.ENABLED),
        "no-pdl": (tuned, False),
        "cublas": (cublas_matmuls(tuned), pdl.ENABLED),
    }
    chosen = sys.argv[4].split(",") if len(sys.argv) > 4 else list(variants)
    variants = {name: variants[name.split(":")[0]] for name in chosen}  # "tuned:2": a rerun
    summary, tokens = [], {}
    for model in models:
        for variant, (ops, pdl_on) in variants.items():
            pdl.ENABLED = pdl_on  # read at each launch: the graphs captured below keep it
            loaded = load_model(model, device, torch.bfloat16, ops=ops)
            cfg = DecodeBenchConfig(
                batch_sizes=tuple(sizes), prompt_len=prompt_len, max_running_requests=max(sizes)
            )
            engine = make_engine(loaded, device, cfg, graphs=True)
            print(
                f"== {model} [{variant}] ops={ops.name} attention={engine.attn_backend.name}"
                f" pdl={pdl_on}"
            )
            tokens[model, variant] = greedy_tokens(engine, loaded.model)
            for bs in sizes:
                replay, kernels = profile_batch(
                    engine, bs, device.synchronize, loaded.model, prompt_len, pdl_on
                )
                summary.append(
                    f"{model:<22} {variant:<7} bs {bs:>3}: replay {replay:.3f} ms, {kernels} kernels"
                )
            engine.cleanup()
            del engine, loaded
            gc.collect()
            torch.cuda.empty_cache()
    from graphrt.devices.cuda.gemv_tuner import TUNER

    print(f"== tuned matmuls ({TUNER.tuning_s:.1f} s of timing)")
    # bf16 weights; keys are (op, row class, weight rows, K, dtype, ...), or ("two
    # launches", op, row class, ...): a fused op's unfused alternative
    for line in TUNER.report(_weight_bytes):
        print("  " + line)
    print("== summary")
    for line in summary:
        print(line)
    for model in models:  # one arithmetic, scheduled otherwise (not cublas): same bits
        for variant in variants:
            if (
                variant != "tuned"
                and not variant.startswith("cublas")
                and (model, "tuned") in tokens
            ):
                same = tokens[model, "tuned"] == tokens[model, variant]
                print(f"{model}: greedy tokens of {variant} == tuned: {same}")


def _weight_bytes(key) -> int:
    rows, k = key[3:5] if key[0] == "two launches" else key[2:4]
    return rows * k * 2


def greedy_tokens(engine, model) -> list[list[int]]:
    """32 greedy tokens for 4 prompts through the graphs (a race shows as a difference)."""
    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, model.vocab_size, (n,), generator=gen).tolist() for n in (7, 60, 300, 5)
    ]
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    return [r.output_ids for r in engine.generate(prompts, params)]


def cublas_matmuls(ops):
    """``ops`` with every matmul on torch's own (cuBLAS), its norm and activation unfused."""
    from graphrt.devices.cuda.ops import cublas_linear, cublas_linear_act_mul

    return dataclasses.replace(
        ops,
        name=f"{ops.name}+cublas",
        linear=cublas_linear,
        linear_act_mul=cublas_linear_act_mul,
    )


def profile_batch(engine, bs: int, sync, model, prompt_len: int, pdl_on: bool) -> tuple[float, int]:
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    reqs = [
        engine.add_request(torch.randint(0, model.vocab_size, (prompt_len,)).tolist(), params)
        for _ in range(bs)
    ]
    while engine.prefill_pending:
        engine.step()
    batch = engine.build_decode_batch(reqs)
    runner = engine.decode_graph_runner(reqs, batch)  # a batch with a long row: its own
    execute = median_ms(lambda: runner.execute(batch), sync, 100, 10)
    load = median_ms(lambda: runner.load_batch(batch), sync, 100, 10)
    runner.load_batch(batch)
    key, static = runner._loaded
    replay = median_ms(lambda: runner.backend.replay(key), sync, 100, 10)
    print(f"bs={bs}: execute {execute:.3f} ms | load_batch {load:.3f} | replay only {replay:.3f}")
    trace = device_trace(lambda: runner.backend.replay(key), sync, torch.device("cuda"))
    kernels = print_kernels("graph replay", trace)
    print_launches(trace, pdl_on, gemv_calls(runner, static, sync))
    for r in reqs:
        engine.abort(r)
    return replay, kernels


def print_kernels(name: str, trace: list[dict], top: int = 16) -> int:
    """Kernel count, GPU time and the costliest kernels by name: the launch count."""
    by_name: dict[str, list[float]] = collections.defaultdict(list)
    for e in trace:
        by_name[e["name"]].append(e["dur"])
    total = sum(sum(durs) for durs in by_name.values())
    print(f"  {name}: {len(trace)} kernels, {total / 1e3:.3f} ms GPU time; top:")
    for kernel, durs in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]:
        print(f"    {sum(durs) / 1e3:7.3f} ms  x{len(durs):<4} {kernel[:100]}")
    return len(trace)


def gemv_calls(runner, static, sync) -> list[tuple[str, int]]:
    """The Triton GEMV launches of one forward of ``static``, in launch order: (label,
    weight bytes) each, the label its weight's shape, rows and fused work. Run eagerly:
    the closure its graph captured, on the batch ``load_batch`` just loaded, so the
    replay's _gemv_kernel launches, in time order, are these one for one."""
    from graphrt.devices.cuda import ops as cuda_ops

    calls, real = [], cuda_ops.gemv

    def labelled(x, weight, bias, config, **fused):
        n, k = weight.shape
        tags = [name for name, value in fused.items() if value is not None and value is not False]
        rows = "" if x.shape[0] == 1 else f" x{x.shape[0]} rows"
        calls.append((f"{n}x{k}{rows} {'+'.join(tags)}".rstrip(), weight.nbytes))
        return real(x, weight, bias, config, **fused)

    cuda_ops.gemv = labelled
    try:
        with torch.inference_mode():
            runner._graph_function(static)()
        sync()
    finally:
        cuda_ops.gemv = real
    return calls


def print_launches(trace: list[dict], pdl_on: bool, gemvs=(), top: int = 24) -> None:
    """The replay's kernels from the profiler's trace: its GEMVs by projection (``gemvs``,
    ``gemv_calls``' labels, matched to the _gemv_kernel launches in time order), then all
    kernels by launch (name, grid, block; only the trace records grids).
    HAZARD: with PDL a kernel starts while the one before it drains and its time includes
    that wait (stop 63 on an H100, PDL on: a 64-program GEMV, by its grid Gemma 4's 0.8 MB
    per-layer gate behind the down projection, took 18.6 us a call; the kernels summed
    3.80 ms in a 2.62 ms replay): read the no-pdl variant's table for launches' own times."""
    kernels = [e for e in trace if e.get("cat") == "kernel"]
    print_projections([e["dur"] for e in kernels if e["name"] == "_gemv_kernel"], gemvs, pdl_on)
    launches: dict[tuple, list[float]] = collections.defaultdict(list)
    for e in kernels:
        args = e.get("args", {})
        key = (e["name"][:40], tuple(args.get("grid", ())), tuple(args.get("block", ())))
        launches[key].append(e["dur"])
    overlap = ", PDL on: times include waits for the kernel before" if pdl_on else ""
    print(f"  by launch (us: total, calls, median a call; grid; block{overlap}):")
    for (name, grid, block), durs in sorted(launches.items(), key=lambda kv: -sum(kv[1]))[:top]:
        print(
            f"    {sum(durs):8.1f} x{len(durs):<4} {statistics.median(durs):7.2f}  {name:<40}"
            f" grid {grid} block {block}"
        )


def print_projections(durations: list[float], gemvs, pdl_on: bool) -> None:
    """Each projection's GEMV in the step: its launches' time and the weight's read rate,
    against the one-row bench's figures for the same shapes alone (gemv_widths.py)."""
    if len(durations) != len(gemvs):
        print(f"  GEMVs by projection: {len(durations)} launches, {len(gemvs)} calls labelled")
        return
    by_label: dict[str, list[tuple[float, int]]] = collections.defaultdict(list)
    for dur, (label, nbytes) in zip(durations, gemvs):
        by_label[label].append((dur, nbytes))
    overlap = " (PDL on: waits included)" if pdl_on else ""
    print(f"  GEMVs by projection (us: total, calls, median a call, TB/s at it){overlap}:")
    for label, runs in sorted(by_label.items(), key=lambda kv: -sum(d for d, _ in kv[1])):
        median = statistics.median(d for d, _ in runs)
        rate = statistics.median(b for _, b in runs) / (median * 1e-6) / 1e12
        print(
            f"    {sum(d for d, _ in runs):8.1f} x{len(runs):<4} {median:7.2f} {rate:5.2f}  {label}"
        )


if __name__ == "__main__":
    main()
