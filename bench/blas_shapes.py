"""Host time of a matmul whose shape the BLAS library has not seen before, against one it has.

cuBLAS picks a kernel for each new (M, N, K) and dtype: on the H200 (torch 2.11) a
bfloat16 ``linear`` with a new M took 0.65-0.86 ms of host time, a repeated one 0.015 ms.
Each prefill step has a new token count M, so this cost comes once a matmul. (Padding
prefill steps to 8 sizes an octave was tried against it on the H200 and served slower:
BENCHMARKS.md, "Serving".)

    python bench/blas_shapes.py [--calls 200] [--out blas.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def per_call_us(weight: torch.Tensor, inputs: list[torch.Tensor]) -> tuple[float, float]:
    """(host us, host + device us) a call of ``linear`` over ``inputs`` in turn."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for x in inputs:
        torch.nn.functional.linear(x, weight)
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    total = time.perf_counter() - start
    return 1e6 * host / len(inputs), 1e6 * total / len(inputs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--out-features", type=int, default=1024)
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("blas_shapes: needs a CUDA device")
    torch.manual_seed(0)
    report = []
    for dtype in (torch.float32, torch.bfloat16):
        weight = torch.randn(args.out_features, args.hidden, device="cuda", dtype=dtype)
        rows = [1000 + 7 * i for i in range(args.calls + 1)]  # token counts a server sees
        inputs = [torch.randn(m, args.hidden, device="cuda", dtype=dtype) for m in rows]
        torch.nn.functional.linear(inputs[0], weight)  # the first shape, and cuBLAS's start
        for label, xs in (("one M, repeated", [inputs[0]] * args.calls),
                          ("a new M each call", inputs[1:]),
                          ("those Ms again", inputs[1:])):  # fmt: skip
            host, total = per_call_us(weight, xs)
            report.append({"dtype": str(dtype), "case": label, "host_us": round(host, 1),
                           "total_us": round(total, 1)})  # fmt: skip
            print(f"{str(dtype):>15} {label:<18} host {host:7.1f} us a call, "
                  f"host + device {total:7.1f} us")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "shape": [args.hidden, args.out_features], "calls": args.calls,
                       "results": report}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
