"""Skinny matmuls at verify and small-batch widths (issue 20: verify on decode's budget).

A verify forward at batch 1 multiplies 2 to 16 rows; the tuner serves them with cuBLAS
(split-K: a second kernel, outside the PDL chain) or a 16-row tensor-core tile, which on
projections of few output tiles (N = 1536: 96 tiles of 16) leaves SMs idle. For each
projection of a decode step this times, the tuner's way (inside a CUDA graph, weights read
cold), at M = 2 .. 16 rows:

- cuBLAS, the best 16-row tile (``DOT_CONFIGS``) and the best split-K tile
  (``SPLIT_CONFIGS``: K over several programs, summed in split order in the same launch);
- one row on decode's row path, the floor a verify row would like to cost;

and checks that split-K gives the same bits launch after launch.

``--one-row`` instead times decode at batch 1 (issue 21's batch-1 target): each row-path
configuration (``ROW_CONFIGS``, and ``--extra N:K:W,...`` to try) on every projection, us
and weight TB/s, against the device's copy bandwidth: how far a batch-1 step's GEMVs are
from the floor, projection by projection.

    python bench/gemv_widths.py [--model gemma4-e2b] [--rows 2,5,8,16] [--out f.json]
    python bench/gemv_widths.py --model llama-1b --one-row [--extra 16:1024:8,32:512:8]
"""

from __future__ import annotations

import argparse
import json

import torch

from graphrt.core.bench.timing import copy_bandwidth_gbps
from graphrt.core.models.ops import PreNorm
from graphrt.devices.cuda.gemv_tuner import GemvTuner
from graphrt.devices.cuda.ops import cublas_linear, cublas_linear_act_mul
from graphrt.devices.cuda.triton_gemv import (
    DOT_CONFIGS,
    ROW_CONFIGS,
    SPLIT_CONFIGS,
    GemvConfig,
    gemv,
)

# (name, N, K, epilogue, calls a step): the projections of a decode step as the models call
# them (Gemma 4 norms in its own kernels; Llama fuses norm and residual into the GEMV). N
# counts outputs: a gated projection reads 2N weight rows, gate then up.
SHAPES = {
    "gemma4-e2b": [  # 35 layers, every 5th full; the last 20 share KV (q only) and MLP x2
        ("qkv sliding", 2560, 1536, "plain", 12),
        ("qkv full", 5120, 1536, "plain", 3),
        ("q sliding", 2048, 1536, "plain", 16),
        ("q full", 4096, 1536, "plain", 4),
        ("o sliding", 1536, 2048, "plain", 28),
        ("o full", 1536, 4096, "plain", 7),
        ("gate_up", 6144, 1536, "gated", 15),
        ("gate_up wide", 12288, 1536, "gated", 20),
        ("down", 1536, 6144, "plain", 15),
        ("down wide", 1536, 12288, "plain", 20),
        ("lm head", 262144, 1536, "plain", 1),
    ],
    "llama-1b": [
        ("qkv", 3072, 2048, "norm", 16),
        ("o", 2048, 2048, "residual", 16),
        ("gate_up", 8192, 2048, "gated-norm", 16),
        ("down", 2048, 8192, "residual", 16),
        ("lm head", 128256, 2048, "plain", 1),
    ],
    "llama-8b": [
        ("qkv", 6144, 4096, "norm", 32),
        ("o", 4096, 4096, "residual", 32),
        ("gate_up", 14336, 4096, "gated-norm", 32),
        ("down", 4096, 14336, "residual", 32),
        ("lm head", 128256, 4096, "plain", 1),
    ],
}


def _case(n: int, k: int, epilogue: str, max_rows: int):
    """The weight and ``run(config, rows, w)`` (config None: cuBLAS) for one projection."""
    dev, dtype = torch.device("cuda"), torch.bfloat16
    gated = epilogue.startswith("gated")
    weight = torch.randn((2 if gated else 1) * n, k, device=dev, dtype=dtype) / k**0.5
    with_norm = epilogue in ("norm", "gated-norm")
    norm = PreNorm(torch.rand(k, device=dev, dtype=dtype) + 0.5, 1e-6) if with_norm else None
    x_all = torch.randn(max_rows, k, device=dev, dtype=dtype)
    res_all = torch.randn(max_rows, n, device=dev, dtype=dtype)
    act = "gelu_pytorch_tanh" if epilogue == "gated" else "silu"

    def run(config, rows, w=weight):
        x = x_all[:rows]
        res = res_all[:rows] if epilogue == "residual" else None
        if gated:
            if config is None:
                return cublas_linear_act_mul(x, w, None, act, norm=norm)
            return gemv(x, w, None, config, act=act, gated=True, norm=norm)
        if config is None:
            return cublas_linear(
                x, w, None, norm=norm, residual=None if res is None else res.clone()
            )
        return gemv(x, w, None, config, norm=norm, residual=res)

    return weight, run


def one_row(model: str, extra: str | None, tuner: GemvTuner) -> dict:
    """Each row-path configuration on each projection at M = 1: us and weight TB/s (weights
    read cold, calls back to back in a graph as in a step), and the step's projections at
    the best of them against the copy bandwidth."""
    dev = torch.device("cuda")
    copy_tbs = copy_bandwidth_gbps(dev, torch.cuda.synchronize) / 1e3
    configs = list(ROW_CONFIGS)
    for text in extra.split(",") if extra else ():
        block_n, block_k, warps = (int(x) for x in text.split(":"))
        configs.append(GemvConfig(block_n, block_k, num_warps=warps, block_m=1))
    tags = [f"{c.block_n}x{c.block_k}w{c.num_warps}" for c in configs]
    print(f"{model}, M = 1, bf16: us / weight TB/s by row-path configuration; copy bandwidth "
          f"{copy_tbs:.2f} TB/s")  # fmt: skip
    print(f"{'projection':>10} {'MB':>7} " + " ".join(f"{t:>13}" for t in tags) + "   best/floor")
    report, best_us, floor_us = [], 0.0, 0.0
    for name, n, k, epilogue, calls in SHAPES[model]:
        weight, run = _case(n, k, epilogue, 1)
        cells = []
        for i, config in enumerate(configs):
            tuner._time((name, 1, i), (config,), weight, lambda c, w, run=run: run(c, 1, w))
            cells.append(tuner.timings[(name, 1, i)][1] * 1e3)
        mb, floor = weight.nbytes / 1e6, weight.nbytes / copy_tbs / 1e6
        best = min(cells)
        print(f"{name:>10} {mb:>7.1f} " + " ".join(f"{us:>6.1f} / {mb / us:4.2f}"
              for us in cells) + f"   {best / floor:.2f}x", flush=True)  # fmt: skip
        best_us, floor_us = best_us + calls * best, floor_us + calls * floor
        report.append(dict(projection=name, n=n, k=k, calls=calls, mb=mb, floor_us=floor,
                           us=dict(zip(tags, cells))))  # fmt: skip
    print(f"a step's projections at M = 1: {best_us:.0f} us at the best configurations, "
          f"{floor_us:.0f} at the copy bandwidth ({best_us / floor_us:.2f}x)")  # fmt: skip
    return {"model": model, "copy_tbs": copy_tbs, "one_row": report, "step_us": best_us}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="gemma4-e2b", choices=sorted(SHAPES))
    parser.add_argument("--rows", default="2,5,8,16")
    parser.add_argument("--one-row", action="store_true", help="decode at batch 1 (above)")
    parser.add_argument("--extra", help="with --one-row: more row-path configurations, N:K:W")
    parser.add_argument("--out")
    args = parser.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    torch.manual_seed(0)
    tuner = GemvTuner()
    if args.one_row:
        result = one_row(args.model, args.extra, tuner)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
        return
    report = []
    print(f"{'projection':>14} {'M':>3} {'cuBLAS us':>9} {'tile us':>8} {'split us':>8} "
          f"{'split config':>16} {'1 row us':>8} {'same bits':>9}")  # fmt: skip
    step = {m: {"cublas": 0.0, "tile": 0.0, "best": 0.0, "one row": 0.0} for m in rows_list}
    for name, n, k, epilogue, calls in SHAPES[args.model]:
        weight, run = _case(n, k, epilogue, max(rows_list))
        tuner._time((name, 1), ROW_CONFIGS, weight, lambda c, w, run=run: run(c, 1, w))
        one_us = tuner.timings[(name, 1)][1] * 1e3
        for m in rows_list:

            def go(c, w, m=m, run=run):
                return run(c, m, w)

            # Each timed on its own (the tuner's timing keeps the best of what it is given).
            tuner._time((name, m, "cublas"), (None,), weight, go)
            cublas_us = tuner.timings[(name, m, "cublas")][1] * 1e3
            tuner._time((name, m, "tile"), DOT_CONFIGS, weight, go)
            tile_us = tuner.timings[(name, m, "tile")][1] * 1e3
            split = tuner._time((name, m, "split"), SPLIT_CONFIGS, weight, go)
            split_us = tuner.timings[(name, m, "split")][1] * 1e3
            # The same bits, launches alternating two weights: a split reading sums before
            # they were written would find the other weight's.
            other = torch.flip(weight, (0,))
            firsts = (run(split, m, weight), run(split, m, other))
            same = all(
                torch.equal(run(split, m, w), first)
                for _ in range(5)
                for w, first in zip((weight, other), firsts)
            )
            tag = f"{split.block_n}x{split.block_k} s{split.split_k}"
            print(f"{name:>14} {m:>3} {cublas_us:>9.1f} {tile_us:>8.1f} {split_us:>8.1f} "
                  f"{tag:>16} {one_us:>8.1f} {str(same):>9}", flush=True)  # fmt: skip
            for key, us in (("cublas", cublas_us), ("tile", min(cublas_us, tile_us)),
                            ("best", min(cublas_us, tile_us, split_us)), ("one row", one_us)):  # fmt: skip
                step[m][key] += calls * us
            report.append(
                dict(projection=name, n=n, k=k, epilogue=epilogue, calls=calls, rows=m,
                     cublas_us=round(cublas_us, 2), tile_us=round(tile_us, 2),
                     split_us=round(split_us, 2), split_config=vars(split),
                     one_row_us=round(one_us, 2), split_same_bits=same)
            )  # fmt: skip
    for m, t in step.items():
        print(f"a step's projections at M={m} (calls x us): cuBLAS {t['cublas']:.0f} us, tuner "
              f"today {t['tile']:.0f}, with split-K {t['best']:.0f}; one row {t['one row']:.0f}")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "projections": report, "step_us": step}, f, indent=1)


if __name__ == "__main__":
    main()
