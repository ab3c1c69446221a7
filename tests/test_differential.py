"""Differential random testing (issue 10, item 6): one seeded random schedule served in
lockstep by an eager engine and graph engines (the real CUDA full and breakable and NPU
graph backends over the stand-in device module), request by request the same tokens. The
schedule: arrivals between steps in bursts and lulls, random prompt lengths and
max_new_tokens (batches grow and shrink across the buckets, so graphs replay padded, and
in exact mode only at captured sizes), greedy and seeded sampled requests, eos stops and
requests that reach the context's end; speculative rounds with the MTP drafter on
graphs, and with an oracle drafter whose rounds accept 0 to all drafts; auto lengths'
plain steps and rounds launched ahead of their reads. The driver is
tests/differential.py's ``run_schedule``: tests/soak.py runs the same one for 10,000
steps on the H200."""

from __future__ import annotations

import dataclasses

import differential
import pytest
import torch
from helpers import (
    CPU,
    OracleDraftRunner,
    cpu_engine,
    cycling_chooser,
    spy_launches,
    standin_device,
)

from graphrt.core.models import load_model
from graphrt.devices.cpu import CpuDevice
from graphrt.spec import MTPDecoding, SpecConfig

BUCKETS = (1, 2, 4, 8)
MAX_RUNNING = 8  # the largest bucket: batches of 3, 5, 6 and 7 replay padded
CONTEXT = 64


def engine_config(**overrides) -> dict:
    config = dict(
        max_running_requests=MAX_RUNNING,
        max_context_len=CONTEXT,
        kv_pool_tokens=MAX_RUNNING * (CONTEXT + 8),
        graph_buckets=BUCKETS,
    )
    return {**config, **overrides}


def graph_engine(loaded, backend: str, strategy=None, capture_safe: bool = True, **config):
    device = standin_device(capture_safe)
    config = engine_config(runner="graph", graph_backend=backend, **config)
    return cpu_engine(loaded, strategy, device, **config)


def schedule(seed: int, vocab: int, **overrides):
    config = dict(
        vocab=vocab,
        max_context_len=CONTEXT,
        max_running=MAX_RUNNING,
        prompt_len=(1, 16),
        new_tokens=(1, 12),
        phase_steps=8,
    )
    return differential.Schedule(differential.ScheduleConfig(seed=seed, **{**config, **overrides}))


def assert_no_mismatch(result) -> None:
    assert not result.mismatches, "\n".join(m.describe() for m in result.details)
    assert not result.leaks, result.leaks


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models on one thread: with two threads on busy cores each small matmul waits
    for the other thread (16 ms against 25 us on the CI's 2 cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def llama():
    return differential.with_eos(load_model("random:llama-tiny", CPU, torch.float32), count=8)


@pytest.mark.graphs
def test_plain_decode_on_graphs_padded_and_exact_equals_eager(llama):
    engines = {
        "eager": cpu_engine(llama, **engine_config()),
        "cuda-full": graph_engine(llama, "cuda-full"),
        "cuda-full-exact": graph_engine(llama, "cuda-full", graph_padding=False),
        "cuda-breakable": graph_engine(llama, "cuda-breakable", capture_safe=False),
        "npu": graph_engine(llama, "npu"),
    }
    margin = differential.GreedyMargin(llama, CpuDevice(), CONTEXT)  # in a mismatch's message
    result = differential.run_schedule(
        engines, schedule(5, llama.model.vocab_size), steps=60, margin=margin
    )
    assert_no_mismatch(result)
    # What the schedule covered: batches between and at the buckets, both kinds of
    # sampling, every way to finish (to_context requests end at the context's end).
    sizes = set(result.batch_sizes)
    assert {1, MAX_RUNNING} <= sizes and len(sizes - set(BUCKETS)) >= 2, sizes
    assert 0 < result.sampled_requests < result.requests
    assert all(result.finish_reasons[k] for k in ("stop", "length", "context")), result
    # Padded: every decode step replayed a graph; exact: only the bucket-sized ones.
    padded = ("cuda-full", "cuda-breakable", "npu")
    assert all(result.graph_steps[name] == result.decode_steps for name in padded)
    on_buckets = sum(n for size, n in result.batch_sizes.items() if size in BUCKETS)
    assert result.graph_steps["cuda-full-exact"] == on_buckets < result.decode_steps
    assert result.graph_steps["eager"] == 0


def spec_engines(target, drafter, steps: int, topk: int, one_graph: bool = True):
    """(eager, graph) engines with frozen-KV MTP drafting, on 1 to 4 requests; the graph
    engine's rounds on one graph each, or (``one_graph=False``) the draft loop's and
    verify's."""
    config = dict(graph_buckets=(1, 2, 4), max_running_requests=4)
    strategies = [
        MTPDecoding(drafter, SpecConfig(steps, topk, one_graph=one_graph)) for _ in range(2)
    ]
    return {
        "eager": cpu_engine(target, strategies[0], **engine_config(**config)),
        "cuda-full": graph_engine(target, "cuda-full", strategies[1], **config),
    }


@pytest.fixture(scope="module")
def gemma4_pair(gemma4_tiny, gemma4_assistant):
    target = load_model(str(gemma4_tiny.path), CPU, torch.float32)
    drafter = load_model(str(gemma4_assistant.path), CPU, torch.float32)
    return differential.with_eos(target, count=6), drafter


def spec_schedule(seed: int, vocab: int, requests: int):
    return schedule(
        seed, vocab, max_running=4, num_requests=requests, new_tokens=(1, 16), to_context=0.1
    )


@pytest.mark.graphs
def test_speculative_rounds_on_graphs_equal_eager(gemma4_pair):
    """Each round on one graph (draft loop, verify and tail), batches of 1 to 4 (3 padded)."""
    target, drafter = gemma4_pair
    engines = spec_engines(target, drafter, steps=3, topk=2)
    sched = spec_schedule(27, target.model.vocab_size, requests=12)
    result = differential.run_schedule(engines, sched, steps=10**6)
    assert_no_mismatch(result)
    assert {1, 3, 4} <= set(result.batch_sizes), result.batch_sizes
    graph = engines["cuda-full"]
    # Every round replayed its graph, the sampled variant's too: it was captured just
    # before the first round with a sampled request (MTPDecoding.captures_before).
    assert graph.stats.eager_steps == result.steps - result.decode_steps  # the prefills
    assert graph.stats.spec_rounds == graph.stats.graph_rounds > 0
    assert graph.stats.lazy_capture_s > 0
    assert sum(graph.strategy.longest.sampled_round.replays_per_size().values()) > 0
    assert result.sampled_requests and result.finish_reasons["stop"]
    assert result.finish_reasons["context"]  # rounds capped at the context's end


@pytest.mark.graphs
def test_speculative_rounds_with_oracle_accept_lengths_equal_eager(gemma4_pair):
    """An oracle drafter proposes each request's greedy continuation, wrong at chosen
    steps: rounds accept 0 to all drafts, and verify, acceptance and commit replay graphs
    under every accept length. Greedy output equals plain decoding's (lossless)."""
    target, drafter = gemma4_pair
    seed, requests, steps = 41, 12, 3
    plain = {"plain": cpu_engine(target, **engine_config(max_running_requests=4))}
    reference = differential.run_schedule(
        plain, spec_schedule(seed, target.model.vocab_size, requests), 10**6, record_outputs=True
    )
    # The oracle drafts eagerly (draft_eager below): rounds of two graphs, verify's replayed.
    engines = spec_engines(target, drafter, steps=steps, topk=1, one_graph=False)
    oracle_drafts = engines["cuda-full"].strategy.longest
    oracle_drafts.draft = None  # the oracle drafts eagerly; verify on graphs
    truths = {}
    for name, engine in engines.items():
        truths[name] = {}
        engine.strategy.draft_eager = OracleDraftRunner(engine, truths[name], topk=1)

    def tell_the_oracle_each_slots_continuation():
        for name, engine in engines.items():
            truths[name].clear()
            for r in engine.running:
                truths[name][r.req_slot] = r.prompt_ids + reference.outputs[r.rid]

    result = differential.run_schedule(
        engines,
        spec_schedule(seed, target.model.vocab_size, requests),
        10**6,
        before_step=tell_the_oracle_each_slots_continuation,
        record_outputs=True,
    )
    assert_no_mismatch(result)
    hist = engines["cuda-full"].stats.accept_histogram
    assert all(hist) and len(hist) == steps + 1, hist  # rounds accepted 0, 1, .., all drafts
    # The prefills only: every verify replayed a graph (the sampled variant's captured
    # just before the first round with a sampled request).
    assert engines["cuda-full"].stats.eager_steps == result.steps - result.decode_steps
    greedy = [i for i, p in result.params.items() if p.greedy]
    assert greedy and all(result.outputs[i] == reference.outputs[i] for i in greedy)


def test_the_driver_reports_the_seed_step_and_request_of_a_mismatch(llama):
    """A token flipped on one engine at one step: one mismatch, said where."""
    engines = {name: cpu_engine(llama, **engine_config()) for name in ("eager", "faulty")}
    faulty, calls, flipped = engines["faulty"], [], []
    decode = faulty.strategy.decode

    def flip_one_token(reqs):
        outcome = decode(reqs)
        calls.append(len(reqs))
        if len(calls) == 9:  # the 9th decode step: flip its last request's token
            last = outcome.tokens[-1]
            last[0] = (last[0] + 1) % llama.model.vocab_size
            flipped.append((reqs[-1].rid, len(reqs[-1].output_ids)))
        return outcome

    faulty.strategy.decode = flip_one_token
    result = differential.run_schedule(
        engines, schedule(5, llama.model.vocab_size, to_context=0.0), steps=20, keep=1
    )
    assert result.mismatches == 1 and len(result.details) == 1
    detail = result.details[0]
    assert [(detail.request, detail.index)] == flipped and detail.engine == "faulty"
    message = detail.describe()
    assert message.startswith(f"seed 5 step {detail.step} request {detail.request} on faulty")


@pytest.mark.graphs
def test_auto_lengths_launched_ahead_equal_plain_greedy(gemma4_pair):
    """Auto lengths (scripted: plain steps and rounds of 1 to 3 in runs, each kind behind
    itself and the other) on one-graph rounds, every step launched behind the one before
    where it can (``overlap``: a plain step behind a round too, at the round's device
    lengths), under arrivals, eos stops and the context's end: greedy output equals an
    eager engine's plain decoding, and every slot comes back."""
    target, drafter = gemma4_pair
    strategy = MTPDecoding(drafter, SpecConfig(num_steps=3, adaptive=True))
    strategy.chooser = cycling_chooser(3, (0, 0, 3, 3, 0, 1, 2, 2, 0, 3, 1, 0))
    engines = {
        "plain": cpu_engine(target, **engine_config(max_running_requests=4)),
        "auto-overlap": graph_engine(
            target,
            "cuda-full",
            strategy,
            graph_buckets=(1, 2, 4),
            max_running_requests=4,
            overlap=True,
            capture_all_graphs=True,
        ),
    }
    graph = engines["auto-overlap"]
    with pytest.MonkeyPatch.context() as patch:
        _, launched_ahead = spy_launches(graph, patch)
        # Plain steps launched on device lengths: behind a round (or behind such a step).
        on_device_lengths = []
        launch_plain = strategy.plain.launch

        def spy_plain(reqs, last_tokens=None, kv_lens=None, in_flight=0):
            step = launch_plain(reqs, last_tokens, kv_lens, in_flight)
            on_device_lengths.append(step is not None and kv_lens is not None)
            return step

        patch.setattr(strategy.plain, "launch", spy_plain)
        sched = spec_schedule(33, target.model.vocab_size, requests=14)
        sched = differential.Schedule(dataclasses.replace(sched.cfg, sampled=0.0))
        result = differential.run_schedule(engines, sched, steps=10**6)
    assert_no_mismatch(result)
    assert result.finish_reasons["stop"] and result.finish_reasons["context"], result
    assert launched_ahead and any(on_device_lengths)
    assert set(graph.stats.rounds_by_steps) == {1, 2, 3} and graph.stats.spec_plain_steps
    assert graph.stats.spec_rounds == graph.stats.graph_rounds  # every round replayed
    assert graph._pending is None
