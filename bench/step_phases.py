"""Where a decode step's or round's host time goes: plain, auto and fixed-length engines.

The embedded pair, one request, in a plain engine, an auto engine, and one forced to
rounds of 4 draft steps (engines sized as bench/spec_matrix.py sizes them). Each
engine decodes ``tokens`` tokens ``reps`` times, engines in turn; per step, the host
time of each phase (the decode batch, the forward's launch, sampling with its one read,
the engine's settling, the strategy's bookkeeping) and the whole step, medians in us.
With PROFILE=1, then the host operators of 20 steps of each.

Run: python bench/step_phases.py [tokens, default 128] [device, default cuda] [reps, 3]
[slots: request slots of the engines, default 1,64]; env BATCH: requests a run (default 1);
ENGINES: plain, plain-seeds (a plain engine whose graph writes auto's seeds), round4,
auto, auto-plain (auto forced to plain steps), auto-plain-nogc (and no collections);
TWO_GRAPH=1: drafting engines run each round on two graphs (the draft loop's and
verify's), not one (spec.round_graph); a kind with the suffix "+2g" (round4+2g, auto+2g)
does alone, beside the one-graph kinds
"""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
import sys
import time
from collections import defaultdict

import torch
from tokenizers import Tokenizer

from graphrt import devices
from graphrt.core.bench.timing import host_launch_us
from graphrt.core.engine import Engine, EngineConfig, SamplingParams
from graphrt.core.engine import strategy as strategy_module
from graphrt.core.engine.strategy import PlainDecode
from graphrt.core.host import HostRead
from graphrt.core.models import load_model
from graphrt.core.pretrained import ASSISTANT_DIR, TARGET_DIR
from graphrt.spec import MTPDecoding, SpecConfig
from graphrt.spec import strategy as spec_strategy_module

PROMPT = "def fibonacci(n):"


@contextlib.contextmanager
def phases(engine: Engine):
    """Times the phases of ``engine``'s decode steps: -> {step kind: {phase: [seconds]}},
    the kind "plain" or "round <draft steps>"."""
    times: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    step: dict[str, float] = {}
    saved = []

    def wrap(owner, name, label):
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                result = original(*args, **kwargs)
            finally:
                step[label] = step.get(label, 0.0) + time.perf_counter() - start
            if label == "strategy.decode":
                step["kind"] = f"round {result.rounds[0].num_steps}" if result.rounds else "plain"
            if label == "whole step" and "kind" in step:
                kind = step.pop("kind")
                for key, value in step.items():
                    times[kind][key].append(value)
            if label in ("whole step", "prefill"):
                step.clear()
            return result

        saved.append((owner, name, original))
        setattr(owner, name, timed)

    ctx = engine.ctx
    wrap(type(ctx), "decode_batch", "decode_batch")
    wrap(type(ctx), "forward", "forward")
    wrap(strategy_module, "draw_tokens", "sample")
    wrap(HostRead, "wait", "read")
    wrap(engine, "_apply", "apply")
    wrap(engine, "_emit", "emit")
    wrap(engine.strategy, "decode", "strategy.decode")
    wrap(engine.strategy, "step_done", "step_done")
    wrap(engine, "_capture_needed", "capture_needed(plan)")
    if isinstance(engine.strategy, MTPDecoding):  # a round's pieces
        for name in ("round_inputs", "one_graph_round", "draft", "verify", "settle"):
            wrap(engine.strategy, name, f"round.{name}")
        wrap(engine.ledger, "hold", "round.hold")
        wrap(spec_strategy_module, "read_host", "round.read_host")
        if engine.strategy.plain.graph_runner is not None:
            wrap(type(engine.strategy.plain.graph_runner), "execute", "graph.execute")
    wrap(engine, "_decode_step", "whole step")
    try:
        yield times
    finally:
        for owner, name, original in reversed(saved):
            if owner in (engine, engine.strategy, engine.ledger):
                delattr(owner, name)
            else:
                setattr(owner, name, original)


def main() -> None:
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 128
    device = devices.current(sys.argv[2] if len(sys.argv) > 2 else "cuda")
    reps = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    slots = [int(s) for s in (sys.argv[4] if len(sys.argv) > 4 else "1,64").split(",")]
    dtype = torch.bfloat16 if device.name == "cuda" else torch.float32
    target = load_model(str(TARGET_DIR), device, dtype)
    drafter = load_model(str(ASSISTANT_DIR), device, dtype)
    prompt = Tokenizer.from_file(str(TARGET_DIR / "tokenizer.json")).encode(PROMPT).ids
    batch = int(os.environ.get("BATCH", "1"))  # requests a generate (<= the slots)
    kinds = os.environ.get("ENGINES", "plain,round4,auto").split(",")
    engines = {}
    for n in slots:
        # As bench/spec_matrix.py builds them: the context and pool sized to the work.
        context = len(prompt) + tokens + 18
        cfg = EngineConfig(
            max_running_requests=n, max_context_len=context, kv_pool_tokens=n * context
        )
        for kind in kinds:
            if kind == "plain":
                strategy = None
            elif kind == "plain-seeds":  # a plain engine whose graph writes seeds as auto's
                table = torch.zeros(n + 1, target.model.config.hidden_size, dtype=dtype)
                table = table.to(device.torch_device())

                def write_seeds(batch_, out, table=table):
                    table[batch_.req_pool_indices] = out.hidden.to(table.dtype)

                strategy = PlainDecode(after_forward=write_seeds)
            else:  # round4, auto, auto-plain, auto-plain-nogc
                one_graph = os.environ.get("TWO_GRAPH") != "1" and not kind.endswith("+2g")
                spec = SpecConfig(5, adaptive=True, one_graph=one_graph)
                strategy = MTPDecoding(drafter, spec)
            engines[f"{kind}/{n}"] = Engine(target, cfg, device, strategy)
    params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    prompts = [prompt] * batch
    for name, engine in engines.items():
        engine.generate(prompts, params)  # warm (the auto engines draft as they choose)
        if name.startswith("round4"):
            engine.strategy.force_step(4)  # rounds of 4 from here on
        if name.startswith("auto-plain"):
            engine.strategy.force_step(0)  # plain steps in a drafting engine
    results: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for _ in range(reps):
        for name, engine in engines.items():
            collecting = gc.isenabled()
            if "nogc" in name:
                gc.disable()
            with phases(engine) as times:
                engine.generate(prompts, params)
            if collecting:
                gc.enable()
            for kind, by_phase in times.items():
                for label, values in by_phase.items():
                    results[f"{name} {kind}"][label] += values
    columns = sorted(results)
    labels = list(dict.fromkeys(label for c in columns for label in results[c]))
    host = host_launch_us(device.torch_device(), device.synchronize)
    print(
        f"{device.name}, {dtype}, {tokens} tokens x {reps}: median us a decode step (steps); "
        f"host {host:.2f} us a launch"
    )
    print(f"{'phase':<22}" + "".join(f"{c:>20}" for c in columns))
    for label in labels + ["steps"]:
        cells = [results[c].get(label if label != "steps" else "whole step") for c in columns]
        if label == "steps":
            row = "".join(f"{len(c):20d}" for c in cells)
        else:
            row = "".join(
                f"{statistics.median(c) * 1e6:20.1f}" if c else f"{'-':>20}" for c in cells
            )
        print(f"{label:<22}{row}")
    if os.environ.get("PROFILE") == "1" and device.name == "cuda":
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        for name, engine in engines.items():
            with torch.profiler.profile(activities=acts) as prof:
                engine.generate(prompts, SamplingParams(max_new_tokens=21, ignore_eos=True))
                torch.cuda.synchronize()
            print(f"---- {name}: host operators over 20 steps")
            print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=45))


if __name__ == "__main__":
    main()
