"""The differential driver (issue 10, item 6): one seeded random schedule served in
lockstep by several engines, every request's tokens compared after every step.

A schedule has arrivals at random steps (bursts and lulls), random prompt lengths and
max_new_tokens, greedy and seeded sampled requests, eos stops and requests that run into
the context's end. Mismatches are counted, not fatal; the first few are kept with the
seed, step and request that reproduce them, and for greedy requests the reference's
top-2 logit gap where they diverged (a gap near float rounding is a near-tie). Used by
tests/test_differential.py (bounded, CPU) and tests/soak.py (10,000 steps, H200).
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from graphrt.core.engine import Engine, EngineConfig, Request, SamplingParams
from graphrt.core.models.loader import LoadedModel

# Concurrency a phase of the schedule aims at, as a fraction of max_running: lulls that
# drain the engine to idle, single requests, partial and full batches, and overload.
PHASE_LOADS = (0.0, 0.1, 0.3, 0.6, 1.0, 1.5)
# A greedy mismatch where the reference's top-2 logits lie closer than this is a near-tie:
# kernels that round differently (another GEMM for a padded batch) may pick either token.
NEAR_TIE = 1e-4


# ---- the schedule ------------------------------------------------------------------


@dataclass(frozen=True)
class ScheduleConfig:
    seed: int = 0
    vocab: int = 512
    max_context_len: int = 128
    max_running: int = 8  # the engines' request cap: phases load between 0 and 1.5x it
    prompt_len: tuple[int, int] = (1, 24)  # inclusive ranges
    new_tokens: tuple[int, int] = (1, 24)
    sampled: float = 0.5  # fraction of requests sampled (each with its own seed)
    honor_eos: float = 0.5  # fraction that stop at an eos token (the rest ignore_eos)
    to_context: float = 0.03  # fraction asking for more tokens than the context holds
    burst: float = 0.2  # chance that a phase opens with a burst (2 to max_running requests)
    phase_steps: int = 12
    num_requests: int | None = None  # stop arriving after this many (None: no limit)


class Schedule:
    """Seeded arrivals, drawn step by step from the seed alone (never from an engine's
    state), so every engine in a run and every rerun of a seed gets the same requests."""

    def __init__(self, cfg: ScheduleConfig):
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.added = 0
        self._rate = 0.0
        # Little's law: arrivals per step = concurrency / steps a request stays. It stays
        # its tokens (requests run to the context's end weigh in), plus the prefill steps
        # that interleave with decoding (about half as many again).
        new = sum(cfg.new_tokens) / 2 * (1 - cfg.to_context)
        new += cfg.to_context * (cfg.max_context_len - sum(cfg.prompt_len) / 2)
        self._rate_per_load = cfg.max_running / (1.5 * new)

    def arrivals(self, step: int) -> list[tuple[list[int], SamplingParams]]:
        cfg, rng = self.cfg, self.rng
        count = 0
        if step % cfg.phase_steps == 0:
            self._rate = rng.choice(PHASE_LOADS) * self._rate_per_load
            count += rng.randint(2, cfg.max_running) if rng.random() < cfg.burst else 0
        count += _poisson(rng, self._rate)
        if cfg.num_requests is not None:
            count = min(count, cfg.num_requests - self.added)
        self.added += count
        return [self._request() for _ in range(count)]

    @property
    def exhausted(self) -> bool:
        return self.cfg.num_requests is not None and self.added >= self.cfg.num_requests

    def _request(self) -> tuple[list[int], SamplingParams]:
        cfg, rng = self.cfg, self.rng
        prompt = [rng.randrange(3, cfg.vocab) for _ in range(rng.randint(*cfg.prompt_len))]
        new = rng.randint(*cfg.new_tokens)
        to_context = rng.random() < cfg.to_context
        if to_context:
            new = cfg.max_context_len  # runs (eos or not) into the context's end
        sampling = {}
        if rng.random() < cfg.sampled:
            sampling = dict(
                temperature=rng.choice((0.6, 1.0, 1.3)),
                top_p=rng.choice((1.0, 0.9)),
                top_k=rng.choice((0, 0, 20)),
                seed=rng.randrange(2**32),
            )
        ignore_eos = rng.random() >= cfg.honor_eos or to_context
        return prompt, SamplingParams(max_new_tokens=new, ignore_eos=ignore_eos, **sampling)


def _poisson(rng: random.Random, lam: float) -> int:
    """Knuth's method: fine for the small rates of a schedule."""
    limit, k, p = math.exp(-lam), 0, rng.random()
    while p > limit:
        k += 1
        p *= rng.random()
    return k


def with_eos(loaded: LoadedModel, count: int, seed: int = 0) -> LoadedModel:
    """``loaded`` with ``count`` random eos ids: random weights rarely emit the one real
    eos id, and a schedule needs requests that stop early."""
    ids = random.Random(seed).sample(range(3, loaded.model.vocab_size), count)
    return dataclasses.replace(loaded, eos_token_ids=tuple(sorted(ids)))


# ---- the differential driver -------------------------------------------------------


@dataclass
class Mismatch:
    seed: int
    step: int  # schedule step at which the streams first differed
    request: int  # index in arrival order (= the request id of a fresh engine)
    engine: str
    index: int  # first differing output position
    prompt_len: int
    params: SamplingParams
    expected: list[int]  # the reference engine's tokens around ``index``
    actual: list[int]
    finish: tuple[str | None, str | None]
    margin: float | None = None  # greedy: reference top-2 logit gap at ``index``

    def describe(self) -> str:
        p = self.params
        kind = "greedy" if p.greedy else f"sampled (T {p.temperature}, seed {p.seed})"
        gap = "" if self.margin is None else f"; reference top-2 logit gap {self.margin:.3g}"
        return (
            f"seed {self.seed} step {self.step} request {self.request} on {self.engine}: "
            f"token {self.index} differs ({kind}, prompt {self.prompt_len}, max_new_tokens "
            f"{p.max_new_tokens}, ignore_eos {p.ignore_eos}): reference {self.expected} vs "
            f"{self.actual}, finish {self.finish[0]} vs {self.finish[1]}{gap}"
        )


@dataclass
class RunResult:
    seed: int
    steps: int = 0  # reference engine steps with work (prefills and decode steps)
    decode_steps: int = 0
    requests: int = 0  # requests finished on the reference engine
    finish_reasons: Counter = field(default_factory=Counter)  # see _finish
    batch_sizes: Counter = field(default_factory=Counter)  # reference decode batches
    sampled_requests: int = 0
    mismatches: int = 0
    near_ties: int = 0  # greedy mismatches at a near-tie (with ``margin``)
    details: list[Mismatch] = field(default_factory=list)  # the first few
    graph_steps: dict[str, int] = field(default_factory=dict)
    leaks: list[str] = field(default_factory=list)  # pools not whole again at the end
    wall_s: float = 0.0
    # With record_outputs: each request's parameters and the reference's tokens.
    params: dict[int, SamplingParams] = field(default_factory=dict)
    outputs: dict[int, list[int]] = field(default_factory=dict)

    def summary(self) -> dict:
        """What the JSON keeps: counts, and the kept mismatches in words."""
        names = ("seed", "steps", "decode_steps", "requests", "sampled_requests")
        out = {name: getattr(self, name) for name in names}
        out["finish_reasons"] = dict(self.finish_reasons)
        out["batch_sizes"] = dict(sorted(self.batch_sizes.items()))
        out["graph_steps"] = self.graph_steps
        out["mismatches"] = self.mismatches
        out["near_ties"] = self.near_ties
        out["mismatch_details"] = [m.describe() for m in self.details]
        out["leaks"] = self.leaks
        out["wall_s"] = round(self.wall_s, 2)
        return out


def run_schedule(
    engines: dict[str, Engine],
    schedule: Schedule,
    steps: int,
    *,
    before_step: Callable[[], None] | None = None,
    after_step: Callable[[RunResult], None] | None = None,
    margin: Callable[[list[int], list[int]], float] | None = None,
    keep: int = 5,
    record_outputs: bool = False,
) -> RunResult:
    """Serve ``schedule`` on every engine in lockstep until the first (the reference) has
    run ``steps`` decode steps or the schedule is exhausted, then drain; compare each
    request's tokens with the reference's after every step. Engines must be fresh (a
    request's id is then its index in arrival order). ``before_step`` runs before each
    step, ``after_step`` after each reference step (with the running result);
    ``margin(prompt, prefix)`` gives a greedy request's top-2 logit gap, and
    ``record_outputs`` keeps each request's parameters and reference tokens."""
    names = list(engines)
    ref = names[0]
    result = RunResult(seed=schedule.cfg.seed)
    reqs: dict[str, list[Request | None]] = {name: [] for name in names}
    live: set[int] = set()  # requests some engine is still serving, or not yet compared
    diverged: set[tuple[int, str]] = set()
    start, step = time.perf_counter(), 0
    while True:
        arriving = result.decode_steps < steps and not schedule.exhausted
        if arriving:
            for prompt, params in schedule.arrivals(step):
                live.add(len(reqs[ref]))
                result.sampled_requests += not params.greedy
                for name, engine in engines.items():
                    reqs[name].append(engine.add_request(prompt, params))
        busy = [e for e in engines.values() if e.has_work]
        if not busy and not arriving:
            break
        if busy:
            if before_step is not None:
                before_step()
            reference = engines[ref]
            prefilled = reference.stats.prefill_tokens
            stepped = reference.step() if reference.has_work else []
            for engine in busy:
                if engine is not reference:
                    engine.step()
            if stepped:
                result.steps += 1
                if reference.stats.prefill_tokens == prefilled:
                    result.decode_steps += 1
                    result.batch_sizes[len(stepped)] += 1
            for i in sorted(live):
                if _compare(reqs, i, ref, step, result, diverged, margin, keep):
                    live.discard(i)
                    r = reqs[ref][i]
                    result.requests += 1
                    result.finish_reasons[_finish(r)] += 1
                    if record_outputs:
                        result.params[i], result.outputs[i] = r.params, r.output_ids
                    for rs in reqs.values():
                        rs[i] = None  # hold nothing the engines let go of (the soak)
            if stepped and after_step is not None:
                after_step(result)
        step += 1
    result.wall_s = time.perf_counter() - start
    for name, engine in engines.items():
        result.graph_steps[name] = engine.stats.graph_steps
        kv, rp = engine.kv_pool, engine.req_pool
        if kv.available() != kv.num_slots or rp.available() != rp.max_requests:
            result.leaks.append(
                f"{name}: {kv.num_slots - kv.available()} KV slots and "
                f"{rp.max_requests - rp.available()} request slots still held"
            )
    return result


def _finish(r: Request) -> str:
    """stop, length, context (the context's end came before max_new_tokens) or error."""
    short = len(r.output_ids) < r.params.max_new_tokens
    return "context" if r.finish_reason.value == "length" and short else r.finish_reason.value


def _compare(reqs, i, ref, step, result, diverged, margin, keep) -> bool:
    """Compare request ``i`` on every engine with the reference; True once all finished."""
    expected = reqs[ref][i]
    for name, rs in reqs.items():
        actual = rs[i]
        if name == ref or (i, name) in diverged or _agree(expected, actual):
            continue
        diverged.add((i, name))
        mismatch = _mismatch(expected, actual, i, name, step, result.seed, margin)
        result.mismatches += 1
        result.near_ties += mismatch.margin is not None and mismatch.margin < NEAR_TIE
        if len(result.details) < keep:
            result.details.append(mismatch)
    return all(rs[i].finished for rs in reqs.values())


def _agree(a: Request, b: Request) -> bool:
    """No difference yet: one stream is a prefix of the other, and neither stopped while
    the other went on (after a divergence elsewhere the engines' schedules drift apart,
    so a request may be served at different steps; its tokens must still agree)."""
    x, y = a.output_ids, b.output_ids
    n = min(len(x), len(y))
    if x[:n] != y[:n]:
        return False
    if (a.finished and len(y) > n) or (b.finished and len(x) > n):
        return False
    return not (a.finished and b.finished) or a.finish_reason == b.finish_reason


def _mismatch(expected, actual, i, name, step, seed, margin) -> Mismatch:
    a, b = expected.output_ids, actual.output_ids
    index = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
    gap = None
    if margin is not None and expected.params.greedy and index < len(a):
        gap = margin(expected.prompt_ids, a[:index])
    reasons = tuple(r.finish_reason.value if r.finish_reason else None for r in (expected, actual))
    return Mismatch(
        seed=seed,
        step=step,
        request=i,
        engine=name,
        index=index,
        prompt_len=len(expected.prompt_ids),
        params=expected.params,
        expected=a[max(0, index - 2) : index + 3],
        actual=b[max(0, index - 2) : index + 3],
        finish=reasons,
        margin=gap,
    )


class GreedyMargin:
    """The eager top-2 logit gap after ``prompt + prefix``: where a greedy request
    diverged, a gap near float rounding marks a near-tie rather than a bug."""

    def __init__(self, loaded: LoadedModel, device, max_context_len: int):
        config = EngineConfig(
            runner="eager", max_running_requests=1, max_context_len=max_context_len
        )
        self.engine = Engine(loaded, config, device)

    def __call__(self, prompt: list[int], prefix: list[int]) -> float:
        params = SamplingParams(max_new_tokens=1, ignore_eos=True, return_logits=True)
        req = self.engine.add_request(prompt + prefix, params)
        while self.engine.has_work:
            self.engine.step()
        top = req.output_logits[0].float().topk(2).values
        return float(top[0] - top[1])
