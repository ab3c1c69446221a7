"""Swapped-operand GEMV tiles (w @ x.T) against the row path and the 16-row tiles.

Two questions, per projection of a decode step and per row count (1, 5 and 16 by default:
decode at batch 1, a round of 4's verify, a full tile):

- speed: the best of each family, timed the tuner's way (in a CUDA graph, weights read
  cold): cuBLAS, the row path (1 row), the 16-row tiles (``DOT_CONFIGS``), split-K tiles,
  swapped tiles (``SWAP_CONFIGS``) and swapped split-K tiles;
- bits: does every swapped tile (no split) give row 0 the bits the first 16-row tile gives
  it alone? If so they may serve the batch-invariant ops beside the tiles, and a tile as
  fast as the row path at one row makes invariance free at batch 1 (issue 20, item 4).

Ends with a step's projections (calls x us) for each M: what the tuner picks today, with
the swapped tiles offered, and the invariant ops' tiles with and without them.

    python bench/swap_tiles.py [--models gemma4-e2b,llama-1b] [--rows 1,5,16] [--out f.json]
"""

from __future__ import annotations

import argparse
import json

import torch
from gemv_widths import SHAPES, _case

from graphrt.devices.cuda.gemv_tuner import GemvTuner
from graphrt.devices.cuda.triton_gemv import (
    DOT_CONFIGS,
    ROW_CONFIGS,
    SPLIT_CONFIGS,
    SWAP_CONFIGS,
    SWAP_SPLIT_CONFIGS,
)

FAMILIES = {
    "cublas": (None,),
    "row": ROW_CONFIGS,
    "dot": DOT_CONFIGS,
    "split": SPLIT_CONFIGS,
    "swap": SWAP_CONFIGS,
    "swap split": SWAP_SPLIT_CONFIGS,
}


def _best(tuner, key, configs, weight, run, rows) -> tuple[float, str]:
    """The fastest of ``configs`` at ``rows`` rows, timed the tuner's way: (us, its label)."""
    choice = tuner._time(key, configs, weight, lambda c, w: run(c, rows, w))
    return tuner.timings[key][1] * 1e3, "cublas" if choice is None else choice.label


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="gemma4-e2b,llama-1b")
    parser.add_argument("--rows", default="1,5,16")
    parser.add_argument("--out")
    args = parser.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    torch.manual_seed(0)
    tuner = GemvTuner()
    report = []
    for model in args.models.split(","):
        print(f"== {model}, bf16: best us of each family (its configuration) | swapped "
              f"tiles giving row 0 the 16-row tile's bits")  # fmt: skip
        step = {m: dict.fromkeys(("today", "with swap", "inv", "inv with swap"), 0.0)
                for m in rows_list}  # fmt: skip
        for name, n, k, epilogue, calls in SHAPES[model]:
            weight, run = _case(n, k, epilogue, max(rows_list))
            ref = run(DOT_CONFIGS[0], 1)[0]
            for m in rows_list:
                best: dict[str, tuple[float, str]] = {}
                each: dict[str, float] = {}  # every swapped configuration's us, to prune them
                for family, configs in FAMILIES.items():
                    if family == "row" and m != 1:
                        continue  # the row path reads x once a row: verify widths lose
                    if not family.startswith("swap"):
                        best[family] = _best(
                            tuner, (model, name, m, family), configs, weight, run, m
                        )
                        continue
                    times = {c.label: _best(tuner, (model, name, m, c), (c,), weight, run, m)[0]
                             for c in configs}  # fmt: skip
                    label = min(times, key=times.__getitem__)
                    best[family] = (times[label], label)
                    each |= times
                same = [bool(torch.equal(run(c, m)[0], ref)) for c in SWAP_CONFIGS]
                us = {f: t for f, (t, _) in best.items()}
                today = min(us[f] for f in ("cublas", "row", "dot", "split") if f in us)
                swap_all = min(today, us["swap"], us["swap split"])
                inv_swap = min(us["dot"], us["swap"]) if all(same) else us["dot"]
                for col, value in zip(step[m], (today, swap_all, us["dot"], inv_swap)):
                    step[m][col] += calls * value
                cells = "  ".join(f"{f} {t:6.1f} ({label})" for f, (t, label) in best.items())
                print(f"{name:>13} M={m:<2} {cells}  bits {sum(same)}/{len(same)}", flush=True)
                report.append(dict(model=model, projection=name, n=n, k=k, calls=calls, rows=m,
                                   best={f: dict(us=round(t, 2), config=label)
                                         for f, (t, label) in best.items()},
                                   swap_us={c: round(t, 2) for c, t in each.items()},
                                   swap_same_bits=same))  # fmt: skip
        for m, cols in step.items():
            print(f"{model} M={m}: a step's projections (calls x us): tuner today "
                  f"{cols['today']:.0f}, with swapped tiles {cols['with swap']:.0f}; invariant "
                  f"tiles {cols['inv']:.0f}, with swapped ones {cols['inv with swap']:.0f}")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
