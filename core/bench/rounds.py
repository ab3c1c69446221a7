"""Speculative-round benchmark (`graphrt bench --draft`): the pieces of a round, side by side.

Per request batch size, on one target and a drafting strategy: a plain decode step, as
its graph's execute alone and as a whole engine step timed as a round is (a round over
that step is the accept length at which drafting breaks even), every piece the strategy
names (``DecodeStrategy.bench_pieces``; frozen-KV MTP with two graphs a round: the draft
loop and the verify forward; with one, none) on graphs and eagerly, a whole round, the
accept length those rounds reached, tokens/s with and without the drafter, and the
tokens/s the measured round time would give at every accept length (round time does not
depend on acceptance). Between the graphs of a two-graph round the device may idle while
the host prepares the next: device events recorded around every replay (the backend's
``replay_observer``) time that gap (0 with one graph a round).

The strategy offers its pieces through core's protocol, as it offers its rounds to the
engine, so this bench imports nothing from spec/: the CLI, the composition root, builds
the strategy (core/cli/bench.py).
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from functools import partial
from statistics import median

import torch

from graphrt.core.bench.decode import prefilled
from graphrt.core.bench.output import fmt
from graphrt.core.bench.timing import median_ms
from graphrt.core.engine import Engine, EngineConfig, SamplingParams
from graphrt.core.engine.strategy import DecodeStrategy
from graphrt.core.models.loader import LoadedModel
from graphrt.core.runners.backend import ExecutionBackend


@dataclass(frozen=True)
class RoundBenchConfig:
    batch_sizes: tuple[int, ...] = (1, 8, 32)
    prompt_len: int = 512
    steps: int = 30  # timed calls per measurement (eager ones: a third)
    warmup: int = 3
    seed: int = 0
    max_context_len: int | None = None  # as DecodeBenchConfig's


@dataclass
class RoundBatchResult:
    batch_size: int
    decode_ms: float | None = None  # the decode graph's execute: inputs, replay, output
    # A plain engine step, timed as a round is (launch, the read, the host's bookkeeping).
    decode_step_ms: float | None = None
    # Per piece of the strategy: "<name>" on graphs, "<name>_eager" (JSON: "<key>_ms").
    pieces_ms: dict[str, float | None] = field(default_factory=dict)
    round_ms: float | None = None
    graph_gap_ms: float | None = None  # device idle between a round's graphs (one: 0)
    break_even_accept_length: float | None = None  # round_ms / decode_step_ms
    accept_length_mean: float | None = None
    spec_tokens_per_s: float | None = None
    decode_tokens_per_s: float | None = None
    tokens_per_s_at_accept_length: list[float] = field(default_factory=list)  # [L - 1]: L
    hf_assisted_tokens_per_s: float | None = None

    def to_json(self) -> dict:
        """Flat, the pieces after the decode step: ``draft_ms``, ``draft_eager_ms``, ..."""
        out = asdict(self)
        pieces = {f"{key}_ms": ms for key, ms in out.pop("pieces_ms").items()}
        first = {key: out.pop(key) for key in ("batch_size", "decode_ms")}
        return {**first, **pieces, **out}


def round_engines(
    target: LoadedModel, strategy: DecodeStrategy, device, cfg: RoundBenchConfig
) -> tuple[Engine, Engine]:
    """(engine decoding with ``strategy``, plain engine) over one target, graphs at the
    batch sizes, the context long enough for every timed round."""
    max_bs = max(cfg.batch_sizes)
    needed = cfg.prompt_len + (cfg.warmup + cfg.steps + 4) * _tokens_per_round(strategy) + 8
    config = EngineConfig(
        max_running_requests=max_bs,
        max_context_len=max(needed, cfg.max_context_len or 0),
        kv_pool_tokens=max_bs * (needed + strategy.extra_kv_slots()),
        seed=cfg.seed,
        runner="graph",
        graph_buckets=tuple(cfg.batch_sizes),
        # Each step read before the next is launched: a round timed as a caller sees it
        # (the bench's method), not overlapped with the next one's launch.
        overlap=False,
    )
    return Engine(target, config, device, strategy), Engine(target, config, device)


def _tokens_per_round(strategy: DecodeStrategy) -> int:
    # A round emits its accepted path, root included: at most the tree's nodes, which
    # are the slots it holds beyond the request's own.
    return max(1, strategy.extra_kv_slots())


def run_round_bench(
    round_engine: Engine,
    plain_engine: Engine,
    cfg: RoundBenchConfig,
    sync: Callable[[], None],
    hf_peer: Callable[[], float] | None = None,
    report=print,
) -> list[RoundBatchResult]:
    rng = random.Random(cfg.seed)
    vocab = round_engine.loaded.model.vocab_size
    results = []
    for bs in cfg.batch_sizes:
        result = RoundBatchResult(batch_size=bs)
        prompts = [[rng.randrange(vocab) for _ in range(cfg.prompt_len)] for _ in range(bs)]
        result.decode_ms, result.decode_step_ms = _decode_times(plain_engine, prompts, cfg, sync)
        _time_round(round_engine, prompts, cfg, sync, result, report)
        result.break_even_accept_length = result.round_ms / result.decode_step_ms
        result.decode_tokens_per_s = bs / result.decode_step_ms * 1e3
        result.spec_tokens_per_s = bs * result.accept_length_mean / result.round_ms * 1e3
        report(
            f"{bs:>4} decode {result.decode_ms:.3f} ms, step {result.decode_step_ms:.3f} ms | "
            + "".join(f"{k} {fmt(ms)} | " for k, ms in result.pieces_ms.items())
            + f"round {result.round_ms:.3f} ms, gap {fmt(result.graph_gap_ms)} ms"
            f" | accept {result.accept_length_mean:.2f}"
        )
        results.append(result)
    if hf_peer is not None and 1 in cfg.batch_sizes:  # assisted generation takes batch 1 only
        try:
            tokens_per_s = hf_peer()
        except Exception as e:  # the peer is a comparison: its failure loses no result
            report(f"transformers assisted-generation peer failed: {type(e).__name__}: {e}")
        else:
            next(r for r in results if r.batch_size == 1).hf_assisted_tokens_per_s = tokens_per_s
            report(f"   1 transformers assisted generation: {tokens_per_s:.2f} tokens/s")
    return results


def _requests(engine: Engine, prompts: list[list[int]], max_new_tokens: int):
    return prefilled(
        engine, prompts, SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    )


def _decode_times(engine: Engine, prompts, cfg: RoundBenchConfig, sync) -> tuple[float, float]:
    """(the decode graph's execute, a whole plain engine step) in ms."""
    reqs = _requests(engine, prompts, cfg.warmup + cfg.steps + 4)
    batch = engine.build_decode_batch(reqs)
    runner = engine.graph_runner
    assert runner is not None and runner.can_run_graph(batch), "no decode graph fits"
    # The same batch over and over: its KV slots written again, its requests not moved on.
    execute_ms = median_ms(lambda: runner.execute(batch), sync, cfg.steps, cfg.warmup)
    step_ms = median_ms(engine.step, sync, cfg.steps, cfg.warmup)
    for req in reqs:
        engine.abort(req)
    return execute_ms, step_ms


def _time_round(engine: Engine, prompts, cfg, sync, result: RoundBatchResult, report) -> None:
    rounds = cfg.warmup + cfg.steps
    reqs = _requests(engine, prompts, rounds * _tokens_per_round(engine.strategy) + 1)
    eager_steps = max(3, cfg.steps // 3)
    with engine.strategy.bench_pieces(reqs) as pieces:
        for name, run in pieces.items():
            ms = None
            if run(True):  # a graph fits (this call warms it up too)
                ms = median_ms(partial(run, True), sync, cfg.steps, cfg.warmup)
            else:
                report(f"batch {len(reqs)}: no {name} graph fits; its graph timing skipped")
            result.pieces_ms[name] = ms
            eager = median_ms(partial(run, False), sync, eager_steps, cfg.warmup)
            result.pieces_ms[f"{name}_eager"] = eager
    # Whole rounds, each advancing every request; replays timed with events.
    stats = engine.stats
    rounds0, hist0 = stats.spec_rounds, list(stats.accept_histogram)
    replays = []
    with replay_events(engine.graph_backend, engine.torch_device) as events:

        def one_round():
            if events is not None:
                events.clear()
            engine.step()
            replays.append(list(events or ()))

        result.round_ms = median_ms(one_round, sync, cfg.steps, cfg.warmup)
    timed = [gap_ms(e) for e in replays[-cfg.steps :] if e]  # events complete: synced
    result.graph_gap_ms = median(timed) if timed else None
    hist = list(stats.accept_histogram)
    if hist0:
        hist = [n - m for n, m in zip(hist, hist0)]
    counted = stats.spec_rounds - rounds0
    result.accept_length_mean = sum((k + 1) * n for k, n in enumerate(hist)) / counted
    # Unrounded (the JSON and the plot keep them whole): tables round when they print.
    result.tokens_per_s_at_accept_length = [
        len(reqs) * length / result.round_ms * 1e3 for length in range(1, len(hist) + 1)
    ]
    for req in reqs:
        engine.abort(req)


@contextlib.contextmanager
def replay_events(backend: ExecutionBackend, device: torch.device) -> Iterator[list | None]:
    """Device events recorded right before and after every replay of ``backend``'s graphs,
    as (key, start, end), through its ``replay_observer``; None on a device without events
    (the CPU)."""
    try:
        torch.Event(device=device, enable_timing=True).record()
    except RuntimeError:
        yield None
        return
    events: list = []

    @contextlib.contextmanager
    def record(key):
        start = torch.Event(device=device, enable_timing=True)
        end = torch.Event(device=device, enable_timing=True)
        start.record()
        yield
        end.record()
        events.append((key, start, end))

    backend.replay_observer = record
    try:
        yield events
    finally:
        backend.replay_observer = None


def gap_ms(events) -> float:
    """Device time between the end of one replayed graph and the start of the next."""
    pairs = zip(events, events[1:])
    return sum(end.elapsed_time(start) for (_, _, end), (_, start, _) in pairs)


def result_json(results: list[RoundBatchResult], **header) -> dict:
    return {**header, "batches": [r.to_json() for r in results]}


def table(results: list[RoundBatchResult]) -> list[str]:
    """The results as lines of a table: header first."""
    pieces = list(results[0].pieces_ms)
    head = f"{'bs':>4} {'decode':>8} {'step':>8} "
    head += " ".join(f"{p.replace('_', ' '):>12}" for p in pieces)
    head += f" {'round':>8} {'gap':>6} {'even at':>7} {'accept':>6} {'spec tok/s':>10}"
    head += f" {'decode tok/s':>12}"
    lines = [head + f" {'hf tok/s':>8}"]
    for r in results:
        lines.append(
            f"{r.batch_size:>4} {fmt(r.decode_ms):>8} {fmt(r.decode_step_ms):>8} "
            + " ".join(f"{fmt(r.pieces_ms[p]):>12}" for p in pieces)
            + f" {fmt(r.round_ms):>8} {fmt(r.graph_gap_ms):>6} "
            f"{fmt(r.break_even_accept_length, '.2f'):>7} "
            f"{fmt(r.accept_length_mean, '.2f'):>6} {fmt(r.spec_tokens_per_s, '.1f'):>10} "
            f"{fmt(r.decode_tokens_per_s, '.1f'):>12} {fmt(r.hf_assisted_tokens_per_s, '.2f'):>8}"
        )
    return lines
