"""Decode attention, one layer, by KV split count: GPU time of the partial and combine
kernels replayed from a CUDA graph (triton.testing.do_bench_cudagraph, median), and of
that the combine kernel alone, for a model's attention shape over contexts and batch sizes:
every row at a fixed split count, then the engine's choice ("auto": splits from each
row's length, scratch for a 131,072-token context). Issue 21 chose the rule from this
table.

Run on the device: python bench/decode_splits.py [--shape llama-1b|gemma4-sliding|gemma4-global]
[--contexts 512,2048,8192,32768] [--batch-sizes 1,8,64] [--splits 8,16,32,64,128]

``--launches 64:4:2,64:4:3,128:8:3`` instead times the engine's rule with stage 1
launched as BLOCK_N:num_warps:num_stages (the first is the reference), with the KV read's
TB/s and whether each output equals the reference's bits; ``64:4:2+128@2048`` launches
stage 1 twice, rows of 2,048 visible keys and more on 128-key blocks (``decode_attention``'s
``long_rows``); ``--contiguous`` gives every request consecutive slots instead of
scattered ones.
"""

from __future__ import annotations

import argparse

import torch
import triton
from paged_layer import SHAPES, PagedLayer  # bench/ is the script's directory

from graphrt.devices.cuda.triton_decode import max_kv_splits


def layer_us(
    shape: str,
    bs: int,
    ctx: int,
    splits: int | None,
    rest_chunk: int | None,
    launch: tuple[int, ...] | None = None,  # see parse_launch
    contiguous: bool = False,
    timed: bool = True,
) -> tuple[float, float, torch.Tensor]:
    """One layer's decode attention over ``bs`` rows of ``ctx`` keys, us, of that the
    combine alone, and the output: ``splits`` for every row, or (None) the engine's
    rule, its combine taking ``rest_chunk`` splits a step past the first 16 (None: the
    default); ``launch``: stage 1's (BLOCK_N, num_warps, num_stages). ``timed=False``:
    two launches and no timing (0 us), for a profiler to read one (``--once``)."""
    max_splits = max_kv_splits(131072) if splits is None else splits
    layer = PagedLayer(
        shape, [ctx] * bs, torch.device("cuda"), torch.bfloat16, max_splits, contiguous
    )
    short = {} if splits is None else {"short_splits": splits}  # fixed: short = most
    stage1 = dict(zip(("block_n", "num_warps", "num_stages"), launch or ()))
    if launch and len(launch) == 5:  # (..., long rows' BLOCK_N, from keys)
        stage1 = dict(zip(("block_n", "num_warps", "num_stages"), launch[:3]))
        stage1["long_rows"] = (launch[4], launch[3])

    def run():
        layer.attend(rest_chunk=rest_chunk, **stage1, **short)

    def combine():
        layer.combine(rest_chunk=rest_chunk, **short)

    run()  # the scratch the combine reads
    if not timed:
        run()
        torch.cuda.synchronize()
        return 0.0, 0.0, layer.out.clone()
    # do_bench_cudagraph runs on a side stream that does not wait for this one.
    torch.cuda.synchronize()
    total = triton.testing.do_bench_cudagraph(run, rep=50) * 1e3
    combine_us = triton.testing.do_bench_cudagraph(combine, rep=50) * 1e3
    run()
    return total, combine_us, layer.out.clone()


def parse_launch(text: str) -> tuple[int, ...]:
    """ "64:4:2" -> (64, 4, 2); "64:4:2+128@2048" -> (64, 4, 2, 128, 2048)."""
    first, _, long_rows = text.partition("+")
    launch = tuple(int(x) for x in first.split(":"))
    if long_rows:
        block_n, _, from_keys = long_rows.partition("@")
        launch += (int(block_n), int(from_keys))
    return launch


def sweep_launches(args: argparse.Namespace) -> None:
    """The engine's rule with each of ``--launches``: us a layer, TB/s of its KV read, and
    whether the output equals the first launch's bit for bit."""
    launches = [parse_launch(c) for c in args.launches.split(",")]
    heads, kv_heads, head_dim = SHAPES[args.shape]
    print(
        f"{args.shape}, {'contiguous' if args.contiguous else 'scattered'} slots, bf16; us a "
        "layer / KV TB/s (= same bits as the first, ! differ), by BLOCK_N:warps:stages"
    )
    print(f"{'batch':>5} {'context':>7} " + " ".join(f"{args.launches.split(',')[i]:>15}"
                                                 for i in range(len(launches))))  # fmt: skip
    for bs in (int(b) for b in args.batch_sizes.split(",")):
        for ctx in (int(c) for c in args.contexts.split(",")):
            kv_bytes = 2 * bs * ctx * kv_heads * head_dim * 2  # bf16
            if kv_bytes > 16 << 30:
                continue
            cells, reference = [], None
            for launch in launches:
                us, _, out = layer_us(
                    args.shape, bs, ctx, None, None, launch, args.contiguous, not args.once
                )
                us = us or float("nan")  # --once: not timed
                same = reference is None or torch.equal(out, reference)
                reference = out if reference is None else reference
                cells.append(f"{us:7.1f} / {kv_bytes / us / 1e6:4.2f}{'=' if same else '!'}")
            print(f"{bs:>5} {ctx:>7} " + " ".join(f"{c:>15}" for c in cells), flush=True)


def _label(splits: int | None, rest_chunk: int | None) -> str:
    return str(splits) if splits else f"auto/{rest_chunk}" if rest_chunk else "auto"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-1b", choices=sorted(SHAPES))
    parser.add_argument("--contexts", default="512,2048,8192,32768")
    parser.add_argument("--batch-sizes", default="1,8,64")
    parser.add_argument("--splits", default="8,16,32,64,128")
    parser.add_argument(
        "--rest-chunk", type=int, default=None,
        help="also time the length rule with the combine taking this many splits a step",
    )  # fmt: skip
    parser.add_argument("--launches", help="BLOCK_N:num_warps:num_stages,... (see above)")
    parser.add_argument("--contiguous", action="store_true", help="consecutive slots a request")
    parser.add_argument(
        "--once", action="store_true",
        help="with --launches: launch each twice, untimed (for ncu: bash bench/h200.sh ncu)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.launches:
        sweep_launches(args)
        return
    heads, kv_heads, head_dim = SHAPES[args.shape]
    # (splits, rest chunk): fixed counts, the length rule, and with --rest-chunk its variant
    columns = [(int(s), None) for s in args.splits.split(",")] + [(None, None)]
    columns += [(None, args.rest_chunk)] if args.rest_chunk else []
    print(
        f"{args.shape}: {heads} heads on {kv_heads} KV heads, head_dim {head_dim}, bf16; "
        "us a layer / of that the combine, by split count"
    )
    print(f"{'batch':>5} {'context':>7} " + " ".join(f"{_label(*c):>15}" for c in columns))
    for bs in (int(b) for b in args.batch_sizes.split(",")):
        for ctx in (int(c) for c in args.contexts.split(",")):
            kv_bytes = 2 * bs * ctx * kv_heads * head_dim * 2
            if kv_bytes > 16 << 30:
                continue
            cells = []
            for s, rest in columns:
                us, combine_us, _ = layer_us(args.shape, bs, ctx, s, rest)
                cells.append(f"{us:7.1f} / {combine_us:5.1f}")
            print(f"{bs:>5} {ctx:>7} " + " ".join(f"{c:>15}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
