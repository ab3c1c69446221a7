"""bench/eval_pair.py's oracle runs (``--oracle-rate``) on the CPU: the no-draft run's
output is told to ``TokenOracle`` by request slot as requests are admitted (its
``Teacher``), several requests a batch and slots reused, so at rate 1 every round but a
request's last accepts all its drafts and every output equals the no-draft run's."""

from __future__ import annotations

import json
import sys

from helpers import load_bench


def test_an_oracle_run_accepts_the_targets_own_continuation(
    tmp_path, monkeypatch, gemma4_tiny, gemma4_assistant
):
    module = load_bench("eval_pair")
    out = tmp_path / "eval.json"
    argv = ["eval_pair.py", "--target", str(gemma4_tiny.path), "--draft",
            str(gemma4_assistant.path), "--tokens", "random", "--files", "4",
            "--prompt-len", "9", "--max-new-tokens", "9", "--batch-size", "2",
            "--configs", "3x1", "--oracle-rate", "1.0", "--out", str(out)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    assert module.main() == 0
    results = json.loads(out.read_text())["results"]
    drafted = results["steps 3, topk 1 (4 verified)"]
    assert drafted["outputs_equal"] and len(drafted["output_ids"]) == 4
    # 8 tokens a request after its first: 2 rounds of 4; one that ran past the known
    # sequence, or a request told another's, accepts less.
    assert drafted["accept_histogram"] == [0, 0, 0, 4 * 2], drafted["accept_histogram"]
