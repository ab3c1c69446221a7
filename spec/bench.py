"""Speculative-decoding benchmark: the pieces of a frozen-KV MTP round, side by side.

Per request batch size, on one target and its assistant: a plain decode step
(graph), the draft loop and the verify forward (graph and eager), a whole
round, the accept length those rounds reached, tokens/s with and without the
drafter, and the tokens/s the measured round time would give at every accept
length (round time does not depend on acceptance). Between the graphs of a
round the device may idle while the host prepares the next: the bench times
that gap with events around every replay. The peer is transformers' assisted
generation (``generate(..., assistant_model=...)``) on the same weights.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from statistics import median

import torch

from graphrt.core.bench.timing import median_ms
from graphrt.core.engine import Engine, EngineConfig, SamplingParams
from graphrt.core.models.loader import LoadedModel
from graphrt.devices.base import Device
from graphrt.spec.config import SpecConfig
from graphrt.spec.strategy import MTPDecoding


@dataclass(frozen=True)
class SpecBenchConfig:
    batch_sizes: tuple[int, ...] = (1, 8, 32)
    prompt_len: int = 512
    steps: int = 30  # timed calls per measurement (eager ones: a third)
    warmup: int = 3
    seed: int = 0


@dataclass
class SpecBatchResult:
    batch_size: int
    decode_ms: float | None = None
    draft_ms: float | None = None
    draft_eager_ms: float | None = None
    verify_ms: float | None = None
    verify_eager_ms: float | None = None
    round_ms: float | None = None
    graph_gap_ms: float | None = None  # device idle between the draft and the verify graph
    accept_length_mean: float | None = None
    spec_tokens_per_s: float | None = None
    decode_tokens_per_s: float | None = None
    tokens_per_s_at_accept_length: list[float] = field(default_factory=list)  # [L - 1]: L
    hf_assisted_tokens_per_s: float | None = None


def bench_engines(
    target: LoadedModel, drafter: LoadedModel, device: Device, spec: SpecConfig, cfg
) -> tuple[Engine, Engine]:
    """(speculative engine, plain engine) over one target, graphs at the batch sizes."""
    max_bs = max(cfg.batch_sizes)
    rounds = cfg.warmup + cfg.steps + 4
    context = cfg.prompt_len + rounds * (spec.num_steps + 1) + 8
    config = EngineConfig(
        max_running_requests=max_bs,
        max_context_len=context,
        kv_pool_tokens=max_bs * (context + spec.num_draft_tokens),
        seed=cfg.seed,
        runner="graph",
        graph_buckets=tuple(cfg.batch_sizes),
    )
    return Engine(target, config, device, MTPDecoding(drafter, spec)), Engine(
        target, config, device
    )


def run_spec_bench(
    spec_engine: Engine,
    plain_engine: Engine,
    cfg: SpecBenchConfig,
    sync: Callable[[], None],
    hf_peer: Callable[[], object] | None = None,
    report=print,
) -> list[SpecBatchResult]:
    rng = random.Random(cfg.seed)
    vocab = spec_engine.loaded.model.vocab_size
    results = []
    for bs in cfg.batch_sizes:
        result = SpecBatchResult(batch_size=bs)
        prompts = [[rng.randrange(vocab) for _ in range(cfg.prompt_len)] for _ in range(bs)]
        result.decode_ms = _decode_ms(plain_engine, prompts, cfg, sync)
        _time_round_pieces(spec_engine, prompts, cfg, sync, result)
        steps = spec_engine.strategy.cfg.num_steps
        result.decode_tokens_per_s = bs / result.decode_ms * 1e3
        result.spec_tokens_per_s = bs * result.accept_length_mean / result.round_ms * 1e3
        result.tokens_per_s_at_accept_length = [
            round(bs * length / result.round_ms * 1e3, 1) for length in range(1, steps + 2)
        ]
        report(
            f"{bs:>4} decode {result.decode_ms:.3f} ms | draft {result.draft_ms:.3f} "
            f"(eager {result.draft_eager_ms:.2f}) | verify {result.verify_ms:.3f} (eager "
            f"{result.verify_eager_ms:.2f}) | round {result.round_ms:.3f} ms, gap "
            f"{result.graph_gap_ms or 0:.3f} ms | accept {result.accept_length_mean:.2f}"
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
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    reqs = [engine.add_request(p, params) for p in prompts]
    while engine.waiting:  # prefill every request (in as many steps as it takes)
        engine.step()
    return reqs


def _decode_ms(engine: Engine, prompts, cfg: SpecBenchConfig, sync) -> float:
    reqs = _requests(engine, prompts, cfg.warmup + cfg.steps + 4)
    batch = engine.build_decode_batch(reqs)
    runner = engine.graph_runner
    assert runner is not None and runner.can_run_graph(batch), "no decode graph fits"
    ms = median_ms(lambda: runner.execute(batch), sync, cfg.steps, cfg.warmup)
    for req in reqs:
        engine.abort(req)
    return ms


def _time_round_pieces(engine: Engine, prompts, cfg, sync, result: SpecBatchResult) -> None:
    strategy: MTPDecoding = engine.strategy
    rounds = cfg.warmup + cfg.steps
    reqs = _requests(engine, prompts, rounds * (strategy.cfg.num_steps + 1) + 1)
    inputs = strategy.round_inputs(reqs)
    eager_steps = max(3, cfg.steps // 3)
    for graphs, name in ((True, "draft_ms"), (False, "draft_eager_ms")):
        steps = cfg.steps if graphs else eager_steps
        ms = median_ms(lambda g=graphs: strategy.draft(inputs, g), sync, steps, cfg.warmup)
        setattr(result, name, ms)
    tree, on_graph = strategy.draft(inputs)
    assert on_graph, f"no draft-loop graph for batch {len(reqs)}"
    locs_host = engine.kv_pool.alloc_host(len(reqs) * tree.num_nodes)
    locs = locs_host.to(engine.torch_device)
    for graphs, name in ((True, "verify_ms"), (False, "verify_eager_ms")):
        steps = cfg.steps if graphs else eager_steps
        ms = median_ms(lambda g=graphs: strategy.verify(inputs, tree, locs, g), sync, steps, 1)
        setattr(result, name, ms)
    engine.kv_pool.free(locs_host)
    # Whole rounds, each advancing every request; replays timed with events.
    rounds0 = engine.stats.spec_rounds
    hist0 = list(engine.stats.accept_histogram) or [0] * (strategy.cfg.num_steps + 1)
    gaps = []
    with _replay_events(engine) as events:

        def one_round():
            events.clear()
            engine.step()
            gaps.append(list(events))

        result.round_ms = median_ms(one_round, sync, cfg.steps, cfg.warmup)
    timed = [_gap_ms(e) for e in gaps[-cfg.steps :] if e]
    result.graph_gap_ms = median(timed) if timed else None
    hist = [n - m for n, m in zip(engine.stats.accept_histogram, hist0)]
    counted = engine.stats.spec_rounds - rounds0
    result.accept_length_mean = sum((k + 1) * n for k, n in enumerate(hist)) / counted
    for req in reqs:
        engine.abort(req)


class _replay_events:
    """Events recorded on the device right before and after every graph replay."""

    def __init__(self, engine: Engine):
        self.backend = engine.graph_backend
        self.device = engine.torch_device

    def __enter__(self) -> list:
        events: list = []
        try:
            torch.Event(device=self.device, enable_timing=True).record()
        except RuntimeError:  # a device without events (the CPU): no gaps to report
            self.backend = None
            return events
        replay = self.backend.replay

        def timed(key):
            start = torch.Event(device=self.device, enable_timing=True)
            end = torch.Event(device=self.device, enable_timing=True)
            start.record()
            out = replay(key)
            end.record()
            events.append((key, start, end))
            return out

        self.backend.replay = timed
        self.events = events
        return events

    def __exit__(self, *exc) -> None:
        if self.backend is not None:
            del self.backend.replay


def _gap_ms(events) -> float:
    """Device time between the end of one replayed graph and the start of the next."""
    pairs = zip(events, events[1:])
    return sum(end.elapsed_time(start) for (_, _, end), (_, start, _) in pairs)


def hf_assisted_tokens_per_s(
    target_cfg: dict, target: LoadedModel, draft_cfg: dict, drafter: LoadedModel,
    spec: SpecConfig, prompt_len: int, new_tokens: int, device: torch.device, sync,
) -> float:  # fmt: skip
    """transformers' assisted generation (batch 1, greedy) on graphrt's weights: tokens/s."""
    from graphrt.core.bench.peer_hf import build_hf_model

    dtype = next(target.model.parameters()).dtype
    hf_target, _ = build_hf_model(target_cfg, target.model, device, dtype)
    hf_draft, _ = build_hf_model(draft_cfg, drafter.model, device, dtype)
    hf_draft.generation_config.num_assistant_tokens = spec.num_steps
    hf_draft.generation_config.num_assistant_tokens_schedule = "constant"
    ids = torch.randint(0, target.model.vocab_size, (1, prompt_len), device=device)
    kwargs = dict(
        assistant_model=hf_draft,
        do_sample=False,
        min_new_tokens=new_tokens,
        attention_mask=torch.ones_like(ids),
        pad_token_id=0,
    )
    with torch.no_grad():
        hf_target.generate(ids, max_new_tokens=4, **{**kwargs, "min_new_tokens": 4})  # warm-up
        sync()
        start = time.perf_counter()
        out = hf_target.generate(ids, max_new_tokens=new_tokens, **kwargs)
        sync()
    return (out.shape[1] - prompt_len) / (time.perf_counter() - start)


def result_json(results: list[SpecBatchResult], **header) -> dict:
    return {**header, "batches": [asdict(r) for r in results]}
