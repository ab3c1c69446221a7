"""Graph tests fail when graphs do not run.

A failed capture degrades to eager steps and a warning (GraphRunner.capture), which
keeps serving but would turn a broken capture into a passing eager run. So every test
marked ``graphs`` is held to graphs two ways:

- conftest fails one that passes with no graph replayed in its process while it ran
  (helpers.GraphWitness; graphs a child process replayed, the test reports), or, for a
  test about capture itself (``graphs_capture``), none captured; and one in whose process
  a bucket's capture failed and was dropped (its sizes ran on another bucket or eagerly),
  unless it is about that (``graphs_drops``); its hooks are tested here;
- a test whose graphs that witness cannot see (built by a fixture other tests share) is
  marked ``graphs_shared`` too, and must fail when it runs with every capture forced to
  fail, in pytest and in every process the tests start (tests/fail_captures/).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
from helpers import FAIL_CAPTURES, ProbeItem, folder_conftest
from pluggy import Result

ROOT = Path(__file__).resolve().parents[1]
LANE = "not cuda and not npu and not xpu"
# The lane's counts (2026-12-03): 151 graph tests, 20 of them graphs_shared; far fewer
# means a marker was lost somewhere.
MIN_GRAPH_TESTS = 130
MIN_SHARED_TESTS = 10


def _pytest(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, "tests"],
        cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip


# Loaded into the forced-failure run (-p): counts the lane's graph tests before -m
# deselects all but the shared ones, so that one pytest run (one collection of every
# test module, importing torch and transformers) serves both checks.
_COUNT_GRAPH_TESTS = """
import os
import pytest

@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    lane = [item for item in items if item.get_closest_marker("graphs")
            and not any(item.get_closest_marker(m) for m in ("cuda", "npu", "xpu"))]
    with open(os.environ["GRAPHRT_TEST_GRAPH_COUNT"], "w") as f:
        f.write(str(len(lane)))
"""


@pytest.mark.slow
def test_every_shared_graph_test_fails_when_every_capture_fails(tmp_path):
    if os.environ.get(FAIL_CAPTURES) == "1":
        pytest.skip("already running with every capture failing")
    (tmp_path / "count_graph_tests.py").write_text(_COUNT_GRAPH_TESTS)
    path = os.environ.get("PYTHONPATH")
    count, report = tmp_path / "graph_tests", tmp_path / "report.xml"
    proc = _pytest(
        "-p", "count_graph_tests", "-m", f"graphs_shared and {LANE}", f"--junitxml={report}",
        **{FAIL_CAPTURES: "1", "GRAPHRT_TEST_GRAPH_COUNT": str(count)},
        PYTHONPATH=str(tmp_path) + (os.pathsep + path if path else ""),
    )  # fmt: skip
    assert report.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    assert int(count.read_text()) >= MIN_GRAPH_TESTS, proc.stdout[-2000:]
    passed, ran = [], 0
    for case in ET.parse(report).iter("testcase"):
        outcome = {child.tag for child in case} & {"failure", "error", "skipped"}
        ran += "skipped" not in outcome
        if not outcome:
            passed.append(f"{case.get('classname')}::{case.get('name')}")
    assert ran >= MIN_SHARED_TESTS, f"only {ran} shared graph tests ran:\n{proc.stdout[-2000:]}"
    assert not passed, "these graph tests pass with no graph:\n" + "\n".join(passed)


def _generate(prompts=((5, 6, 7), (8, 9)), **config):
    """A graph-capable engine over random:llama-tiny that generates 3 tokens for each of
    ``prompts`` (none: it only captures, when ``config`` asks for graphs)."""
    from helpers import cpu_engine

    from graphrt.core.engine import SamplingParams
    from graphrt.core.models import load_model
    from graphrt.devices.cpu import CpuDevice

    loaded = load_model("random:llama-tiny", CpuDevice(), torch.float32)
    engine = cpu_engine(loaded, max_context_len=32, **{"graph_buckets": (2,), **config})
    if prompts:
        engine.generate(
            [list(p) for p in prompts], SamplingParams(max_new_tokens=3, ignore_eos=True)
        )
    return engine


def _outcome_of(conftest, item: ProbeItem, body) -> BaseException | None:
    """What conftest's setup and call hooks make of a passing test running ``body``."""
    setup = conftest.pytest_runtest_setup(item)
    next(setup)
    with contextlib.suppress(StopIteration):
        setup.send(Result(None, None))
    call = conftest.pytest_runtest_call(item)
    next(call)
    body()
    outcome = Result(None, None)
    with contextlib.suppress(StopIteration):
        call.send(outcome)
    return outcome.exception


def test_conftest_fails_a_graphs_test_that_ran_no_graph(request):
    from helpers import standin_device

    conftest = folder_conftest(request.config)

    eager = _outcome_of(conftest, ProbeItem("eager", "graphs"), _generate)
    assert isinstance(eager, pytest.fail.Exception)
    assert "marked graphs, but no graph was replayed" in str(eager)
    assert _outcome_of(conftest, ProbeItem("shared", "graphs", "graphs_shared"), _generate) is None
    assert _outcome_of(conftest, ProbeItem("unmarked"), _generate) is None

    def on_graphs():
        assert _generate(runner="graph", device=standin_device()).stats.graph_steps > 0

    assert _outcome_of(conftest, ProbeItem("graphs", "graphs"), on_graphs) is None

    def capture_only():  # the engine captures its buckets; nothing generates
        _generate(runner="graph", device=standin_device(), prompts=[])

    never_replayed = _outcome_of(conftest, ProbeItem("captured", "graphs"), capture_only)
    assert isinstance(never_replayed, pytest.fail.Exception)
    assert "marked graphs, but no graph was replayed" in str(never_replayed)
    about_capture = ProbeItem("capture", "graphs", "graphs_capture")
    assert _outcome_of(conftest, about_capture, capture_only) is None
    captured_nothing = _outcome_of(conftest, about_capture, _generate)
    assert "marked graphs, but no graph was captured" in str(captured_nothing)


def test_conftest_fails_a_graphs_test_whose_bucket_was_dropped(request, monkeypatch):
    from helpers import standin_device

    from graphrt.core.runners.graph import GraphRunner

    conftest = folder_conftest(request.config)
    capture = GraphRunner.capture_one_shape  # the witness's counting wrapper

    def failing_at_one(runner, size):
        if size == 1:
            raise torch.OutOfMemoryError("injected: no memory for batch 1")
        return capture(runner, size)

    monkeypatch.setattr(GraphRunner, "capture_one_shape", failing_at_one)
    engines = []

    def one_dropped():  # batches of 2 replay their graph; the 1 bucket failed at capture
        engine = _generate(runner="graph", device=standin_device(), graph_buckets=(1, 2))
        assert engine.stats.graph_steps > 0
        engines.append(engine)

    dropped = _outcome_of(conftest, ProbeItem("dropped", "graphs"), one_dropped)
    assert isinstance(dropped, pytest.fail.Exception)
    assert "1 bucket capture(s) failed and were dropped" in str(dropped)
    assert list(engines[0].graph_runner.dropped_buckets) == [1]
    about_drops = ProbeItem("about drops", "graphs", "graphs_drops")
    assert _outcome_of(conftest, about_drops, one_dropped) is None
    # A shared fixture's captures run in the setup of its first test: its drops fail that
    # test though it need not replay.
    shared = _outcome_of(conftest, ProbeItem("shared", "graphs", "graphs_shared"), one_dropped)
    assert isinstance(shared, pytest.fail.Exception)
    assert "1 bucket capture(s) failed and were dropped" in str(shared)
