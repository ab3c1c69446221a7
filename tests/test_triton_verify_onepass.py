"""The one-pass tree verify kernel (devices/cuda/triton_verify_onepass.py, verify's
default attention) against naive float64 softmax attention and the masked-SDPA
reference of test_triton_verify, on the same random trees over scattered pools.

CPU lane: the kernels under Triton's interpreter, in a subprocess (see
test_triton_verify), with several nodes a program and one, one program along the splits
and several, the split count a request takes checked against its prefix and the programs. CUDA lane: real sizes in float32
and bfloat16 (Gemma 4's head_dim 256 and 512, 8 query heads on one KV head) and long
prefixes on a 128-split scratch; a CUDA graph replay against eager is test_triton_verify's,
for both kernels.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import OLD_INTERPRETER, needs_gpu, needs_triton, rel_err, run_under_triton_interpreter
from test_triton_verify import (
    CPU_PREFIX_LENS,
    CUDA_CASES,
    CUDA_TOLERANCES,
    INTERPRETER_CASES,
    VerifyInputs,
    cuda_case,
    interpreter_case,
    make_inputs,
    naive_verify,
)


def run_onepass(
    inp: VerifyInputs,
    num_kv_splits: int = 16,
    block_n: int | None = None,
    programs: int | None = None,
    q: torch.Tensor | None = None,
) -> tuple[torch.Tensor, list[int]]:
    """The kernel into a NaN-filled ``out`` (NaN scratch too: the combine must read only
    what stage 1 wrote) -> (out, each row's split count)."""
    from graphrt.devices.cuda.triton_decode import allocate_decode_scratch
    from graphrt.devices.cuda.triton_verify_onepass import onepass_verify_attention

    q = inp.q if q is None else q
    rows, num_heads, head_dim = q.shape
    scratch = allocate_decode_scratch(rows + 3, num_heads, head_dim, q.device, num_kv_splits)
    scratch[0].fill_(float("nan"))
    scratch[1].fill_(float("nan"))
    out = torch.full_like(inp.q, float("nan"))
    result = onepass_verify_attention(
        q, *inp.tensors()[1:], out, *scratch, inp.sm_scale, inp.window, block_n=block_n,
        programs=programs,
    )  # fmt: skip
    assert result is out
    return out, scratch[2][:rows].tolist()


def expected_splits(
    inp: VerifyInputs, block_n: int, max_splits: int, split_blocks: int, programs: int
) -> list:
    """Each row's split count as the kernel derives it from its request's prefix (the
    blocks from the first any of the request's rows sees): at most one split for every
    ``split_blocks`` blocks, one a program (``programs`` along the splits), runs of
    equal length but the last, none empty."""
    n, window = inp.num_nodes, inp.window or 0
    out = []
    for b, prefix in enumerate(inp.prefix_lens):
        q_pos = inp.positions[b * n : (b + 1) * n].tolist()
        lo = min(max(p + 1 - window, 0) if window else 0 for p in q_pos)
        blocks = max(-(-prefix // block_n) - min(lo, prefix) // block_n, 0)
        per_split = -(-blocks // min(max(min(-(-blocks // split_blocks), programs), 1), max_splits))
        out += [max(-(-blocks // max(per_split, 1)), 1)] * n
    return out


def one_request(inp: VerifyInputs, b: int) -> VerifyInputs:
    """Request ``b`` of ``inp`` as a batch of its own (same pool, same table)."""
    n = inp.num_nodes
    rows = slice(b * n, (b + 1) * n)
    return VerifyInputs(
        q=inp.q[rows], k_buffer=inp.k_buffer, v_buffer=inp.v_buffer,
        req_to_token=inp.req_to_token, req_pool_indices=inp.req_pool_indices[b : b + 1],
        seq_lens=inp.seq_lens[b : b + 1], positions=inp.positions[rows],
        out_cache_loc=inp.out_cache_loc[rows], tree_mask=inp.tree_mask[b : b + 1],
        prefix_lens=inp.prefix_lens[b : b + 1], window=inp.window, sm_scale=inp.sm_scale,
    )  # fmt: skip


# ---- CPU lane: under Triton's interpreter ---------------------------------------------


def interpreter_results() -> dict:
    """Runs in a TRITON_INTERPRET=1 subprocess: test_triton_verify's cases (head dims 16,
    24, 64; KV groups 1, 2, 8; trees of 1 to 7 nodes; windows shorter than the tree,
    within it and longer; positions by depth or gapped), with 1, 3 and the scratch's count
    of programs along the splits, splits of one block at least and of two, and MAX_TILE
    small enough that a program serves one or two nodes, or large enough for a request's
    every node; the longest request alone gives its rows in the batch bit for bit."""
    from graphrt.devices.cuda import triton_verify_onepass as onepass

    errors, flags = {}, {}
    for i, case in enumerate(INTERPRETER_CASES):
        head_dim, num_heads, num_kv_heads, n, window, gapped, chain, splits, block_n = case
        # The same inputs as test_triton_verify's (whose test also holds SDPA to naive).
        name, inp, q = interpreter_case(i)
        naive = naive_verify(inp)
        # Tiles of one node a program, two, or every node of a request.
        block_d = max(16, 1 << (head_dim - 1).bit_length())
        group = num_heads // num_kv_heads
        onepass.MAX_TILE = block_d * group * (1, 2, n)[i % 3]
        block = block_n or 16
        split_blocks = 1 + i % 2
        onepass.split_blocks = lambda block_d, least=split_blocks: least
        outs = []
        for programs in (1, 3, splits + 2):
            out, row_splits = run_onepass(inp, splits + 2, block, programs, q)
            outs.append(out)
            errors[f"{name}/P{programs}/vs_naive"] = rel_err(out, naive)
            flags[f"{name}/P{programs}/written"] = bool(torch.isfinite(out).all())
            want = expected_splits(inp, block, splits + 2, split_blocks, programs)
            flags[f"{name}/P{programs}/splits"] = row_splits == want
        last = len(CPU_PREFIX_LENS) - 1  # the longest prefix: the most splits
        alone, _ = run_onepass(one_request(inp, last), splits + 2, block, 3)
        flags[f"{name}/alone_equals_batch"] = torch.equal(alone, outs[1][last * n :])

    # The default programs along the splits: TARGET_PROGRAMS over the batch's others
    # (requests x KV heads, a program a chain here), up to a power of two, at most the
    # scratch's splits: 8 over 2 requests' 2 KV heads give 2, over one request's 4 (its 7
    # blocks of 16 keys: 4 runs of 2, the last of 1), 16 over 3 requests' 4 (not 3: 3
    # runs of 3 blocks); with 3 blocks a split at least, the one request takes 3 splits.
    # And 5 blocks on 4 programs: 3 runs of 2 (a fourth would be empty).
    onepass.MAX_TILE = 16 * 2 * 3
    two = make_inputs([100, 40], 3, 4, 2, 16, torch.float32, "cpu", seed=12)
    one = one_request(two, 0)
    three = make_inputs([100, 40, 120], 3, 4, 2, 16, torch.float32, "cpu", seed=14)
    cases = ((two, 8, 1, 2), (one, 8, 1, 4), (three, 16, 1, 4), (one, 8, 3, 4))
    for batch, target, least, programs in cases:
        onepass.TARGET_PROGRAMS = target
        onepass.split_blocks = lambda block_d, least=least: least
        out, row_splits = run_onepass(batch, 8, 16)
        name = f"default-B{len(batch.prefix_lens)}-P{programs}x{least}"
        errors[f"{name}/vs_naive"] = rel_err(out, naive_verify(batch))
        flags[f"{name}/splits"] = row_splits == expected_splits(batch, 16, 8, least, programs)
    onepass.TARGET_PROGRAMS = 256
    onepass.split_blocks = lambda block_d: 1
    short = make_inputs([80], 3, 4, 2, 16, torch.float32, "cpu", seed=13)
    out, row_splits = run_onepass(short, 8, 16, 4)
    errors["no-empty-split/vs_naive"] = rel_err(out, naive_verify(short))
    flags["no-empty-split/splits"] = row_splits == [3] * 3

    # A 7-chain one node a program under a window of 4: its nodes' first visible keys
    # fall in different blocks, and every program of the request still cuts the prefix
    # alike (the splits follow the request's nodes, not the program's).
    onepass.MAX_TILE = 16 * 2
    inp = make_inputs([50], 7, 2, 1, 16, torch.float32, "cpu", seed=10, window=4, chain=True)
    out, row_splits = run_onepass(inp, 8, 16, 8)
    errors["spread-chain/vs_naive"] = rel_err(out, naive_verify(inp))
    flags["spread-chain/splits"] = row_splits == expected_splits(inp, 16, 8, 1, 8)
    # A deep node whose window starts past the first split's keys, scores far below 0
    # (q = -30 on K = 1: log-sum-exps near -700): its first split must not be empty, or
    # the combine, starting from an empty split's -inf taken as 0, underflows to zeros.
    onepass.MAX_TILE = 16 * 2 * 2  # both nodes in one program: the first's keys start it
    inp = make_inputs([64], 2, 2, 1, 16, torch.float32, "cpu", seed=11, window=20)
    inp.positions[:] = torch.tensor([64, 67])
    inp.tree_mask[0] = torch.tensor([[True, False], [True, True]])
    inp.k_buffer.fill_(1.0)
    inp.q.fill_(-30.0)
    out, _ = run_onepass(inp, 8, 16)
    errors["far-below-zero/vs_naive"] = rel_err(out, naive_verify(inp))

    # A padding request as a graph batch may hold one: request row 0, a seq_len short
    # of n, slot 0 everywhere and no tree key visible. Its rows come out zeros.
    inp = make_inputs([5, 0], 3, 2, 1, 16, torch.float32, "cpu", seed=9)
    inp.req_pool_indices[1], inp.seq_lens[1] = 0, 1
    inp.out_cache_loc[3:], inp.tree_mask[1] = 0, False
    out, _ = run_onepass(inp, 3, 16)
    errors["padding/vs_naive"] = rel_err(out, naive_verify(inp))
    flags["padding/zeros"] = torch.equal(out[3:], torch.zeros_like(out[3:]))
    return {"errors": errors, "flags": flags}


@needs_triton
@pytest.mark.skipif(OLD_INTERPRETER, reason="triton < 3.7: its interpreter mishandles loop bounds")
def test_onepass_kernel_under_interpreter_matches_naive():
    results = run_under_triton_interpreter(__file__)
    # Per case: per programs (1, 3, S) an error and 2 flags, and the flag of bits alone;
    # then the default programs' four errors and flags, the no-empty-split error and
    # flag, the spread chain's, the far-below-zero error, the padding request's error
    # and flag.
    assert len(results["errors"]) == 3 * len(INTERPRETER_CASES) + 8
    assert len(results["flags"]) == 7 * len(INTERPRETER_CASES) + 7
    too_far = {name: err for name, err in results["errors"].items() if not err <= 1e-5}
    assert not too_far, too_far
    failed = [name for name, ok in results["flags"].items() if not ok]
    assert not failed, failed


@needs_triton
@pytest.mark.parametrize("element_size", [2, 4], ids=["bf16", "fp32"])
@pytest.mark.parametrize("head_dim", [256, 512])
def test_onepass_kernels_compile_for_sm90(head_dim, element_size):
    """The interpreter runs the kernel without Triton's type checks: here it compiles for
    an H200 as Gemma 4's layers launch it (8 heads on one KV head, a 5-node chain in one
    program in bfloat16, 8 warps at the tile limit), with the combine it ends in (one
    split first), and asks no more shared memory than an H200 block has (float32 at
    head_dim 512 asked 264 KiB with a whole chain in a program). In bfloat16 it spills
    little and leaves room for a second block where the tile allows: a loop over a
    request's splits (stop 44) spilled 0.7 KB a thread at head_dim 256 and 2 KB at 512,
    asked 96 / 192 KiB, and a layer at 64 requests took 96 us on the H200 against the
    one-split kernel's 64 (head_dim 512, two machine starts)."""
    from graphrt.devices.cuda import triton_verify_onepass as onepass
    from graphrt.devices.cuda.offline_compile import (
        ATTENTION_POINTERS,
        H200_SHARED_BYTES,
        compile_for_h200,
        registers_and_stack,
    )
    from graphrt.devices.cuda.triton_decode import (
        _decode_combine_kernel,
        default_block_n,
        dot_precision,
        rest_splits,
    )

    kv = "*bf16" if element_size == 2 else "*fp32"
    pointers = ATTENTION_POINTERS | {"Q": kv, "K": kv, "V": kv, "Out": kv}
    nodes, block_g = onepass.program_nodes(8, 5, head_dim, element_size)
    assert (nodes, block_g) == ((4, 32) if (head_dim, element_size) == (512, 4) else (5, 64))
    block_n = default_block_n(head_dim, element_size)
    precision = dot_precision(torch.bfloat16 if element_size == 2 else torch.float32)
    stage1 = dict(KV_GROUP=8, NODES=nodes, BLOCK_G=block_g, BLOCK_N=block_n, BLOCK_T=16,
                  SPLIT_BLOCKS=onepass.split_blocks(head_dim), HEAD_DIM=head_dim,
                  BLOCK_D=head_dim, DOT_PRECISION=precision)  # fmt: skip
    warps = 8 if block_g * head_dim >= onepass.MAX_TILE else 4
    compiled = compile_for_h200(onepass._onepass_partial_kernel, stage1, warps, pointers)
    assert compiled.metadata.shared <= H200_SHARED_BYTES, compiled.metadata.shared
    if element_size == 2:
        _, stack = registers_and_stack(compiled)
        assert stack <= head_dim * 2, stack  # 8 / 416 bytes at 256 / 512 (Triton 3.7.1)
        assert compiled.metadata.shared <= head_dim * 256, compiled.metadata.shared  # 64 / 128 KiB
    combine = dict(MIN_SPLITS=1, BLOCK_S=1, BLOCK_REST=rest_splits(1, 128, head_dim),
                   HEAD_DIM=head_dim, BLOCK_D=head_dim, LAUNCH_DEPENDENTS=True)  # fmt: skip
    compile_for_h200(_decode_combine_kernel, combine, 2, pointers)


# ---- CUDA lane -----------------------------------------------------------------------


@pytest.mark.cuda
@needs_gpu
@needs_triton
@pytest.mark.parametrize("dtype,shape,num_nodes,window", CUDA_CASES)
def test_cuda_onepass_matches_naive(dtype, shape, num_nodes, window):
    inp = cuda_case(dtype, shape, num_nodes, window)
    out, _ = run_onepass(inp)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert rel_err(out.cpu(), naive_verify(inp)) < CUDA_TOLERANCES[dtype]


@pytest.mark.cuda
@needs_gpu
@needs_triton
def test_cuda_onepass_long_prefixes_take_the_programs_splits():
    """Prefixes of 8,190 and 20,000 tokens on a scratch of 128 splits (a 32k context's),
    bfloat16, Gemma 4's 8 heads on one KV head: with the default programs along the
    splits (128: the scratch's) the requests take 128 and 125 splits (256 blocks of 32
    keys in runs of 2, 625 in runs of 5), with 4 programs 4, and the rows match naive
    attention either way."""
    from graphrt.devices.cuda.triton_decode import max_kv_splits

    inp = make_inputs([8190, 20000], 5, 8, 1, 256, torch.bfloat16, "cuda", seed=5, chain=True)
    for programs, want in ((None, [128] * 5 + [125] * 5), (4, [4] * 10)):
        out, splits = run_onepass(inp, max_kv_splits(32768), programs=programs)
        assert rel_err(out.cpu(), naive_verify(inp)) < CUDA_TOLERANCES[torch.bfloat16]
        assert splits == want


if __name__ == "__main__":
    # The CPU lane's subprocess (TRITON_INTERPRET=1 is already in its environment).
    torch.manual_seed(0)
    print(json.dumps(interpreter_results()))
