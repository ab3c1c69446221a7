"""The centroid head's fused greedy op (``selected_argmax``, devices/cuda/triton_gemma.py)
against ``TORCH_OPS``: each row's token with the largest selected logit, the smallest id
among equal logits, whatever order the clusters list the tokens in.

Values are small dyadic numbers (multiples of 1/8 times multiples of 1/16), so every
float32 sum is exact in any order and ties are real ties: the kernel must then give
torch's tokens exactly. Duplicated weight rows make ties between selected tokens in
about half the rows, listed in a random order (a tie broken by position fails).

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


def case(rows: int, vocab: int, hidden: int, selected: int, dtype, device, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randint(-4, 5, (vocab, hidden), generator=gen) / 8
    weight[1::2] = weight[0::2]  # odd tokens tie with the even one before them
    h = torch.randint(-8, 9, (rows, hidden), generator=gen) / 16
    tokens = torch.stack([torch.randperm(vocab, generator=gen)[:selected] for _ in range(rows)])
    pairs = tokens[:, : selected // 2] // 2 * 2  # half the rows list both of a pair
    tokens[::2, : selected // 2] = pairs[::2]
    tokens[::2, selected // 2 : selected // 2 * 2] = pairs[::2] + 1
    to = dict(device=device)
    return h.to(dtype=dtype, **to), weight.to(dtype=dtype, **to), tokens.to(**to)


def compare(fused, dtype, device, shapes) -> list[dict]:
    results = []
    for rows, vocab, hidden, selected in shapes:
        h, weight, tokens = case(rows, vocab, hidden, selected, dtype, device)
        want = TORCH_OPS.selected_argmax(h, weight, tokens)
        got = fused(h, weight, tokens)
        logits = (h.float().unsqueeze(1) @ weight.float()[tokens].transpose(1, 2)).squeeze(1)
        ties = int(((logits == logits.amax(-1, keepdim=True)).sum(-1) > 1).sum())
        results.append(
            {
                "shape": [rows, vocab, hidden, selected],
                "equal": bool(torch.equal(got, want)),
                "dtype": got.dtype == torch.int64,
                "tied_rows": ties,
            }  # fmt: skip
        )
    return results


def interpreter_results() -> list[dict]:
    from graphrt.devices.cuda.triton_gemma import selected_argmax

    # rows, vocab, hidden, selected: one block a row, several, a partial last block and
    # a hidden width of several chunks that is not a power of two.
    shapes = [(3, 512, 64, 96), (5, 1024, 48, 300), (2, 4096, 160, 512)]
    return [
        {**r, "dtype_name": str(dtype)}
        for dtype in (torch.float32, torch.float16)
        for r in compare(selected_argmax, dtype, torch.device("cpu"), shapes)
    ]


def check(results: list[dict]) -> None:
    for r in results:
        assert r["equal"] and r["dtype"], r
    assert sum(r["tied_rows"] for r in results) >= len(results)  # ties were exercised


@needs_triton
@pytest.mark.skipif(OLD_INTERPRETER, reason="triton < 3.7: its interpreter mishandles loop bounds")
def test_selected_argmax_under_interpreter_matches_torch():
    results = run_under_triton_interpreter(__file__)
    assert len(results) == 6
    check(results)


def test_reference_breaks_ties_by_the_smallest_id():
    h = torch.ones(1, 2)
    weight = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 0.0], [1.0, 1.0]])
    tokens = torch.tensor([[3, 2, 1]])  # 3 and 2 both score 2: token 2 wins
    assert TORCH_OPS.selected_argmax(h, weight, tokens).tolist() == [2]


@pytest.mark.cuda
@needs_gpu
@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cuda_selected_argmax_matches_torch_and_replays(dtype):
    from graphrt.devices.cuda.triton_gemma import selected_argmax

    cuda = torch.device("cuda")
    shapes = [(1, 262144, 256, 4096), (64, 262144, 256, 4096), (7, 5000, 200, 300)]
    check(compare(selected_argmax, dtype, cuda, shapes))
    h, weight, tokens = case(8, 262144, 256, 4096, dtype, cuda, seed=1)
    selected_argmax(h, weight, tokens)  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = selected_argmax(h, weight, tokens)
    h2, _, tokens2 = case(8, 262144, 256, 4096, dtype, cuda, seed=2)
    h.copy_(h2)
    tokens.copy_(tokens2)
    graph.replay()
    assert torch.equal(out, TORCH_OPS.selected_argmax(h, weight, tokens))


if __name__ == "__main__":
    # The CPU lane's subprocess (TRITON_INTERPRET=1 is already in its environment).
    print(json.dumps(interpreter_results()))
