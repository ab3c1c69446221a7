"""``scaled_embed`` (devices/cuda/triton_gemma.py) against ``TORCH_OPS``, bit for bit:
Gemma's scaled token embedding (the scale rounded to the table's dtype, then one product
rounded), with an MTP assistant's seed hidden beside it (cast to the table's dtype), in
one launch where torch takes three (gather, scale, concatenation).

Values are random normals: the product and the casts round on every element, so a scale
left in float32, a tail truncated instead of rounded, or a row read off by one misses
``torch.equal``. Widths that are not a multiple of the kernel's block, a tail narrower and
wider than the embedding, no tail, repeated ids; ids and tail as contiguous tensors and as
strided views (a one-graph round embeds column 0 of its (B, n) node ids: read with unit
stride, every request past the first embedded another node's token, on the H200).

CPU lane: under TRITON_INTERPRET=1 in a subprocess (see test_triton_ops). CUDA lane: the
E2B assistant's shape (hidden 1536 beside its 1536-wide seed, vocabulary 262,144) in
bfloat16 and float16, eager and inside a CUDA graph.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import needs_gpu, needs_triton, run_under_triton_interpreter

from graphrt.core.models.ops import TORCH_OPS


def compare(scaled_embed, dtype, device, shapes, strided: bool = False) -> list[dict]:
    """Each shape (rows, vocab, hidden, tail width or None, tail dtype): equal bits?
    ``strided``: the ids are column 0 of a (rows, 3) tensor, the tail rows every other
    row of a taller one (a row stride that is not its width)."""
    results = []
    for rows, vocab, hidden, extra, tail_dtype in shapes:
        gen = torch.Generator().manual_seed(rows * 7 + hidden)
        table = torch.randn(vocab, hidden, generator=gen).to(dtype).to(device)
        ids = torch.randint(0, vocab, (rows, 3), generator=gen)
        ids[-1, 0] = ids[0, 0]  # a repeated token
        ids = ids.to(device)[:, 0] if strided else ids[:, 0].contiguous().to(device)
        scale = torch.tensor(hidden**0.5, device=device)  # float32, as Gemma's buffer
        tail = None
        if extra is not None:
            tail = (torch.randn(rows * 2, extra, generator=gen) * 3).to(tail_dtype).to(device)
            tail = tail[::2] if strided else tail[::2].contiguous()
        want = TORCH_OPS.scaled_embed(ids, table, scale, tail)
        got = scaled_embed(ids, table, scale, tail)
        layout = got.shape == want.shape and got.dtype == want.dtype
        results.append(
            {
                "shape": [rows, vocab, hidden, extra, str(tail_dtype), str(dtype), strided],
                "equal": layout and bool(torch.equal(got, want)),
                # The scale must round: sqrt(hidden) is not exact in 16 bits.
                "scale_rounds": dtype == torch.float32 or float(scale.to(dtype)) != float(scale),
            }
        )
    return results


def interpreter_results() -> list[dict]:
    from graphrt.devices.cuda.triton_gemma import scaled_embed

    # rows, vocab, hidden, tail width (None: none), tail dtype: a tail of another dtype
    # (float32, rounded) and of the table's; widths across a block boundary (1024).
    shapes = [
        (3, 50, 96, 96, torch.float32),
        (2, 17, 1000, 40, torch.float32),
        (4, 33, 24, 1100, None),
        (1, 9, 130, None, None),
    ]
    results = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        cases = [(*s[:4], s[4] or dtype) for s in shapes]
        for strided in (False, True):
            results += compare(scaled_embed, dtype, torch.device("cpu"), cases, strided)
    return results


def check(results: list[dict]) -> None:
    for r in results:
        assert r["equal"] and r["scale_rounds"], r


@needs_triton
def test_scaled_embed_under_interpreter_equals_torch():
    results = run_under_triton_interpreter(__file__)
    assert len(results) == 24
    check(results)


def test_reference_rounds_the_scale_to_the_tables_dtype_first():
    """transformers' Gemma4TextScaledWordEmbedding: ``embed * scale.to(dtype)``; a float32
    scale would give other bfloat16 products."""
    table = torch.tensor([[1.0, 3.0]], dtype=torch.bfloat16)
    scale = torch.tensor(1536**0.5)  # 39.1918..., 39.25 in bfloat16
    out = TORCH_OPS.scaled_embed(torch.tensor([0]), table, scale, torch.ones(1, 1))
    assert out.dtype == torch.bfloat16
    assert out.tolist() == [[39.25, 118.0, 1.0]]  # 3 x 39.25 = 117.75 -> 118 (to even)


@pytest.mark.cuda
@needs_gpu
@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cuda_scaled_embed_equals_torch_and_replays(dtype):
    from graphrt.devices.cuda.triton_gemma import scaled_embed

    cuda = torch.device("cuda")
    # The E2B assistant's draft rows (1 and 64 requests), and the target's own decode rows.
    shapes = [(1, 262144, 1536, 1536, torch.float32), (64, 262144, 1536, 1536, dtype)]
    shapes += [(8, 262144, 1536, None, dtype)]
    check(compare(scaled_embed, dtype, cuda, shapes))
    check(compare(scaled_embed, dtype, cuda, shapes, strided=True))
    table = torch.randn(262144, 1536, device=cuda).to(dtype)
    scale = torch.tensor(1536**0.5, device=cuda)
    ids = torch.randint(0, 262144, (4,), device=cuda)
    tail = torch.randn(4, 1536, device=cuda).to(dtype)
    scaled_embed(ids, table, scale, tail)  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = scaled_embed(ids, table, scale, tail)
    ids.copy_(torch.randint(0, 262144, (4,), device=cuda))
    tail.copy_(torch.randn_like(tail))
    graph.replay()
    assert torch.equal(out, TORCH_OPS.scaled_embed(ids, table, scale, tail))


if __name__ == "__main__":
    # The CPU lane's subprocess (TRITON_INTERPRET=1 is already in its environment).
    print(json.dumps(interpreter_results()))
