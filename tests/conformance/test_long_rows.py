"""Decode graphs of their own for batches with a long row (``AttentionBackend.long_row_keys``).

On CUDA, rows of 2,048 visible keys and more attend on larger KV blocks in a second launch
a layer; short batches must not pay that launch, so they keep the plain decode graphs and
a batch whose longest row reaches the count takes graphs captured for it when it first
needs them. Here a reference attention declares a long-row count of 24 keys and records
the flag each forward saw, on the CUDA stand-in (graphs replay recorded ops on CPU): which
graphs serve which batch, when they are captured, and the tokens (every row is served
right on either graph, so they equal an eager engine's).
"""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
from harness import CASES, case_device, case_engine, loaded_model
from helpers import random_prompts

from graphrt.core.attention.torch_ref import TorchAttentionBackend
from graphrt.core.engine import Engine, EngineConfig, SamplingParams
from graphrt.core.models import load_model
from graphrt.spec import MTPDecoding, SpecConfig

LONG_KEYS = 24


class LongRowAttention(TorchAttentionBackend):
    """The torch reference with a long-row count; ``flags``: each forward's ``long_rows``
    (Python runs at capture and in eager forwards, not in replays)."""

    def __init__(self, kv_pool, req_pool):
        super().__init__(kv_pool, req_pool)
        self.flags: list[bool] = []

    def long_row_keys(self, layers):
        assert layers, "the target's KV layers"
        return LONG_KEYS

    def forward(self, q, k, v, spec, batch):
        self.flags.append(batch.long_rows)
        return super().forward(q, k, v, spec, batch)


@pytest.fixture
def case():
    base = next(c for c in CASES if c.id == "cuda-full-standin")
    return dataclasses.replace(base, make_attention=LongRowAttention)


@pytest.fixture
def loaded(case, session_cache):
    return loaded_model(case, session_cache)


def _long_runner_replays(engine) -> int:
    runner = engine.strategy.long_runner
    return sum(runner.replays_per_size().values()) if runner is not None else 0


def test_long_batches_take_their_own_graphs_captured_when_first_needed(case, loaded):
    engine = case_engine(case, loaded, graphs=True)
    long_runner = engine.strategy.long_runner
    assert long_runner is not None and long_runner.captured_sizes == []
    vocab = loaded.model.vocab_size
    # Rows of 6 and 9 keys that end at 12 and 15: never long, nothing captured for them.
    short = random_prompts((6, 9), seed=3, vocab=vocab)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    out = engine.generate(short, params)
    assert long_runner.captured_sizes == [] and _long_runner_replays(engine) == 0
    assert not any(engine.attn_backend.flags)
    reference = case_engine(case, loaded, graphs=False).generate(short, params)
    assert [r.output_ids for r in out] == [r.output_ids for r in reference]

    # Rows of 10 and 20 keys growing past 24 in the run: plain graphs first, then the long
    # rows' graphs, captured at the step whose longest row first reaches 24 keys.
    prompts = random_prompts((10, 20), seed=4, vocab=vocab)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    plain_before = sum(engine.graph_runner.replays_per_size().values())
    engine.attn_backend.flags.clear()
    out = engine.generate(prompts, params)
    assert long_runner.captured_sizes == engine.graph_runner.captured_sizes
    assert engine.stats.lazy_capture_s > 0
    # 11 decode steps of 2 rows (bucket 4): lengths after each 21..31 for the longer row:
    # steps to 23 on the plain graphs (3), from 24 on the long rows' (8).
    assert sum(engine.graph_runner.replays_per_size().values()) - plain_before == 3
    assert _long_runner_replays(engine) == 8
    assert any(engine.attn_backend.flags)  # the long graphs' capture saw the flag
    eager = case_engine(case, loaded, graphs=False)
    reference = eager.generate(prompts, params)
    assert [r.output_ids for r in out] == [r.output_ids for r in reference]
    assert any(eager.attn_backend.flags)  # an eager engine's long batches: the same schedule


def test_batch_invariant_models_take_no_long_rows_graphs(case, loaded, monkeypatch):
    """--batch-invariant keeps one block size for every row (its verify reuses decode's),
    so the engine neither captures nor flags long batches: there is nothing to gain."""
    ops = dataclasses.replace(loaded.model.ops, width_invariant=True)
    monkeypatch.setattr(loaded.model, "ops", ops)
    engine = case_engine(case, loaded, graphs=True)
    assert engine.strategy.long_runner is None and engine.strategy.deferred_captures() == ()
    prompts = random_prompts((20, 22), seed=6, vocab=loaded.model.vocab_size)
    engine.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True))
    # The longer row reaches 24 keys in the run: all 7 decode steps on the plain graphs.
    assert sum(engine.graph_runner.replays_per_size().values()) == 7
    assert not any(engine.attn_backend.flags)


def test_a_server_captures_the_long_rows_graphs_up_front(case, loaded):
    engine = case_engine(case, loaded, graphs=True)
    assert engine.strategy.deferred_captures() == (engine.strategy.long_runner,)
    assert engine.strategy.deferred_captures() == ()  # handed out once


def test_refused_long_graphs_leave_long_batches_on_the_plain_graphs(case, loaded):
    engine = case_engine(case, loaded, graphs=True)
    strategy = engine.strategy
    strategy.refuse_capture(strategy.long_runner)  # as the graph-memory cap would
    assert strategy.long_runner is None
    prompts = random_prompts((20, 22), seed=5, vocab=loaded.model.vocab_size)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    graph_before = engine.stats.graph_steps
    out = engine.generate(prompts, params)
    assert engine.stats.graph_steps - graph_before == params.max_new_tokens - 1
    assert strategy.long_runner is None and not any(engine.attn_backend.flags)
    reference = case_engine(case, loaded, graphs=False).generate(prompts, params)
    assert [r.output_ids for r in out] == [r.output_ids for r in reference]


def test_a_drafters_plain_steps_take_the_long_rows_graphs_too(case, gemma4_tiny, gemma4_assistant):
    """Requests that opt out of drafting take plain steps in a speculative engine: its
    strategy hands out (and captures) the plain steps' long-row graphs as a plain one."""
    target, drafter = (load_model(str(c.path), case.device, case.dtype)
                       for c in (gemma4_tiny, gemma4_assistant))  # fmt: skip

    def engine(graphs: bool) -> Engine:
        config = EngineConfig(max_running_requests=4, max_context_len=64, graph_buckets=(2, 4),
                              runner="graph" if graphs else "eager")  # fmt: skip
        strategy = MTPDecoding(drafter, SpecConfig(num_steps=3))
        return Engine(target, config, case_device(case), strategy)

    spec = engine(graphs=True)
    plain = spec.strategy.plain
    assert plain.long_runner is not None and plain.long_runner.captured_sizes == []
    prompts = random_prompts((18, 12), seed=6, vocab=target.model.vocab_size)
    params = SamplingParams(max_new_tokens=10, ignore_eos=True, speculate=False)
    out = spec.generate(prompts, params)
    # The longer row: 19..27 keys after its 9 decode steps, 24 from the sixth on.
    assert plain.long_runner.captured_sizes == plain.graph_runner.captured_sizes
    assert sum(plain.long_runner.replays_per_size().values()) == 4
    reference = engine(graphs=False).generate(prompts, params)
    assert [r.output_ids for r in out] == [r.output_ids for r in reference]


def test_the_decode_bench_times_the_runner_a_step_takes(case, loaded):
    """`graphrt bench` times ``Engine.decode_graph_runner``'s runner: at a long context the
    long rows' (captured for it), at a short one the plain decode graphs."""
    engine = case_engine(case, loaded, graphs=True)
    vocab = loaded.model.vocab_size
    for prompt_len, runner in ((8, engine.graph_runner), (30, engine.strategy.long_runner)):
        reqs = [engine.add_request(p) for p in random_prompts((prompt_len,) * 2, vocab=vocab)]
        while engine.prefill_pending:
            engine.step()
        batch = engine.build_decode_batch(reqs)
        assert engine.decode_graph_runner(reqs, batch) is runner
        assert runner.can_run_graph(batch) and batch.long_rows == (prompt_len == 30)
        for req in reqs:
            engine.abort(req)


@pytest.mark.cuda
def test_on_cuda_long_batches_replay_their_graphs_with_eager_engines_tokens(monkeypatch):
    """The CUDA device's own pair (full graphs, Triton attention) in bfloat16, the long-row
    count lowered to 256 keys (llama-tiny's context is 1,024): the long rows' graphs are
    captured mid-run and replayed, their second launch in every layer, and the tokens
    equal an eager engine's, whose long batches take the same schedule."""
    case = next((c for c in CASES if c.id == "cuda-full-triton-bfloat16"), None)
    if case is None or importlib.util.find_spec("triton") is None:
        pytest.skip("needs CUDA and Triton")
    from graphrt.devices.cuda import attention as cuda_attention

    monkeypatch.setattr(cuda_attention, "LONG_ROW_KEYS", 256)
    loaded = load_model("random:llama-tiny", case.device, case.dtype)
    sizes = {"max_context_len": 1024, "kv_pool_tokens": 4096}
    engine = case_engine(case, loaded, graphs=True, **sizes)
    long_runner = engine.strategy.long_runner
    assert long_runner is not None and long_runner.captured_sizes == []
    prompts = random_prompts((250, 200), seed=7, vocab=loaded.model.vocab_size)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    out = engine.generate(prompts, params)
    # The longer row: 251..261 keys after its 11 decode steps, 256 from the sixth on.
    assert sum(engine.graph_runner.replays_per_size().values()) == 5
    assert sum(long_runner.replays_per_size().values()) == 6
    reference = case_engine(case, loaded, graphs=False, **sizes).generate(prompts, params)
    assert [r.output_ids for r in out] == [r.output_ids for r in reference]


@pytest.mark.cuda
def test_on_cuda_long_batches_list_stage_1_with_the_grid_by_rows_tokens(monkeypatch):
    """A model without long rows' blocks (their measured choice turned off here) under
    LIST_LONG_ROWS (off for the reference, on for the engine), the listed count lowered to
    256 keys: the long rows' graphs are
    captured and replayed with stage 1 as one work list in every layer, and the tokens
    equal those of an eager engine that never lists (the grid by rows): the list changes
    no bit on the GPU."""
    case = next((c for c in CASES if c.id == "cuda-full-triton-bfloat16"), None)
    if case is None or importlib.util.find_spec("triton") is None:
        pytest.skip("needs CUDA and Triton")
    from graphrt.devices.cuda import attention as cuda_attention
    from graphrt.devices.cuda import triton_decode

    launches = []

    def recording(*args, **kwargs):
        launches.append(kwargs.get("work_list", False))
        return triton_decode.decode_attention(*args, **kwargs)

    monkeypatch.setattr(cuda_attention, "long_block_n", lambda head_dim, size: None)
    monkeypatch.setattr(cuda_attention, "decode_attention", recording)
    monkeypatch.setattr(cuda_attention, "LISTED_ROW_KEYS", 256)
    monkeypatch.setattr(triton_decode, "LIST_LONG_ROWS", False)
    loaded = load_model("random:llama-tiny", case.device, case.dtype)
    sizes = {"max_context_len": 1024, "kv_pool_tokens": 4096}
    prompts = random_prompts((250, 200), seed=7, vocab=loaded.model.vocab_size)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    reference = case_engine(case, loaded, graphs=False, **sizes).generate(prompts, params)
    assert launches and not any(launches)  # off: no long graphs, no list
    monkeypatch.setattr(triton_decode, "LIST_LONG_ROWS", True)
    launches.clear()
    engine = case_engine(case, loaded, graphs=True, **sizes)
    long_runner = engine.strategy.long_runner
    assert long_runner is not None and engine.strategy.long_row_keys == 256
    assert launches and not any(launches)  # the plain graphs, captured up front: by rows
    launches.clear()
    out = engine.generate(prompts, params)
    # The longer row: 251..261 keys after its 11 decode steps, 256 from the sixth on.
    assert sum(engine.graph_runner.replays_per_size().values()) == 5
    assert sum(long_runner.replays_per_size().values()) == 6
    assert launches and all(launches)  # the long graphs, captured mid-run: listed
    assert [r.output_ids for r in out] == [r.output_ids for r in reference]
