"""Verify of chains on decode's kernel (``decode_attention``'s ``chain``): each node of a
request's n-node chain a decode row whose last keys are the chain's nodes, read from the
verify batch's slots, not from the token table.

Every case checks the rows against naive float64 attention over the keys verify's
semantics name (tests/test_triton_verify.py's reference and inputs: scattered slots, a
poisoned padding slot, NaN-filled outputs) and, bit for bit, against decode's own rows
over a token table that holds each node's chain (what a plain step sees once the path is
accepted). The table itself is never written.
CPU lane: under Triton's interpreter, in a subprocess. CUDA lane: Gemma 4's shapes in
16-bit and float32, and a CUDA graph replay against eager.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import OLD_INTERPRETER, needs_gpu, needs_triton, rel_err, run_under_triton_interpreter
from test_triton_verify import CUDA_TOLERANCES, VerifyInputs, make_inputs, naive_verify


def chain_rows(inp: VerifyInputs, splits: int, block_n: int | None, **kw) -> torch.Tensor:
    """The chains on decode's kernel into a NaN-filled ``out``."""
    from graphrt.devices.cuda.triton_decode import allocate_decode_scratch, decode_attention

    rows, heads, head_dim = inp.q.shape
    scratch = allocate_decode_scratch(rows + 3, heads, head_dim, inp.q.device, splits)
    scratch[0].fill_(float("nan"))
    out = torch.full_like(inp.q, float("nan"))
    decode_attention(
        inp.q, inp.k_buffer, inp.v_buffer, inp.req_to_token, inp.req_pool_indices,
        inp.seq_lens, out, *scratch, inp.sm_scale, inp.window, block_n=block_n,
        chain=(inp.out_cache_loc, inp.num_nodes), **kw,
    )  # fmt: skip
    return out


def decode_rows(inp: VerifyInputs, splits: int, block_n: int | None, **kw) -> torch.Tensor:
    """Decode's rows, one per node, over a table row per node that holds its request's
    prefix and the chain up to the node."""
    from graphrt.devices.cuda.triton_decode import allocate_decode_scratch, decode_attention

    rows, heads, head_dim = inp.q.shape
    n = inp.num_nodes
    table = torch.zeros(rows + 1, inp.req_to_token.shape[1], dtype=torch.int64)
    for r in range(rows):
        b, i = divmod(r, n)
        req, prefix = int(inp.req_pool_indices[b]), inp.prefix_lens[b]
        table[r + 1, :prefix] = inp.req_to_token[req, :prefix].cpu()
        table[r + 1, prefix : prefix + i + 1] = inp.out_cache_loc[b * n : b * n + i + 1].cpu()
    scratch = allocate_decode_scratch(rows, heads, head_dim, inp.q.device, splits)
    out = torch.full_like(inp.q, float("nan"))
    decode_attention(
        inp.q, inp.k_buffer, inp.v_buffer, table.to(inp.q.device),
        torch.arange(1, rows + 1, device=inp.q.device), (inp.positions + 1).to(torch.int32),
        out, *scratch, inp.sm_scale, inp.window, block_n=block_n, **kw,
    )  # fmt: skip
    return out


# (head_dim, query heads, KV heads, n, window, splits, block_n): KV groups 1, 2 and 8;
# head dims 16, 24 (masked lanes) and 64; chains of 1, 2, 5 and 7; windows shorter than
# the chain (3 on a 7-chain), within it and longer; decode's default blocks and 16 keys.
# (Few cases: each interpreted launch costs the CPU lane seconds.)
INTERPRETER_CASES = [
    (16, 2, 2, 5, None, 3, 16),
    (24, 4, 2, 7, 3, 3, 16),
    (64, 8, 1, 2, 20, 3, None),
    (16, 2, 1, 1, 4, 2, None),
]
# 0: the root sees only itself; 3: shorter than the splits; 70: several 16-key blocks.
CPU_PREFIX_LENS = [0, 3, 21, 70]


def interpreter_results() -> dict:
    """Runs in a TRITON_INTERPRET=1 subprocess; returns errors and flags for the test."""
    errors, flags = {}, {}
    for i, (head_dim, heads, kv_heads, n, window, splits, block_n) in enumerate(INTERPRETER_CASES):
        name = f"D{head_dim}-G{heads // kv_heads}-n{n}-window{window}"
        inp = make_inputs(
            CPU_PREFIX_LENS, n, heads, kv_heads, head_dim, torch.float32, "cpu", seed=i,
            window=window, chain=True,
        )  # fmt: skip
        table = inp.req_to_token.clone()
        out = chain_rows(inp, splits, block_n)
        errors[f"{name}/vs_naive"] = rel_err(out, naive_verify(inp))
        flags[f"{name}/equals_decode_rows"] = torch.equal(out, decode_rows(inp, splits, block_n))
        flags[f"{name}/table_untouched"] = torch.equal(inp.req_to_token, table)
    # A graph batch's padding request: request row 0, a length short of its chain, every
    # node in the padding slot (large K). Its rows stay finite.
    inp = make_inputs([5, 0], 3, 2, 1, 16, torch.float32, "cpu", seed=9, chain=True)
    inp.req_pool_indices[1], inp.seq_lens[1] = 0, 1
    inp.out_cache_loc[3:] = 0
    out = chain_rows(inp, 3, None)
    flags["padding/finite"] = bool(torch.isfinite(out).all())
    errors["padding/real_rows_vs_naive"] = rel_err(out[:3], naive_verify(inp)[:3])
    return {"errors": errors, "flags": flags}


@needs_triton
@pytest.mark.skipif(OLD_INTERPRETER, reason="triton < 3.7: its interpreter mishandles loop bounds")
def test_chains_on_decode_kernel_match_naive_and_decode_rows_under_interpreter():
    results = run_under_triton_interpreter(__file__)
    assert len(results["errors"]) == len(INTERPRETER_CASES) + 1
    assert len(results["flags"]) == 2 * len(INTERPRETER_CASES) + 1
    too_far = {name: err for name, err in results["errors"].items() if not err <= 1e-5}
    assert not too_far, too_far
    failed = [name for name, ok in results["flags"].items() if not ok]
    assert not failed, failed


def test_only_chains_of_small_or_width_invariant_batches_go_to_decode():
    """The backend's choice, on host facts alone: a tree that is not a chain never goes;
    a chain goes up to CHAIN_ON_DECODE_MAX (request, KV head) pairs, and always in a
    width-invariant model."""
    from graphrt.core.attention.base import AttentionSpec
    from graphrt.core.batch import ForwardBatch, ForwardMode
    from graphrt.devices.cuda.attention import CHAIN_ON_DECODE_MAX, TritonAttentionBackend
    from graphrt.spec.verify import VerifyInput

    def batch(requests: int, chain: bool) -> ForwardBatch:
        n = 5
        rows = torch.zeros(requests * n, dtype=torch.int64)
        info = VerifyInput(*(torch.zeros(requests, n, n, dtype=torch.bool),) * 4, chain=chain)
        return ForwardBatch(
            mode=ForwardMode.TARGET_VERIFY, input_ids=rows, positions=rows,
            req_pool_indices=torch.zeros(requests, dtype=torch.int64),
            seq_lens=torch.full((requests,), n, dtype=torch.int32), out_cache_loc=rows,
            seq_lens_cpu=[n] * requests, extend_lens_cpu=[n] * requests, spec_info=info,
        )  # fmt: skip

    def spec(kv_heads: int, invariant: bool = False) -> AttentionSpec:
        return AttentionSpec(8, kv_heads, 64, 0.125, 0, width_invariant=invariant)

    goes = TritonAttentionBackend._chain_on_decode
    assert CHAIN_ON_DECODE_MAX == 4
    assert goes(spec(1), batch(4, True)) and not goes(spec(1), batch(5, True))
    assert goes(spec(2), batch(2, True)) and not goes(spec(2), batch(3, True))
    assert not goes(spec(1), batch(1, False))
    assert goes(spec(1, invariant=True), batch(64, True))
    assert not goes(spec(1, invariant=True), batch(1, False))


# ---- CUDA lane ------------------------------------------------------------------------

CUDA_SHAPES = [(512, 8, 1), (256, 8, 1), (64, 16, 4)]  # Gemma 4's full and sliding; G = 4


@pytest.mark.cuda
@needs_gpu
@needs_triton
@pytest.mark.parametrize("window", [None, 512])
@pytest.mark.parametrize("shape", CUDA_SHAPES, ids=lambda s: f"D{s[0]}-G{s[1] // s[2]}")
@pytest.mark.parametrize("dtype", list(CUDA_TOLERANCES), ids=str)
def test_cuda_chains_on_decode_kernel_match_naive_and_decode_rows(dtype, shape, window):
    from graphrt.devices.cuda.triton_decode import NUM_KV_SPLITS

    head_dim, heads, kv_heads = shape
    inp = make_inputs(
        [0, 17, 512, 1300], 5, heads, kv_heads, head_dim, dtype, "cuda", seed=head_dim,
        window=window, chain=True,
    )  # fmt: skip
    table = inp.req_to_token.clone()
    out = chain_rows(inp, NUM_KV_SPLITS, None)
    assert rel_err(out.cpu(), naive_verify(inp)) < CUDA_TOLERANCES[dtype]
    assert torch.equal(out, decode_rows(inp, NUM_KV_SPLITS, None))
    assert torch.equal(inp.req_to_token, table)


@pytest.mark.cuda
@needs_gpu
@needs_triton
def test_cuda_chains_on_decode_kernel_replay_as_eager():
    """Captured once, replayed after every input is rewritten in place (prefixes, slots,
    q, KV): bit for bit the eager launch, and naive attention's within bf16's tolerance."""
    from graphrt.devices.cuda.triton_decode import NUM_KV_SPLITS, allocate_decode_scratch

    bs, n, heads, kv_heads, head_dim, context = 4, 5, 8, 1, 256, 700

    def fresh(seed: int, prefix_lens: list[int]) -> VerifyInputs:
        return make_inputs(
            prefix_lens, n, heads, kv_heads, head_dim, torch.bfloat16, "cuda", seed=seed,
            window=512, chain=True, context=context,
        )  # fmt: skip

    from graphrt.devices.cuda.triton_decode import decode_attention

    static = fresh(0, [1] * bs)
    scratch = allocate_decode_scratch(bs * n, heads, head_dim, torch.device("cuda"), NUM_KV_SPLITS)
    out = torch.empty_like(static.q)

    def forward(result: torch.Tensor) -> None:
        decode_attention(
            static.q, static.k_buffer, static.v_buffer, static.req_to_token,
            static.req_pool_indices, static.seq_lens, result, *scratch, static.sm_scale, 512,
            chain=(static.out_cache_loc, n),
        )  # fmt: skip

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        forward(out)  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        forward(out)
    for seed, prefix_lens in ((1, [600, 0, 37, 512]), (2, [3, 511, 90, 1])):
        live = fresh(seed, prefix_lens)
        for static_t, live_t in zip(static.tensors(), live.tensors()):
            static_t.copy_(live_t)
        out.fill_(float("nan"))
        graph.replay()
        replayed = out.clone()
        eager = torch.full_like(out, float("nan"))
        forward(eager)
        assert torch.equal(replayed, eager), seed
        assert rel_err(replayed.cpu(), naive_verify(live)) < CUDA_TOLERANCES[torch.bfloat16]
    graph.reset()


if __name__ == "__main__":
    # The CPU lane's subprocess (TRITON_INTERPRET=1 is already in its environment).
    torch.manual_seed(0)
    print(json.dumps(interpreter_results()))
