"""Frozen-KV MTP speculative decoding against transformers, on Gemma 4 checkpoints that
transformers makes (float32, CPU): the first round's draft chain, lossless greedy output
(topk 1 and 3, steps 1 to 5, mixed prompt lengths), and speculative sampling's output
distribution on a vocabulary of 8."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import CPU, hf_greedy, random_prompts

from graphrt.core.engine import Engine, EngineConfig, SamplingParams
from graphrt.core.models import load_model
from graphrt.core.runners.base import BaseRunner, RunnerOutput
from graphrt.spec.config import SpecConfig
from graphrt.spec.draft import draft_tree

PROMPT_LENS = (9, 16, 12)  # all longer than the sliding window (6)
NEW_TOKENS = 24


def spec_engine(target, drafter, steps: int, topk: int, graph_backend=None, **config) -> Engine:
    loaded = load_model(str(target.path), CPU, torch.float32)
    draft = load_model(str(drafter.path), CPU, torch.float32)
    cfg = EngineConfig(**{"max_context_len": 128, **config})
    spec = SpecConfig(num_steps=steps, topk=topk)
    return Engine(loaded, CPU, cfg, drafter=draft, spec_config=spec, graph_backend=graph_backend)


@pytest.fixture(scope="module")
def hf_reference(gemma4_tiny):
    prompts = random_prompts(PROMPT_LENS, seed=7)
    return prompts, [hf_greedy(gemma4_tiny.hf, p, NEW_TOKENS)[0] for p in prompts]


@pytest.mark.parametrize("ordered", [False, True], ids=["tied-head", "ordered-embeddings"])
def test_first_round_draft_equals_transformers_candidate_generator(
    ordered, gemma4_tiny, gemma4_assistant, gemma4_assistant_ordered
):
    from transformers import GenerationConfig
    from transformers.generation.candidate_generator import (
        SinglePositionMultiTokenCandidateGenerator,
    )

    drafter = gemma4_assistant_ordered if ordered else gemma4_assistant
    steps = 5
    (prompt,) = random_prompts([15], seed=3)
    target = gemma4_tiny.hf
    with torch.no_grad():
        out = target(
            torch.tensor([prompt]), output_hidden_states=True, return_shared_kv_states=True
        )
        first = int(out.logits[0, -1].argmax())
        ids = torch.tensor([prompt + [first]])
        drafter.hf.generation_config.num_assistant_tokens = steps
        gen = SinglePositionMultiTokenCandidateGenerator(
            drafter.hf, target.get_input_embeddings(), GenerationConfig(max_length=100)
        )
        cand, _ = gen.get_candidates(ids, {"attention_mask": torch.ones_like(ids)}, out, False, 0)
    expected = cand[0, ids.shape[1] :].tolist()

    engine = spec_engine(gemma4_tiny, drafter, steps=steps, topk=1)
    req = engine.add_request(prompt, SamplingParams(max_new_tokens=8, ignore_eos=True))
    engine.step()  # prefill: the first token comes from the target alone
    assert req.output_ids == [first]
    worker = engine.spec_worker
    _, _, drafts = draft_tree(
        worker.draft_runner.execute,
        worker.cfg,
        torch.tensor([first]),
        req.spec_seed.unsqueeze(0),
        torch.tensor([req.req_slot]),
        torch.tensor([req.kv_len], dtype=torch.int32),
        [req.kv_len],
    )
    assert drafts[0].tolist() == expected
    assert len(set(expected)) > 1  # a real chain, not one repeated token


@pytest.mark.parametrize("topk", [1, 3])
@pytest.mark.parametrize("steps", [1, 2, 3, 4, 5])
def test_greedy_with_drafter_equals_transformers(
    steps, topk, gemma4_tiny, gemma4_assistant, hf_reference
):
    prompts, expected = hf_reference
    engine = spec_engine(gemma4_tiny, gemma4_assistant, steps, topk)
    reqs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    assert [r.output_ids for r in reqs] == expected
    assert engine.stats.spec_rounds > 0
    assert engine.kv_pool.available() == engine.kv_pool.num_slots  # every KV slot came back
    for r in reqs:
        for rnd in r.spec_rounds:
            assert len(rnd["draft_tokens"]) == engine.spec_config.num_draft_tokens - 1


class OracleDraftRunner(BaseRunner):
    """Stands in for the drafter to exercise acceptance: proposes each request's true greedy
    continuation, except where ``wrong(request, position, step)`` says to propose a wrong
    token (then, with topk > 1, the right one ranks second, so it sits on a side branch)."""

    def __init__(self, engine: Engine, truth: dict[int, list[int]], topk: int):
        super().__init__(model=None, attn_backend=None)
        self.engine, self.truth, self.topk = engine, truth, topk
        self.calls = 0

    def can_run_graph(self, batch):
        return False

    def load_batch(self, batch):
        pass

    def execute(self, batch) -> RunnerOutput:
        step = self.calls % self.engine.spec_config.num_steps
        self.calls += 1
        vocab = self.engine.loaded.model.vocab_size
        logits = torch.full((batch.num_tokens, vocab), -10.0)
        for row, (slot, pos, tok) in enumerate(
            zip(batch.req_pool_indices.tolist(), batch.positions.tolist(), batch.input_ids.tolist())
        ):
            seq = self.truth[slot]
            on_path = pos + step < len(seq) and seq[pos + step] == tok
            nxt = (
                seq[pos + step + 1]
                if on_path and pos + step + 1 < len(seq)
                else (tok * 7 + 1) % vocab
            )
            wrong = (slot * 5 + pos * 3 + step) % 4 == 0
            bad = (nxt + 1 + step) % vocab
            logits[row, bad if wrong else nxt] = 5.0
            if self.topk > 1:
                logits[row, nxt if wrong else bad] = 4.0
        hidden = torch.zeros(batch.num_tokens, self.engine.loaded.model.config.hidden_size)
        return RunnerOutput(logits=logits, hidden=hidden)


@pytest.mark.parametrize(("steps", "topk"), [(3, 1), (4, 1), (3, 3)])
def test_acceptance_with_varying_accept_lengths_is_lossless(
    steps, topk, gemma4_tiny, gemma4_assistant, hf_reference
):
    prompts, expected = hf_reference
    engine = spec_engine(gemma4_tiny, gemma4_assistant, steps, topk)
    reqs = [
        engine.add_request(p, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
        for p in prompts
    ]
    engine.step()  # prefill assigns request slots
    truth = {r.req_slot: r.prompt_ids + exp for r, exp in zip(reqs, expected)}
    engine.spec_worker.draft_runner = OracleDraftRunner(engine, truth, topk)
    while engine.has_work:
        engine.step()
    assert [r.output_ids for r in reqs] == expected
    hist = engine.stats.accept_histogram
    # Rounds ended at several depths, and some accepted two drafts or more.
    assert sum(1 for h in hist if h) >= 3 and sum(hist[2:]) > 0, hist
    per_request = {tuple(len(rnd["accepted_tokens"]) for rnd in r.spec_rounds) for r in reqs}
    assert len(per_request) > 1  # requests in one batch accepted different lengths
    assert engine.kv_pool.available() == engine.kv_pool.num_slots
    assert engine.stats.accept_length_mean > 1.5


def chi2_quantile(df: int, z: float = 3.09) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z 3.09: p = 0.999)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.slow
def test_speculative_sampling_matches_target_distribution(gemma4_tiny_vocab):
    target, drafter = gemma4_tiny_vocab
    prompt = [1, 5, 3, 6, 4, 7]
    params = dict(temperature=1.0, top_k=6, max_new_tokens=3, ignore_eos=True)
    n = 3000
    engine = spec_engine(
        target, drafter, steps=3, topk=1, max_running_requests=500, max_context_len=32
    )
    reqs = engine.generate([prompt] * n, SamplingParams(**params))
    assert engine.stats.spec_rounds >= n and sum(engine.stats.accept_histogram[1:]) > n // 10
    # Exact target distribution of the 2nd and 3rd tokens (what the speculative round emits),
    # from transformers on every continuation: P(t1) P(t2 | t1) P(t3 | t1, t2).
    hf = target.hf
    vocab = 8

    def probs(seqs: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            logits = hf(seqs).logits[:, -1].double()
        kth = logits.topk(params["top_k"], dim=-1).values[:, -1:]
        return logits.masked_fill(logits < kth, float("-inf")).softmax(-1)

    base = torch.tensor([prompt])
    p1 = probs(base)[0]
    grid = torch.cartesian_prod(torch.arange(vocab), torch.arange(vocab))  # (64, 2): t1, t2
    p2 = probs(torch.cat([base.expand(vocab, -1), torch.arange(vocab).unsqueeze(1)], 1))  # (8, 8)
    p3 = probs(torch.cat([base.expand(len(grid), -1), grid], 1))  # (64, 8)
    joint = p1[:, None, None] * p2[:, :, None] * p3.view(vocab, vocab, vocab)  # (t1, t2, t3)
    expected = joint.sum(0).flatten()  # (t2, t3) marginal: both from one speculative round
    counts = torch.zeros(vocab * vocab, dtype=torch.float64)
    for r in reqs:
        counts[r.output_ids[1] * vocab + r.output_ids[2]] += 1
    keep = expected * n >= 5
    stat = ((counts[keep] - n * expected[keep]) ** 2 / (n * expected[keep])).sum().item()
    assert stat < chi2_quantile(int(keep.sum()) - 1), (stat, int(keep.sum()))
    # Total variation too: a biased acceptance rule (always taking the draft) fails both.
    assert ((counts / n - expected).abs().sum() < 0.2).item()


def test_cli_generate_with_draft_agrees_with_transformers(
    capsys, gemma4_tiny, gemma4_assistant, hf_reference
):
    import json

    from graphrt.core.cli.main import main

    prompts, expected = hf_reference
    argv = ["generate", "--model", str(gemma4_tiny.path), "--draft", str(gemma4_assistant.path)]
    argv += ["--spec-steps", "4", "--max-new-tokens", str(NEW_TOKENS), "--ignore-eos", "--json"]
    for p in prompts:
        argv += ["--prompt-ids", ",".join(map(str, p))]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["output_ids"] for r in out["requests"]] == expected
    spec = out["stats"]["spec"]
    assert set(spec) == {"rounds", "accept_length_mean", "accept_histogram"}
    assert (
        len(spec["accept_histogram"]) == 5 and sum(spec["accept_histogram"]) == spec["rounds"] > 0
    )
    assert spec["accept_length_mean"] >= 1.0
    for req in out["requests"]:
        rounds = req["spec_rounds"]
        assert rounds and all(len(r["draft_tokens"]) == 4 for r in rounds)  # topk 1: the chain
        for r in rounds:  # accepted drafts are a prefix of the chain
            assert r["draft_tokens"][: len(r["accepted_tokens"])] == r["accepted_tokens"]


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--spec-draft-tokens", "9"], "spec-draft-tokens"),
        (["--graph-backend", "bogus"], "offers compile"),
    ],
)
def test_cli_draft_errors_are_one_line(capsys, extra, needle, gemma4_tiny, gemma4_assistant):
    from graphrt.core.cli.main import main

    argv = ["generate", "--model", str(gemma4_tiny.path), "--draft", str(gemma4_assistant.path)]
    assert main([*argv, "--prompt-ids", "5,6,7", "--spec-steps", "2", *extra]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


def test_cli_draft_for_a_non_gemma_target_is_a_one_line_error(capsys, gemma4_assistant, llama_tied):
    from graphrt.core.cli.main import main

    argv = ["generate", "--model", str(llama_tied.path), "--draft", str(gemma4_assistant.path)]
    assert main([*argv, "--prompt-ids", "5,6,7"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Gemma 4 target" in err[0], err


def standin_cuda_backend():
    from conformance.standin import StandInGraphModule

    from graphrt.devices.cuda.graph import CudaFullGraphBackend

    return CudaFullGraphBackend(module=StandInGraphModule())


@pytest.mark.parametrize(("steps", "topk"), [(3, 1), (2, 3)])
@pytest.mark.parametrize("backend", ["standin-cuda-full", "cpu-compile"])
def test_draft_loop_graph_keyed_by_request_batch_size(
    backend, steps, topk, gemma4_tiny, gemma4_assistant, hf_reference
):
    """The whole draft loop captured per request batch size (a GraphRunner subclass):
    padded and exact sizes replay it, the output stays lossless, and its drafts equal
    the eager loop's."""
    from graphrt.devices.cpu.compile import CompiledGraphBackend

    prompts, expected = hf_reference
    graph_backend = (
        standin_cuda_backend() if backend.startswith("standin") else CompiledGraphBackend()
    )
    engine = spec_engine(
        gemma4_tiny, gemma4_assistant, steps, topk, graph_backend=graph_backend,
        graph_buckets=(2, 4), max_running_requests=4,
    )  # fmt: skip
    worker = engine.spec_worker
    assert worker.draft_graph.captured_sizes == [2, 4] and engine.graph_runner is None
    # Three requests (padded to 4), then fewer as they finish at different lengths.
    lengths = [NEW_TOKENS, NEW_TOKENS - 9, NEW_TOKENS - 17]
    reqs = [
        engine.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True))
        for p, n in zip(prompts, lengths)
    ]
    engine.step()  # prefill
    # Same state, both loops: graph drafts equal eager drafts.
    root = torch.tensor([r.output_ids[-1] for r in reqs])
    args = (
        root,
        torch.stack([r.spec_seed for r in reqs]),
        torch.tensor([r.req_slot for r in reqs]),
        torch.tensor([r.kv_len for r in reqs], dtype=torch.int32),
        [r.kv_len for r in reqs],
    )
    eager = draft_tree(worker.draft_runner.execute, worker.cfg, *args)
    graph = worker._draft(*args)
    assert worker.graph_rounds == 1
    for e, g in zip(eager, graph):
        assert torch.equal(e, g)
    while engine.has_work:
        engine.step()
    assert [r.output_ids for r in reqs] == [exp[:n] for exp, n in zip(expected, lengths)]
    assert engine.stats.graph_steps == worker.graph_rounds > engine.stats.spec_rounds // 3
    assert engine.kv_pool.available() == engine.kv_pool.num_slots
