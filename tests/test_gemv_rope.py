"""The GEMV's q/k/v epilogue (``gemv(..., rope=RopeWrite)``: a Llama attention's merged
projection, rope on q and k, k and v into the KV cache, q returned) against the two
launches it replaces: the same GEMV configuration without it, then the plain rope kernel
writing the cache (``triton_rope``). The epilogue rounds as those two do, so q and every
cache row must match bit for bit; cache slots no row writes must stay untouched.

Cases: the row path (one row) and tensor-core tiles (3 rows), one K chunk and several,
with and without bias and the fused norm, grouped-query heads, BLOCK_N from 2 (one rope
pair a program) to 32 (pairs of two heads), positions far apart, rope tables in float32
and in the activations' dtype (a 16-bit model's buffers).

CPU lane: under TRITON_INTERPRET=1 in a subprocess (see test_triton_ops), and the ops
table's wrapper (``TRITON_OPS.linear_rope``) against its two ops. CUDA lane: every
configuration the tuner may pick, at Llama 3.2 1B's shape (1 and 3 rows) and at head_dim
128 with a bias, bfloat16 and float16.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import OLD_INTERPRETER, needs_gpu, needs_triton, run_under_triton_interpreter

from graphrt.core.attention.base import KVWrite
from graphrt.core.models.ops import PreNorm


def rope_case(rows, heads, kv_heads, head_dim, k, dtype, device, bias, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen)).to(device, dtype)

    n = (heads + 2 * kv_heads) * head_dim
    x = randn(rows, k + 8)[:, :k]  # strided rows
    weight = randn(n, k, scale=k**-0.5)
    b = randn(n) if bias else None
    norm = PreNorm(randn(k, scale=0.2) + 1, 1e-5)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    t = torch.arange(4096, dtype=torch.float32)
    emb = torch.cat([torch.outer(t, inv_freq)] * 2, dim=-1)
    cos, sin = emb.cos().to(device), emb.sin().to(device)
    positions = torch.tensor([5, 4095, 1000, 77][:rows], device=device)
    loc = torch.tensor([3, 9, 1, 6][:rows], device=device)
    return x, weight, b, norm, cos, sin, positions, loc


def compare(dtype, device, configs, shapes) -> list[dict]:
    from graphrt.devices.cuda.triton_gemv import RopeWrite, gemv
    from graphrt.devices.cuda.triton_rope import triton_rope

    results = []
    for rows, heads, kv_heads, head_dim, k, bias, with_norm in shapes:
        x, weight, b, norm, cos, sin, positions, loc = rope_case(
            rows, heads, kv_heads, head_dim, k, dtype, device, bias
        )
        norm = norm if with_norm else None
        if not with_norm:  # tables as a 16-bit model holds them (its buffers' dtype)
            cos, sin = cos.to(dtype), sin.to(dtype)
        q_rows, kv_rows = heads * head_dim, kv_heads * head_dim
        cache_shape = (12, kv_heads, head_dim)  # slots; the rows write 3, 9, 1, 6
        for config in configs(rows):
            k_want, v_want = (
                torch.full(cache_shape, 7.0, device=device, dtype=dtype) for _ in "kv"
            )
            qkv = gemv(x, weight, b, config, norm=norm)
            q, kk, v = qkv.split([q_rows, kv_rows, kv_rows], dim=-1)
            q_want, _ = triton_rope(
                positions, q.view(rows, heads, head_dim), kk.view(rows, kv_heads, head_dim),
                cos, sin, v.view(rows, kv_heads, head_dim), KVWrite(k_want, v_want, loc),
            )  # fmt: skip
            k_got, v_got = (torch.full(cache_shape, 7.0, device=device, dtype=dtype) for _ in "kv")
            rope = RopeWrite(positions, cos, sin, KVWrite(k_got, v_got, loc), heads)
            q_got = gemv(x, weight, b, config, norm=norm, rope=rope)
            results.append(
                {
                    "case": f"{str(dtype)[6:]}/M{rows}-H{heads}-Hkv{kv_heads}-D{head_dim}-K{k}"
                    f"-b{int(bias)}-n{int(with_norm)}/{config.block_n}x{config.block_k}"
                    f"m{config.block_m}s{config.split_k}",
                    "q": torch.equal(q_got.view(rows, heads, head_dim), q_want),
                    "k": torch.equal(k_got, k_want),
                    "v": torch.equal(v_got, v_want),
                    "untouched": bool((k_got[0] == 7).all() and (v_got[11] == 7).all()),
                    "rotated": not torch.equal(q_want, q.view(rows, heads, head_dim)),
                }
            )
    return results


def ops_results(dtype, device) -> list[dict]:
    """``TRITON_OPS.linear_rope`` (the tuner's GEMV with the epilogue) against the same
    table's linear then rope (the tuner's GEMV, then the rope kernel), as Llama calls it.
    Interpreter only: on a GPU the two ops' tuners choose apart (cuBLAS for one, maybe)."""
    from graphrt.core.models.ops import linear_then_rope
    from graphrt.devices.cuda.ops import TRITON_OPS

    results = []
    for rows in (1, 3):
        x, weight, b, norm, cos, sin, positions, loc = rope_case(
            rows, 4, 2, 16, 100, dtype, device, True
        )
        caches = [torch.zeros(12, 2, 16, device=device, dtype=dtype) for _ in range(4)]
        args = dict(norm=norm, positions=positions, cos=cos, sin=sin, num_heads=4)
        got = TRITON_OPS.linear_rope(x, weight, b, kv_write=KVWrite(*caches[:2], loc), **args)
        two_ops = linear_then_rope(TRITON_OPS.linear, TRITON_OPS.rope)
        want = two_ops(x, weight, b, kv_write=KVWrite(*caches[2:], loc), **args)
        results.append(
            {
                "case": f"{str(dtype)[6:]}/ops-M{rows}",
                "q": got.shape == (rows, 4, 16) and torch.equal(got, want),
                "k": torch.equal(caches[0], caches[2]),
                "v": torch.equal(caches[1], caches[3]),
                "untouched": bool((caches[0][0] == 0).all()),
                "rotated": bool(caches[0][loc].abs().sum() > 0),
            }
        )
    return results


def _cpu_configs(rows):
    from graphrt.devices.cuda.triton_gemv import GemvConfig

    if rows == 1:  # one rope pair a program; four pairs over two chunks
        return (GemvConfig(2, 128, block_m=1), GemvConfig(8, 64, block_m=1))
    return (GemvConfig(16, 64), GemvConfig(32, 64, split_k=2))  # tiles; split-K over 2 chunks


def interpreter_results() -> list[dict]:
    # rows, heads, kv heads, head_dim, K, bias, norm: K 100 is two 64-chunks, the last part
    # masked, and one 128-chunk; head_dim 8 puts two heads in a 32-wide block.
    shapes = [(1, 4, 2, 16, 100, True, True), (3, 4, 2, 16, 100, False, True),
              (1, 4, 1, 8, 64, False, False), (3, 2, 2, 8, 100, True, False)]  # fmt: skip
    cpu = torch.device("cpu")
    return [
        r for dtype in (torch.bfloat16, torch.float16)
        for r in compare(dtype, cpu, _cpu_configs, shapes) + ops_results(dtype, cpu)
    ]  # fmt: skip


def check(results: list[dict]) -> None:
    bad = [r for r in results if not (r["q"] and r["k"] and r["v"] and r["untouched"])]
    assert not bad, bad
    assert all(r["rotated"] for r in results)


@needs_triton
@pytest.mark.skipif(OLD_INTERPRETER, reason="triton < 3.7: its interpreter mishandles loop bounds")
def test_gemv_rope_epilogue_under_interpreter_equals_gemv_then_rope():
    results = run_under_triton_interpreter(__file__)
    assert len(results) == 2 * (4 * 2 + 2)
    check(results)


@needs_gpu
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_gemv_rope_epilogue_equals_gemv_then_rope(dtype):
    from graphrt.devices.cuda.triton_gemv import configs_for

    # Llama 3.2 1B's attention (32 heads, 8 KV heads of 64, hidden 2048), one row and 3
    shapes = [(1, 32, 8, 64, 2048, False, True), (3, 32, 8, 64, 2048, False, True),
              (1, 32, 8, 128, 4096, True, True)]  # fmt: skip
    check(compare(dtype, torch.device("cuda"), configs_for, shapes))


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(json.dumps(interpreter_results()))
