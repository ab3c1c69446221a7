"""The centroid head's fused greedy ops (devices/cuda/triton_gemma.py) against
``TORCH_OPS``: ``topk_set`` (each row's k largest scores, ties at the k-th to the smallest
indices) and ``selected_argmax`` (each row's token of its clusters with the largest
logit, the smallest id among equal logits, whatever order the clusters list them in).

Values are small dyadic numbers (multiples of 1/8 times multiples of 1/16), so every
float32 sum is exact in any order and ties are real ties: the kernels must then give
torch's indices exactly. Duplicated weight rows make ties between selected tokens (a tie
broken by position fails); scores drawn from a few values tie at the k-th largest.

CPU lane: under TRITON_INTERPRET=1 in a subprocess (see test_triton_ops). CUDA lane: the
same in bfloat16 and float16 at the E2B assistant's shape (4,096 of 262,144 tokens,
hidden 256), and inside a CUDA graph.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import OLD_INTERPRETER, needs_gpu, needs_triton, run_under_triton_interpreter

from graphrt.core.models.ops import TORCH_OPS


def case(rows: int, vocab: int, hidden: int, cluster: int, k: int, dtype, device, seed=0):
    """-> (hidden, weight, clusters (C, W), top (N, k)): tokens 2t and 2t + 1 score alike
    and sit at one entry of twin clusters c and c + C/2, the smaller id in either one;
    each row takes k/2 clusters and their twins, so its maximum is always tied."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randint(-4, 5, (vocab, hidden), generator=gen) / 8
    weight[1::2] = weight[0::2]  # odd tokens tie with the even one before them
    h = torch.randint(-8, 9, (rows, hidden), generator=gen) / 16
    pairs = torch.randperm(vocab // 2, generator=gen) * 2
    flip = torch.randint(0, 2, (vocab // 2,), generator=gen)
    clusters = torch.cat([pairs + flip, pairs + 1 - flip]).view(-1, cluster)  # (C, W)
    num = clusters.shape[0]
    first = torch.stack([torch.randperm(num // 2, generator=gen)[: k // 2] for _ in range(rows)])
    top = torch.cat([first, first + num // 2], dim=1).sort(-1).values  # (N, k)
    to = dict(device=device)
    return h.to(dtype=dtype, **to), weight.to(dtype=dtype, **to), clusters.to(**to), top.to(**to)


def compare(ops, dtype, device, shapes) -> list[dict]:
    """``ops``: (topk_set, selected_argmax) under test."""
    topk_set, selected_argmax = ops
    results = []
    for rows, vocab, hidden, cluster, k in shapes:
        h, weight, clusters, top = case(rows, vocab, hidden, cluster, k, dtype, device)
        want = TORCH_OPS.selected_argmax(h, weight, clusters, top)
        got = selected_argmax(h, weight, clusters, top)
        tokens = clusters[top].reshape(rows, -1)
        logits = (h.float().unsqueeze(1) @ weight.float()[tokens].transpose(1, 2)).squeeze(1)
        ties = int(((logits == logits.amax(-1, keepdim=True)).sum(-1) > 1).sum())
        # Scores from 9 values: many tie at the k-th largest.
        gen = torch.Generator().manual_seed(rows)
        scores = (torch.randint(-4, 5, (rows, vocab // cluster), generator=gen) / 4).to(dtype)
        scores = scores.to(device)
        top_want = TORCH_OPS.topk_set(scores, k)
        top_got = topk_set(scores, k)
        # NaN hiddens (a whole row; one column, which leaves +-inf and NaN logits): the
        # first NaN's id, as torch's argmax over the row, never an id past the vocabulary.
        h_nan = h.clone()
        h_nan[0] = float("nan")
        h_nan[-1, 0] = float("inf")
        nan_want = TORCH_OPS.selected_argmax(h_nan, weight, clusters, top)
        nan_got = selected_argmax(h_nan, weight, clusters, top)
        nan_logits = h_nan.float().unsqueeze(1) @ weight.float()[tokens].transpose(1, 2)
        first_nan = torch.where(nan_logits.squeeze(1).isnan(), tokens, vocab).amin(-1)
        results.append(
            {
                "shape": [rows, vocab, hidden, cluster, k],
                "argmax_equal": bool(torch.equal(got, want)),
                "int64": got.dtype == top_got.dtype == torch.int64,
                "tied_rows": ties,
                "topk_equal": bool(torch.equal(top_got, top_want)),
                "nan_equal": bool(torch.equal(nan_got, nan_want)),
                "nan_first": bool(
                    torch.equal(nan_want[first_nan < vocab], first_nan[first_nan < vocab])
                ),
                "nan_rows": int((first_nan < vocab).sum()),
            }  # fmt: skip
        )
    return results


def interpreter_results() -> list[dict]:
    from graphrt.devices.cuda.triton_gemma import selected_argmax, topk_set

    # rows, vocab, hidden, cluster, k: one block a row, several, a partial last block, and
    # a hidden width that is not a power of two, in one masked chunk (below FEW_ROWS rows:
    # small blocks of whole hidden rows) and in several (from FEW_ROWS rows).
    shapes = [
        (3, 512, 64, 16, 6),
        (5, 1024, 48, 8, 40),
        (2, 4096, 160, 32, 16),
        (4, 4096, 160, 32, 16),
    ]
    return [
        {**r, "dtype_name": str(dtype)}
        for dtype in (torch.float32, torch.float16)
        for r in compare((topk_set, selected_argmax), dtype, torch.device("cpu"), shapes)
    ]


def check(results: list[dict]) -> None:
    for r in results:
        assert r["argmax_equal"] and r["topk_equal"] and r["int64"], r
        assert r["nan_equal"] and r["nan_first"] and r["nan_rows"] >= 1, r
    assert all(r["tied_rows"] == r["shape"][0] for r in results)  # every maximum tied


@needs_triton
@pytest.mark.skipif(OLD_INTERPRETER, reason="triton < 3.7: its interpreter mishandles loop bounds")
def test_centroid_ops_under_interpreter_match_torch():
    results = run_under_triton_interpreter(__file__)
    assert len(results) == 8
    check(results)


def test_references_break_ties_by_the_smallest_index():
    h = torch.ones(1, 2)
    weight = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 0.0], [1.0, 1.0]])
    clusters = torch.tensor([[3, 2], [1, 0]])  # 3 and 2 both score 2: token 2 wins
    top = torch.tensor([[0, 1]])
    assert TORCH_OPS.selected_argmax(h, weight, clusters, top).tolist() == [2]
    scores = torch.tensor([[1.0, 3.0, 2.0, 3.0, 2.0, 2.0]])
    assert TORCH_OPS.topk_set(scores, 3).tolist() == [[1, 2, 3]]  # 2.0 at 2 before 4, 5


@pytest.mark.cuda
@needs_gpu
@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cuda_centroid_ops_match_torch_and_replay(dtype):
    from graphrt.devices.cuda.triton_gemma import selected_argmax, topk_set

    cuda = torch.device("cuda")
    # The E2B assistant's head: 2,048 clusters of 128 tokens, top 32, hidden 256.
    shapes = [(1, 262144, 256, 128, 32), (64, 262144, 256, 128, 32), (7, 5120, 200, 8, 30)]
    check(compare((topk_set, selected_argmax), dtype, cuda, shapes))
    h, weight, clusters, top = case(8, 262144, 256, 128, 32, dtype, cuda, seed=1)
    scores = torch.randn(8, 2048, device=cuda).to(dtype)
    selected_argmax(h, weight, clusters, topk_set(scores, 32))  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = selected_argmax(h, weight, clusters, topk_set(scores, 32))
    h.copy_(torch.randn_like(h))
    scores.copy_(torch.randn_like(scores))
    graph.replay()
    want_top = TORCH_OPS.topk_set(scores, 32)
    assert torch.equal(out, TORCH_OPS.selected_argmax(h, weight, clusters, want_top))


if __name__ == "__main__":
    # The CPU lane's subprocess (TRITON_INTERPRET=1 is already in its environment).
    print(json.dumps(interpreter_results()))
