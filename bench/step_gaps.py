"""How long the device idles between decode steps: each step's tokens read before the next
is launched, against plain steps launched ahead (``EngineConfig(overlap=True)``, --overlap).

Per model and kind of engine (plain decoding; auto draft lengths, the chooser free; or
rounds of a fixed number of draft steps, e.g. ``4``), an engine that reads each step and
one that launches ahead, built alike, generate the same requests in turn, ``reps`` times.
Models that draft: the embedded pair (``pair``, its assistant) and ``random:gemma4-e2b``
(its random assistant: issue 20's table, whose "eager tail" row this measures with
``--kinds 4 --prompt-len 512``); others take plain steps only. Device events recorded around every graph replay (the
backend's ``replay_observer``, as `graphrt bench --draft` times a round's graphs) give the
device's idle time between one step's graph and the next: the host's share of a step that
launching ahead should hide. Reported per engine: decoding tokens/s (median of the reps),
the median and 90th percentile idle between consecutive replays in us, and the idle's
share of the decoding time. On the CPU (no device events) tokens/s only.

    python bench/step_gaps.py [--models pair,random:llama-1b] [--kinds plain,auto,4]
        [--batch-sizes 1,8] [--tokens 200] [--prompt-len N] [--reps 3] [--device cuda]
        [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from tokenizers import Tokenizer

from graphrt import devices
from graphrt.core.bench.rounds import replay_events
from graphrt.core.bench.timing import host_launch_us
from graphrt.core.engine import Engine, EngineConfig, SamplingParams
from graphrt.core.models import load_model
from graphrt.core.pretrained import ASSISTANT_DIR, TARGET_DIR
from graphrt.spec import MTPDecoding, SpecConfig

PROMPT = "def fibonacci(n):"
# Each drafting model's assistant.
DRAFTERS = {"pair": str(ASSISTANT_DIR), "random:gemma4-e2b": "random:gemma4-e2b-assistant"}


def idle_us(events) -> list[float]:
    """Device time between the end of each replay and the start of the next, in us (the
    prefill before the first replay is no such gap)."""
    return [end.elapsed_time(start) * 1e3 for (_, _, end), (_, start, _) in zip(events, events[1:])]


def run(engine: Engine, prompts, params, device) -> dict:
    """One generate; -> decoding tokens/s and the idle gaps between its replays."""
    before = engine.stats.decoding_s, engine.stats.decoded_tokens
    with replay_events(engine.graph_backend, device.torch_device()) as events:
        start = time.perf_counter()
        engine.generate(prompts, params)
        device.synchronize()
        wall = time.perf_counter() - start
        gaps = idle_us(events) if events else []
    seconds = engine.stats.decoding_s - before[0]
    tokens = engine.stats.decoded_tokens - before[1]
    return {"tokens_per_s": tokens / seconds, "gaps_us": gaps, "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="pair,random:llama-1b")
    ap.add_argument("--kinds", default="plain,auto")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument(
        "--prompt-len", type=int, default=None, help="the README's prompt repeated to N tokens"
    )
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = devices.current(args.device)
    dtype = torch.bfloat16 if device.name == "cuda" else torch.float32
    prompt = Tokenizer.from_file(str(TARGET_DIR / "tokenizer.json")).encode(PROMPT).ids
    if args.prompt_len:
        prompt = (prompt * (args.prompt_len // len(prompt) + 1))[: args.prompt_len]
    params = SamplingParams(max_new_tokens=args.tokens, ignore_eos=True)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    rows = []
    for model in args.models.split(","):
        target = load_model(str(TARGET_DIR) if model == "pair" else model, device, dtype)
        drafter = None
        for kind in args.kinds.split(","):
            if kind != "plain" and model not in DRAFTERS:
                continue  # no assistant drafts for it
            if kind != "plain" and drafter is None:
                drafter = load_model(DRAFTERS[model], device, dtype)
            for size in sizes:
                context = len(prompt) + args.tokens + 18  # as bench/spec_matrix.py sizes it
                engines = {}
                for overlap in (False, True):
                    cfg = EngineConfig(
                        max_running_requests=size, max_context_len=context,
                        kv_pool_tokens=size * context, overlap=overlap,
                    )  # fmt: skip
                    strategy = None
                    if kind == "auto":
                        strategy = MTPDecoding(drafter, SpecConfig(5, adaptive=True))
                    elif kind != "plain":  # rounds of that many draft steps
                        strategy = MTPDecoding(drafter, SpecConfig(int(kind)))
                    engines[overlap] = Engine(target, cfg, device, strategy)
                prompts = [prompt] * size
                results = {False: [], True: []}
                for engine in engines.values():
                    run(engine, prompts, params, device)  # warm
                for _ in range(args.reps):
                    for overlap, engine in engines.items():
                        results[overlap].append(run(engine, prompts, params, device))
                for overlap, runs in results.items():
                    gaps = [g for r in runs for g in r["gaps_us"]]
                    tok_s = statistics.median(r["tokens_per_s"] for r in runs)
                    wall = sum(r["wall_s"] for r in runs)
                    rows.append({
                        "model": model, "kind": kind, "batch": size, "overlap": overlap,
                        "tokens_per_s": tok_s,
                        "idle_median_us": statistics.median(gaps) if gaps else None,
                        "idle_p90_us": statistics.quantiles(gaps, n=10)[-1] if len(gaps) > 1 else None,
                        "idle_share": sum(gaps) * 1e-6 / wall if gaps else None,
                        "replays": len(gaps) + len(runs),
                    })  # fmt: skip
                for engine in engines.values():
                    engine.cleanup()
    host = host_launch_us(device.torch_device(), device.synchronize)
    print(
        f"{device.name}, {dtype}, {args.tokens} tokens x {args.reps}; host {host:.2f} us a launch"
    )
    print(f"{'model':<19}{'kind':<6}{'bs':>4} {'launch':<8}{'tok/s':>10}{'x':>7}"
          f"{'idle us':>9}{'p90':>8}{'idle %':>8}")  # fmt: skip
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    for row in rows:
        base = next(
            r for r in rows
            if (r["model"], r["kind"], r["batch"], r["overlap"])
            == (row["model"], row["kind"], row["batch"], False)
        )  # fmt: skip
        share = None if row["idle_share"] is None else 100 * row["idle_share"]
        print(
            f"{row['model']:<19}{row['kind']:<6}{row['batch']:>4} "
            f"{'ahead' if row['overlap'] else 'read':<8}{row['tokens_per_s']:>10.1f}"
            f"{row['tokens_per_s'] / base['tokens_per_s']:>7.2f}"
            f"{fmt(row['idle_median_us'], '9.1f'):>9}{fmt(row['idle_p90_us'], '8.1f'):>8}"
            f"{fmt(share, '8.1f'):>8}"
        )
    if args.out:
        header = {"device": device.describe(), "dtype": str(dtype), "tokens": args.tokens,
                  "reps": args.reps, "host_launch_us": host}  # fmt: skip
        with open(args.out, "w") as f:
            json.dump({**header, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
