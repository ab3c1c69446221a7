"""Prefill attention, one layer: the Triton extend kernel by block configuration against
torch SDPA (the reference backend's path: gather the request's K/V, then flash) (issue 21).

Cases: one whole prompt, a chunk after cached tokens (a long prompt's last chunk), and a
burst of short prompts (a server's). Medians of CUDA-event timings, us a layer.

    python bench/extend_blocks.py [--shape llama-1b|gemma-global] [--configs 64x64x4x3,...]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from graphrt.core.attention.torch_ref import _causal
from graphrt.devices.cuda import triton_extend

SHAPES = {"llama-1b": (32, 8, 64), "gemma-global": (8, 1, 512)}  # heads, KV heads, head_dim
CASES = {  # name: [(cached tokens, new tokens) per request]
    "prompt 512": [(0, 512)],
    "prompt 8192": [(0, 8192)],
    "chunk 8192 after 24576": [(24576, 8192)],
    "40 prompts x 200": [(0, 200)] * 40,
}


def timed_us(fn, repeats: int = 20) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        begin, end = torch.cuda.Event(True), torch.cuda.Event(True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(begin.elapsed_time(end) * 1e3)
    return statistics.median(samples)


def bench_case(reqs, heads: int, kv_heads: int, dim: int, configs) -> list[float]:
    """us a layer: SDPA, then the kernel at each of ``configs``."""
    dtype, dev = torch.bfloat16, torch.device("cuda")
    default = triton_extend._blocks
    total = sum(p + n for p, n in reqs)
    k_buf = torch.randn(total + 1, kv_heads, dim, dtype=dtype, device=dev)
    v_buf = torch.randn_like(k_buf)
    table = torch.zeros(len(reqs), max(p + n for p, n in reqs), dtype=torch.int64, device=dev)
    slot = 1  # slot 0: the padding slot
    for r, (p, n) in enumerate(reqs):
        table[r, : p + n] = torch.arange(slot, slot + p + n, device=dev)
        slot += p + n
    tokens = sum(n for _, n in reqs)
    q = torch.randn(tokens, heads, dim, dtype=dtype, device=dev)
    out = torch.empty_like(q)
    meta = triton_extend.extend_metadata([p for p, _ in reqs], [n for _, n in reqs], dev)
    req_slots = torch.arange(len(reqs), device=dev)
    longest = max(n for _, n in reqs)

    def sdpa():
        start = 0
        for r, (p, n) in enumerate(reqs):
            slots = table[r, : p + n]
            key = k_buf[slots].transpose(0, 1).unsqueeze(0)
            value = v_buf[slots].transpose(0, 1).unsqueeze(0)
            q_r = q[start : start + n].transpose(0, 1).unsqueeze(0)
            o = _causal(q_r, key, value, dim**-0.5, heads != kv_heads)
            out[start : start + n] = o[0].transpose(0, 1)
            start += n

    row = [timed_us(sdpa)]
    for config in configs:
        triton_extend._blocks = lambda _d, c=config: c
        try:
            row.append(timed_us(lambda: triton_extend.extend_attention(
                q, k_buf, v_buf, out, table, req_slots, meta, longest, dim**-0.5, None)))  # fmt: skip
        except Exception as e:  # noqa: BLE001 (a config that does not fit: say so, go on)
            print(f"   {config}: {type(e).__name__}: {str(e).splitlines()[0][:80]}")
            row.append(float("nan"))
        finally:
            triton_extend._blocks = default
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-1b", choices=SHAPES)
    parser.add_argument(
        "--configs", default="64x64x4x3,128x64x8x3,128x64x4x3,128x32x4x3,64x32x4x3,64x64x4x2"
    )
    args = parser.parse_args()
    heads, kv_heads, dim = SHAPES[args.shape]
    configs = [tuple(int(x) for x in c.split("x")) for c in args.configs.split(",")]
    print(f"{args.shape}: {heads} heads on {kv_heads} KV heads, head_dim {dim}, bf16; us a layer")
    print(f"| case | sdpa | {' | '.join(args.configs.split(','))} |")
    for case, reqs in CASES.items():
        row = bench_case(reqs, heads, kv_heads, dim, configs)
        print(f"| {case} | " + " | ".join(f"{us:.1f}" for us in row) + " |", flush=True)


if __name__ == "__main__":
    main()
