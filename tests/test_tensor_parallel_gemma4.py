"""Tensor parallelism for Gemma 4 on the CPU: 2 ranks over gloo, each loading its shard of
a transformers-made checkpoint, serving the same prompts in lockstep (SPMD), give the
greedy tokens of one process holding the whole model, on the eager runner and on graphs
(the stand-in CUDA graph backend, the collectives recorded inside the graphs):

- the E2B-shaped target (per-layer inputs, KV sharing, double-wide MLP, softcapping);
- the same target drafting with its MTP assistant (tied head, and the centroid-ordered
  head): the assistant's query heads read the KV heads of their rank;
- a 31B-shaped target with one KV head replicated on both ranks (K = V on full layers,
  untied head), alone and with an assistant reading that one head.

Heads that do not split over the ranks are refused at build time in one line.

All cases run in one pair of spawned processes: starting them costs more than the cases.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from helpers import (
    CPU,
    GEMMA4_WINDOW,
    Checkpoint,
    GraphWitness,
    cpu_engine,
    cycling_chooser,
    join_gloo,
    random_prompts,
    selected_params,
    standin_device,
)

from graphrt.core.engine import SamplingParams
from graphrt.core.errors import UsageError
from graphrt.core.models import load_model
from graphrt.core.models.gemma4 import Gemma4ForCausalLM
from graphrt.core.models.gemma4_config import gemma4_config_from_hf
from graphrt.core.parallel import SINGLE, TPGroup
from graphrt.core.parallel.launch import free_port, leave_job
from graphrt.spec import MTPDecoding, SpecConfig

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True)  # each token: a collective a layer
LENS = (5, 11, 3)  # 11 is longer than the sliding window (6)
SPEC = SpecConfig(num_steps=3, topk=2)
RUNNERS = ("eager", "graph")
GRAPH_MARKS = {"eager": (), "graph": pytest.mark.graphs}
# case -> (target fixture, assistant fixture or None)
CASES = {
    "target": ("gemma4_tiny", None),
    "mtp": ("gemma4_tiny", "gemma4_assistant"),
    "mtp-ordered": ("gemma4_tiny", "gemma4_assistant_ordered"),
    "one-kv-head": ("gemma4_one_kv_head", None),
    "one-kv-head-mtp": ("gemma4_one_kv_head", "gemma4_one_kv_head_assistant"),
}


# Auto draft lengths: each rank's chooser scripted differently (rank 0's order, rank 1's
# reversed), as each rank's own timings could make them choose; rank 0's choice must rule.
AUTO_ORDER = (3, 0, 1, 2)


def _generate(
    target: str, drafter: str | None, tp: TPGroup, runner: str, auto: bool = False
) -> dict:
    """Every request's greedy tokens and speculative rounds (drafts, accepted tokens, draft
    lengths run), and how many steps and rounds replayed graphs. ``auto``: auto lengths,
    each rank's chooser scripted apart (AUTO_ORDER)."""
    loaded = load_model(target, CPU, torch.float32, tp=tp)
    strategy = None
    if drafter is not None:
        # Fixed rounds on one graph each (the default), auto lengths on two graphs.
        auto_spec = SpecConfig(num_steps=3, adaptive=True, one_graph=False)
        spec = auto_spec if auto else SPEC
        strategy = MTPDecoding(load_model(drafter, CPU, torch.float32, tp=tp), spec)
    if auto:
        strategy.chooser = cycling_chooser(3, AUTO_ORDER[:: 1 if tp.rank == 0 else -1])
    device = standin_device() if runner == "graph" else None
    # The requests decode in lockstep, a batch of 3 at every step and round (finishing
    # together): one bucket, padded to 4; smaller ones would be captured, never replayed.
    drops = GraphWitness.drops  # from before the engine: it captures as it is built
    engine = cpu_engine(
        loaded, strategy, device, runner=runner, max_context_len=64, graph_buckets=(4,)
    )
    prompts = random_prompts(LENS, seed=5, vocab=loaded.model.vocab_size)
    reqs = engine.generate(prompts, GREEDY)
    s = engine.stats
    return dict(
        tokens=[r.output_ids for r in reqs],
        drafts=[r.spec_rounds for r in reqs],
        graph_steps=s.graph_steps,
        rounds=s.spec_rounds,
        graph_rounds=s.graph_rounds,
        rounds_by_steps=dict(s.rounds_by_steps),
        plain_steps=s.spec_plain_steps,
        drops=GraphWitness.drops - drops,  # the buckets this job dropped (a rank's counts)
    )


def _rank_main(rank: int, port: int, jobs: dict, out_dir: str) -> None:
    tp = join_gloo(rank, 2, port)
    GraphWitness.install()  # this process's drops, for the parent's check
    results = {key: _generate(*args, tp, key[1]) for key, args in jobs.items()}
    # The scripted auto lengths, in one order on every rank (a set's order is each
    # process's own: ranks that ran the runners in different orders broke the job).
    for runner in dict.fromkeys(runner for _, runner in jobs):
        results[("auto", runner)] = _generate(*jobs[("mtp", runner)], tp, runner, auto=True)
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    del tp  # leave_job frees the group, as a product rank does
    leave_job(0)


def _save(path: Path, hf, seed: int, scale: float = 1.0) -> Checkpoint:
    """Perturbed norms (so that a norm applied to a slice would show); 2-D weights times
    ``scale`` (an assistant's drafts then are confident, with no ties between logits)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
            elif param.dim() == 2:
                param.mul_(scale)
    hf.save_pretrained(path)
    return Checkpoint(path, hf)


@pytest.fixture(scope="module")
def gemma4_one_kv_head(tmp_path_factory) -> Checkpoint:
    """31B-shaped attention (K = V on full layers, one KV head everywhere) with E2B's
    per-layer inputs and KV sharing, untied head."""
    from transformers import Gemma4ForCausalLM as HFGemma4
    from transformers import Gemma4TextConfig

    s, f = "sliding_attention", "full_attention"
    cfg = Gemma4TextConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=1,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        head_dim=16,
        global_head_dim=32,
        layer_types=[s, f, s, s, f],
        sliding_window=GEMMA4_WINDOW,
        num_kv_shared_layers=2,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=300,
        final_logit_softcapping=30.0,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(51)
    return _save(tmp_path_factory.mktemp("gemma4_one_kv_head"), HFGemma4(cfg).eval(), 51)


@pytest.fixture(scope="module")
def gemma4_one_kv_head_assistant(tmp_path_factory) -> Checkpoint:
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM

    text = dict(
        model_type="gemma4_text",
        vocab_size=300,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        global_head_dim=32,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=GEMMA4_WINDOW,
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0,
        max_position_embeddings=256,
    )
    cfg = Gemma4AssistantConfig(text_config=text, backbone_hidden_size=64)
    torch.manual_seed(52)
    hf = Gemma4AssistantForCausalLM(cfg).eval()
    return _save(tmp_path_factory.mktemp("gemma4_one_kv_head_assistant"), hf, 52, scale=8.0)


@pytest.fixture(scope="module")
def two_ranks(request, tmp_path_factory) -> tuple[dict, dict]:
    """(one process's eager results per case, each rank's results per (case, runner))."""
    path = {
        name: str(request.getfixturevalue(name).path)
        for pair in CASES.values()
        for name in pair
        if name
    }
    jobs = {
        (case, runner): (path[target], path[drafter] if drafter else None)
        for case, (target, drafter) in CASES.items()
        for runner in selected_params(request.session, __name__, "runner")
    }
    expected = {
        case: _generate(path[target], path[drafter] if drafter else None, SINGLE, "eager")
        for case, (target, drafter) in CASES.items()
    }
    out = tmp_path_factory.mktemp("tp_gemma4")
    mp.start_processes(
        _rank_main, args=(free_port(), jobs, str(out)), nprocs=2, start_method="spawn"
    )
    return expected, [torch.load(out / f"rank{rank}.pt") for rank in range(2)]


@pytest.mark.parametrize("runner", [pytest.param(r, marks=GRAPH_MARKS[r]) for r in RUNNERS])
@pytest.mark.parametrize("case", CASES)
def test_two_ranks_give_the_tokens_of_one(two_ranks, case, runner):
    expected, ranks = two_ranks
    drafter = CASES[case][1]
    for rank, results in enumerate(ranks):
        got = results[(case, runner)]
        GraphWitness.saw(got["graph_steps"] + got["graph_rounds"], got["drops"])  # conftest's
        assert got["tokens"] == expected[case]["tokens"], f"rank {rank}"
        if drafter is None:
            assert (got["graph_steps"] > 0) == (runner == "graph")
        else:
            # Greedy output is lossless whatever the drafter proposes: its drafts and
            # what each round accepted show that its split runs as the whole one does.
            assert got["drafts"] == expected[case]["drafts"], f"rank {rank}"
            assert got["rounds"] > 0
            # Every round drafted and verified on graphs, or none did.
            assert got["graph_rounds"] == (got["rounds"] if runner == "graph" else 0)


@pytest.mark.parametrize("runner", [pytest.param(r, marks=GRAPH_MARKS[r]) for r in RUNNERS])
def test_auto_lengths_follow_rank_0s_choice_on_every_rank(two_ranks, runner):
    """Each rank's chooser times its own steps, so ranks could choose apart (a round on one,
    a plain step on another: their collectives would part ways). Rank 0's choice rules:
    both ranks run its lengths, and greedy tokens are one process's."""
    expected, ranks = two_ranks
    got = [results[("auto", runner)] for results in ranks]
    for rank in got:
        graphs = rank["graph_steps"] + rank["graph_rounds"]
        GraphWitness.saw(graphs, rank["drops"])  # for conftest's check
        assert (graphs > 0) == (runner == "graph")
        rounds = sum(rank["rounds_by_steps"].values())  # every round on graphs, or none
        assert rank["graph_rounds"] == (rounds if runner == "graph" else 0)
        assert rank["tokens"] == expected["mtp"]["tokens"]
    assert got[0]["rounds_by_steps"] == got[1]["rounds_by_steps"]
    assert got[0]["plain_steps"] == got[1]["plain_steps"] > 0
    # Rank 0's order: lengths 3, 1 and 2 each ran, at batch 3 three rounds a step.
    assert sorted(got[0]["rounds_by_steps"]) == [1, 2, 3]


def _refused(path: Path, tp: TPGroup) -> str:
    with pytest.raises(UsageError) as e:
        load_model(str(path), CPU, torch.float32, tp=tp)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_heads_that_do_not_split_are_refused_in_one_line(gemma4_tiny, gemma4_assistant):
    # The group is not needed to build a model: no processes here.
    three = TPGroup(rank=0, size=3)
    expected = "num_attention_heads (4) does not split evenly over 3 ranks"
    assert _refused(gemma4_tiny.path, three) == expected
    assert _refused(gemma4_assistant.path, three) == expected
    # 6 heads split over 2 ranks; 3 KV heads neither split nor, being more than the
    # ranks, are replicated.
    cfg = json.loads((gemma4_tiny.path / "config.json").read_text())
    config = gemma4_config_from_hf(
        {**cfg, "num_attention_heads": 6, "num_key_value_heads": 3}, "Gemma4ForCausalLM"
    )
    with torch.device("meta"), pytest.raises(UsageError) as e:
        Gemma4ForCausalLM(config, tp=TPGroup(rank=0, size=2))
    assert str(e.value) == "num_key_value_heads (3) does not split evenly over 2 ranks"


def test_an_assistant_split_unlike_its_target_is_refused(gemma4_tiny, gemma4_assistant):
    """Its query heads must read the KV heads their rank holds: same group, same rank."""
    target = load_model(str(gemma4_tiny.path), CPU, torch.float32, tp=TPGroup(rank=1, size=2))
    drafter = load_model(str(gemma4_assistant.path), CPU, torch.float32)
    with pytest.raises(UsageError, match="built for rank 0 of 1 but the target for rank 1 of 2"):
        drafter.model.bind_target(target.model)
