"""bench/spec_matrix.py runs end to end on the CPU: the embedded pair's cells, plain and
auto, closed and steady on the same engines, into one JSON, and ``--trace`` writes what
auto weighed each step (the file the chooser's choices are replayed from off the device;
a change to the chooser's record signature once broke it unseen)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_the_matrix_measures_the_pairs_cells_and_traces_auto(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("spec_matrix", BENCH / "spec_matrix.py")
    matrix = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "spec_matrix", matrix)  # its dataclasses look it up
    spec.loader.exec_module(matrix)
    out, trace = tmp_path / "matrix.json", tmp_path / "trace.jsonl"
    # 72 tokens: auto tries no round (so weighs nothing) in a batch with fewer than 64
    # left before one has measured acceptance.
    argv = ["spec_matrix.py", "--device", "cpu", "--models", "pair", "--batch-sizes", "2",
            "--modes", "plain,auto", "--tokens", "72", "--reps", "1",
            "--workloads", "closed,steady",
            "--out", str(out), "--trace", str(trace)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    matrix.main()
    result = json.loads(out.read_text())
    assert result["workloads"] == ["closed", "steady"]
    cells = {(c["mode"], c["workload"]): c for c in result["cells"]}
    assert set(cells) == {(m, w) for m in ("plain", "auto") for w in ("closed", "steady")}
    assert all(c["tokens_per_s"] > 0 for c in cells.values())
    assert sum(cells["auto", "closed"]["steps_by_count"]) > 0
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    labels = {"pair bs2 warm", "pair bs2", "pair bs2 steady warm", "pair bs2 steady"}
    assert {line["cell"] for line in lines} == labels
    weighed = [line for line in lines if line["tokens"] is not None]
    assert weighed and all(len(line["weighed_ms"]) == 6 for line in weighed)
