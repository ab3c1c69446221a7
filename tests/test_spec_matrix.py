"""bench/spec_matrix.py runs end to end on the CPU: the embedded pair's cells, plain and
auto, closed and steady on the same engines, into one JSON, and ``--trace`` writes what
auto weighed each step (the file the chooser's choices are replayed from off the device;
a change to the chooser's record signature once broke it unseen)."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest
import torch
from helpers import load_bench


@pytest.fixture
def matrix():
    return load_bench("spec_matrix")


def test_the_matrix_measures_the_pairs_cells_and_traces_auto(matrix, tmp_path, monkeypatch):
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


@pytest.mark.parametrize("rate", [0.5, 0.7, 0.9])
def test_the_oracle_accepts_each_row_near_its_rate_with_rounds_unlinked(matrix, rate):
    """Every row passes draft depth d with frequency close to rate ** d (well inside
    independent coins' spread), and a round's acceptance says next to nothing of the
    next one's. Coins drifted: a row's 128 tokens once accepted 15% over expectation and
    auto read as 0.87 of the best mode. A Weyl sequence fails the second check: its
    rounds alternate, which misleads a chooser that follows recent acceptance."""
    batch, nodes, rounds = 8, 6, 320
    seen = []
    oracle = matrix.CoinAcceptance(lambda tree, forced, room: seen.append(forced), "cpu")
    oracle.rate.fill_(rate)
    tree = SimpleNamespace(
        tokens=torch.arange(1, nodes + 1).repeat(batch, 1),  # (B, n) a chain's drafts
        depth=torch.arange(nodes).repeat(batch, 1),
    )
    target = torch.zeros(batch, nodes, dtype=torch.long)  # never what was drafted
    for _ in range(rounds):
        oracle(tree, target, torch.full((batch,), 100))
    forced = torch.stack(seen)  # (rounds, B, n)
    passed = forced[:, :, :-1] == tree.tokens[:, 1:]  # (rounds, B, n - 1): depths 1..n-1
    chains = passed.int().cumprod(-1).bool()  # a depth passes only where its parent did
    assert torch.equal(chains, passed)
    expected = rate ** torch.arange(1, nodes, dtype=torch.float64)
    by_row = passed.double().mean(0)  # (B, n - 1)
    coins_spread = (expected * (1 - expected) / rounds).sqrt()  # one standard deviation
    misses = (by_row - expected).abs() / coins_spread  # coins: 0.8 on average, up to 2-3
    assert misses.mean() < 0.3 and misses.max() < 1.0
    first = passed[:, :, 0].double()  # (rounds, B): accepted the first draft
    now, after = first[:-1] - first.mean(0), first[1:] - first.mean(0)
    lag_one = (now * after).mean(0) / (now * now).mean(0)  # (B,) autocorrelation
    assert lag_one.mean().abs() < 0.1  # a Weyl sequence at rate 0.5: -0.53
    assert not torch.equal(passed[:, 0], passed[:, 1])  # rows read apart


def test_every_mode_of_a_repetition_meets_the_same_coins(matrix, tmp_path, monkeypatch):
    """The oracle's coins restart before each mode's timed run: rounds of 4 on one graph a
    round and on two (the same rounds, eagerly here) accept alike in every repetition,
    and the two repetitions, on other coins, differ. The embedded pair stands in for the
    oracle's random target (a small one, on the CPU)."""
    from graphrt.core.pretrained import ASSISTANT_DIR, TARGET_DIR

    out = tmp_path / "matrix.json"
    argv = ["spec_matrix.py", "--device", "cpu", "--models", "oracle",
            "--oracle-model", str(TARGET_DIR), "--oracle-draft", str(ASSISTANT_DIR),
            "--prompt-len", "8", "--rates", "0.7", "--batch-sizes", "2",
            "--modes", "4,4+2g", "--tokens", "40", "--reps", "2", "--out", str(out)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    accepted = {}
    measure = matrix.measure

    def kept(engine, subject, bs, model, mode, args, workload, rep=0):
        cell = measure(engine, subject, bs, model, mode, args, workload, rep)
        accepted[mode, rep] = (cell["rounds"], cell["accept_length"])  # the timed run's
        return cell

    monkeypatch.setattr(matrix, "measure", kept)
    matrix.main()
    assert accepted["4", 0] == accepted["4+2g", 0] and accepted["4", 1] == accepted["4+2g", 1]
    assert accepted["4", 0] != accepted["4", 1]
