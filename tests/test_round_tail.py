"""A speculative round's tail as one kernel (``ModelOps.round_tail``, CUDA:
devices/cuda/triton_round_tail.py) against spec's tensor ops (spec.verify.round_tail with
``TORCH_OPS``): the packed row the host reads (the path's tail order included), the token
table and the seed table must come out equal.

Trees are random forests with dropped nodes, siblings drafting distinct tokens as a
drafter's top-k does (and in one shape a token repeated, as a draft rule may: the deepest
accepted node of lowest index ends the path), and target tokens that follow a child's
draft three times in four, so that paths run deep; chains (topk 1) too. Each batch holds a request at the context's
end (its acceptance capped) and a graph's padding request (every mask entry True, slot 0).
Hiddens and the seed table are bfloat16 or float32 (the target's dtype, both), and wider
than one of the kernel's blocks.

CPU lane: under TRITON_INTERPRET=1 in a subprocess. CUDA lane: the same on the GPU, eagerly
and replayed from a CUDA graph.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from helpers import OLD_INTERPRETER, needs_gpu, needs_triton, run_under_triton_interpreter

from graphrt.core.batch import ForwardBatch, ForwardMode
from graphrt.core.models.ops import TORCH_OPS
from graphrt.spec.tree import ancestors
from graphrt.spec.verify import RoundTables, VerifyInput, round_tail

VOCAB, CONTEXT = 6, 64
# B, n, chain, siblings repeating a token (a draft rule's trees: bench/oracles.py's TokenOracle)
SHAPES = [
    (5, 2, True, False),
    (5, 5, True, False),
    (6, 6, False, False),
    (4, 9, False, False),
    (3, 17, False, False),
    (5, 9, False, True),
]


def forest(n: int, chain: bool, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (parents (n,), valid (n,)): node 0 the root, each later node under an earlier
    valid one, one in six dropped (parent -1, as the tree build leaves them)."""
    parents, valid = torch.full((n,), -1), torch.zeros(n, dtype=torch.bool)
    valid[0] = True
    for i in range(1, n):
        if chain:
            parents[i], valid[i] = i - 1, True
        elif torch.rand((), generator=gen) > 1 / 6:
            candidates = valid[:i].nonzero().flatten()
            parents[i] = candidates[torch.randint(len(candidates), (), generator=gen)]
            valid[i] = True
    return parents, valid


def case(
    bs: int,
    n: int,
    chain: bool,
    device,
    seed: int,
    dtype=torch.bfloat16,
    context=CONTEXT,
    repeat: bool = False,
):
    """-> (logits (B * n, V), hidden (B * n, H), batch, tables): a verify's outputs and its
    batch; the last request is padding, the one before it at the context's end."""
    gen = torch.Generator().manual_seed(seed)
    parents, valid = zip(*(forest(n, chain, gen) for _ in range(bs)))
    parents, valid = torch.stack(parents), torch.stack(valid)
    tokens = torch.randint(VOCAB, (bs, n), generator=gen)
    for b in range(bs):  # siblings draft distinct tokens
        for p in range(n):
            kids = [c for c in range(1, n) if valid[b, c] and parents[b, c] == p]
            tokens[b, kids] = torch.randperm(max(VOCAB, len(kids)), generator=gen)[: len(kids)]
            if repeat and len(kids) > 1:  # the last sibling repeats the first's token
                tokens[b, kids[-1]] = tokens[b, kids[0]]
    target = torch.randint(VOCAB, (bs, n), generator=gen)
    for b in range(bs):  # a child's draft, three times in four (always at the context's end)
        for i in range(n):
            kids = [c for c in range(1, n) if valid[b, c] and parents[b, c] == i]
            if kids and (b == bs - 2 or torch.rand((), generator=gen) < 0.75):
                target[b, i] = tokens[b, kids[torch.randint(len(kids), (), generator=gen)]]
    mask, depth = ancestors(parents)
    kv_lens = torch.randint(0, context - n, (bs,), generator=gen)
    kv_lens[-2] = context - 3  # at the context's end: two drafts at most
    slots = torch.randperm(bs + 3, generator=gen)[:bs] + 1
    # The padding request, as verify_shape pads a graph's rows.
    mask[-1], parents[-1], depth[-1], valid[-1], slots[-1], kv_lens[-1] = True, -1, 0, False, 0, 0
    locs = torch.randperm(1000, generator=gen)[: bs * n] + 1
    locs.view(bs, n)[-1] = 0
    logits = torch.full((bs * n, max(VOCAB, n) + 3), -1.0)
    logits[torch.arange(bs * n), target.flatten()] = 1.0
    hidden = torch.randn(bs * n, 1100, generator=gen).to(dtype)
    info = VerifyInput(tree_mask=mask, parents=parents, depth=depth, valid=valid)
    batch = ForwardBatch(
        mode=ForwardMode.TARGET_VERIFY,
        input_ids=tokens.flatten(),
        positions=torch.zeros(bs * n, dtype=torch.int64),
        req_pool_indices=slots,
        seq_lens=(kv_lens + n).to(torch.int32),
        out_cache_loc=locs,
        seq_lens_cpu=(kv_lens + n).tolist(),
        extend_lens_cpu=[n] * bs,
        spec_info=info,
    )
    tables = RoundTables(
        req_to_token=torch.zeros(bs + 4, context, dtype=torch.int64),
        seeds=torch.zeros(bs + 4, 1100, dtype=dtype),
    )
    to = lambda t: t.to(device)  # noqa: E731
    batch = dataclasses.replace(
        batch,
        input_ids=to(batch.input_ids), positions=to(batch.positions),
        req_pool_indices=to(slots), seq_lens=to(batch.seq_lens), out_cache_loc=to(locs),
        spec_info=VerifyInput(*(to(t) for t in (mask, parents, depth, valid))),
    )  # fmt: skip
    return to(logits), to(hidden), batch, RoundTables(*(to(t) for t in dataclasses.astuple(tables)))


def compare(kernel, device) -> list[dict]:
    fused_ops = dataclasses.replace(TORCH_OPS, round_tail=kernel)
    results = []
    for i, (bs, n, chain, repeat) in enumerate(SHAPES):
        dtype = torch.bfloat16 if i % 2 == 0 else torch.float32
        logits, hidden, batch, tables = case(bs, n, chain, device, i, dtype, repeat=repeat)
        want_tables = RoundTables(*(t.clone() for t in dataclasses.astuple(tables)))
        want = round_tail(logits, hidden, batch, want_tables, CONTEXT, ops=TORCH_OPS)
        got = round_tail(logits, hidden, batch, tables, CONTEXT, ops=fused_ops)
        results.append(
            {
                "shape": [bs, n, chain],
                "packed": torch.equal(got.cpu(), want.cpu()),
                "table": torch.equal(tables.req_to_token.cpu(), want_tables.req_to_token.cpu()),
                "seeds": torch.equal(tables.seeds.cpu(), want_tables.seeds.cpu()),
                "accepted": want[:, 0].tolist(),
                "got": got[:2].tolist(),
                "want": want[:2].tolist(),
            }
        )
    return results


def check(results: list[dict]) -> None:
    for r in results:
        assert r["packed"] and r["table"] and r["seeds"], r
    deepest = max(max(r["accepted"]) for r in results)
    assert deepest >= 4, "no path ran deep: the cases test little"
    assert all(r["accepted"][-1] == 0 for r in results), "the padding request accepted"


def interpreter_results() -> list[dict]:
    from graphrt.devices.cuda.triton_round_tail import round_tail as kernel

    return compare(kernel, torch.device("cpu"))


@needs_triton
@pytest.mark.skipif(OLD_INTERPRETER, reason="triton < 3.7: its interpreter mishandles loop bounds")
def test_round_tail_kernel_under_interpreter_matches_tensor_ops():
    check(run_under_triton_interpreter(__file__))


def test_cases_reach_the_context_end_cap():
    """In some compared case the request at the context's end would accept more without
    its cap (two drafts at most there): the cases test the cap."""
    capped = []
    for i, (bs, n, chain, _) in enumerate(SHAPES):
        logits, hidden, batch, tables = case(bs, n, chain, torch.device("cpu"), seed=i)
        packed = round_tail(logits, hidden, batch, tables, CONTEXT, ops=TORCH_OPS)
        wide = RoundTables(tables.req_to_token.new_zeros(bs + 4, 2 * CONTEXT), tables.seeds)
        uncapped = round_tail(logits, hidden, batch, wide, 2 * CONTEXT, ops=TORCH_OPS)
        assert int(packed[-2, 0]) <= 2
        capped.append(int(uncapped[-2, 0]) > int(packed[-2, 0]))
    assert any(capped)


def test_the_repeating_shape_accepts_two_siblings_of_one_token():
    """In the shape whose siblings may repeat a token, some request's two siblings both
    drafted their parent's target token: the kernel's choice among tied paths is tested."""
    i = next(i for i, shape in enumerate(SHAPES) if shape[3])
    bs, n, chain, repeat = SHAPES[i]
    logits, _, batch, _ = case(bs, n, chain, torch.device("cpu"), i, repeat=repeat)
    target = logits.argmax(dim=-1).view(bs, n)
    tokens, parents = batch.input_ids.view(bs, n), batch.spec_info.parents
    tied = [
        (b, p)
        for b in range(bs - 1)  # (not the padding request)
        for p in range(n)
        if sum(int(parents[b, c] == p and tokens[b, c] == target[b, p]) for c in range(n)) > 1
    ]
    assert tied


@needs_triton
def test_round_tail_kernel_compiles_for_the_most_nodes_without_spilling():
    """The widest tree the kernel serves compiles for sm_90 (Triton's compiler and ptxas,
    no GPU) with nothing spilled to local memory: its (n, n) tiles fit the registers."""
    from graphrt.devices.cuda.offline_compile import compile_for_h200, registers_and_stack
    from graphrt.devices.cuda.triton_round_tail import MAX_NODES, _round_tail_kernel, block_nodes

    pointers = {
        "TreeTokens": "*i64", "Parents": "*i64", "Depth": "*i64", "Valid": "*u8",
        "Mask": "*u8", "Target": "*i64", "SeqLens": "*i32", "ReqSlots": "*i64",
        "NodeLocs": "*i64", "Hidden": "*bf16", "ReqToToken": "*i64", "Seeds": "*bf16",
        "Packed": "*i64",
    }  # fmt: skip
    constants = {"BLOCK_N": block_nodes(MAX_NODES), "BLOCK_H": 1024}
    compiled = compile_for_h200(_round_tail_kernel, constants, 4, pointers=pointers)
    _, spilled = registers_and_stack(compiled)
    assert spilled == 0


@needs_triton
def test_round_tail_leaves_wider_trees_to_the_tensor_ops(monkeypatch):
    """A tree past the kernel's MAX_NODES: the op declines (None, the kernel never
    launched) and spec's round runs the tensor ops."""
    from graphrt.devices.cuda import triton_round_tail
    from graphrt.devices.cuda.triton_round_tail import MAX_NODES
    from graphrt.devices.cuda.triton_round_tail import round_tail as kernel

    class Unlaunchable:
        def __getitem__(self, grid):
            raise AssertionError("the kernel launched for a tree past MAX_NODES")

    monkeypatch.setattr(triton_round_tail, "_round_tail_kernel", Unlaunchable())

    cpu = torch.device("cpu")
    context = 4 * MAX_NODES
    logits, hidden, batch, tables = case(3, MAX_NODES + 1, False, cpu, seed=3, context=context)
    want_tables = RoundTables(*(t.clone() for t in dataclasses.astuple(tables)))
    want = round_tail(logits, hidden, batch, want_tables, context, ops=TORCH_OPS)
    fused_ops = dataclasses.replace(TORCH_OPS, round_tail=kernel)
    got = round_tail(logits, hidden, batch, tables, context, ops=fused_ops)
    assert torch.equal(got, want) and torch.equal(tables.req_to_token, want_tables.req_to_token)


@pytest.mark.cuda
@needs_gpu
@needs_triton
def test_cuda_round_tail_matches_tensor_ops_and_replays():
    from graphrt.devices.cuda.triton_round_tail import round_tail as kernel

    cuda = torch.device("cuda")
    check(compare(kernel, cuda))
    fused_ops = dataclasses.replace(TORCH_OPS, round_tail=kernel)
    logits, hidden, batch, tables = case(6, 6, False, cuda, seed=7)
    round_tail(logits, hidden, batch, tables, CONTEXT, ops=fused_ops)  # compiled first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = round_tail(logits, hidden, batch, tables, CONTEXT, ops=fused_ops)
    fresh, fresh_hidden, _, _ = case(6, 6, False, cuda, seed=8)  # new targets, same tree
    logits.copy_(fresh)
    hidden.copy_(fresh_hidden)
    want_tables = RoundTables(*(t.clone() for t in dataclasses.astuple(tables)))
    graph.replay()
    want = round_tail(logits, hidden, batch, want_tables, CONTEXT, ops=TORCH_OPS)
    assert torch.equal(got, want)
    assert torch.equal(tables.req_to_token, want_tables.req_to_token)
    assert torch.equal(tables.seeds, want_tables.seeds)


if __name__ == "__main__":
    # The CPU lane's subprocess (TRITON_INTERPRET=1 is already in its environment).
    print(json.dumps(interpreter_results()))
