"""The greedy sampler's Triton kernels (devices/cuda/triton_argmax.py) against
``TORCH_OPS.greedy_tokens``, token for token.

Logits are drawn from a few integers, so every row's maximum is tied, often across two
blocks of the kernel's first stage (the smallest id must win, not the first block to
finish or the last). Rows with a NaN or a +Inf must come back ``BAD_LOGITS``; a -Inf
(a ruled-out token) is an ordinary value, and a row of -Inf alone gives token 0, as
torch's argmax does.

CPU lane: under TRITON_INTERPRET=1 in a subprocess (see test_triton_ops). CUDA lane: Llama
3's and Gemma 4's vocabularies, float32 and bfloat16, eagerly and inside a CUDA graph.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import OLD_INTERPRETER, needs_gpu, needs_triton, run_under_triton_interpreter

from graphrt.core.models.ops import BAD_LOGITS, TORCH_OPS


def logits_case(rows: int, vocab: int, dtype, device, seed=0) -> torch.Tensor:
    """(rows, vocab) tied logits; row 1 NaN, row 2 +Inf, row 3 -Inf and ties across the
    first and last blocks, row 4 all -Inf (rows beyond those as many as there are)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randint(-6, 7, (rows, vocab), generator=gen).float()
    special = {
        1: lambda r: r.__setitem__(vocab // 2, float("nan")),
        2: lambda r: r.__setitem__(vocab - 1, float("inf")),
        3: lambda r: (r.__setitem__(0, float("-inf")), r.__setitem__(1, 7.0),
                      r.__setitem__(vocab - 1, 7.0)),
        4: lambda r: r.fill_(float("-inf")),
    }  # fmt: skip
    for row, change in special.items():
        if row < rows:
            change(logits[row])
    padded = torch.full((rows, vocab + 16), 99.0)  # rows strided: stride(0) > vocab
    padded[:, :vocab] = logits
    return padded.to(dtype=dtype, device=device)[:, :vocab]


def compare(greedy_tokens, dtype, device, shapes) -> list[dict]:
    results = []
    for rows, vocab in shapes:
        logits = logits_case(rows, vocab, dtype, device)
        want = TORCH_OPS.greedy_tokens(logits)
        got = greedy_tokens(logits)
        results.append(
            {
                "shape": [rows, vocab],
                "dtype": str(dtype),
                "equal": torch.equal(got.cpu(), want.cpu()),
                "int64": got.dtype == torch.int64,
                "bad_rows": int((got == BAD_LOGITS).sum()),
                "got": got.cpu().tolist()[:6],
                "want": want.cpu().tolist()[:6],
            }
        )
    return results


def check(results: list[dict]) -> None:
    for r in results:
        assert r["equal"] and r["int64"], r
        rows = r["shape"][0]
        assert r["bad_rows"] == (rows > 1) + (rows > 2), r  # the NaN row and the +Inf row
        if rows > 4:
            assert r["got"][3] == 1 and r["got"][4] == 0, r  # tie across blocks; all -Inf


def interpreter_results() -> list[dict]:
    from graphrt.devices.cuda.triton_argmax import greedy_tokens

    # One block a row, three with a partial last one, and a width below one block.
    shapes = [(5, 4096), (6, 10000), (2, 7)]
    return [
        r for dtype in (torch.float32, torch.bfloat16)
        for r in compare(greedy_tokens, dtype, torch.device("cpu"), shapes)
    ]  # fmt: skip


@needs_triton
@pytest.mark.skipif(OLD_INTERPRETER, reason="triton < 3.7: its interpreter mishandles loop bounds")
def test_greedy_tokens_under_interpreter_match_torch():
    results = run_under_triton_interpreter(__file__)
    assert len(results) == 6
    check(results)


def test_reference_marks_nan_and_inf_rows_only():
    logits = torch.tensor(
        [[0.0, 2.0, 2.0], [float("nan"), 1.0, 0.0], [0.0, float("inf"), 1.0], [float("-inf")] * 3]
    )
    assert TORCH_OPS.greedy_tokens(logits).tolist() == [1, BAD_LOGITS, BAD_LOGITS, 0]


@needs_gpu
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_greedy_tokens_match_torch_eager_and_in_a_graph(dtype):
    from graphrt.devices.cuda.triton_argmax import greedy_tokens

    device = torch.device("cuda")
    shapes = [(1, 128256), (8, 128256), (64, 128256), (1, 262144), (40, 262144)]
    check(compare(greedy_tokens, dtype, device, shapes))
    logits = logits_case(8, 128256, dtype, device)
    want = TORCH_OPS.greedy_tokens(logits)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        greedy_tokens(logits)  # compiled outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = greedy_tokens(logits)
    torch.cuda.current_stream().wait_stream(stream)
    logits.copy_(logits_case(8, 128256, dtype, device, seed=1))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, TORCH_OPS.greedy_tokens(logits)) and not torch.equal(out, want)


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(json.dumps(interpreter_results()))
