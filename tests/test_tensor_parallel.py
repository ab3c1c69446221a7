"""Tensor parallelism end to end on the CPU: 2 ranks over gloo, each loading its shard of
a transformers-made Llama checkpoint (GQA with untied head, tied head, Qwen2's q/k/v
biases, one KV head replicated on both ranks, a vocabulary of 301 padded to 2 x 151), serving the same prompts in lockstep (SPMD), give the greedy tokens of one
process holding the whole model, on the eager runner and on graphs (the stand-in CUDA
graph backend, the all-reduces recorded inside the graphs)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from helpers import CPU, GraphWitness, cpu_engine, join_gloo, random_prompts, selected_params

from graphrt.core.engine import SamplingParams
from graphrt.core.errors import UsageError
from graphrt.core.models import load_model
from graphrt.core.parallel import TPGroup
from graphrt.core.parallel.launch import free_port, leave_job

GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True)  # each token: a collective a layer
LENS = (5, 11, 3)


def _generate(path: str, tp: TPGroup, runner: str) -> tuple[list[list[int]], int, int]:
    """-> every request's greedy tokens, the decode steps that replayed a graph, and those
    launched ahead.
    ``runner`` "graph-overlap": on graphs, each step launched before the last one's read
    (``EngineConfig.overlap``: every rank launches and settles alike)."""
    loaded = load_model(path, CPU, torch.float32, tp=tp)
    device = None
    overlap = runner == "graph-overlap"
    runner = runner.removesuffix("-overlap")
    if runner == "graph":
        from helpers import standin_device

        device = standin_device()
    # Prefill steps of 4 tokens: the 5- and 11-token prompts prefill in chunks, and steps
    # that complete no prompt compute no logits (the ranks gather zero vocabulary rows).
    # Decode runs once every prompt is in, a batch of 3 to the end: one bucket, padded to
    # 4; smaller ones would be captured, never replayed.
    drops = GraphWitness.drops  # from before the engine: it captures as it is built
    engine = cpu_engine(
        loaded, device=device, runner=runner, max_context_len=64, graph_buckets=(4,),
        max_prefill_tokens=4, overlap=overlap,
    )  # fmt: skip
    prompts = random_prompts(LENS, seed=5, vocab=loaded.model.vocab_size)
    outputs = [r.output_ids for r in engine.generate(prompts, GREEDY)]
    drops = GraphWitness.drops - drops  # the buckets this job dropped (a rank's counts)
    return outputs, engine.stats.graph_steps, engine.stats.launched_ahead, drops


def _rank_main(rank: int, port: int, jobs: dict, out_dir: str) -> None:
    # No reference to the group outlives the jobs: leave_job frees it, as a product rank.
    tp = join_gloo(rank, 2, port)
    GraphWitness.install()  # this process's drops, for the parent's check
    results = {key: _generate(path, tp, key[1]) for key, path in jobs.items()}
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    del tp
    leave_job(0)


# llama_odd_vocab is the tied-head case: its padded shards cover what an even split does.
MODELS = ("llama_gqa_untied", "llama_odd_vocab", "qwen2", "llama_mqa")


@pytest.fixture(scope="module")
def two_ranks(request, tmp_path_factory) -> tuple[dict, list[dict]]:
    """(one process's tokens per model, each rank's results per (model, runner)): every
    job in one pair of ranks, which start up (torch, gloo) once."""
    path = {model: str(request.getfixturevalue(model).path) for model in MODELS}
    runners = selected_params(request.session, __name__, "runner")
    jobs = {(model, runner): path[model] for model in MODELS for runner in runners}
    expected = {model: _generate(path[model], TPGroup.single(), "eager")[0] for model in MODELS}
    out = tmp_path_factory.mktemp("tp_llama")
    mp.start_processes(
        _rank_main, args=(free_port(), jobs, str(out)), nprocs=2, start_method="spawn"
    )
    return expected, [torch.load(out / f"rank{rank}.pt") for rank in range(2)]


@pytest.mark.parametrize(
    "runner",
    [
        "eager",
        pytest.param("graph", marks=pytest.mark.graphs),
        pytest.param("graph-overlap", marks=pytest.mark.graphs),
    ],
)
@pytest.mark.parametrize("model", MODELS)
def test_two_ranks_give_the_tokens_of_one(two_ranks, model, runner):
    expected, ranks = two_ranks
    for rank, results in enumerate(ranks):
        tokens, graph_steps, launched_ahead, drops = results[(model, runner)]
        assert tokens == expected[model], f"rank {rank}"
        assert (graph_steps > 0) == runner.startswith("graph")  # decode replayed the graphs
        assert (launched_ahead > 0) == runner.endswith("overlap")
        GraphWitness.saw(graph_steps, drops)  # the ranks' graphs, for conftest's check


def test_a_model_without_tensor_parallelism_is_refused_in_one_line():
    # Every registered architecture has TP now: a model class without it stands in.
    from torch import nn

    from graphrt.core.models.loader import build_model

    class NoTP(nn.Linear):
        def __init__(self, config, ops):
            super().__init__(2, 2)

    with pytest.raises(UsageError, match="not implemented for NoTP"):
        build_model(NoTP, None, CPU, torch.float32, tp=TPGroup(rank=0, size=2))


def test_each_rank_reads_only_its_slice_of_split_tensors(llama_gqa_untied, monkeypatch):
    """Rank 1 of 2 loads straight from safetensors: split tensors are read as slices
    (never whole), and each parameter holds its rows/columns of the full tensor."""
    from safetensors.torch import load_file

    from graphrt.core.models import loader

    read_whole: list[str] = []
    read = loader.LazyTensor.read
    monkeypatch.setattr(
        loader.LazyTensor, "read", lambda self: read_whole.append(self.name) or read(self)
    )
    tp = TPGroup(rank=1, size=2)  # no process group: building and loading need none
    model = load_model(str(llama_gqa_untied.path), CPU, torch.float32, tp=tp).model
    assert read_whole and all(name.endswith("norm.weight") for name in read_whole)

    full = load_file(str(llama_gqa_untied.path / "model.safetensors"))
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    q = full["model.layers.0.self_attn.q_proj.weight"]
    k = full["model.layers.0.self_attn.k_proj.weight"]
    half_q, half_k = q.shape[0] // 2, k.shape[0] // 2
    assert torch.equal(attn.qkv_proj.weight[:half_q], q[half_q:])
    assert torch.equal(attn.qkv_proj.weight[half_q : half_q + half_k], k[half_k:])
    o = full["model.layers.0.self_attn.o_proj.weight"]
    assert torch.equal(attn.o_proj.weight, o[:, o.shape[1] // 2 :])
    down = full["model.layers.0.mlp.down_proj.weight"]
    assert torch.equal(mlp.down_proj.weight, down[:, down.shape[1] // 2 :])
    embed = full["model.embed_tokens.weight"]
    assert torch.equal(model.model.embed_tokens.weight, embed[embed.shape[0] // 2 :])


def test_a_random_preset_splits_the_one_process_model(monkeypatch):
    """random:<preset> under tensor parallelism: each rank holds its shard of the very
    weights one process draws from the seed (so TP=1 and TP=2 give the same tokens)."""
    whole = load_model("random:llama-tiny", CPU, torch.float32).model
    rank1 = load_model("random:llama-tiny", CPU, torch.float32, tp=TPGroup(rank=1, size=2)).model
    w, r = whole.model.layers[1], rank1.model.layers[1]
    q, kv = whole.config.num_heads * whole.config.head_dim // 2, r.self_attn.kv_size
    full_q = whole.config.num_heads * whole.config.head_dim
    qkv = w.self_attn.qkv_proj.weight
    assert torch.equal(r.self_attn.qkv_proj.weight[:q], qkv[q:full_q])
    assert torch.equal(r.self_attn.qkv_proj.weight[q : q + kv], qkv[full_q + kv : full_q + 2 * kv])
    assert torch.equal(r.self_attn.o_proj.weight, w.self_attn.o_proj.weight[:, q:])
    assert torch.equal(r.mlp.down_proj.weight, w.mlp.down_proj.weight.chunk(2, dim=1)[1])
    assert torch.equal(rank1.lm_head.weight, whole.lm_head.weight.chunk(2)[1])
    assert torch.equal(r.input_layernorm.weight, w.input_layernorm.weight)
