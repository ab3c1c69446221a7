"""The decode step with some projections' GEMV choices forced (issue 21's batch-1 target).

The tuner times each candidate alone: 16 calls of one projection in a graph, each behind a
call of itself. In a step the projection runs behind another kernel (qkv behind the
previous layer's down projection, o behind attention's combine), and a configuration that
reads its weight before the PDL wait (one K chunk a program) may gain there what the
tuner's chain does not show. At stop 88 the tuner gave llama-1b's qkv (norm and rope,
3072 x 2048) a two-chunk configuration, 8.1 us a call in the step at 1.55 TB/s.

This runs ``graphrt bench`` (graphs) once as tuned, which fills the card's choices file
(``gemv_tuner.cache_path``), then for each variant a copy of that file with the named
entries replaced, in its own GRAPHRT_CACHE_DIR, every variant ``--passes`` times in order,
then reversed (ABBA). A variant is ``OP:NxK=N:K:W[,OP:NxK=N:K:W...]`` (a row-path
configuration: outputs a program, K chunk, warps), or ``tuned``:

    python bench/gemv_forced.py --model random:llama-1b --batch-sizes 1 \\
        --variants "tuned;linear_rope:3072x2048=4:2048:8;linear:2048x2048=8:1024:8"

Each cell: the median graph ms of the variant's passes, and its ratio to tuned. The forced
configuration must be one the tuner may choose (``ROW_CONFIGS``): it keeps a choice only
among its candidates, and would time the shape again otherwise. Only the row class of batch
1 is forced (``--row-class``, the tuner's key: '1').
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from graphrt.devices.cuda.gemv_tuner import _read_choices, cache_path, shipped_paths
from graphrt.devices.cuda.triton_gemv import ROW_CONFIGS, GemvConfig

GRAPH_MS = re.compile(r"^\s*(\d+) eager \S+ ms, graph ([\d.]+) ms")


def parse_variant(text: str) -> dict[tuple[str, int, int], GemvConfig]:
    """'OP:NxK=N:K:W,...' -> {(op, N, K): config}; 'tuned' -> {}."""
    if text == "tuned":
        return {}
    forced = {}
    for part in text.split(","):
        try:
            target, config = part.split("=")
            op, shape = target.split(":")
            n, k = (int(v) for v in shape.split("x"))
            block_n, block_k, warps = (int(v) for v in config.split(":"))
        except ValueError:
            sys.exit(f"gemv_forced: variant part {part!r} is not OP:NxK=N:K:W")
        choice = GemvConfig(block_n, block_k, num_warps=warps, block_m=1)
        if choice not in ROW_CONFIGS:
            sys.exit(f"gemv_forced: {config} is not a row-path configuration the tuner offers")
        forced[(op, n, k)] = choice
    return forced


def forced_file(source: dict, forced: dict, row_class: str) -> dict:
    """The choices file with each forced (op, N, K) entry of ``row_class`` replaced."""
    entries = dict(source)
    for (op, n, k), choice in forced.items():
        prefix = f"({op!r}, {row_class!r}, {n}, {k},"
        hits = [key for key in entries if key.startswith(prefix)]
        if not hits:
            sys.exit(f"gemv_forced: no tuned choice for {op} {n}x{k} at row class {row_class}")
        for key in hits:
            entries[key] = dataclasses.asdict(choice)
    return entries


def bench(args, cache_dir: str) -> dict[int, float]:
    """One `graphrt bench` run: {batch size: graph ms}."""
    flags = f"--model {args.model} --batch-sizes {args.batch_sizes} --runners graph"
    flags += f" --steps {args.steps} --prompt-len {args.prompt_len} --no-plot"
    flags += f" --out {Path(tempfile.gettempdir(), 'gemv-forced-bench.json')}"  # not the tree's
    command = [sys.executable, "-m", "graphrt.core.cli.main", "bench", *flags.split()]
    env = dict(os.environ, GRAPHRT_CACHE_DIR=cache_dir)
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        sys.exit(f"gemv_forced: graphrt bench failed: {last}")
    lines = done.stdout.splitlines()
    times = {int(m[1]): float(m[2]) for line in lines if (m := GRAPH_MS.match(line))}
    if not times:
        sys.exit("gemv_forced: graphrt bench printed no graph time")
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="random:llama-1b")
    parser.add_argument("--batch-sizes", default="1")
    parser.add_argument("--variants", default="tuned;linear_rope:3072x2048=4:2048:8")
    parser.add_argument("--row-class", default="1")
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--prompt-len", type=int, default=512)
    args = parser.parse_args()
    variants = args.variants.split(";")
    forced = [parse_variant(v) for v in variants]

    home = os.environ.get("GRAPHRT_CACHE_DIR") or tempfile.mkdtemp(prefix="gemv-forced-")
    os.environ["GRAPHRT_CACHE_DIR"] = home  # cache_path's, as the runs' below
    bench(args, home)  # fills the choices file (and Triton's cache)
    name = torch.cuda.get_device_name()
    path = cache_path(name)
    # The card's shipped choices answer a tuner before it times anything, and are not
    # written to its file: a forced copy holds them too (its own entries first).
    source = {}
    for shipped in reversed(shipped_paths(name, torch.cuda.get_device_capability())):
        source.update(_read_choices(shipped))
    source.update(_read_choices(path))
    dirs = []
    for i, one in enumerate(forced):
        if not one:
            dirs.append(home)
            continue
        copy = Path(tempfile.mkdtemp(prefix=f"gemv-forced-{i}-"))
        shutil.copytree(home, copy, dirs_exist_ok=True)
        (copy / path.name).write_text(json.dumps(forced_file(source, one, args.row_class)))
        dirs.append(str(copy))

    times: list[dict[int, list[float]]] = [{} for _ in variants]
    for p in range(args.passes):
        order = range(len(variants)) if p % 2 == 0 else reversed(range(len(variants)))
        for i in order:
            for bs, ms in bench(args, dirs[i]).items():
                times[i].setdefault(bs, []).append(ms)
    sizes = sorted(times[0])
    print(
        f"{args.model} on {torch.cuda.get_device_name()}: graph ms, median of {args.passes} "
        f"passes (ABBA), x the first variant"
    )
    print(f"{'variant':>48} " + " ".join(f"{'bs ' + str(bs):>18}" for bs in sizes))
    base = {bs: statistics.median(times[0][bs]) for bs in sizes}
    for name, cells in zip(variants, times):
        row = []
        for bs in sizes:
            ms = statistics.median(cells[bs])
            row.append(f"{ms:8.3f} ({ms / base[bs]:.3f}x)")
        print(f"{name[:48]:>48} " + " ".join(f"{c:>18}" for c in row))


if __name__ == "__main__":
    main()
