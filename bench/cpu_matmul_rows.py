"""The CPU's projections by row count: torch's matmul (MKL) against oneDNN's linear on a
prepacked weight (devices/cpu/onednn.py), on the embedded pair's shapes, float32.

Prints us a call (median of ``--calls`` calls, each timed alone) for each shape and row
count, the largest difference from ``F.linear``, and whether each row count's rows equal
the same rows computed among 16 (row invariance); writes them to ``--out`` as JSON. Why
the CPU verifies on oneDNN: stop 82 in BENCHMARKS.md.

Run: python bench/cpu_matmul_rows.py [--calls 2000] [--out cpu-matmul-rows.json]
(threads: OMP_NUM_THREADS)
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from graphrt.core.bench.timing import median_ms
from graphrt.devices.cpu.onednn import pack_weight, packed_linear

# (N, K): the target's q/k/v, o, gate/up and down, its head, the assistant's gate/up and down
SHAPES = [(384, 256), (256, 256), (1280, 256), (256, 640), (4096, 256), (2048, 256), (256, 1024)]
ROWS = (1, 2, 3, 4, 6, 16)


def per_call_us(fn, args: tuple, calls: int) -> float:
    return median_ms(lambda: fn(*args), lambda: None, steps=calls, warmup=50) * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000, help="calls timed, each alone")
    parser.add_argument("--out", default="cpu-matmul-rows.json")
    args = parser.parse_args(argv)
    gen = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; us a call, MKL / oneDNN")
    print("| N x K | " + " | ".join(f"{m} rows" for m in ROWS) + " | max diff | rows invariant |")
    print("|---|" + "---:|" * len(ROWS) + "---:|---|")
    results = []
    for n, k in SHAPES:
        weight = torch.randn(n, k, generator=gen) / k**0.5
        x = torch.randn(max(ROWS), k, generator=gen)
        packed = pack_weight(weight)
        us, diff = {}, 0.0
        for m in ROWS:
            rows = x[:m].contiguous()
            us[m] = (
                per_call_us(F.linear, (rows, weight), args.calls),
                per_call_us(packed_linear, (rows, packed), args.calls),
            )
            diff = max(
                diff, (packed_linear(rows, packed) - F.linear(rows, weight)).abs().max().item()
            )
        among16 = packed_linear(x, packed)
        invariant = all(torch.equal(packed_linear(x[:m], packed), among16[:m]) for m in ROWS)
        cells = " | ".join(f"{mkl:.1f} / {dnn:.1f}" for mkl, dnn in us.values())
        print(f"| {n} x {k} | {cells} | {diff:.1e} | {invariant} |")
        results.append(
            {
                "n": n,
                "k": k,
                "us_mkl_onednn_by_rows": us,
                "max_diff": diff,
                "rows_invariant": invariant,
            }
        )
    meta = {"torch": torch.__version__, "threads": torch.get_num_threads(), "calls": args.calls}
    with open(args.out, "w") as f:
        json.dump({**meta, "results": results}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
