"""Is a GEMV row's result independent of how many rows run beside it, and what does that cost?

For each decode projection shape, row 0 of x (the same values every time) is multiplied
with every GEMV configuration (CUDA-core row path, 16-row tensor-core tiles, larger tiles)
at M = 1 .. 384 rows, and compared bitwise with the 16-row tile at M = 1. Then each
M is timed the tuner's way (in a graph, cold weights): cuBLAS, the row path, the best
16-row tile and the best tile of any size.

    python bench/probe_invariance.py [--out results.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from graphrt.core.models.ops import PreNorm
from graphrt.devices.cuda.gemv_tuner import GemvTuner
from graphrt.devices.cuda.ops import cublas_linear
from graphrt.devices.cuda.triton_gemv import DOT_CONFIGS, ROW_CONFIGS, TILE_CONFIGS, gemv

# (N, K, norm, residual): Llama-3.2-1B qkv / o / down, Gemma 4 E2B o, the LM heads' shape
SHAPES = [
    (3072, 2048, True, False),
    (2048, 2048, False, True),
    (2048, 8192, False, True),
    (1536, 2048, False, False),
    (262144, 1536, False, False),
]
ROWS = (1, 2, 4, 6, 8, 12, 16, 17, 24, 64, 128, 384)


def _case(n: int, k: int, with_norm: bool, with_residual: bool):
    """A weight, x rows, the norm and residual, and ``run(config, rows, w)`` (None: cuBLAS)."""
    dev, dtype = torch.device("cuda"), torch.bfloat16
    weight = torch.randn(n, k, device=dev, dtype=dtype) / k**0.5
    norm = PreNorm(torch.rand(k, device=dev, dtype=dtype) + 0.5, 1e-6) if with_norm else None
    x_all = torch.randn(max(ROWS), k, device=dev, dtype=dtype)
    res_all = torch.randn(max(ROWS), n, device=dev, dtype=dtype) if with_residual else None

    def run(config, rows, w=weight):
        x = x_all[:rows]
        res = None if res_all is None else res_all[:rows]
        if config is None:
            return cublas_linear(
                x, w, None, norm=norm, residual=None if res is None else res.clone()
            )
        return gemv(x, w, None, config, norm=norm, residual=res)

    return weight, x_all, norm, res_all, run


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.manual_seed(0)
    report = {"bitwise": [], "timing": []}
    for n, k, with_norm, with_residual in SHAPES:
        weight, x_all, norm, res_all, run = _case(n, k, with_norm, with_residual)

        ref = run(DOT_CONFIGS[0], 1)[0]
        for config in ROW_CONFIGS[:2] + DOT_CONFIGS + TILE_CONFIGS:
            for rows in ROWS:
                if config.block_m == 1 and rows > 16:
                    continue
                out = run(config, rows)
                report["bitwise"].append(
                    {
                        "shape": [n, k, with_norm, with_residual],
                        "config": vars(config) | {},
                        "rows": rows,
                        "row0_equal": bool(torch.equal(out[0], ref)),
                        "max_diff": float((out[0].float() - ref.float()).abs().max()),
                    }
                )
        # Cross-check: row r of a big batch equals that row run alone (16-row tile).
        big = run(TILE_CONFIGS[2], 384)
        for r in (5, 17, 200):
            x_saved = x_all[r].clone()
            alone = gemv(
                x_saved[None],
                weight,
                None,
                DOT_CONFIGS[0],
                norm=norm,
                residual=None if res_all is None else res_all[r : r + 1],
            )
            report["bitwise"].append(
                {
                    "shape": [n, k, with_norm, with_residual],
                    "config": "tile64 row vs alone",
                    "rows": r,
                    "row0_equal": bool(torch.equal(big[r], alone[0])),
                    "max_diff": 0.0,
                }
            )
    bad = [b for b in report["bitwise"] if not b["row0_equal"]]
    print(f"bitwise: {len(report['bitwise']) - len(bad)} equal, {len(bad)} differ", flush=True)
    for b in bad[:60]:
        print("DIFF", b, flush=True)
    for n, k, with_norm, with_residual in SHAPES:
        weight, x_all, norm, res_all, run = _case(n, k, with_norm, with_residual)

        tuner = GemvTuner()
        for rows in ROWS:
            groups = {"row path": ROW_CONFIGS} if rows <= 16 else {}
            groups |= {"tile16": DOT_CONFIGS, "any tile": DOT_CONFIGS + TILE_CONFIGS}
            entry = {"shape": [n, k, with_norm, with_residual], "rows": rows}
            for name, configs in groups.items():
                key = (name, n, k, rows)

                def go(c, w, rows=rows, run=run):
                    return run(c, rows, w)

                if "cublas_us" not in entry:
                    tuner._time(("cublas", *key), (None,), weight, go)
                    entry["cublas_us"] = round(tuner.timings[("cublas", *key)][0] * 1e3, 2)
                # The first candidate stands where the tuner puts cuBLAS: the best config wins.
                choice = tuner._time(key, (configs[0], *configs), weight, go)
                best_ms = tuner.timings[key][1]
                entry[name + "_us"] = round(best_ms * 1e3, 2)
                entry[name + "_choice"] = None if choice is None else vars(choice)
            report["timing"].append(entry)
            print(entry, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
