"""Summarise a `graphrt serve --step-trace FILE` trace: where the engine loop's time went.

Each pass of the loop is classed as a prefill, a speculative round (of a mean draft
length), a plain decode step, or idle bookkeeping. Reported: the wall time's split
between the kinds, the time waiting for the step lock, handing out events, and between
passes (the loop thread waiting for work or the GIL); per kind, passes, median and p99
step time, requests in the batch and tokens a pass; and the loop thread's CPU share.
Stretches of work apart by more than ``--idle`` seconds (a load test's warm-up and each
client count) are summarised one by one.

    python bench/step_trace.py trace.json [--idle SECONDS] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

SLOWEST = 8  # passes listed by step time
PASS_PARTS = ("t", "lock_s", "step_s", "text_s", "events_s")  # a pass ends at their sum


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank ``q``th percentile (NaN of nothing); bench/serve_load.py's too."""
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))]


def kind(rec: dict) -> str:
    if rec["prefill_s"] > 0:
        return "prefill"
    if rec["rounds"] > 0:
        return "round"
    if rec["eager"] + rec["graph"] > 0:
        return "decode"
    return "other"


def summarise(trace: dict) -> dict:
    # Traces written before text_s was recorded count it in step_s.
    recs = [{"text_s": 0.0, **dict(zip(trace["fields"], p))} for p in trace["passes"]]
    wall = max(recs[-1]["t"] - recs[0]["t"], 1e-9)  # a one-pass stretch: 0
    out = {"passes": len(recs), "wall_s": wall, "kinds": {}}
    busy = {"lock_s": 0.0, "text_s": 0.0, "events_s": 0.0, "gap_s": 0.0}
    for a, b in zip(recs, recs[1:]):
        busy["lock_s"] += a["lock_s"]
        busy["text_s"] += a["text_s"]
        busy["events_s"] += a["events_s"]
        busy["gap_s"] += b["t"] - sum(a[f] for f in PASS_PARTS)
    out.update({k: v / wall for k, v in busy.items()})  # shares of the wall time
    out["cpu_share"] = sum(r["cpu_s"] for r in recs[:-1]) / wall
    for name in ("prefill", "round", "decode", "other"):
        rs = [r for r in recs[:-1] if kind(r) == name]
        if not rs:
            continue
        steps = [r["step_s"] for r in rs]
        entry = {
            "passes": len(rs),
            "share": sum(steps) / wall,
            "step_ms_p50": 1e3 * statistics.median(steps),
            "step_ms_p99": 1e3 * percentile(steps, 99),
            "running_mean": statistics.fmean(r["running"] for r in rs),
            "tokens_mean": statistics.fmean(r["tokens"] for r in rs),
            "events_ms_p50": 1e3 * statistics.median(r["events_s"] for r in rs),
        }
        if name == "round":
            entry["draft_steps_mean"] = sum(r["drafted"] for r in rs) / sum(r["rounds"] for r in rs)
        out["kinds"][name] = entry
    out["tokens_per_s"] = sum(r["tokens"] for r in recs[:-1]) / wall
    slow = sorted(recs, key=lambda r: -r["step_s"])[:SLOWEST]
    out["slowest"] = [{"kind": kind(r), **r} for r in sorted(slow, key=lambda r: r["t"])]
    return out


def segments(trace: dict, idle_s: float) -> list[dict]:
    """The trace cut where the loop idled longer than ``idle_s`` (a load test's client
    counts, run one after another, come apart)."""
    out, start = [], 0
    passes = trace["passes"]
    at = {name: i for i, name in enumerate(trace["fields"])}
    ends = [sum(p[at[f]] for f in PASS_PARTS if f in at) for p in passes]
    for i in range(1, len(passes) + 1):
        if i == len(passes) or passes[i][0] - ends[i - 1] > idle_s:
            out.append({"fields": trace["fields"], "passes": passes[start:i]})
            start = i
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument(
        "--idle", type=float, default=1.0, help="cut the trace where the loop idled this long"
    )
    ap.add_argument("--min-passes", type=int, default=20, help="skip shorter pieces")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with open(args.trace) as f:
        pieces = [
            p for p in segments(json.load(f), args.idle) if len(p["passes"]) >= args.min_passes
        ]
    if not pieces:
        sys.exit("step_trace: no stretch of passes in the trace")
    summaries = [summarise(p) for p in pieces]
    if args.json:
        print(json.dumps(summaries, indent=1))
        return
    for i, s in enumerate(summaries):
        print(f"\nstretch {i + 1} of {len(summaries)}:")
        show(s)


def show(s: dict) -> None:
    print(
        f"{s['passes']} passes over {s['wall_s']:.2f} s, {s['tokens_per_s']:.0f} tok/s; "
        f"lock wait {s['lock_s']:.1%}, text {s['text_s']:.1%}, events {s['events_s']:.1%}, "
        f"between passes "
        f"{s['gap_s']:.1%}; loop thread on a CPU {s['cpu_share']:.1%} of the wall"
    )
    print(
        "| kind | passes | wall share | step p50 ms | step p99 ms | running | tokens a pass "
        "| events p50 ms | draft steps |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, e in s["kinds"].items():
        print(
            f"| {name} | {e['passes']} | {e['share']:.1%} | {e['step_ms_p50']:.2f} | "
            f"{e['step_ms_p99']:.2f} | {e['running_mean']:.1f} | {e['tokens_mean']:.1f} | "
            f"{e['events_ms_p50']:.2f} | {e.get('draft_steps_mean', 0):.2f} |"
        )
    print("slowest passes: " + "; ".join(
        f"{r['kind']} {1e3 * r['step_s']:.1f} ms at {r['t']:.2f} s (running {r['running']}, "
        f"waiting {r['waiting']}, cpu {1e3 * r['cpu_s']:.0f} ms)" for r in s["slowest"]
    ))  # fmt: skip


if __name__ == "__main__":
    main()
