"""Capture: exactly the configured buckets, largest first, in one session; cleanup and
recapture; per-device capture details (breakable segments, NPU update support)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness import Harness, check_many_runners, without_inductor
from helpers import GraphWitness, rel_err

from graphrt.core.errors import GraphrtError
from graphrt.core.runners import ShapeKey

pytestmark = pytest.mark.graphs


# The session's harness captures on first use: in this test in the lane's order, in an
# earlier test on the same worker in another (pytest-xdist's default reordering).
@pytest.mark.graphs_shared
def test_captures_configured_buckets_largest_first_in_one_session(graph_case: Harness):
    h = graph_case
    assert h.runner.buckets == h.case.buckets
    assert h.runner.captured_sizes == sorted(h.case.buckets)
    expected = [ShapeKey(size) for size in sorted(h.case.buckets, reverse=True)]
    assert h.capture_log == ["session-enter", *expected, "session-exit"]


@pytest.mark.graphs_shared  # the session's harness captured its graphs
def test_stream_graphs_share_one_pool(graph_case: Harness):
    module = getattr(graph_case.backend, "module", None)
    if not graph_case.case.is_standin or module is None:
        pytest.skip("only the stand-in shows which pool each graph was captured into")
    assert len(module.pools) == 1  # one graph_pool_handle() for the whole capture
    assert {g.pool for g in module.graphs} == set(module.pools)


def test_capture_sessions_share_one_side_stream():
    """Every session captures on one stream: each fresh one would cost cuBLAS a workspace
    for the life of the process (32 MiB on Hopper), counted as graph memory."""
    from standin import StandInGraphModule

    from graphrt.devices.cuda.graph import CudaFullGraphBackend

    module = StandInGraphModule()
    backend = CudaFullGraphBackend(module)
    x = torch.zeros(2)
    try:
        for size in (2, 1):  # as lazy captures: one session each
            with backend.capture_session():
                backend.capture_one(ShapeKey(size), lambda: x + 1)
        streams = [context["stream"] for context in module.graph_contexts]
        assert len(streams) == 2 and streams[0] is streams[1]
        assert streams[0] is not module.default_stream
        with backend.replay_session():  # both graphs replay after the second session
            backend.replay(ShapeKey(2))
            backend.replay(ShapeKey(1))
    finally:
        backend.cleanup()


@pytest.mark.graphs_shared  # the session's harness captured its graphs
def test_breakable_capture_segments(graph_case: Harness):
    h = graph_case
    if not h.case.breakable:
        pytest.skip("not a breakable backend")
    layers = len(h.model.kv_layer_specs())
    # Attention that is not capture-safe is a graph break: layers + 1 segments per
    # forward, the attention running eagerly between them. Capture-safe: one segment.
    per_key = 1 if h.attn.capture_safe else layers + 1
    for key in h.backend.keys():
        assert len(h.backend._graphs[key].graphs) == per_key, key
    if h.case.is_standin:
        assert not h.attn.capture_safe
        assert len(h.backend.module.graphs) == len(h.case.buckets) * (layers + 1)


@pytest.mark.graphs_shared  # the session's harness captured its graphs
def test_npu_graphs_are_captured_with_auto_dispatch(graph_case: Harness):
    h = graph_case
    if h.case.id != "npu-standin":
        pytest.skip("the stand-in NPU records its graph contexts")
    contexts = h.backend.module.graph_contexts
    assert len(contexts) == len(h.case.buckets)
    assert all(c["auto_dispatch_capture"] is True for c in contexts)


def test_cleanup_then_capture_again(graph_case: Harness, monkeypatch):
    h = graph_case
    if h.case.id == "cpu-compile":  # dynamo's cache across cleanup, not inductor's codegen
        monkeypatch.setattr(torch, "compile", without_inductor(torch.compile))
    buckets = (2,)  # its own tiny list: a CPU compile per capture
    runner = h.new_runner(buckets)
    reqs = h.new_requests([5, 11], seed=7)
    for attempt in range(2):
        runner.capture()
        assert runner.captured_sizes == [2]
        batch = h.decode_batch(reqs)
        assert runner.can_run_graph(batch)
        graph = runner.execute(batch)
        eager = h.eager.execute(batch)
        assert rel_err(graph.logits, eager.logits) <= h.case.rtol, f"attempt {attempt}"
        assert torch.equal(graph.logits.argmax(-1), eager.logits.argmax(-1))
        h.advance(reqs, eager.logits)
        runner.cleanup()
        assert runner.captured_sizes == []
        assert not runner.can_run_graph(batch)


def test_a_second_runner_of_one_shape_on_one_backend_is_refused(graph_case: Harness):
    """Graph keys come from a runner's GraphShape and a size: a second runner of the same
    shape on the same backend would replace the first's graphs (and a drop would forget
    them), so its capture is refused whole, and the first runner's graphs still replay."""
    h = graph_case
    backend = h.case.make_backend()
    first, second = h.new_runner((2,), backend=backend), h.new_runner((2,), backend=backend)
    first.capture()
    try:
        with pytest.raises(GraphrtError, match="captured already on this backend"):
            second.capture()
        assert second.captured_sizes == [] and first.captured_sizes == [2]
        batch = h.decode_batch(h.new_requests([5, 11], seed=9))
        assert first.can_run_graph(batch)
        assert torch.equal(first.execute(batch).logits, first.execute(batch).logits)
    finally:
        first.cleanup()


def test_many_runners_in_one_process_each_replay_their_own_graphs(graph_case: Harness):
    """Several GraphRunners live in one process (an Engine per configuration, target and
    draft runners, cleanup and recapture): each keeps replaying its own graphs."""
    if graph_case.case.id != "cpu-compile":
        check_many_runners(graph_case)
        return
    # dynamo's cache of compiled code is process-wide and outlives runners: run in a
    # fresh interpreter, so that whatever this leaves behind cannot reach other tests.
    script = (
        "import sys; sys.path[:0] = sys.argv[1:]; "
        "import harness; harness.check_many_runners_alone('cpu-compile')"
    )
    here = Path(__file__).resolve().parent
    proc = subprocess.run(
        [sys.executable, "-c", script, str(here), str(here.parent)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # The child's replays, for conftest; it fails on a dropped bucket itself.
    GraphWitness.saw(int(proc.stdout.split()[-1]), drops=0)


@pytest.mark.graphs_capture  # what capture built; nothing replays
def test_device_graphs_share_one_logits_buffer(graph_case: Harness):
    """Every bucket's logits are rows of one buffer sized for the largest bucket (device
    graph backends; compiled code returns fresh outputs); the draft loop's runner, which
    computes no model logits, holds none."""
    h = graph_case
    shared = h.runner._shared_logits
    if not h.backend.replays_into_static_outputs:
        assert shared is None
        pytest.skip("compiled code returns fresh outputs: nothing to share")
    largest = max(h.case.buckets)
    assert shared.shape == (largest, h.model.vocab_size) and shared.dtype == torch.float32
    for key, (_, outputs) in h.runner._captured.items():
        assert outputs.logits.data_ptr() == shared.data_ptr(), key
        assert outputs.logits.shape == (key.size, h.model.vocab_size)
    own_loop = h.new_runner(
        (1, 2), backend=h.case.make_backend(), forward=lambda batch: (batch.input_ids + 1,)
    )
    own_loop.capture()
    assert own_loop._shared_logits is None
    own_loop.cleanup()
