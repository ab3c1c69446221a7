"""The ``graph_case`` fixture: every conformance test runs once per graph backend case
available in this process (see harness.py for the cases)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

# `from harness import ...` under every --import-mode (as tests/conftest.py does for helpers).
_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from harness import CASES, GraphCase, Harness, loaded_model, without_inductor  # noqa: E402

# ---- fixtures ------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def session_cache() -> dict:
    """Models and harnesses built once per session (a capture per case, not per test)."""
    cache: dict = {}
    yield cache
    for item in cache.values():
        if isinstance(item, Harness):
            item.runner.cleanup()


@pytest.fixture(params=[pytest.param(c, id=c.id, marks=c.marks) for c in CASES])
def case(request) -> GraphCase:
    return request.param


@pytest.fixture
def cpu_compile_without_inductor(case, monkeypatch):
    """For modules whose subject is the Engine's dispatch or fallback (graphs, eager,
    padding, failed captures), the same over any dynamo backend: the CPU compile case
    compiles through dynamo without inductor (harness.without_inductor). Inductor's code
    is checked at every bucket by test_replay; its cache served these modules' buckets
    only when test_replay had compiled them first (10-26 s of the lane by file order)."""
    if case.id == "cpu-compile":
        monkeypatch.setattr(torch, "compile", without_inductor(torch.compile))


@pytest.fixture
def loaded(case, session_cache):
    return loaded_model(case, session_cache)


@pytest.fixture
def graph_case(case, session_cache) -> Harness:
    """The case's captured harness, with no live requests left over from earlier tests."""
    key = ("harness", case.id)
    if key not in session_cache:
        session_cache[key] = Harness(case, loaded_model(case, session_cache))
    harness = session_cache[key]
    yield harness
    harness.release_all()
