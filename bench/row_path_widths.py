"""What a verify's width costs on the row path (issue 20, width-invariant verify).

Up to ``ops.ROW_PATH_ROWS`` rows every skinny matmul runs decode's own row-path
configuration, the one the tuner times on one row, so each row gets its one-row bits. For
each projection of a decode step this times, at M = 1 .. 16 rows and the tuner's way
(inside a CUDA graph, weights read cold):

- the row path with decode's configuration (its row groups: ``triton_gemv.row_group``);
- cuBLAS, and the best 16-row tensor-core tile: what served 2..16 rows before;

and checks that every row of the M-row call equals that row run alone, bit for bit.

    python bench/row_path_widths.py [--model gemma4-e2b] [--rows 1,2,5,8,16] [--out f.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from graphrt.core.models.ops import PreNorm
from graphrt.devices.cuda.gemv_tuner import GemvTuner
from graphrt.devices.cuda.ops import cublas_linear, cublas_linear_act_mul
from graphrt.devices.cuda.triton_gemv import DOT_CONFIGS, ROW_CONFIGS, gemv, row_group

# (name, N, K, epilogue): the projections of a decode step as the models call them
# (Gemma 4 norms in its own kernels; Llama fuses its norm and residual into the GEMV).
SHAPES = {
    "gemma4-e2b": [
        ("qkv sliding", 2560, 1536, "plain"),
        ("qkv full", 5120, 1536, "plain"),
        ("o sliding", 1536, 2048, "plain"),
        ("o full", 1536, 4096, "plain"),
        ("gate_up", 12288, 1536, "gated"),
        ("gate_up wide", 24576, 1536, "gated"),
        ("down", 1536, 6144, "plain"),
        ("down wide", 1536, 12288, "plain"),
        ("lm head", 262144, 1536, "plain"),
    ],
    "llama-1b": [
        ("qkv", 3072, 2048, "norm"),
        ("o", 2048, 2048, "residual"),
        ("gate_up", 16384, 2048, "gated-norm"),
        ("down", 2048, 8192, "residual"),
        ("lm head", 128256, 2048, "plain"),
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

    def run(config, rows, w=weight, first=0):
        x = x_all[first : first + rows]
        res = res_all[first : first + rows] if epilogue == "residual" else None
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="gemma4-e2b", choices=sorted(SHAPES))
    parser.add_argument("--rows", default="1,2,5,8,16")
    parser.add_argument("--out")
    args = parser.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    torch.manual_seed(0)
    tuner = GemvTuner()
    report = []
    print(f"{'projection':>14} {'M':>3} {'group':>5} {'row path us':>11} {'cuBLAS us':>9} "
          f"{'tile us':>8} {'best other':>10} {'rows == alone':>13}")  # fmt: skip
    totals: dict[int, list[float]] = {m: [0.0, 0.0] for m in rows_list}
    for name, n, k, epilogue in SHAPES[args.model]:
        weight, run = _case(n, k, epilogue, max(rows_list))
        one = tuner._time((name, 1), ROW_CONFIGS, weight, lambda c, w, run=run: run(c, 1, w))
        for m in rows_list:

            def go(c, w, m=m, run=run):
                return run(c, m, w)

            tuner._time((name, m, "row"), (one,), weight, go)
            row_us = tuner.timings[(name, m, "row")][1] * 1e3
            tuner._time((name, m, "other"), (None, *DOT_CONFIGS), weight, go)
            cublas_us, tile_us = (t * 1e3 for t in tuner.timings[(name, m, "other")])
            together = run(one, m)
            alone = torch.cat([run(one, 1, first=r) for r in range(m)])
            equal = bool(torch.equal(together, alone))
            group = row_group(one, m, k, epilogue.startswith("gated"))
            other = min(cublas_us, tile_us)
            totals[m][0] += row_us
            totals[m][1] += other
            print(f"{name:>14} {m:>3} {group:>5} {row_us:>11.1f} {cublas_us:>9.1f} "
                  f"{tile_us:>8.1f} {other:>10.1f} {str(equal):>13}", flush=True)  # fmt: skip
            report.append(
                dict(projection=name, n=n, k=k, epilogue=epilogue, rows=m, config=vars(one),
                     group=group, row_path_us=round(row_us, 2), cublas_us=round(cublas_us, 2),
                     tile_us=round(tile_us, 2), rows_equal_alone=equal)
            )  # fmt: skip
    for m, (row_us, other_us) in totals.items():
        print(
            f"sum over projections, M={m}: row path {row_us:.1f} us, best other {other_us:.1f} us"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "projections": report}, f, indent=1)


if __name__ == "__main__":
    main()
