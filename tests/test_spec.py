"""Frozen-KV MTP speculative decoding against transformers, on Gemma 4 checkpoints that
transformers makes (float32, CPU): the first round's draft chain, lossless greedy output
(topk 1 and 3, steps 1 to 5, mixed prompt lengths), and speculative sampling's output
distribution on a vocabulary of 8."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    CPU,
    OracleDraftRunner,
    chi2_quantile,
    cli_error_line,
    cpu_engine,
    hf_greedy,
    host_reads,
    needs_gpu,
    random_prompts,
)

from graphrt.core.engine import Engine, EngineConfig, SamplingParams
from graphrt.core.models import load_model
from graphrt.spec import MTPDecoding, SpecConfig
from graphrt.spec.draft import draft_chain, draft_tree
from graphrt.spec.tree import build_verify_tree

PROMPT_LENS = (9, 16, 12)  # all longer than the sliding window (6)
NEW_TOKENS = 24
SAMPLING_TEMPERATURE = 0.3


def spec_engine(
    target,
    drafter,
    steps: int,
    topk: int,
    device=None,
    one_graph: bool = True,
    draft_rule=None,
    **config,
) -> Engine:
    """An Engine with frozen-KV MTP drafting, eager unless ``device`` brings graphs;
    ``one_graph``: each round on one graph (the default) or the draft loop's and verify's."""
    loaded = load_model(str(target.path), CPU, torch.float32)
    draft = load_model(str(drafter.path), CPU, torch.float32)
    spec = SpecConfig(num_steps=steps, topk=topk, one_graph=one_graph)
    strategy = MTPDecoding(draft, spec, draft_rule=draft_rule)
    runner = "graph" if device is not None else "eager"
    return cpu_engine(
        loaded, strategy, device, **{"max_context_len": 128, "runner": runner, **config}
    )


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
    strategy = engine.strategy
    _, _, drafts = draft_tree(
        strategy.draft_eager.execute,
        strategy.cfg,
        torch.tensor([first]),
        strategy.seed_table[req.req_slot].unsqueeze(0),
        torch.tensor([req.req_slot]),
        torch.tensor([req.kv_len], dtype=torch.int32),
        [req.kv_len],
    )
    assert drafts[0].tolist() == expected
    assert len(set(expected)) > 1  # a real chain, not one repeated token


@pytest.mark.parametrize("ordered", [False, True], ids=["tied-head", "ordered-embeddings"])
@pytest.mark.parametrize("steps", [1, 2, 5])
def test_the_chain_path_drafts_the_general_trees_chain(
    steps, ordered, gemma4_tiny, gemma4_assistant, gemma4_assistant_ordered
):
    """topk 1 verifying every draft takes ``draft_chain`` (no scores, no tree build, and
    the centroid head's argmax without a full row): its tree equals the general path's,
    field by field, for requests at different lengths."""
    drafter = gemma4_assistant_ordered if ordered else gemma4_assistant
    engine = spec_engine(gemma4_tiny, drafter, steps=steps, topk=1)
    prompts = random_prompts([9, 16, 5], seed=11)
    reqs = [
        engine.add_request(p, SamplingParams(max_new_tokens=8, ignore_eos=True)) for p in prompts
    ]
    engine.step()  # prefill
    strategy = engine.strategy
    inputs = strategy.round_inputs(reqs)
    args = (inputs.root, inputs.seed_hidden, inputs.req_slots, inputs.kv_lens, inputs.kv_lens_cpu)
    run = strategy.draft_eager.execute
    chain = draft_chain(run, strategy.cfg, *args)
    general = build_verify_tree(inputs.root, *draft_tree(run, strategy.cfg, *args), 1)
    for name in ("tokens", "parents", "depth", "mask", "valid"):
        assert torch.equal(getattr(chain, name), getattr(general, name)), name
    assert chain.mask.is_contiguous() and chain.depth.is_contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_centroid_greedy_tokens_are_the_argmax_of_its_logits(dtype, gemma4_assistant_ordered):
    """The centroid head's greedy tokens (a chain's draft step) equal the first maximum of
    its full logits row, ties included: rows of the head are duplicated so that selected
    tokens tie, and the smallest tied id must win wherever the clusters put it."""
    drafter = load_model(str(gemma4_assistant_ordered.path), CPU, dtype).model
    weight = drafter.lm_head_weight
    with torch.no_grad():
        weight[1::2] = weight[0::2]  # every odd token scores as the even one before it
    hidden = torch.randn(64, weight.shape[1], generator=torch.Generator().manual_seed(5))
    hidden = hidden.to(dtype)
    expected = drafter.compute_logits(hidden).argmax(dim=-1)
    got = drafter.greedy_tokens(hidden)
    assert torch.equal(got, expected)
    logits = drafter.compute_logits(hidden)
    ties = (logits == logits.amax(dim=-1, keepdim=True)).sum(dim=-1)
    assert (ties > 1).sum() >= 8  # ties happen among selected tokens (14 of 64 rows here)


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
            assert len(rnd["draft_tokens"]) == engine.strategy.cfg.num_draft_tokens - 1


def test_greedy_with_drafter_after_prefills_in_chunks_equals_transformers(
    gemma4_tiny, gemma4_assistant, hf_reference
):
    """Prompts prefilled 5 tokens a step: each request's first seed is the hidden of its
    last chunk's last token, whichever step that chunk ran in."""
    prompts, expected = hf_reference
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    chunked = spec_engine(gemma4_tiny, gemma4_assistant, 3, 1, max_prefill_tokens=5)
    reqs = chunked.generate(prompts, params)
    assert [r.output_ids for r in reqs] == expected
    assert chunked.kv_pool.available() == chunked.kv_pool.num_slots
    # Every round drafts what it drafts after a one-step prefill: the seeds are the same.
    whole = spec_engine(gemma4_tiny, gemma4_assistant, 3, 1).generate(prompts, params)
    assert chunked.stats.spec_rounds > 0
    assert [r.spec_rounds for r in reqs] == [r.spec_rounds for r in whole]


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
    engine.strategy.draft_eager = OracleDraftRunner(engine, truth, topk)
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


@pytest.mark.slow
def test_speculative_sampling_matches_target_distribution(gemma4_tiny_vocab):
    target, drafter = gemma4_tiny_vocab
    prompt = [1, 5, 3, 6, 4, 7]
    # A low temperature keeps the target far from uniform: a biased draw would show.
    params = dict(temperature=SAMPLING_TEMPERATURE, top_k=6, max_new_tokens=3, ignore_eos=True)
    n = 6000
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
            logits = hf(seqs).logits[:, -1].double() / SAMPLING_TEMPERATURE
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
    marginal = ((counts[keep] - n * expected[keep]) ** 2 / (n * expected[keep])).sum().item()
    assert marginal < chi2_quantile(int(keep.sum()) - 1), (marginal, int(keep.sum()))
    # Total variation too: a biased acceptance rule (always taking the draft) fails both.
    assert ((counts / n - expected).abs().sum() < 0.2).item()
    # The draws at accepted nodes, directly: where round 1 accepted its first draft (t2),
    # t3 was drawn at that node and must follow P(t3 | t1, t2), context by context.
    # Checked by hand: with every draw below a round's root sharpened to p^2, this gives
    # 95 against a bound of 60 (30 dof) and the marginal above 134 against 97; unbiased,
    # 34 and 87. (At temperature 0.5 neither caught it: the target was too near uniform.)
    accepted = [r for r in reqs if r.spec_rounds[0]["accepted_tokens"]]
    assert len(accepted) > 500, len(accepted)
    stat, dof = 0.0, 0
    for t1, t2 in grid.tolist():
        drawn = [r.output_ids[2] for r in accepted if r.output_ids[:2] == [t1, t2]]
        if len(drawn) < 20:
            continue
        cell = p3[t1 * vocab + t2] * len(drawn)
        keep = cell >= 5
        seen = torch.bincount(torch.tensor(drawn), minlength=vocab).double()[keep]
        stat += ((seen - cell[keep]) ** 2 / cell[keep]).sum().item()
        dof += int(keep.sum()) - 1
    assert dof >= 3 and stat < chi2_quantile(dof), (stat, dof)


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
    assert set(spec) == {
        "rounds", "graph_rounds", "accept_length_mean", "accept_histogram",
        "accepted_per_position", "drafted_per_position", "plain_steps", "rounds_by_steps",
    }  # fmt: skip
    assert spec["plain_steps"] == 0  # --spec-steps 4: every step a round of 4 steps
    assert spec["rounds_by_steps"] == {"4": spec["rounds"]}
    assert spec["drafted_per_position"] == [spec["rounds"]] * 4
    assert (
        len(spec["accept_histogram"]) == 5 and sum(spec["accept_histogram"]) == spec["rounds"] > 0
    )
    assert spec["accept_length_mean"] >= 1.0
    # Acceptance by draft position: the request-rounds that accepted the draft at each.
    accepted = [len(r["accepted_tokens"]) for req in out["requests"] for r in req["spec_rounds"]]
    assert spec["accepted_per_position"] == [sum(a > i for a in accepted) for i in range(4)]
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
    assert main([*argv, "--prompt-ids", "5,6,7", "--spec-steps", "2", *extra]) == 2  # usage
    err = capsys.readouterr().err
    assert needle in cli_error_line(err), err


@pytest.mark.parametrize("command", ["generate", "serve", "bench"])
def test_cli_round_graphs_reach_the_spec_config(capsys, command):
    """``--round-graphs one|two`` (default one) sets ``SpecConfig.one_graph`` in every
    drafting command; another value is a usage error."""
    from graphrt.core.cli.args import build_parser, spec_config_args

    parser = build_parser()
    for flag, one_graph in (([], True), (["--round-graphs", "two"], False)):
        args = parser.parse_args([command, *flag])
        assert SpecConfig(**spec_config_args(args)).one_graph is one_graph
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args([command, "--round-graphs", "three"])
    assert exit_info.value.code == 2 and "--round-graphs" in capsys.readouterr().err


def test_cli_draft_for_a_non_gemma_target_is_a_one_line_error(capsys, gemma4_assistant, llama_tied):
    from graphrt.core.cli.main import main

    argv = ["generate", "--model", str(llama_tied.path), "--draft", str(gemma4_assistant.path)]
    assert main([*argv, "--prompt-ids", "5,6,7"]) == 2  # usage: the pair does not fit
    err = capsys.readouterr().err
    assert "Gemma 4 target" in cli_error_line(err), err


@pytest.mark.parametrize(
    ("pair", "extra", "needle"),
    [
        (("gemma4_tiny", "llama_tied"), [], "not a frozen-KV MTP assistant"),  # was AttributeError
        (("gemma4_tiny", "gemma4_assistant"), ["--spec-topk", "100000"], "larger than the drafter"),
        (("gemma4_assistant", None), [], "keeps no KV cache of its own"),  # was ZeroDivisionError
    ],
    ids=["draft-not-an-assistant", "topk-above-vocab", "assistant-as-model"],
)
def test_cli_mismatched_models_are_usage_errors(capsys, request, pair, extra, needle):
    from graphrt.core.cli.main import main

    model, draft = (request.getfixturevalue(n).path if n else None for n in pair)
    capsys.readouterr()  # a checkpoint fixture made just now wrote its progress bar
    argv = ["generate", "--model", str(model), "--prompt-ids", "5,6,7", "--device", "cpu"]
    argv += ["--draft", str(draft)] if draft else []
    assert main([*argv, *extra]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and needle in cli_error_line(captured.err), captured.err


def test_a_drafter_in_another_dtype_than_its_target_is_refused(gemma4_tiny, gemma4_assistant):
    from graphrt.core.errors import GraphrtError

    target = load_model(str(gemma4_tiny.path), CPU, torch.float32)
    drafter = load_model(str(gemma4_assistant.path), CPU, torch.bfloat16)
    with pytest.raises(GraphrtError, match="torch.bfloat16 but the target's are torch.float32"):
        drafter.model.bind_target(target.model)


def graph_device(backend: str):
    """A CPU device whose graph backend is the stand-in CUDA graph or torch.compile."""
    from graphrt.devices.cpu import CpuDevice
    from graphrt.devices.cpu.compile import CompiledGraphBackend
    from graphrt.devices.cuda.graph import CudaFullGraphBackend

    def standin():
        from conformance.standin import StandInGraphModule

        return CudaFullGraphBackend(module=StandInGraphModule())

    class GraphDevice(CpuDevice):
        def _graph_backend_factories(self):
            return {backend: standin if backend.startswith("standin") else CompiledGraphBackend}

    return GraphDevice()


@pytest.mark.graphs
@pytest.mark.parametrize(("steps", "topk"), [(3, 1), (2, 3)])
@pytest.mark.parametrize("rounds", ["one-graph", "two-graph"])
def test_rounds_on_graphs_per_request_batch_size(
    rounds, steps, topk, gemma4_tiny, gemma4_assistant, hf_reference
):
    """Rounds captured per request batch size, on the stand-in CUDA backend: one graph a
    round (the default), or the draft loop's and the verify forward's. Padded and exact
    sizes replay them, every round runs on graphs, the output stays lossless (equal to
    transformers' greedy, chains and trees) and two-graph drafts equal the eager loop's.
    (Every backend, CPU compile included, runs the lockstep graph-vs-eager rounds of
    tests/conformance/test_spec_rounds.py.)"""
    prompts, expected = hf_reference
    one_graph = rounds == "one-graph"
    engine = spec_engine(
        gemma4_tiny, gemma4_assistant, steps, topk, device=graph_device("standin-cuda-full"),
        one_graph=one_graph, graph_buckets=(2, 4), max_running_requests=4,
    )  # fmt: skip
    strategy = engine.strategy
    assert engine.graph_runner is None
    on_graphs = (strategy.longest.round,) if one_graph else (
        strategy.draft_graph, strategy.verify_graph
    )  # fmt: skip
    assert all(g.captured_sizes == [2, 4] for g in on_graphs)
    assert (strategy.draft_graph is None) is one_graph
    # Three requests (padded to 4), then fewer as they finish at different lengths.
    lengths = [NEW_TOKENS, NEW_TOKENS - 9, NEW_TOKENS - 17]
    reqs = [
        engine.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True))
        for p, n in zip(prompts, lengths)
    ]
    engine.step()  # prefill
    if not one_graph:  # same state, both loops: graph drafts equal eager drafts
        inputs = strategy.round_inputs(reqs)
        (eager, on_graph), (graph, replayed) = (strategy.draft(inputs, g) for g in (False, True))
        assert (on_graph, replayed) == (False, True)
        for name in ("tokens", "parents", "mask", "valid"):
            assert torch.equal(getattr(eager, name), getattr(graph, name)), name
    while engine.has_work:
        engine.step()
    assert [r.output_ids for r in reqs] == [exp[:n] for exp, n in zip(expected, lengths)]
    stats = engine.stats
    assert stats.graph_rounds == stats.spec_rounds > 0 and stats.graph_steps > 0
    assert stats.eager_steps == 1  # the prefill; every verify forward replayed a graph
    for graph in on_graphs:  # 3 requests padded to 4, then 2 and 1 (padded to 2)
        assert set(graph.replays_per_size()) == {2, 4}
    assert engine.kv_pool.available() == engine.kv_pool.num_slots


@pytest.mark.parametrize(
    ("steps", "topk", "rounds"),
    [
        (3, 1, "eager"),
        pytest.param(3, 1, "one-graph", marks=pytest.mark.graphs),
        pytest.param(3, 1, "two-graph", marks=pytest.mark.graphs),
        (2, 3, "eager"),
        pytest.param(2, 3, "one-graph", marks=pytest.mark.graphs),
        pytest.param(2, 3, "two-graph", marks=pytest.mark.graphs),
    ],
)
def test_the_token_oracle_drafts_the_targets_own_continuation(
    rounds, steps, topk, oracles, gemma4_tiny, gemma4_assistant, hf_reference
):
    """bench/oracles.py's ``TokenOracle``, a draft rule (``MTPDecoding(draft_rule=...)``)
    run inside the captured rounds: at rate 1 each node of a tree's first-child path
    drafts the target's own greedy token, told by request slot and read at the node's
    position. So a chain accepts every draft in every round but a request's last (the
    one that runs past the known sequence), a tree at least its first (which nodes it
    redrafts: tests/test_oracles.py), and the output is transformers' greedy. A slot or a
    position off by one drafts tokens verify rejects."""
    prompts, expected = hf_reference
    oracle = oracles.TokenOracle(max_requests=4, max_context_len=128, device="cpu")
    oracle.rate.fill_(1.0)
    graphs = rounds != "eager"
    engine = spec_engine(
        gemma4_tiny, gemma4_assistant, steps, topk,
        device=graph_device("standin-cuda-full") if graphs else None,
        one_graph=rounds == "one-graph", draft_rule=oracle, max_running_requests=4,
    )  # fmt: skip
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    reqs = [engine.add_request(p, params) for p in prompts]
    engine.step()  # prefill assigns request slots
    for req, continuation in zip(reqs, expected):
        oracle.know(req.req_slot, req.prompt_ids + continuation)
    while engine.has_work:
        engine.step()
    assert [r.output_ids for r in reqs] == expected
    for req in reqs:
        accepted = [len(rnd["accepted_tokens"]) for rnd in req.spec_rounds]
        if topk == 1:
            assert accepted[:-1] == [steps] * (len(accepted) - 1), accepted
        else:
            assert min(accepted[:-1]) >= 1, accepted
    stats = engine.stats
    assert stats.spec_rounds > 0
    assert stats.graph_rounds == (stats.spec_rounds if graphs else 0)


@pytest.mark.parametrize(
    ("steps", "topk", "rounds"),
    [
        pytest.param(3, 1, "one-graph", marks=pytest.mark.graphs),
        pytest.param(3, 1, "two-graph", marks=pytest.mark.graphs),
        (3, 1, "eager"),
        pytest.param(2, 3, "one-graph", marks=pytest.mark.graphs),
        pytest.param(2, 3, "two-graph", marks=pytest.mark.graphs),
        (2, 3, "eager"),
    ],
)
def test_verify_batches_say_whether_every_tree_is_a_chain(
    monkeypatch, rounds, steps, topk, gemma4_tiny, gemma4_assistant
):
    """Attention learns from the verify batch (``VerifyInput.chain``, a host fact) that
    every request's tree is the chain: in one-graph rounds, two-graph verify graphs and
    eager rounds alike when topk is 1 (the CUDA backend then runs small batches on decode's
    kernel), never for trees."""
    from graphrt.core.attention.torch_ref import TorchAttentionBackend
    from graphrt.core.batch import ForwardMode

    seen = []
    forward = TorchAttentionBackend.forward

    def recording(self, q, k, v, spec, batch):
        if batch.mode is ForwardMode.TARGET_VERIFY:
            seen.append(batch.spec_info.chain)
        return forward(self, q, k, v, spec, batch)

    monkeypatch.setattr(TorchAttentionBackend, "forward", recording)
    device = None if rounds == "eager" else graph_device("standin-cuda-full")
    engine = spec_engine(
        gemma4_tiny, gemma4_assistant, steps, topk, device=device,
        one_graph=rounds == "one-graph", graph_buckets=(2,), max_running_requests=2,
    )  # fmt: skip
    engine.generate(random_prompts((9,), seed=3), SamplingParams(max_new_tokens=6))
    assert seen and set(seen) == {topk == 1}, (len(seen), set(seen))
    stats = engine.stats  # the graph kinds' rounds ran on their graphs, not eagerly
    assert stats.graph_rounds == (0 if rounds == "eager" else stats.spec_rounds)
    assert stats.spec_rounds > 0


def test_a_request_whose_round_can_never_fit_is_refused_in_one_line(
    capsys, gemma4_tiny, gemma4_assistant
):
    """Validation and admission use one budget: prompt + new tokens + the verify tree.
    (This request once passed validation and was never admitted: generate() spun.)"""
    from graphrt.core.cli.main import main

    argv = ["generate", "--model", str(gemma4_tiny.path), "--draft", str(gemma4_assistant.path)]
    argv += ["--prompt-ids", "5,6,7", "--max-new-tokens", "6", "--runner", "eager"]
    argv += ["--spec-steps", "4"]
    assert main([*argv, "--kv-pool-tokens", "9"]) == 1  # 3 + 6 + 5 tree nodes > 9
    error = cli_error_line(capsys.readouterr().err)
    assert "needs 14 KV slots" in error and "holds only 9" in error, error
    assert main([*argv, "--kv-pool-tokens", "14"]) == 0  # exactly the budget: admitted


def test_engine_config_refuses_a_zero_request_cap():
    from graphrt.core.errors import GraphrtError

    with pytest.raises(GraphrtError, match="max_running_requests must be >= 1"):
        EngineConfig(max_running_requests=0)


@pytest.mark.parametrize("topk", [1, 3])
def test_rounds_near_the_end_of_the_context_finish_normally(topk, gemma4_tiny, gemma4_assistant):
    """Prompt 250 of a 256-token context with 8 draft steps: deep tree nodes would sit past
    the rope table. The rounds cap acceptance at the context's end and the request ends
    with what plain decoding gives (once an IndexError killed the batch)."""
    (prompt,) = random_prompts([250], seed=9)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    engine = spec_engine(gemma4_tiny, gemma4_assistant, 8, topk, max_context_len=256)
    (req,) = engine.generate([prompt], params)
    plain = cpu_engine(load_model(str(gemma4_tiny.path), CPU, torch.float32), max_context_len=256)
    (expected,) = plain.generate([prompt], params)
    assert req.output_ids == expected.output_ids and len(req.output_ids) == 7  # 256 - 250 + 1
    assert req.finish_reason.value == "length"
    assert engine.kv_pool.available() == engine.kv_pool.num_slots


# ---- CUDA lane ----------------------------------------------------------------------


def cuda_spec_engine(target, drafter, steps: int, topk: int, **config) -> Engine:
    """Frozen-KV MTP on the GPU with the CUDA device's own kernels and graphs, float32."""
    from graphrt.devices.cuda import CudaDevice

    device = CudaDevice()
    loaded, draft = (load_model(str(c.path), device, torch.float32) for c in (target, drafter))
    config = EngineConfig(**{"max_context_len": 128, "graph_buckets": (1, 2, 4), **config})
    return Engine(loaded, config, device, MTPDecoding(draft, SpecConfig(steps, topk)))


@pytest.mark.graphs
@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize(
    "topk,ordered", [(1, False), (3, False), (1, True)], ids=["chain", "tree", "chain-centroids"]
)
def test_cuda_greedy_with_drafter_on_graphs_equals_transformers(
    topk, ordered, gemma4_tiny, gemma4_assistant, gemma4_assistant_ordered, hf_reference
):
    """Graph rounds (one graph each, the default) give transformers' greedy tokens, and draft
    what eager rounds of the same kernels draft, round by round (the centroid head: its
    Triton top-k and argmax in the round's graph). Three requests: a one-graph round embeds
    column 0 of its (B, n) node ids, a strided view, whose rows past the first the
    embedding kernel once read with unit stride (other nodes' tokens: only verify kept the
    output right)."""
    prompts, expected = hf_reference
    drafter = gemma4_assistant_ordered if ordered else gemma4_assistant
    engine = cuda_spec_engine(gemma4_tiny, drafter, 4, topk)
    round_graph = engine.strategy.longest.round
    assert engine.attn_backend.name == "triton" and round_graph is not None
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    reqs = engine.generate(prompts, params)
    assert [r.output_ids for r in reqs] == expected
    assert engine.stats.graph_rounds == engine.stats.spec_rounds > 0
    assert sum(round_graph.replays_per_size().values()) > 0
    assert engine.kv_pool.available() == engine.kv_pool.num_slots
    eager = cuda_spec_engine(gemma4_tiny, drafter, 4, topk, runner="eager")
    eager_reqs = eager.generate(prompts, params)
    assert eager.stats.graph_rounds == 0 < eager.stats.spec_rounds
    drafts = [[rnd["draft_tokens"] for rnd in r.spec_rounds] for r in reqs]
    assert drafts == [[rnd["draft_tokens"] for rnd in r.spec_rounds] for r in eager_reqs]


@pytest.mark.graphs
@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("topk,batch", [(1, 3), (3, 1)])
def test_cuda_16_bit_greedy_with_drafter_equals_without_batch_invariant(
    dtype, topk, batch, gemma4_tiny, gemma4_assistant
):
    """With the batch-invariant ops (--batch-invariant) a verify row rounds as a decode row
    in 16-bit: every matmul on tensor-core tiles (a row's bits whatever the rows beside it),
    attention on decode's splits. So drafting changes no greedy token of a random model,
    whose top logits are near ties that any other rounding flips. Batch 3 runs in bucket 4:
    4 decode rows, 20 verify rows."""
    from graphrt.devices.cuda import CudaDevice

    device = CudaDevice()

    def load(checkpoint):
        return load_model(str(checkpoint.path), device, dtype, batch_invariant=True)

    config = EngineConfig(max_context_len=128, graph_buckets=(1, 2, 4))
    spec = Engine(
        load(gemma4_tiny), config, device, MTPDecoding(load(gemma4_assistant), SpecConfig(4, topk))
    )
    plain = Engine(load(gemma4_tiny), config, device)
    modules = [*spec.loaded.model.modules(), *plain.loaded.model.modules()]
    assert {m.ops.name for m in modules if hasattr(m, "ops")} == {"triton-batch-invariant"}
    prompts = random_prompts([9, 16, 12, 20, 7, 14], seed=11)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    for i in range(0, len(prompts), batch):
        group = prompts[i : i + batch]
        got = [r.output_ids for r in spec.generate(group, params)]
        assert got == [r.output_ids for r in plain.generate(group, params)], f"prompts {i}.."
    assert spec.stats.graph_rounds == spec.stats.spec_rounds > 0
    assert spec.kv_pool.available() == spec.kv_pool.num_slots


@pytest.mark.graphs
@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("overlap", [False, True], ids=["read-each", "overlap"])
@pytest.mark.parametrize("topk", [1, 3])
def test_cuda_round_waits_on_the_device_once(
    topk, overlap, gemma4_tiny, gemma4_assistant, monkeypatch
):
    """Every step of a round is device work: with torch's sync debug mode set to "error",
    whole rounds (graphs, tree, greedy and sampled acceptance, KV commit, frees, finishing
    requests) run with one host wait each, the pinned copy of the round's results
    (``HostRead.wait``: a round's launch and its settle apart, the engine waits there);
    each round launched behind the one before too (the default on CUDA), the round
    launched past a request's end and dropped included."""
    from graphrt.core.host import HostRead

    engine = cuda_spec_engine(gemma4_tiny, gemma4_assistant, 4, topk, overlap=overlap)
    prompts = random_prompts([9, 16, 12], seed=4)
    sampled = SamplingParams(max_new_tokens=10, temperature=0.7, top_p=0.9, ignore_eos=True)
    greedy = SamplingParams(max_new_tokens=14, ignore_eos=True)
    reqs = [engine.add_request(p, params) for p, params in zip(prompts, (greedy, sampled, greedy))]
    engine.step()  # prefill (samples on the host; not a round)
    # The first round with a sampled request: its sampled verify graphs are captured just
    # before it (capture synchronises): the rounds counted come after.
    engine.step()
    rounds0 = engine.stats.graph_rounds, engine.stats.spec_rounds
    forwards0 = engine.stats.graph_steps  # one a round (every request's round in one graph)
    waits = []
    wait = HostRead.wait

    def counted(read):
        if read._values is None:  # a read already waited for waits no more
            waits.append(read._host.shape)
        torch.cuda.set_sync_debug_mode(0)  # the one wait a round is allowed
        try:
            return wait(read)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    monkeypatch.setattr(HostRead, "wait", counted)
    rounds = 0
    torch.cuda.set_sync_debug_mode("error")
    try:
        while engine.has_work:
            engine.step()
            rounds += 1
    finally:
        torch.cuda.set_sync_debug_mode(0)
    # A sync the debug mode refused fails its step (engine.step keeps the engine going):
    # no request may have failed.
    assert all(r.error is None for r in reqs), [r.error for r in reqs]
    graph_rounds = engine.stats.graph_rounds - rounds0[0]
    assert graph_rounds == engine.stats.spec_rounds - rounds0[1] > 0
    if overlap:  # a round launched in the step before settles in the steps counted, and a
        # round launched past the requests' end settles inside a step: a wait each round
        forwards = engine.stats.graph_steps - forwards0
        assert engine.stats.launched_ahead > 0 and len(waits) == forwards >= 3
    else:
        assert len(waits) == rounds >= 3
    assert engine.kv_pool.available() == engine.kv_pool.num_slots


def test_cli_spec_bench_refuses_a_missing_out_directory_before_running(
    capsys, tmp_path, gemma4_tiny, gemma4_assistant
):
    from graphrt.core.cli.main import main

    argv = ["bench", "--model", str(gemma4_tiny.path), "--draft", str(gemma4_assistant.path)]
    for draft in ([], argv[-2:]):  # the plain decode bench too (it lost its results)
        out = tmp_path / "missing" / "bench.json"
        assert main([*argv[:3], *draft, "--out", str(out), "--device", "cpu"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "does not exist" in err[0], err


@pytest.mark.parametrize("topk", [1, 3])
def test_a_round_reads_no_value_to_the_host_but_its_outcome(gemma4_tiny, gemma4_assistant, topk):
    """A speculative round (drafts, verify, acceptance, greedy and sampled rows) reads no
    tensor value to the host beyond its packed outcome (none of HOST_READS): on CUDA a
    stray read is a wait on the device inside the round."""
    engine = spec_engine(gemma4_tiny, gemma4_assistant, 3, topk)
    engine.add_requests(random_prompts([9, 16], seed=1), SamplingParams(max_new_tokens=20))
    sampled = SamplingParams(max_new_tokens=20, temperature=0.8)
    engine.add_requests(random_prompts([12], seed=2), sampled)
    for _ in range(3):  # prefill, then rounds
        engine.step()
    rounds, running = engine.stats.spec_rounds, len(engine.running)
    assert host_reads(engine.step) == []
    assert engine.stats.spec_rounds == rounds + running  # (one a request)
