"""bench/pair_acceptance.py's runs say what graphrt's rounds accept, and bench/chooser_sim.py
replays them: the runs are the model the chooser is tuned on, so an off-by-one in their
anchors would tune it on the wrong text."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import load_bench

from graphrt import devices
from graphrt.core import pretrained
from graphrt.core.engine import Engine, EngineConfig, SamplingParams
from graphrt.core.models import load_model
from graphrt.spec import MTPDecoding, SpecConfig

TOKENS = 40


@pytest.fixture(scope="module")
def pair_runs():
    transformers = pytest.importorskip("transformers")
    pair_acceptance = load_bench("pair_acceptance")
    target_dir, draft_dir = pretrained.model_and_draft(None, None)
    tokenizer = transformers.AutoTokenizer.from_pretrained(target_dir)
    prompts = [
        tokenizer.encode(text, add_special_tokens=False)
        for text in ("def fibonacci(n):\n", "import os\n\nclass Path:\n")
    ]
    load = transformers.AutoModelForCausalLM.from_pretrained
    target = load(target_dir, dtype=torch.float32).eval()
    assistant = load(draft_dir, dtype=torch.float32).eval()
    runs = [pair_acceptance.runs_of(target, assistant, p, TOKENS) for p in prompts]
    return prompts, runs


@pytest.mark.parametrize("steps", [3, 5])
def test_rounds_replayed_over_the_runs_accept_what_the_engine_accepts(pair_runs, steps):
    prompts, runs = pair_runs
    replayed = [0] * (steps + 1)
    for row in runs:  # the engine's rounds: the prefill's token, then rounds to TOKENS
        emitted = 1
        while emitted < TOKENS:
            accepted = min(row[emitted - 1], steps)
            replayed[accepted] += 1
            emitted += accepted + 1
    device = devices.current("cpu")
    target_dir, draft_dir = pretrained.model_and_draft(None, None)
    target = load_model(target_dir, device, torch.float32)
    drafter = load_model(draft_dir, device, torch.float32)
    config = EngineConfig(max_running_requests=1, max_context_len=128, runner="eager")
    engine = Engine(target, config, device, MTPDecoding(drafter, SpecConfig(steps, 1)))
    engine.generate(prompts, SamplingParams(max_new_tokens=TOKENS, ignore_eos=True))
    assert sum(replayed) > 10 and max(replayed[1:]) > 0  # rounds that accepted drafts
    assert engine.stats.accept_histogram == replayed


class FlatTimes:
    """chooser_sim's step times without their noise: a plain step 1 ms, rounds 0.2 ms a
    draft step more."""

    ms = {1: [1.0, 1.2, 1.4, 1.6, 1.8, 2.0]}

    def __call__(self, bucket, k, rng):
        return self.ms[1][k] * 1e-3


def test_every_mode_of_a_cell_reads_the_same_acceptance():
    """Common random numbers: a cell's acceptance is drawn once, so a mode's tokens/s do
    not depend on what drew from the step-time noise before it, and a chooser that knows
    every round's acceptance (the reference) does at least as well as the fixed lengths."""
    chooser_sim = load_bench("chooser_sim")
    runs = chooser_sim.acceptance_runs(7, 1, 0.7, 64)
    assert runs == chooser_sim.acceptance_runs(7, 1, 0.7, 64)
    assert any(n > 0 for n in runs[0]) and any(n < 5 for n in runs[0])
    times, noise = FlatTimes(), random.Random(0)
    for k in range(6):
        alone = chooser_sim.run_cell(times, random.Random(1), runs, 64, fixed=k)
        assert chooser_sim.run_cell(times, noise, runs, 64, fixed=k) == alone
    fixed = [chooser_sim.run_cell(times, noise, runs, 64, fixed=k) for k in range(6)]
    known = chooser_sim.Reference("foresight", times, runs, 64)
    assert chooser_sim.run_cell(times, noise, runs, 64, known) >= max(fixed)
