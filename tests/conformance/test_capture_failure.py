"""A bucket whose capture fails (out of memory, an op the device cannot capture) is
dropped with one warning, its sizes run on the next bucket up or eagerly, and the tokens
are the eager engine's. On the CPU ``compile`` backend, where a graph is compiled at its
first replay, a failed compile runs that bucket uncompiled."""

from __future__ import annotations

import logging

import pytest
import torch
from harness import ENGINE_BUCKETS, case_engine
from helpers import random_prompts

from graphrt.core.batch import ForwardMode
from graphrt.core.engine import Engine, SamplingParams
from graphrt.core.runners.graph import GraphRunner

pytestmark = [
    pytest.mark.graphs,
    pytest.mark.graphs_drops,
    pytest.mark.usefixtures("cpu_compile_without_inductor"),
]

LENS = (5, 33, 12, 1, 21, 8)  # decode batches of 6 (above the buckets) down to 1
GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True)


def _fail_capture_of(size: int, loaded, monkeypatch) -> list[int]:
    """Make the model's forward raise torch.OutOfMemoryError where the graph of ``size``
    decode requests is captured: the capture run itself on device graphs (after both
    warm-up runs, so a breakable backend has a segment open), the trace on compiled code.
    -> the batch sizes it failed for, once per failure."""
    capturing: list[int] = []
    failed: list[int] = []
    forward = loaded.model.forward
    capture_one_shape = GraphRunner.capture_one_shape

    def capture_one_shape_spy(runner, bucket):
        capturing[:] = [bucket, 0]
        try:
            capture_one_shape(runner, bucket)
        finally:
            capturing.clear()

    def failing_forward(batch, attn, *args, **kwargs):
        if batch.mode is ForwardMode.DECODE and batch.batch_size == size:
            if torch.compiler.is_compiling() or capturing:
                if not torch.compiler.is_compiling():
                    capturing[1] += 1  # runs: 2 warm-ups, then the capture
                if torch.compiler.is_compiling() or capturing[1] == 3:
                    failed.append(size)
                    raise torch.OutOfMemoryError(f"injected: no memory for batch {size}")
        return forward(batch, attn, *args, **kwargs)

    monkeypatch.setattr(GraphRunner, "capture_one_shape", capture_one_shape_spy)
    monkeypatch.setattr(loaded.model, "forward", failing_forward)
    return failed


def _run(engine: Engine, prompts) -> list[list[int]]:
    """Requests of LENS stopping one step apart: decode batches shrink 6, 5, ..., 1."""
    reqs = [
        engine.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True))
        for n, p in enumerate(prompts, start=2)
    ]
    while engine.has_work:
        engine.step()
    return [r.output_ids for r in reqs]


@pytest.mark.parametrize("failing", [4, 1], ids=["largest-fails", "smallest-fails"])
def test_failed_capture_drops_the_bucket_and_keeps_the_tokens(
    case, loaded, failing, monkeypatch, caplog
):
    prompts = random_prompts(LENS, seed=21, vocab=loaded.model.vocab_size)
    reference = _run(case_engine(case, loaded, graphs=False), prompts)
    failed = _fail_capture_of(failing, loaded, monkeypatch)
    caplog.set_level(logging.WARNING)
    engine = case_engine(case, loaded, graphs=True)  # captures: the failure happens here...
    tokens = _run(engine, prompts)  # ...or at the first replay of compiled code
    second = _run(engine, prompts)  # and the engine keeps serving
    runner = engine.graph_runner
    lazy = not runner.backend.replays_into_static_outputs
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]

    # One attempt, never retried at a later step. (Under dynamo the list append is a traced
    # side effect, dropped with the failed compile: there the one warning tells.)
    assert lazy or failed == [failing]
    assert tokens == reference and second == reference
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert f"{failing}" in warnings[0].getMessage()
    assert engine.kv_pool.available() == engine.kv_pool.num_slots
    if lazy:  # compiled code: the bucket stays, uncompiled
        assert runner.captured_sizes == list(ENGINE_BUCKETS) and not runner.dropped_buckets
        assert "runs uncompiled" in warnings[0].getMessage()
        return
    kept = [b for b in ENGINE_BUCKETS if b != failing]
    assert runner.captured_sizes == kept == list(runner.buckets)
    assert set(runner.dropped_buckets) == {failing}
    assert "OutOfMemoryError: injected" in runner.dropped_buckets[failing]
    # Sizes the dropped bucket served: on the next bucket up (bucket 4 for size 1), or
    # eagerly (no bucket above 4): 1 prefill + 6 decode steps per run, two runs.
    decode_on_graphs = 1 if failing == 4 else 4  # (size 1) or (sizes 4, 3, 2, 1)
    assert engine.stats.graph_steps == 2 * decode_on_graphs
    assert engine.stats.eager_steps == 2 * (7 - decode_on_graphs)
