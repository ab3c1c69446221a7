"""Decode-step benchmark: eager vs graph runner (and the transformers peer) per batch size.

For each batch size, ``bs`` requests are prefilled to ``prompt_len`` tokens
through the Engine, then one decode batch is executed repeatedly by each
runner; the same batch, the same KV, side by side in one process. Beside each
time: the bytes the step must read (weights, gathered embedding rows, KV), the
bandwidth floor those bytes give, the bandwidth each runner achieved, and the
device kernels of one step (counted under the profiler, after the timing).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial

import torch

from graphrt.core.bench.output import fmt
from graphrt.core.bench.profile import collective_ms, count_kernels, device_ms, kernel_activity
from graphrt.core.bench.timing import (
    achieved_gbps,
    copy_bandwidth_gbps,
    floor_ms,
    median_ms,
    step_bytes_read,
    weight_bytes,
)
from graphrt.core.engine import Engine, EngineConfig, Request, SamplingParams
from graphrt.core.engine.sampling import greedy_tokens
from graphrt.core.errors import GraphrtError
from graphrt.core.models.ops import model_ops
from graphrt.core.parallel.group import SINGLE


@dataclass(frozen=True)
class DecodeBenchConfig:
    batch_sizes: tuple[int, ...] = (1, 8, 32, 64)
    prompt_len: int = 512
    runners: tuple[str, ...] = ("eager", "graph")  # plus "hf" for the transformers peer
    steps: int = 50
    warmup: int = 5
    max_running_requests: int = 256  # graph buckets are captured up to this
    seed: int = 0
    # The engine's context, raised to what the timed requests need (None: just that). Decode
    # attention's scratch, and with it its kernels' split constants, is sized from it, as a
    # server's is from the model's context; the KV pool stays what the requests need.
    max_context_len: int | None = None
    # One request of each batch prefilled to this many tokens instead of prompt_len: a long
    # row among short ones, as a server's batches hold (None: every row alike).
    long_row: int | None = None

    def prompt_lens(self, bs: int) -> list[int]:
        """Each request's prompt length in a batch of ``bs``: the long row first."""
        lens = [self.prompt_len] * bs
        if self.long_row is not None:
            lens[0] = self.long_row
        return lens


@dataclass
class BatchResult:
    batch_size: int
    eager_ms: float | None = None
    graph_ms: float | None = None
    hf_ms: float | None = None
    # Bytes one decode step must read (timing.step_bytes_read), and that over the copy bandwidth.
    bytes_read: int = 0
    weight_bytes_read: int = 0
    gathered_bytes_read: int = 0
    kv_bytes_read: int = 0
    floor_ms: float = 0.0
    graph_over_floor: float | None = None
    graph_speedup_over_eager: float | None = None
    graph_speedup_over_hf: float | None = None
    graph_gbps: float | None = None  # bytes_read / graph_ms
    eager_gbps: float | None = None
    # Device kernels (and copies) of one step as timed; None where the profiler sees none (CPU).
    graph_kernels: int | None = None
    eager_kernels: int | None = None
    # Tensor parallelism: device time of a graph step's collectives (all-reduces, the
    # logits' gather); None without TP or where the profiler sees no kernels.
    graph_collective_ms: float | None = None
    # The NaN/Inf check folded into the greedy pick (sampling.greedy_tokens): its device
    # time over a plain argmax of this step's logits; None where the profiler sees no
    # kernels (CPU). Inside the graph step it adds no launch and no sync, only this.
    nan_check_ms: float | None = None


@dataclass
class DecodeBenchResult:
    model: str
    device: str
    device_name: str
    dtype: str
    batch_invariant: bool  # the model's kernels (--batch-invariant, or its default)
    tp: int  # ranks the model is split over (times are one rank's: they run in lockstep)
    prompt_len: int
    versions: dict[str, str]
    host_launch_us: float  # the host's speed (timing.host_launch_us)
    max_context_len: int  # the engine's (DecodeBenchConfig.max_context_len; the model's at most)
    long_row: int | None  # DecodeBenchConfig.long_row
    copy_bandwidth_gbps: float
    weight_bytes: int
    kv_bytes_per_token: int
    capture_time_s: float | None
    graph_memory_bytes: int | None
    captured_sizes: list[int]
    graph_backend: str | None
    attention_backend: str
    batches: list[BatchResult] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


def prefilled(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list[Request]:
    """Requests for ``prompts``, prefilled chunk by chunk. A step that fails finishes its
    requests with an error and frees their slots (``Engine.step``); timing them on would
    fail later with an error that names nothing (a bench whose Triton could not compile
    stopped in the token table's update with a TypeError over a request without a slot), so
    the first failure is raised here, in one line."""
    reqs = [engine.add_request(p, params) for p in prompts]
    while engine.prefill_pending:
        engine.step()
    raise_failed(reqs, "prefill")
    return reqs


def raise_failed(reqs: list[Request], what: str) -> None:
    """One line naming the first of ``reqs`` whose step failed, if any did."""
    failed = [r for r in reqs if r.error is not None]
    if failed:
        raise GraphrtError(
            f"bench: {len(failed)} of {len(reqs)} requests failed in {what} ({failed[0].error})"
        )


def generate_tokens_per_s(engine: Engine, prompts, params: SamplingParams) -> float:
    """Decoding tokens/s of one ``engine.generate(prompts, params)`` call alone: what the
    CLI reports (``EngineStats.tokens_per_s``), for this call's share of the stats."""
    stats = engine.stats
    tokens, seconds = stats.decoded_tokens, stats.decoding_s
    raise_failed(engine.generate(prompts, params), "generate")
    return (stats.decoded_tokens - tokens) / (stats.decoding_s - seconds)


def steady_tokens_per_s(
    engine: Engine, prompts: list[list[int]], params: SamplingParams, turns: int = 2
) -> float:
    """Decoding tokens/s with ``len(prompts)`` requests running all along, as a server
    holds its batch: each request that finishes is replaced at once by the next prompt
    (cycling), until ``turns`` requests a slot have finished; the requests still running
    then are aborted, their tokens counted. ``generate_tokens_per_s`` runs a closed batch
    instead, whose requests finish together under plain steps but one by one under
    speculative rounds (accept lengths differ), so a round's batch shrinks through a tail
    of small steps (stop 45's matrix: the pair's rounds of 3 at 64 requests on an H200,
    63k tok/s closed, where their full-batch round time and accept length give 78k).
    Decode steps and rounds only, prefill steps, lazy captures and compiles apart, as the
    CLI counts."""
    stats, size = engine.stats, len(prompts)
    tokens, prefill_s, capture_s = stats.decoded_tokens, stats.prefill_s, stats.lazy_capture_s
    compile_s = stats.compile_time_s
    queue = itertools.cycle(prompts)
    running = engine.add_requests([next(queue) for _ in range(size)], params)
    finished = 0
    start = time.perf_counter()
    try:
        while finished < turns * size:
            if not engine.has_work:  # every request finished unreplaced: cannot happen
                raise RuntimeError("steady_tokens_per_s: no request left to step")
            engine.step()
            done = [r for r in running if r.finished]
            raise_failed(done, "steady decoding")  # replaced, they would count as served
            finished += len(done)
            running = [r for r in running if not r.finished]
            running += [engine.add_request(next(queue), params) for _ in done]
    finally:
        seconds = time.perf_counter() - start
        for req in running:
            engine.abort(req)
    if engine.graph_backend is not None:  # lazy compiles (CPU `compile`), as generate counts
        stats.compile_time_s = engine.graph_backend.lazy_compile_s()
    seconds -= (stats.prefill_s - prefill_s) + (stats.lazy_capture_s - capture_s)
    seconds -= stats.compile_time_s - compile_s
    return (stats.decoded_tokens - tokens) / seconds


def run_decode_bench(
    engine: Engine,
    cfg: DecodeBenchConfig,
    sync,
    hf_peer: Callable[[], object] | None = None,
    report=print,
) -> tuple[list[BatchResult], float, int]:
    """Time every runner at every batch size on ``engine``'s model and pools.

    Returns the per-batch results, the copy bandwidth (GB/s) measured in this
    run, and the model's weight bytes.
    """
    torch.manual_seed(cfg.seed)
    params = SamplingParams(max_new_tokens=cfg.steps + cfg.warmup + 2, ignore_eos=True)
    weights = weight_bytes(engine.loaded.model)
    bandwidth = copy_bandwidth_gbps(engine.torch_device, sync)
    results = []
    for bs in cfg.batch_sizes:
        results.append(_time_graphrt(engine, cfg, bs, params, bandwidth, sync, report))
    # The peer runs after every graphrt measurement, not interleaved: its
    # torch.compile + CUDA-graph trees then never share the process's memory
    # state with graphrt's captured graphs while those still replay.
    if "hf" in cfg.runners and hf_peer is not None:
        peer = hf_peer()
        for result in results:
            result.hf_ms = peer.decode_step_ms(
                result.batch_size, cfg.prompt_len, cfg.steps, cfg.warmup, sync
            )
            report(f"{result.batch_size:>4} transformers peer: {result.hf_ms:.3f} ms")
    for result in results:
        result.graph_gbps = achieved_gbps(result.bytes_read, result.graph_ms)
        result.eager_gbps = achieved_gbps(result.bytes_read, result.eager_ms)
        if result.graph_ms:
            result.graph_over_floor = result.graph_ms / result.floor_ms
            if result.eager_ms:
                result.graph_speedup_over_eager = result.eager_ms / result.graph_ms
            if result.hf_ms:
                result.graph_speedup_over_hf = result.hf_ms / result.graph_ms
    report(HEADER)
    for result in results:
        report(_row(result))
    checked = [r for r in results if r.nan_check_ms is not None and r.graph_ms]
    if checked:
        report(
            "NaN/Inf check in the greedy pick, over a plain argmax (device time): "
            + ", ".join(
                f"bs {r.batch_size} {r.nan_check_ms * 1e3:.1f} us "
                f"({100 * r.nan_check_ms / r.graph_ms:.2f}% of the graph step)"
                for r in checked
            )
        )
    timed = [r for r in results if r.graph_collective_ms is not None]
    if timed:
        report(
            "collectives per graph step (device time): "
            + ", ".join(f"bs {r.batch_size} {r.graph_collective_ms:.3f} ms" for r in timed)
        )
    return results, bandwidth, weights


def _time_graphrt(engine, cfg, bs, params, bandwidth, sync, report) -> BatchResult:
    vocab = engine.loaded.model.vocab_size
    prompts = [torch.randint(0, vocab, (n,)).tolist() for n in cfg.prompt_lens(bs)]
    reqs = prefilled(engine, prompts, params)
    batch = engine.build_decode_batch(reqs)
    read = step_bytes_read(engine.loaded.model, batch.seq_lens_cpu, engine.kv_pool.dtype)
    result = BatchResult(
        batch_size=bs,
        bytes_read=read.total,
        weight_bytes_read=read.weights,
        gathered_bytes_read=read.gathered,
        kv_bytes_read=read.kv,
        floor_ms=floor_ms(read.total, bandwidth),
    )
    device = engine.torch_device
    if "eager" in cfg.runners:
        step = partial(engine.eager_runner.execute, batch)
        result.eager_ms = median_ms(step, sync, cfg.steps, cfg.warmup)
        result.eager_kernels = count_kernels(step, sync, device)  # profiled after, never timed
    # The runner a decode step of the batch takes (long rows: graphs of their own).
    runner = engine.decode_graph_runner(reqs, batch) if "graph" in cfg.runners else None
    if runner is not None:
        if not runner.can_run_graph(batch):
            report(f"batch {bs}: no captured graph fits; graph timing skipped")
        else:
            step = partial(runner.execute, batch)
            result.graph_ms = median_ms(step, sync, cfg.steps, cfg.warmup)
            result.graph_kernels = count_kernels(step, sync, device)
            if getattr(engine.loaded.model, "tp", SINGLE).size > 1:
                result.graph_collective_ms = collective_ms(
                    step, sync, device, engine.device.collective_kernels
                )
    result.nan_check_ms = _nan_check_ms(engine, batch, sync)
    for req in reqs:
        engine.abort(req)
    report(f"{bs:>4} eager {fmt(result.eager_ms)} ms, graph {fmt(result.graph_ms)} ms")
    return result


def _nan_check_ms(engine, batch, sync) -> float | None:
    """What the engine's greedy sampler (argmax with the NaN/Inf mark, on the model's ops:
    CUDA's Triton kernels) costs over torch's bare argmax, on the logits one step of
    ``batch`` produces. Never below 0: the profiler's noise is not a gain. None where the
    profiler records no kernels (CPU), without running the step."""
    if kernel_activity(engine.torch_device) is None:
        return None
    logits = engine.eager_runner.execute(batch).logits
    ops = model_ops(engine.loaded.model)
    checked = device_ms(lambda: greedy_tokens(logits, ops), sync, engine.torch_device)
    bare = device_ms(lambda: logits.argmax(-1), sync, engine.torch_device)
    if checked is None or bare is None:
        return None
    return max(0.0, checked - bare)


HEADER = (
    f"{'bs':>4} {'eager ms':>9} {'graph ms':>9} {'hf ms':>9} {'floor ms':>9} {'graph/floor':>11} "
    f"{'graph x eager':>13} {'graph x hf':>10} {'MB read w/emb/kv':>20} {'graph GB/s':>10} "
    f"{'eager GB/s':>10} {'kernels g/e':>11}"
)


def _row(r: BatchResult) -> str:
    mb = f"{r.weight_bytes_read / 1e6:.1f}/{r.gathered_bytes_read / 1e6:.2f}/{r.kv_bytes_read / 1e6:.1f}"
    kernels = f"{fmt(r.graph_kernels, 'd')}/{fmt(r.eager_kernels, 'd')}"
    return (
        f"{r.batch_size:>4} {fmt(r.eager_ms):>9} {fmt(r.graph_ms):>9} {fmt(r.hf_ms):>9} "
        f"{fmt(r.floor_ms):>9} {fmt(r.graph_over_floor, '.2f'):>11} "
        f"{fmt(r.graph_speedup_over_eager, '.2f'):>13} {fmt(r.graph_speedup_over_hf, '.2f'):>10} "
        f"{mb:>20} {fmt(r.graph_gbps, '.0f'):>10} {fmt(r.eager_gbps, '.0f'):>10} {kernels:>11}"
    )


def make_engine(
    loaded, device, cfg: DecodeBenchConfig, graphs: bool, graph_backend: str | None = None
) -> Engine:
    """An Engine on graphrt ``device`` sized for the benchmark (graphs up to its batch sizes)."""
    max_bs = max(cfg.max_running_requests, max(cfg.batch_sizes))
    lens = cfg.prompt_lens(max(cfg.batch_sizes))
    decoded = cfg.steps + cfg.warmup + 8
    config = EngineConfig(
        max_running_requests=max_bs,
        max_context_len=max(max(lens) + decoded, cfg.max_context_len or 0),
        kv_pool_tokens=sum(lens) + len(lens) * decoded,
        seed=cfg.seed,
        runner="graph" if graphs else "eager",
        graph_backend=graph_backend,
    )
    return Engine(loaded, config, device)
