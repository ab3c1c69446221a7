"""Graph tests fail when graphs do not run.

A failed capture degrades to eager steps and a warning (GraphRunner.capture), which
keeps serving but would turn a broken capture into a passing eager run. So every test
marked ``graphs`` asserts that graphs replayed, and this test holds them to it: it runs
them with every capture forced to fail, in pytest and in every process the tests start
(tests/fail_captures/sitecustomize.py), and expects each one to fail.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from helpers import FAIL_CAPTURES

ROOT = Path(__file__).resolve().parents[1]
# The lane has 141 graph tests (2026-12-02); far fewer means the marker was lost somewhere.
MIN_GRAPH_TESTS = 130


@pytest.mark.slow
def test_every_graph_test_fails_when_every_capture_fails(tmp_path):
    if os.environ.get(FAIL_CAPTURES) == "1":
        pytest.skip("already running with every capture failing")
    report = tmp_path / "report.xml"
    selection = "graphs and not cuda and not npu and not xpu"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-m", selection, "-q", "-p", "no:cacheprovider",
         f"--junitxml={report}", "tests"],
        cwd=ROOT, env={**os.environ, FAIL_CAPTURES: "1"}, capture_output=True, text=True,
        timeout=1800,
    )  # fmt: skip
    assert report.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    passed, ran = [], 0
    for case in ET.parse(report).iter("testcase"):
        outcome = {child.tag for child in case} & {"failure", "error", "skipped"}
        ran += "skipped" not in outcome
        if not outcome:
            passed.append(f"{case.get('classname')}::{case.get('name')}")
    assert ran >= MIN_GRAPH_TESTS, f"only {ran} graph tests ran:\n{proc.stdout[-2000:]}"
    assert not passed, "these graph tests pass with no graph:\n" + "\n".join(passed)
