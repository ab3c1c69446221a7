"""What auto's chooser is charged for each step, against what the steps cost (issue 20).

Runs the README's first command (`graphrt generate`, the embedded pair) in this process,
as the CLI runs it, and records every step the chooser is told of: its draft steps, the
seconds charged (``DraftChooser.record``), whether start-up timed it, and the host time
of its phases since the step before (the launch of the step behind it, the wait for its
read, settling, choosing). Prints the start-up samples, each kind's charges in use,
the charges by change of kind (round -> plain, plain -> plain, ...) with their phases'
medians in ms, and the wall time a token once 20 steps have run.

Modes: ``auto`` (the default command), ``no-draft``, ``auto-plain`` (start-up times
rounds, every step in use is plain), ``mixed`` (runs of 4 rounds of 5, then 3 plain
steps, over and over: every change of kind many times).

Run: python bench/chooser_trace.py MODE [tokens, default 400] [more generate flags]
"""

from __future__ import annotations

import contextlib
import io
import json
import statistics
import sys
import time
from collections import defaultdict

from graphrt.core.engine import engine as engine_module
from graphrt.core.engine import strategy as core_strategy
from graphrt.core.host import HostRead
from graphrt.spec import adaptive

PROMPT = "def fibonacci(n):"
phase: dict[str, float] = {}  # host seconds by phase since the last recorded step
records: list[tuple[int, float, bool, dict[str, float]]] = []  # steps, ms, start-up?, phases
emits: list[tuple[float, int]] = []  # (time, tokens) of each step's emit


def time_phase(owner, name: str, label: str) -> None:
    original = getattr(owner, name)

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            phase[label] = phase.get(label, 0.0) + time.perf_counter() - start

    setattr(owner, name, timed)


def patch(mode: str) -> None:
    time_phase(engine_module.Engine, "_launch_ahead", "launch")
    time_phase(HostRead, "wait", "wait")
    time_phase(engine_module.Engine, "_apply", "apply")
    time_phase(adaptive.DraftChooser, "choose", "choose")
    time_phase(core_strategy.StepContext, "decode_batch", "decode_batch")
    time_phase(core_strategy.StepContext, "forward", "forward")
    record, emit, choose = (
        adaptive.DraftChooser.record,
        engine_module.Engine._emit,
        adaptive.DraftChooser.choose,
    )

    def recorded(self, steps, bucket, seconds, accepted=(), timing=False, closed=None):
        records.append((steps, seconds * 1e3, timing, {k: v * 1e3 for k, v in phase.items()}))
        phase.clear()
        return record(self, steps, bucket, seconds, accepted, timing, closed)

    def emitted(self, reqs, tokens):
        emits.append((time.perf_counter(), sum(len(t) for t in tokens)))
        return emit(self, reqs, tokens)

    steps_chosen = [0]

    def forced(self, *args, **kwargs):
        choose(self, *args, **kwargs)  # its own work still runs
        steps_chosen[0] += 1
        if mode == "auto-plain":
            return 0
        return 5 if steps_chosen[0] % 7 < 4 else 0

    adaptive.DraftChooser.record = recorded
    engine_module.Engine._emit = emitted
    if mode in ("auto-plain", "mixed"):
        adaptive.DraftChooser.choose = forced


def report(mode: str, stats: dict) -> None:
    spec = stats.get("spec") or {}
    print(
        f"== {mode}: {stats['tokens_per_s']:.0f} tok/s, lazy captures {stats['lazy_capture_s']} s,"
        f" rounds {spec.get('rounds_by_steps')}, accept length {spec.get('accept_length_mean')}"
    )
    print("start-up samples (k, ms):", [(k, round(ms, 3)) for k, ms, t, _ in records if t])
    by_kind = defaultdict(list)
    for k, ms, timing, _ in records:
        if not timing:
            by_kind[k].append(ms)
    for k, times in sorted(by_kind.items()):
        print(
            f"  k={k}: n={len(times)} median {statistics.median(times):.3f} "
            f"min {min(times):.3f} max {max(times):.3f}"
        )
    changes = defaultdict(list)  # (before plain?, this plain?) -> [(ms, phases)]
    for before, (k, ms, timing, phases) in zip(records, records[1:]):
        if not timing:
            phases = {**phases, "own_launch": before[3].get("launch", 0.0)}
            changes[(before[0] == 0, k == 0)].append((ms, phases))
    for (was_plain, is_plain), steps in sorted(changes.items()):
        names = sorted({name for _, phases in steps for name in phases})
        medians = " ".join(
            f"{n} {statistics.median([p.get(n, 0.0) for _, p in steps]):.3f}" for n in names
        )
        kinds = f"{'plain' if was_plain else 'round'} -> {'plain' if is_plain else 'round'}"
        print(
            f"  {kinds} n={len(steps)} charged {statistics.median(m for m, _ in steps):.3f} | {medians}"
        )
    if len(emits) > 30:
        start, end = emits[20][0], emits[-1][0]
        tokens = sum(n for _, n in emits[21:])
        print(f"  wall after 20 steps: {(end - start) * 1e3 / tokens:.3f} ms a token")


def main() -> int:
    mode = sys.argv[1] if len(sys.argv) > 1 else "auto"
    tokens = sys.argv[2] if len(sys.argv) > 2 else "400"
    if mode not in ("auto", "no-draft", "auto-plain", "mixed"):
        raise SystemExit(f"unknown mode {mode!r}: auto, no-draft, auto-plain or mixed")
    patch(mode)
    argv = ["generate", "--prompt", PROMPT, "--max-new-tokens", tokens, "--ignore-eos", "--json"]
    sys.argv = ["graphrt", *argv, *(["--no-draft"] if mode == "no-draft" else []), *sys.argv[3:]]
    from graphrt.core.cli.main import main as cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = cli()
    report(mode, json.loads(out.getvalue())["stats"])
    return rc


if __name__ == "__main__":
    sys.exit(main())
