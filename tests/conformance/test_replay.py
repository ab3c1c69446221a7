"""Replay: graph outputs equal eager outputs at every bucket, with padding, as the batch
shrinks; padding never touches live KV; outputs survive the next replay."""

from __future__ import annotations

import pytest
import torch
from harness import Harness
from helpers import rel_err

from graphrt.core.batch import ForwardBatch, ForwardMode
from graphrt.core.memory import PADDING_SLOT

pytestmark = pytest.mark.graphs


def _prompt_lens(n: int, seed: int) -> list[int]:
    """Different prompt lengths, short enough that a few decode steps stay in the context."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, 40, (n,), generator=gen).tolist()


def assert_graph_matches_eager(h: Harness, batch: ForwardBatch, runner=None) -> torch.Tensor:
    """Replay ``batch`` and check it against eager; returns the eager logits."""
    runner = runner or h.runner
    assert runner.can_run_graph(batch)
    bucket = runner._pad_to_bucket(batch.batch_size)
    replays = runner.replays_per_size().get(bucket, 0)
    graph = runner.execute(batch).logits
    assert runner.replays_per_size()[bucket] == replays + 1  # the bucket's graph replayed
    padded = runner._loaded[1].batch_size != batch.batch_size
    if h.case.replays_eager_kernels:
        # The graph ran exactly the kernels eager runs on the same static (padded) batch
        # with the graph's metadata: bitwise, padded or not.
        assert torch.equal(graph, h.eager_same_metadata(runner, batch))
    eager = h.eager.execute(batch).logits
    assert graph.shape == eager.shape == (batch.batch_size, h.model.vocab_size)
    if h.case.eager_metadata_matches and not padded:
        assert torch.equal(graph, eager)
    # Otherwise bitwise cannot hold: compiled code reorders arithmetic, the capture-safe
    # torch reference gathers the whole context where eager gathers max(seq_lens) keys,
    # and a padded batch runs its matmuls with more rows. Within 1e-5 (float32) relative.
    assert rel_err(graph, eager) <= h.case.rtol
    assert torch.equal(graph.argmax(-1), eager.argmax(-1))
    return eager


def test_graph_equals_eager_at_every_bucket(graph_case: Harness):
    h = graph_case
    # The configured list, not runner.buckets: a bucket whose capture failed leaves that.
    for i, size in enumerate(h.case.buckets):
        reqs = h.new_requests(_prompt_lens(size, seed=i), seed=i)
        batch = h.decode_batch(reqs)
        assert h.runner._pad_to_bucket(size) == size  # no padding at a bucket size
        assert_graph_matches_eager(h, batch)
        h.release_all()


@pytest.mark.parametrize("size", [3, 9])
def test_padded_batch_equals_eager_on_the_unpadded_batch(graph_case: Harness, size):
    h = graph_case
    bucket = h.runner._pad_to_bucket(size)
    assert bucket is not None and bucket > size  # 3 -> 4, 9 -> 12 (16 and 16 on the CPU)
    reqs = h.new_requests(_prompt_lens(size, seed=size), seed=size)
    assert_graph_matches_eager(h, h.decode_batch(reqs))
    assert h.runner._loaded[1].batch_size == bucket


def test_shrinking_batch_replays_correctly(graph_case: Harness):
    h = graph_case
    largest = max(h.case.buckets)
    reqs = h.new_requests(_prompt_lens(largest, seed=3), seed=3)
    # largest -> 12 -> 3 (exact, then 12 exact or padded, then padded), as requests finish.
    for n in (largest, 12, 3):
        reqs = reqs[:n]
        eager = assert_graph_matches_eager(h, h.decode_batch(reqs))
        h.advance(reqs, eager)


def test_padding_rows_never_write_live_kv(graph_case: Harness):
    h = graph_case
    others = h.new_requests([7, 20, 13, 4], seed=6)  # live requests outside the padded batch
    # Fill the static rows with the others' cache locations first: a padding row that
    # kept a stale location would write into one of them.
    h.runner.execute(h.decode_batch(others))
    reqs = h.new_requests(_prompt_lens(3, seed=5), seed=5)
    batch = h.decode_batch(reqs)
    # The others' bucket (4, or 16 on the CPU): their 4th row is padding in this batch.
    assert h.runner._pad_to_bucket(3) == h.runner._pad_to_bucket(len(others)) > 3
    k_before = [k.clone() for k in h.kv_pool.k_buffers]
    v_before = [v.clone() for v in h.kv_pool.v_buffers]
    table_before = h.req_pool.req_to_token.clone()
    h.runner.execute(batch)
    allowed = {PADDING_SLOT, *batch.out_cache_loc.tolist()}
    for before, after in zip(k_before + v_before, h.kv_pool.k_buffers + h.kv_pool.v_buffers):
        changed = (before != after).flatten(1).any(1).nonzero().flatten().tolist()
        assert set(changed) <= allowed, f"slots {set(changed) - allowed} changed"
        assert set(batch.out_cache_loc.tolist()) <= set(changed)  # the batch's own KV was written
    assert torch.equal(h.req_pool.req_to_token, table_before)


def test_outputs_stay_valid_after_the_next_replay(graph_case: Harness):
    h = graph_case
    reqs = h.new_requests(_prompt_lens(4, seed=8), seed=8)
    first = h.runner.execute(h.decode_batch(reqs))
    kept = (first.logits.clone(), first.hidden.clone())
    h.advance(reqs, first.logits)
    second = h.runner.execute(h.decode_batch(list(reversed(reqs))))  # same bucket, new inputs
    assert not torch.equal(second.logits, kept[0])
    assert torch.equal(first.logits, kept[0]) and torch.equal(first.hidden, kept[1])


@pytest.mark.graphs_shared  # the session's harness captured its graphs
def test_can_run_graph_only_for_decode_within_the_buckets(graph_case: Harness):
    h = graph_case
    largest = h.runner.buckets[-1]
    reqs = h.new_requests(_prompt_lens(largest + 1, seed=9), seed=9)
    assert not h.runner.can_run_graph(h.decode_batch(reqs))  # oversize
    assert h.runner.can_run_graph(h.decode_batch(reqs[:largest]))
    for mode in ForwardMode:
        batch = h.decode_batch(reqs[:1])
        batch.mode = mode
        assert h.runner.can_run_graph(batch) is (mode is ForwardMode.DECODE)


def test_npu_update_rebinds_padded_seq_lens_before_every_replay(graph_case: Harness):
    h = graph_case
    if h.case.id != "npu-standin":
        pytest.skip("the stand-in NPU records its update calls")
    reqs = h.new_requests(_prompt_lens(9, seed=10), seed=10)
    fill = h.runner.attn_backend.seq_len_fill_value()
    for n in (9, 3, 4):
        batch = h.decode_batch(reqs[:n])
        h.runner.execute(batch)
        bucket = h.runner._pad_to_bucket(n)
        graph = h.backend._graphs[h.runner._make_graph_key(bucket)]
        padded = batch.seq_lens_cpu + [fill] * (bucket - n)
        update = [{"actual_seq_lengths_kv": padded}] * 2
        assert graph.calls[-2:] == [("update", update), ("replay", None)]
    # Every replay of every graph was preceded by its update.
    for graph in h.backend.module.graphs:
        calls = [name for name, _ in graph.calls if name in ("update", "replay")]
        assert calls == ["update", "replay"] * graph.replays
