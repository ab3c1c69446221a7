"""Decode attention, one layer, by a short row's split count and stage 1's programs along the
splits, over batches that mix row lengths (issue 21; stop 83's question).

Stop 83 gave short rows fewer splits in launches of many (row, KV head) pairs, and the
programs along the splits (``split_programs``) fell with them: 2 a pair at batch 64 of
llama-1b. Uniform batches of 512 keys gained (BENCHMARKS.md, stop 83), but a long row among
short ones would then walk its 128 splits on those 2 programs. This times each variant
SHORT:PROGRAMS (0 programs: ``split_programs``' choice for that short count) on uniform and
mixed batches, so the two can be weighed in one run. A variant SHORT:PROGRAMS:w launches
stage 1's work as one list (``decode_attention``'s work_list: the same bits; PROGRAMS then
counts a KV head's programs, 0 ``work_programs``').

Run on the device: python bench/decode_mixed.py [--shape llama-1b|gemma4-sliding|...]
[--batches 64x512,63x512+1x32768,8x512+1x8192] [--variants 16:0,2:0,2:16,4:0,8:0]
[--context 131072] [--combine] [--long-rows]

``--long-rows`` launches as the engine's graphs for batches with a long row do: where the
shape takes larger blocks for long rows (llama-1b's), rows of LONG_ROW_KEYS keys and more
run in a second launch on them. A work list (:w) then lists each launch's rows, which the
engine does not (yet): it lists only where a model takes no such blocks.

The scratch's split dimension is what an engine of ``--context`` keys allocates
(``max_kv_splits``, as CudaAttentionBackend sizes it from its token table); 0, the default,
sizes it for the batch's longest row. HAZARD (comparing rules): the split count is then a
constant where the scratch holds no more than a short row's splits (DOUBLINGS 0: 16 at up
to 8,191 keys), a kernel other than the engine's, whose scratch a long context sizes.
``--combine`` adds a line under each batch: the combine kernel alone, over the partials the
variant's stage 1 left (the rest of the cell is stage 1's).

HAZARD (order): variants timed one after another in a fixed order may read slower the later
they run. ``--passes`` (2) times them in the given order, then reversed, and so on (an even
count balances each variant's places); a cell is the mean of its passes, and each batch's
line ends with the largest spread between one variant's passes. (Stop 86 blamed the order
for equal split counts reading 4-6% apart; ABBA at stop 87 kept the gap, 253.7 against 240.1
us at 64 x 4k: it is the run-time split count of the scratch's DOUBLINGS, above.)

Each cell: us a layer (partial + combine kernels replayed from a CUDA graph, median), and
"=" where the output equals, bit for bit, the first variant of the same short count (the
programs along the splits must change no bit), "!" where it does not. ``--device cpu
--once`` launches each variant twice under Triton's interpreter without timing (a smoke
test: TRITON_INTERPRET=1, small batches).
"""

from __future__ import annotations

import argparse
import functools

import torch
import triton
from paged_layer import SHAPES, PagedLayer  # bench/ is the script's directory

from graphrt.devices.cuda.triton_decode import LONG_ROW_KEYS, long_block_n, max_kv_splits


def parse_batch(text: str) -> list[int]:
    """ "63x512+1x32768" -> [512] * 63 + [32768]: each row's visible keys."""
    lens = []
    for part in text.split("+"):
        count, _, keys = part.partition("x")
        lens += [int(keys)] * int(count)
    return lens


def parse_variant(text: str) -> tuple[int, int, bool]:
    """ "2:16" -> (short splits 2, 16 programs along the splits, by rows); "2:0":
    split_programs'; "2:0:w": one work list, work_programs' programs."""
    short, programs, grid = (text.split(":") + ["", ""])[:3]
    if grid not in ("", "w"):
        raise SystemExit(f"decode_mixed.py: variant {text!r}: the grid is w or nothing")
    return int(short), int(programs or 0), grid == "w"


class Layer(PagedLayer):
    """A ``PagedLayer`` with the engine's scratch for a ``context``-key engine, whose
    ``run(short, programs, listed)`` launches decode attention as a variant does."""

    def __init__(
        self,
        shape: str,
        lens: list[int],
        device: torch.device,
        dtype: torch.dtype,
        context: int,
        long_rows: bool = False,
    ):
        # The engine's scratch for a context of ``context`` keys, or of the longest row (at most
        # MAX_KV_SPLITS), whatever the short count: what it allocates with 16 short splits.
        super().__init__(shape, lens, device, dtype, max_kv_splits(max(context, max(lens))))
        # As an engine's graphs for batches with a long row: a second launch on larger
        # blocks from LONG_ROW_KEYS keys, where the shape takes them (long_block_n).
        head_dim = SHAPES[shape][2]
        block_n = long_block_n(head_dim, torch.finfo(dtype).bits // 8) if long_rows else None
        self.long_rows = None if block_n is None else (LONG_ROW_KEYS, block_n)

    def run(self, short: int, programs: int, listed: bool = False) -> None:
        self.attend(
            short_splits=short, programs=programs or None, work_list=listed,
            long_rows=self.long_rows,
        )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-1b", choices=sorted(SHAPES))
    parser.add_argument("--batches", default="64x512,63x512+1x32768,8x512,7x512+1x8192")
    parser.add_argument("--variants", default="16:0,16:0:w,2:0,2:0:w,4:0,4:0:w")
    parser.add_argument(
        "--context", type=int, default=0, help="size the scratch as an engine of this context"
    )
    parser.add_argument(
        "--combine", action="store_true", help="time the combine kernel alone too (a line)"
    )
    parser.add_argument(
        "--long-rows",
        action="store_true",
        help="the long rows' second launch on larger blocks, as the engine's graphs for "
        "batches with a long row (llama-1b's shape: 128-key blocks from 2,048 keys)",
    )
    parser.add_argument(
        "--passes", type=int, default=2, help="timings of each variant, the order reversed each"
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--once", action="store_true", help="launch twice, untimed (smoke test)")
    args = parser.parse_args()
    if args.passes < 1:
        parser.error(f"--passes must be 1 or more, got {args.passes}")
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    variants = [parse_variant(v) for v in args.variants.split(",")]
    heads, kv_heads, head_dim = SHAPES[args.shape]
    print(
        f"{args.shape}: {heads} heads on {kv_heads} KV heads, head_dim {head_dim}, {dtype}; "
        f"scratch of a {args.context or 'longest row'}-key context; "
        + ("the long rows' launches; " if args.long_rows else "")
        + "us a layer by SHORT:PROGRAMS (= same bits as the first variant of its short count)"
    )
    print(f"{'batch':>24} " + " ".join(f"{v:>10}" for v in args.variants.split(",")))
    passes = 1 if args.once else args.passes
    for text in args.batches.split(","):
        layer = Layer(args.shape, parse_batch(text), device, dtype, args.context, args.long_rows)
        first: dict[int, torch.Tensor] = {}  # short count -> its first variant's output
        same = [False] * len(variants)
        stage = [[] for _ in variants]  # us of each pass, by variant
        combine = [[] for _ in variants]
        for p in range(passes):
            order = list(enumerate(variants))
            for index, (short, programs, listed) in order if p % 2 == 0 else order[::-1]:
                run = functools.partial(layer.run, short, programs, listed)
                run()
                run()
                if not args.once:
                    stage[index].append(time_us(run))
                    run()
                    if args.combine:
                        combine[index].append(
                            time_us(functools.partial(layer.combine, short_splits=short))
                        )
                if args.combine:
                    layer.combine(short_splits=short)  # the same output: it reads what stage 1 left
                if p == 0:
                    out = layer.out.clone()
                    same[index] = torch.equal(out, first.setdefault(short, out))
        cells = [f"{mean(us):8.1f} {'=' if ok else '!'}" for us, ok in zip(stage, same)]
        spread = max((max(us) / min(us) - 1) * 100 for us in stage) if not args.once else 0.0
        line = f"{text:>24} " + " ".join(f"{c:>10}" for c in cells)
        print(f"{line}   spread {spread:.0f}%", flush=True)
        if args.combine:
            print(
                f"{'combine':>24} " + " ".join(f"{mean(us):8.1f}  " for us in combine), flush=True
            )


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def time_us(run) -> float:
    """``run``'s median time in us, replayed from a CUDA graph."""
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(run, rep=50) * 1e3


if __name__ == "__main__":
    main()
