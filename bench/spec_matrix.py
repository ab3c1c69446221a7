"""The speculative speed matrix (issue 20): end-to-end decoding tokens/s, measured.

Rows: models x batch sizes; columns: plain decoding, rounds of 1 to 5 draft steps, and
``--spec-steps auto``. Models:

- ``pair``: the embedded Gemma 4 pair at its real acceptance (code prompts);
- ``oracle-<rate>``: random:gemma4-e2b with its random assistant, whose drafts an oracle
  accepts at a set rate per position (``CoinAcceptance``): the assistant's draft graph and
  the verify graph run as ever (their cost is real), and each drafted node counts as the
  target's own token with probability ``rate`` given its parent's (a stratified
  stream a row, so that every mode accepts close to its expectation, not at its luck;
  restarted before each timed run, so that the modes of a repetition meet the same coins).

Each cell: one engine per mode (all built first, graphs captured once, reused across
cells), its requests of ``--tokens`` new tokens each, after one warm-up generate at that
batch size, the modes in turn ``--reps`` times (order reversed each time), each mode's
median kept; decoding tokens/s counts decode steps and rounds only (prefill and captures
apart), as the CLI.

Run on the device: python bench/spec_matrix.py [--batch-sizes 1,8,32,64] [--rates
0.5,0.7,0.7413,0.9] [--modes plain,1,2,3,4,5,auto] [--tokens 64] [--reps 3] [--out matrix.json]
[--trace steps.jsonl] (the auto chooser's every step: kind, time, acceptance, what it
weighed) [--workloads closed,steady] (closed, the default: a generate of the batch's
prompts, whose speculative rounds end in a tail of shrinking batches; steady, also
--steady: each cell's batch kept full, a finished request replaced at once, until two
requests a slot finished; both: on the same engines, one device start. Where requests
accept differently, plain steps win a closed batch that no choice by tokens a second can
match, one knowing every round's acceptance included: bench/chooser_sim.py --references,
BENCHMARKS.md stop 48; the engine tells auto a generate's batch is closed, and auto then
weighs its finish time: stop 49) [--two-graph] (rounds of two graphs each, the draft
loop's and verify's, instead of one: spec.round_graph); a mode with the suffix "+2g"
("4+2g", "auto+2g") runs that mode on two graphs a round, beside the one-graph mode
[--batch-invariant] (the targets' batch-invariant kernels: every mode writes the same
text in bf16, so that a cell compares choices, not texts; BENCHMARKS.md stop 50)
[--lazy-auto] (auto's engine captures a length when a step first needs it, as `graphrt
generate`; by default every length at start-up, as `graphrt serve`: ``engine_for``)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import triton
from oracles import CoinAcceptance  # bench/oracles.py (bench/ is the script's directory)
from tokenizers import Tokenizer

from graphrt import devices
from graphrt.core.bench.decode import generate_tokens_per_s, steady_tokens_per_s
from graphrt.core.bench.timing import host_launch_us
from graphrt.core.engine import Engine, EngineConfig, SamplingParams
from graphrt.core.models import load_model
from graphrt.core.pretrained import ASSISTANT_DIR, TARGET_DIR
from graphrt.spec import MTPDecoding, SpecConfig
from graphrt.spec.accept import accept

PAIR_PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n\n",
    "class Stack:\n    def __init__(self",
]
MAX_STEPS = 5


TWO_GRAPHS = "+2g"  # a mode's suffix: its rounds on two graphs each (draft loop, verify)


def engine_for(
    mode: str,
    target,
    drafter,
    device,
    cfg: EngineConfig,
    oracle=None,
    one_graph=True,
    lazy_auto=False,
) -> Engine:
    """``mode``'s engine. Auto's captures every length at start-up (``capture_all_graphs``,
    as `graphrt serve` and issue 20's start-up do), unless ``lazy_auto``: then as `graphrt
    generate`, a length when a step first needs it, and a closed batch too short to win a
    capture back (``spec.adaptive.CAPTURE_HORIZON``: every cell here) runs only the longest
    rounds and plain steps. Stop 78's matrix on an H100 ran that way: auto 0.85 of rounds
    of 3 at batch 64, rate 0.5, having never run a round of 3."""
    if mode.endswith(TWO_GRAPHS):  # "4+2g", "auto+2g": that mode, rounds on two graphs
        mode, one_graph = mode.removesuffix(TWO_GRAPHS), False
    if mode == "plain":  # (no rounds: "plain+2g" is plain decoding too)
        return Engine(target, cfg, device)
    steps, adaptive = (MAX_STEPS, True) if mode == "auto" else (int(mode), False)
    if adaptive and not lazy_auto:
        cfg = dataclasses.replace(cfg, capture_all_graphs=True)
    spec = SpecConfig(steps, adaptive=adaptive, one_graph=one_graph)
    strategy = MTPDecoding(drafter, spec, oracle or accept)
    return Engine(target, cfg, device, strategy)


@dataclass
class Subject:
    """A matrix row group: a target and drafter, its prompts and its oracle rates."""

    name: str
    target: object  # LoadedModel
    drafter: object
    prompts_for: Callable[[int], list[list[int]]]  # batch size -> that many prompts
    rates: tuple[float | None, ...] = (None,)  # None: the drafter's own acceptance
    oracle: CoinAcceptance | None = None


def run_model(subject: Subject, args, device, results) -> None:
    """Every mode x batch size (x oracle rate) of one subject; cells into ``results``.

    Every mode's engine is built first, then each cell measures the modes in turn,
    ``--reps`` times, the order reversed each repetition, and keeps each mode's median:
    modes measured one after another drift with the host (the first engine's plain steps
    ran 0.47 ms, the last's 0.36, on one H200 start). HAZARD: every mode's engine and its
    graphs are alive at once; on a smaller device, pass fewer ``--modes`` a run."""
    max_bs = max(args.batch_sizes)
    prompt_len = max(len(p) for p in subject.prompts_for(max_bs))
    tokens = prompt_len + args.tokens + 2 * MAX_STEPS + 8
    cfg = EngineConfig(
        max_running_requests=max_bs,
        max_context_len=tokens,
        kv_pool_tokens=max_bs * tokens,  # (tokens has room for two trees: --overlap)
        overlap=args.overlap,
    )
    if subject.rates != (None,):  # acceptance by coin, in every engine's verify graph
        subject.oracle = CoinAcceptance(accept, device.torch_device())
    engines = {}
    try:
        for mode in args.modes:
            start = time.perf_counter()
            engines[mode] = engine_for(
                mode, subject.target, subject.drafter, device, cfg, subject.oracle,
                one_graph=not args.two_graph, lazy_auto=args.lazy_auto,
            )  # fmt: skip
            print(f"# {subject.name} {mode}: engine built in {time.perf_counter() - start:.1f} s")
        run_cells(subject, engines, args, results)
    finally:  # every mode's engine lives through the subject's cells: their graphs go here
        for engine in engines.values():
            engine.cleanup()
        engines.clear()
        if device.name == "cuda":
            torch.cuda.empty_cache()


def run_cells(subject: Subject, engines: dict[str, Engine], args, results) -> None:
    """Every batch size (x oracle rate) x workload of a subject: the modes in turn,
    ``--reps`` times."""
    for bs in args.batch_sizes:
        for rate, workload in itertools.product(subject.rates, args.workloads):
            if subject.oracle is not None:
                subject.oracle.rate.fill_(rate)
            model = subject.name if rate is None else f"{subject.name}-{rate}"
            cells: dict[str, list[dict]] = {mode: [] for mode in args.modes}
            for rep in range(args.reps):
                order = args.modes if rep % 2 == 0 else args.modes[::-1]
                for mode in order:
                    cell = measure(engines[mode], subject, bs, model, mode, args, workload, rep)
                    cells[mode].append(cell)
            for mode in args.modes:
                cell = median_cell(cells[mode])
                results.append(cell)
                print(json.dumps(cell), flush=True)


def measure(
    engine: Engine,
    subject: Subject,
    bs: int,
    model: str,
    mode: str,
    args,
    workload: str,
    rep: int = 0,
) -> dict:
    """One measurement of one cell: a warm-up generate at this batch size (its graphs,
    auto's first looks), then the timed one, closed or steady (``workload``). An oracle's
    coins restart at block ``rep`` before the timed run: every mode of a repetition meets
    the same coins (stop 78 read a repetition's luck, up to 16% at batch 1, as the
    chooser's)."""
    params = SamplingParams(max_new_tokens=args.tokens, ignore_eos=True)
    warm = SamplingParams(max_new_tokens=16, ignore_eos=True)
    prompts = subject.prompts_for(bs)
    s = engine.stats
    label = f"{model} bs{bs}" + (" steady" if workload == "steady" else "")
    with chooser_trace(engine, args.trace, label + " warm"):
        engine.generate(prompts, warm)
    hist0 = list(s.accept_histogram)
    if subject.oracle is not None:
        subject.oracle.restart(rep)
    run = steady_tokens_per_s if workload == "steady" else generate_tokens_per_s
    with step_timer(engine, bs) as step_ms, chooser_trace(engine, args.trace, label):
        tps = run(engine, prompts, params)
    hist = [n - (hist0[i] if i < len(hist0) else 0) for i, n in enumerate(s.accept_histogram)]
    rounds = sum(hist)
    cell = {
        "model": model,
        "batch_size": bs,
        "workload": workload,
        "mode": mode,
        "tokens_per_s": round(tps, 1),
        "rounds": rounds,
        "accept_length": round(sum((k + 1) * n for k, n in enumerate(hist)) / rounds, 3)
        if rounds
        else None,
    }
    cell["step_ms"] = step_ms  # what a step of each kind took, at the full batch
    if mode.startswith("auto"):
        cell["steps_by_count"] = list(engine.strategy.chooser.steps_by_count)
        cell["why"] = engine.strategy.chooser.explain()
    return cell


def median_cell(measured: list[dict]) -> dict:
    """The measurement of median tokens/s (the lower middle one of an even count), with
    every repetition's tokens/s beside it."""
    ranked = sorted(measured, key=lambda c: c["tokens_per_s"])
    cell = dict(ranked[(len(ranked) - 1) // 2])
    cell["tokens_per_s_reps"] = [c["tokens_per_s"] for c in measured]
    return cell


@contextlib.contextmanager
def step_timer(engine: Engine, batch_size: int) -> Iterator[dict[str, float]]:
    """Times the strategy's decode steps of all ``batch_size`` requests: -> {kind: median
    ms}, kind "plain" or the draft steps of a round, filled on exit. The window the auto
    chooser times (``step_done``: the step and the engine's settling of it), so auto's
    figures and a fixed engine's compare directly; a step launched behind another
    (--overlap) is timed as the engine counts it, from the end of the one before."""
    strategy, times, last = engine.strategy, {}, []
    decode, step_done, launch = strategy.decode, strategy.step_done, strategy.launch

    def timed_decode(reqs):
        outcome = decode(reqs)
        kind = str(outcome.rounds[0].num_steps) if outcome.rounds else "plain"
        last[:] = [kind if len(reqs) == batch_size else None]
        return outcome

    def timed_step_done(seconds):
        step_done(seconds)
        kind = last.pop() if last else None  # the step decode just ran, counted once
        if kind is not None:
            times.setdefault(kind, []).append(seconds)

    def timed_launch(reqs, *fed):
        step = launch(reqs, *fed)
        if step is not None:
            record = step.record

            def timed_record(seconds, outcome):
                if record is not None:
                    record(seconds, outcome)
                if len(reqs) == batch_size:
                    kind = str(outcome.rounds[0].num_steps) if outcome.rounds else "plain"
                    times.setdefault(kind, []).append(seconds)

            step.record = timed_record
        return step

    strategy.decode, strategy.step_done = timed_decode, timed_step_done
    strategy.launch = timed_launch
    medians: dict[str, float] = {}
    try:
        yield medians
    finally:
        del strategy.decode, strategy.step_done, strategy.launch  # the class's again
        medians.update({k: round(statistics.median(v) * 1e3, 3) for k, v in times.items()})


@contextlib.contextmanager
def chooser_trace(engine: Engine, path: str | None, label: str) -> Iterator[None]:
    """With ``path``, appends one JSON line per step the auto chooser records: the cell,
    its batch bucket, draft steps, milliseconds, mean accepted drafts, and the tokens and
    milliseconds by step count it last weighed (to replay its choices off the device)."""
    chooser = getattr(engine.strategy, "chooser", None)
    if path is None or chooser is None:
        yield
        return
    record, lines = chooser.record, []

    def traced(steps, bucket, seconds, accepted=(), timing=False, closed=None):
        record(steps, bucket, seconds, accepted, timing, closed)
        tokens, weighed = (chooser.last or (None, None, None, None))[1:3]
        lines.append(
            {
                "cell": label,
                "bucket": bucket,
                "k": steps,
                "ms": round(seconds * 1e3, 3),
                "accepted": round(sum(n for _, n in accepted) / len(accepted), 3)
                if accepted
                else None,
                "tokens": [round(t, 2) for t in tokens] if tokens else None,
                "weighed_ms": [round(x * 1e3, 3) for x in weighed] if weighed else None,
            }
        )

    chooser.record = traced
    try:
        yield
    finally:
        del chooser.record  # the class's method again
        with open(path, "a") as f:
            f.writelines(json.dumps(line) + "\n" for line in lines)


def table(results: list[dict], modes: list[str]) -> list[str]:
    """Tokens/s per (model, batch, workload) row, by mode; auto's ratio to the best fixed
    mode."""
    rows: dict[tuple[str, int, str], dict[str, dict]] = {}
    for cell in results:
        key = (cell["model"], cell["batch_size"], cell["workload"])
        rows.setdefault(key, {})[cell["mode"]] = cell
    head = (
        f"{'model':<12} {'bs':>3} {'workload':<8} "
        + " ".join(f"{m:>7}" for m in modes)
        + "  auto/best  best"
    )
    lines = [head]
    for (model, bs, workload), cells in rows.items():
        values = {m: cells[m]["tokens_per_s"] for m in modes if m in cells}
        fixed = {m: v for m, v in values.items() if not m.startswith("auto")}
        best = max(fixed, key=fixed.get, default="-")  # none: auto ran alone
        auto = values.get("auto", values.get("auto" + TWO_GRAPHS, 0))
        ratio = auto / fixed[best] if fixed.get(best) else 0
        cols = " ".join(f"{values.get(m, 0):7.0f}" for m in modes)
        lines.append(f"{model:<12} {bs:>3} {workload:<8} {cols}  {ratio:9.2f}  {best}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch-sizes", default="1,8,32,64")
    parser.add_argument(
        "--rates",
        default="0.5,0.7,0.7413,0.9",
        help="the oracle's acceptance a position; at 0.7413 rounds of 4 accept 3 tokens "
        "(1 + r + ... + r^4 = 3: issue 20's 'accept length 3')",
    )
    parser.add_argument("--modes", default="plain,1,2,3,4,5,auto")
    parser.add_argument("--models", default="pair,oracle")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3, help="measurements a cell, per mode")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--oracle-model", default="random:gemma4-e2b")
    parser.add_argument("--oracle-draft", default="random:gemma4-e2b-assistant")
    parser.add_argument("--out", default="spec-matrix.json")
    parser.add_argument("--trace", help="append the auto chooser's steps here (JSON lines)")
    parser.add_argument(
        "--workloads",
        default="closed",
        help="closed (a generate of the batch's prompts), steady (every cell's batch kept "
        "full, each finished request replaced at once, until two requests a slot finished: "
        "decode.steady_tokens_per_s), or both: closed,steady",
    )
    parser.add_argument("--steady", action="store_true", help="--workloads steady")
    parser.add_argument(
        "--overlap",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="launch each step behind the one before, not yet read (EngineConfig.overlap; "
        "default: the device's, on for cuda)",
    )
    parser.add_argument(
        "--two-graph",
        action="store_true",
        help="each round on two graphs, the draft loop's and verify's (default: one graph)",
    )
    parser.add_argument(
        "--lazy-auto",
        action="store_true",
        help="auto's engine captures a length when a step first needs it, as `graphrt "
        "generate` does (default: all at start-up, as `graphrt serve` does)",
    )
    parser.add_argument(
        "--batch-invariant",
        action="store_true",
        help="the targets' batch-invariant kernels: every mode writes the same text in bf16 "
        "(without, the pair's modes wrote different texts at batch 1 on the H200, accept "
        "lengths 2.2 to 3.0 at rounds of 3 to 5, and a cell compared texts, not choices)",
    )
    args = parser.parse_args()
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    args.modes = args.modes.split(",")
    args.workloads = ["steady"] if args.steady else args.workloads.split(",")
    if not set(args.workloads) <= {"closed", "steady"}:
        raise SystemExit(f"--workloads {','.join(args.workloads)}: closed, steady or both")
    device = devices.current(args.device)
    dtype = torch.bfloat16 if device.name == "cuda" else torch.float32
    results: list[dict] = []
    models = args.models.split(",")
    if "pair" in models:
        target = load_model(str(TARGET_DIR), device, dtype, batch_invariant=args.batch_invariant)
        drafter = load_model(str(ASSISTANT_DIR), device, dtype)
        tok = Tokenizer.from_file(str(TARGET_DIR / "tokenizer.json"))
        encoded = [tok.encode(p).ids for p in PAIR_PROMPTS]

        def pair_prompts(bs):
            return [encoded[i % len(encoded)] for i in range(bs)]

        run_model(Subject("pair", target, drafter, pair_prompts), args, device, results)
        del target, drafter
    if "oracle" in models:
        target = load_model(args.oracle_model, device, dtype, batch_invariant=args.batch_invariant)
        drafter = load_model(args.oracle_draft, device, dtype)
        vocab = target.model.vocab_size
        generator = torch.Generator().manual_seed(0)
        pool = torch.randint(
            1, vocab, (max(args.batch_sizes), args.prompt_len), generator=generator
        )

        def oracle_prompts(bs):
            return [row.tolist() for row in pool[:bs]]

        rates = tuple(float(r) for r in args.rates.split(","))
        subject = Subject("oracle", target, drafter, oracle_prompts, rates)
        run_model(subject, args, device, results)
    header = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name() if device.name == "cuda" else platform.processor(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dtype": str(dtype),
        "tokens": args.tokens,
        "prompt_len_oracle": args.prompt_len,
        "workloads": args.workloads,
        "overlap": device.overlap_by_default if args.overlap is None else args.overlap,
        "batch_invariant": args.batch_invariant,
        "two_graph": args.two_graph,
        "lazy_auto": args.lazy_auto,  # auto's lengths captured lazily, not at start-up
        # The host's speed: host-bound cells (the pair, small batches) move with it.
        "host_launch_us": host_launch_us(device.torch_device(), device.synchronize),
    }
    with open(args.out, "w") as f:
        json.dump({**header, "cells": results}, f, indent=1)
    print("\n".join(table(results, args.modes)))


if __name__ == "__main__":
    main()
