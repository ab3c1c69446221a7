"""Triton tree-masked verify attention (devices/cuda/triton_verify.py) against naive
float64 softmax attention and a batched masked-SDPA reference written here.

Every case scatters slots over the pool (slot order unrelated to position order),
poisons the padding slot 0 with large K, builds random draft trees (each node's
parent an earlier node; the mask is a node's ancestors and itself) over mixed
prefix lengths, and fills ``out`` with NaN first, so an unwritten element shows.
CPU lane: the kernels under Triton's interpreter, in a subprocess (TRITON_INTERPRET=1
must be set before triton is first imported), whose errors come back as JSON.
CUDA lane: real sizes in float32 / bfloat16 (Gemma 4's head_dim 256 and 512 with
8 query heads on one KV head among them), and a CUDA graph replay against eager.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from helpers import OLD_INTERPRETER, needs_gpu, needs_triton, rel_err, run_under_triton_interpreter

PADDING_K = 50.0  # large, finite garbage in the padding slot's K: a row reading it shows


@dataclass
class VerifyInputs:
    """One TARGET_VERIFY batch: B trees of n nodes over a scattered paged pool."""

    q: torch.Tensor  # (B*n, H, D)
    k_buffer: torch.Tensor  # (num_slots + 1, Hkv, D)
    v_buffer: torch.Tensor
    req_to_token: torch.Tensor  # (max_reqs + 1, context)
    req_pool_indices: torch.Tensor  # (B,)
    seq_lens: torch.Tensor  # (B,) int32, prefix + n
    positions: torch.Tensor  # (B*n,)
    out_cache_loc: torch.Tensor  # (B*n,)
    tree_mask: torch.Tensor  # (B, n, n) bool
    prefix_lens: list[int]
    window: int | None
    sm_scale: float

    @property
    def num_nodes(self) -> int:
        return self.tree_mask.shape[1]

    def tensors(self) -> list[torch.Tensor]:
        return [
            self.q,
            self.k_buffer,
            self.v_buffer,
            self.req_to_token,
            self.req_pool_indices,
            self.seq_lens,
            self.positions,
            self.out_cache_loc,
            self.tree_mask,
        ]


def random_tree(num_nodes: int, gen: torch.Generator, chain: bool) -> list[int]:
    """Parent of each node (-1 for the root); a parent always precedes its child."""
    if chain:
        return [i - 1 for i in range(num_nodes)]
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, num_nodes)]


def make_inputs(
    prefix_lens: list[int],
    num_nodes: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device,
    seed: int,
    window: int | None = None,
    gapped: bool = False,  # node positions: parent's + 1..3 (root: prefix + 0..3), not depth
    chain: bool = False,  # every tree a chain, as deep as it is long
    context: int | None = None,  # req_to_token width; the pool holds B * context slots
) -> VerifyInputs:
    gen = torch.Generator().manual_seed(seed)
    bs = len(prefix_lens)
    context = context or max(prefix_lens) + 4 * num_nodes
    num_slots = bs * context
    k_buffer = torch.randn(num_slots + 1, num_kv_heads, head_dim, generator=gen)
    v_buffer = torch.randn(num_slots + 1, num_kv_heads, head_dim, generator=gen)
    k_buffer[0] = PADDING_K
    # Scattered slots and request rows, as after frees and reuse; row 0 and
    # every unowned position of req_to_token stay slot 0.
    free = (torch.randperm(num_slots, generator=gen) + 1).tolist()
    req_rows = (torch.randperm(bs + 2, generator=gen)[:bs] + 1).tolist()
    req_to_token = torch.zeros(bs + 3, context, dtype=torch.int64)
    positions, out_cache_loc = [], []
    tree_mask = torch.zeros(bs, num_nodes, num_nodes, dtype=torch.bool)
    for b, prefix in enumerate(prefix_lens):
        req_to_token[req_rows[b], :prefix] = torch.tensor([free.pop() for _ in range(prefix)])
        out_cache_loc += [free.pop() for _ in range(num_nodes)]
        parents = random_tree(num_nodes, gen, chain)
        pos = []
        for i, parent in enumerate(parents):
            step = int(torch.randint(0 if parent < 0 else 1, 4, (1,), generator=gen))
            if parent < 0:
                pos.append(prefix + (step if gapped else 0))
            else:
                pos.append(pos[parent] + (step if gapped else 1))
                tree_mask[b, i] = tree_mask[b, parent]
            tree_mask[b, i, i] = True
        positions += pos
    rows = bs * num_nodes
    return VerifyInputs(
        q=torch.randn(rows, num_heads, head_dim, generator=gen).to(device, dtype),
        k_buffer=k_buffer.to(device, dtype),
        v_buffer=v_buffer.to(device, dtype),
        req_to_token=req_to_token.to(device),
        req_pool_indices=torch.tensor(req_rows, device=device),
        seq_lens=torch.tensor([p + num_nodes for p in prefix_lens], dtype=torch.int32).to(device),
        positions=torch.tensor(positions, device=device),
        out_cache_loc=torch.tensor(out_cache_loc, device=device),
        tree_mask=tree_mask.to(device),
        prefix_lens=list(prefix_lens),
        window=window,
        sm_scale=1.3 * head_dim**-0.5,
    )


def naive_verify(inp: VerifyInputs) -> torch.Tensor:
    """Explicit softmax in float64, node by node, over the keys the semantics name -> (B*n, H, D)."""
    q, k_buffer, v_buffer, req_to_token, req_rows, _, positions, locs, tree_mask = (
        t.cpu() for t in inp.tensors()
    )
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_buffer.shape[1]
    group = num_heads // num_kv_heads
    n, window = inp.num_nodes, inp.window
    out = torch.empty(q.shape, dtype=torch.float64)
    for b, prefix in enumerate(inp.prefix_lens):
        for i in range(n):
            row = b * n + i
            q_pos = int(positions[row])
            slots = [
                int(req_to_token[req_rows[b], j])
                for j in range(prefix)
                if window is None or j > q_pos - window
            ]
            slots += [
                int(locs[b * n + j])
                for j in range(n)
                if tree_mask[b, i, j] and (window is None or positions[b * n + j] > q_pos - window)
            ]
            if not slots:  # a padding row: the kernel's empty softmax is zeros
                out[row] = 0.0
                continue
            key = k_buffer[slots].double()  # (L, Hkv, D)
            value = v_buffer[slots].double()
            qg = q[row].to(k_buffer.dtype).double().view(num_kv_heads, group, head_dim)
            scores = torch.einsum("kgd,lkd->kgl", qg, key) * inp.sm_scale
            weights = (scores - scores.amax(-1, keepdim=True)).exp()
            weights = weights / weights.sum(-1, keepdim=True)
            out[row] = torch.einsum("kgl,lkd->kgd", weights, value).reshape(num_heads, head_dim)
    return out


def sdpa_verify(inp: VerifyInputs) -> torch.Tensor:
    """The same attention as one masked SDPA over [padded prefix | tree] keys -> (B*n, H, D)."""
    q, k_buffer, v_buffer, req_to_token, req_rows, _, positions, locs, tree_mask = (
        t.cpu() for t in inp.tensors()
    )
    bs, n = tree_mask.shape[:2]
    num_heads, head_dim = q.shape[1:]
    max_prefix = max(inp.prefix_lens)
    slots = torch.cat([req_to_token[req_rows, :max_prefix], locs.view(bs, n)], dim=1)  # (B, L)
    key = k_buffer[slots].double().transpose(1, 2)  # (B, Hkv, L, D)
    value = v_buffer[slots].double().transpose(1, 2)
    prefix_pos = torch.arange(max_prefix).expand(bs, max_prefix)  # (B, P)
    in_prefix = prefix_pos < torch.tensor(inp.prefix_lens).view(bs, 1)
    visible = torch.cat([in_prefix.unsqueeze(1).expand(bs, n, max_prefix), tree_mask], dim=2)
    # visible: (B, n, L)
    if inp.window is not None:
        k_pos = torch.cat([prefix_pos, positions.view(bs, n)], dim=1)  # (B, L)
        q_pos = positions.view(bs, n, 1)
        visible &= k_pos.unsqueeze(1) > q_pos - inp.window
    qb = q.to(k_buffer.dtype).double().view(bs, n, num_heads, head_dim).transpose(1, 2)
    out = F.scaled_dot_product_attention(
        qb,  # (B, H, n, D)
        key,
        value,
        attn_mask=visible.unsqueeze(1),
        scale=inp.sm_scale,
        enable_gqa=num_heads != key.shape[1],
    )
    return out.transpose(1, 2).reshape(bs * n, num_heads, head_dim)


def run_kernel(
    inp: VerifyInputs,
    num_kv_splits: int | None = None,
    block_n: int | None = None,
    q: torch.Tensor | None = None,
    short_splits: int | None = None,
) -> torch.Tensor:
    """The kernel into a NaN-filled ``out`` with scratch sized past B*n rows."""
    from graphrt.devices.cuda.triton_decode import NUM_KV_SPLITS, allocate_decode_scratch
    from graphrt.devices.cuda.triton_verify import tree_verify_attention

    q = inp.q if q is None else q
    rows, num_heads, head_dim = q.shape
    splits = NUM_KV_SPLITS if num_kv_splits is None else num_kv_splits  # decode's
    scratch = allocate_decode_scratch(rows + 3, num_heads, head_dim, q.device, splits)
    scratch[0].fill_(float("nan"))  # empty splits store no output: the combine must not read it
    out = torch.full_like(inp.q, float("nan"))
    short = {} if short_splits is None else {"short_splits": short_splits}
    result = tree_verify_attention(
        q, *inp.tensors()[1:], out, *scratch, inp.sm_scale, inp.window, block_n=block_n, **short
    )
    assert result is out
    return out


# ---- CPU lane: the kernels under Triton's interpreter ----------------------------------

# 0: the root sees only itself; 3: shorter than the splits; 70: several 16-key steps
# per split in the 3-split launches.
CPU_PREFIX_LENS = [0, 3, 21, 70]
# (head_dim, num_heads, num_kv_heads, n, window, gapped, chain, num_kv_splits, block_n):
# KV groups 1, 2 and 8; head dims 16, 24 (masked lanes) and 64; n = 1, 2, 5, 7; windows
# shorter than the tree (3 on a 7-chain), within it, and longer; positions by depth or gapped.
INTERPRETER_CASES = [
    (16, 2, 2, 5, None, False, False, 3, 16),
    (24, 4, 2, 7, 3, False, True, 3, 16),
    (64, 8, 1, 2, 20, True, False, 3, None),
    (24, 8, 1, 7, 5, True, False, 2, 16),
    (16, 2, 1, 1, 4, False, False, 3, None),
    (64, 2, 1, 5, None, True, True, 3, 16),
]


def interpreter_case(i: int) -> tuple[str, VerifyInputs, torch.Tensor]:
    """INTERPRETER_CASES[i]'s name, inputs (over CPU_PREFIX_LENS, seed i) and q: the first
    case's with a row stride wider than H * D, as a slice of a fused projection."""
    head_dim, num_heads, num_kv_heads, n, window, gapped, chain, _, _ = INTERPRETER_CASES[i]
    name = f"D{head_dim}-G{num_heads // num_kv_heads}-n{n}-window{window}-gapped{gapped}"
    inp = make_inputs(
        CPU_PREFIX_LENS, n, num_heads, num_kv_heads, head_dim, torch.float32, "cpu",
        seed=i, window=window, gapped=gapped, chain=chain,
    )  # fmt: skip
    q = inp.q
    if i == 0:
        wide = torch.zeros(q.shape[0], num_heads, head_dim + 8)
        wide[:, :, :head_dim] = q
        q = wide[:, :, :head_dim]
    return name, inp, q


def interpreter_results() -> dict:
    """Runs in a TRITON_INTERPRET=1 subprocess; returns errors and flags for the test to check.
    Every case packs nodes into programs as large batches do (one node a program is
    decode's own schedule, checked by the invariance flags)."""
    from graphrt.devices.cuda import triton_verify

    triton_verify.PACK_MIN_PROGRAMS = 0  # this subprocess only
    errors, flags = {}, {}
    for i, case in enumerate(INTERPRETER_CASES):
        head_dim, num_heads, num_kv_heads, n, window, gapped, chain, splits, block_n = case
        name, inp, q = interpreter_case(i)
        out = run_kernel(inp, splits, block_n, q)
        naive, sdpa = naive_verify(inp), sdpa_verify(inp)
        errors[f"{name}/vs_naive"] = rel_err(out, naive)
        errors[f"{name}/vs_sdpa"] = rel_err(out, sdpa)
        errors[f"{name}/sdpa_vs_naive"] = rel_err(sdpa, naive)
        flags[f"{name}/written"] = bool(torch.isfinite(out).all())

    # A padding request as a graph batch may hold one: request row 0, a seq_len short
    # of n, slot 0 everywhere and no tree key visible. Its rows must stay NaN-free.
    inp = make_inputs([5, 0], 3, 2, 1, 16, torch.float32, "cpu", seed=9)
    inp.req_pool_indices[1], inp.seq_lens[1] = 0, 1
    inp.out_cache_loc[3:], inp.tree_mask[1] = 0, False
    out = run_kernel(inp, 3)
    errors["padding/vs_naive"] = rel_err(out, naive_verify(inp))
    flags["padding/zeros"] = torch.equal(out[3:], torch.zeros_like(out[3:]))
    flags.update(invariance_flags("cpu", torch.float32, 3, 16, head_dim=16))
    doubling_results(errors, flags)
    return {"errors": errors, "flags": flags}


# invariance_flags' cases for doubling splits: a packed chain whose program straddles a
# doubling (two schedules), and one node a program.
DOUBLING_CASES = ((False, True, 5, 4, 2, 0), (False, False, 4, 4, 2, 10**9))


def doubling_results(errors: dict, flags: dict) -> None:
    """Rows long enough for more splits, at toy lengths: SPLIT_KEYS 4 and short rows of 2
    splits, so rows double to 4 splits at 16 keys, 8 at 32 and 16 at 64. A 5-node chain
    over a 13-token prefix straddles 16 (one program, two schedules); 35 tokens get 8
    splits (4 under a sliding window of 20). Each node still equals decode's row bit for
    bit, decode and verify match naive attention, each row's split count is
    ``row_splits``' and the number of programs along the splits changes no bit."""
    from graphrt.devices.cuda import triton_decode
    from graphrt.devices.cuda.triton_decode import allocate_decode_scratch, decode_attention

    # Few programs along the splits (interpreted programs cost seconds); P = 16 once below.
    saved = triton_decode.SPLIT_KEYS, triton_decode.TARGET_PROGRAMS
    triton_decode.SPLIT_KEYS, triton_decode.TARGET_PROGRAMS = 4, 8
    try:
        verify_flags = invariance_flags(
            "cpu", torch.float32, 16, 16, head_dim=16, short_splits=2, prefix_lens=(13, 35),
            cases=DOUBLING_CASES,
        )  # fmt: skip
        flags.update({f"doubling/{k}": v for k, v in verify_flags.items()})
        inp = make_inputs([13, 35], 5, 4, 2, 16, torch.float32, "cpu", seed=12, chain=True)
        verify = run_kernel(inp, 16, 16, short_splits=2)
        errors["doubling/verify_vs_naive"] = rel_err(verify, naive_verify(inp))
        for window in (None, 20):
            # Decode of the roots (their prefix's keys and their own), P = 1 and 16.
            name = f"doubling/decode-window{window}"
            inp = make_inputs([13, 35], 5, 4, 2, 16, torch.float32, "cpu", seed=12,
                              window=window, chain=True)  # fmt: skip
            n = inp.num_nodes
            roots, lens = inp.q[::n], (inp.positions[::n] + 1).to(torch.int32)
            table = inp.req_to_token.clone()
            table[inp.req_pool_indices, inp.positions[::n]] = inp.out_cache_loc[::n]
            outs, splits = [], []
            # P = 1 and 16, then the combine rescaling over chunks of 2 splits past the first.
            for programs, rest_chunk in ((1, None), (16, None), (None, 2)):
                scratch = allocate_decode_scratch(len(roots), 4, 16, roots.device, 16)
                out = torch.full_like(roots, float("nan"))
                decode_attention(
                    roots, inp.k_buffer, inp.v_buffer, table, inp.req_pool_indices, lens, out,
                    *scratch, inp.sm_scale, window, block_n=16, programs=programs,
                    short_splits=2, rest_chunk=rest_chunk,
                )  # fmt: skip
                outs.append(out)
                splits.append(scratch[2].tolist())
            flags[f"{name}/programs_change_no_bit"] = torch.equal(outs[0], outs[1])
            want = [triton_decode.row_splits(min(k, window or k), 16, 2) for k in lens.tolist()]
            flags[f"{name}/row_splits"] = splits[0] == splits[1] == splits[2] == want
            flags[f"{name}/doubled"] = max(want) == (4 if window else 8)
            naive = naive_verify(inp)[::n]
            errors[f"{name}/vs_naive"] = rel_err(outs[1], naive)
            errors[f"{name}/chunked_combine_vs_naive"] = rel_err(outs[2], naive)
    finally:
        triton_decode.SPLIT_KEYS, triton_decode.TARGET_PROGRAMS = saved


# invariance_flags' cases: (windowed by its sliding_window, chain, nodes, query heads, KV
# heads, PACK_MIN_PROGRAMS): 0 packs 16 // G nodes into a program (as large batches do),
# 10**9 serves one node a program.
INVARIANCE_CASES = (
    (False, False, 4, 4, 2, 0),
    (True, False, 4, 4, 2, 0),
    (False, True, 4, 4, 2, 0),
    (True, False, 5, 8, 1, 0),
    (True, False, 4, 4, 2, 10**9),
)


def invariance_flags(
    device,
    dtype,
    splits: int | None,
    block_n: int | None,
    head_dim: int = 64,
    short_splits: int | None = None,
    prefix_lens: tuple[int, ...] = (0, 3, 40),
    sliding_window: int = 6,
    cases: tuple[tuple, ...] = INVARIANCE_CASES,
) -> dict[str, bool]:
    """Width invariance: each node's row equals, bit for bit, decode attention's row for
    that token with the node's path in the token table (what a plain step would see)."""
    from graphrt.devices.cuda import triton_verify
    from graphrt.devices.cuda.triton_decode import (
        NUM_KV_SPLITS,
        allocate_decode_scratch,
        decode_attention,
    )

    flags = {}
    short = {} if short_splits is None else {"short_splits": short_splits}
    for windowed, chain, n, heads, kv_heads, pack_min in cases:
        window = sliding_window if windowed else None
        inp = make_inputs(list(prefix_lens), n, heads, kv_heads, head_dim, dtype, device,
                          seed=11, window=window, chain=chain)  # fmt: skip
        saved, triton_verify.PACK_MIN_PROGRAMS = triton_verify.PACK_MIN_PROGRAMS, pack_min
        try:
            verify = run_kernel(inp, splits, block_n, short_splits=short_splits)
        finally:
            triton_verify.PACK_MIN_PROGRAMS = saved
        rows, n = inp.q.shape[0], inp.num_nodes
        table = torch.zeros(rows + 1, inp.req_to_token.shape[1], dtype=torch.int64)
        for r in range(rows):
            b, i = divmod(r, n)
            req, prefix = int(inp.req_pool_indices[b]), inp.prefix_lens[b]
            table[r + 1, :prefix] = inp.req_to_token[req, :prefix].cpu()
            for j in range(n):
                if inp.tree_mask[b, i, j]:
                    table[r + 1, int(inp.positions[b * n + j])] = int(inp.out_cache_loc[b * n + j])
        scratch = allocate_decode_scratch(
            rows, heads, head_dim, inp.q.device, splits or NUM_KV_SPLITS
        )
        scratch[0].fill_(float("nan"))
        decode = torch.full_like(inp.q, float("nan"))
        decode_attention(
            inp.q, inp.k_buffer, inp.v_buffer, table.to(inp.q.device),
            torch.arange(1, rows + 1, device=inp.q.device),
            (inp.positions + 1).to(torch.int32), decode, *scratch, inp.sm_scale, window,
            block_n=block_n, **short,
        )  # fmt: skip
        name = f"invariance/window{window}-chain{chain}-G{heads // kv_heads}-pack{pack_min}"
        flags[name] = torch.equal(verify, decode)
    return flags


@needs_triton
@pytest.mark.skipif(OLD_INTERPRETER, reason="triton < 3.7: its interpreter mishandles loop bounds")
def test_verify_kernel_under_interpreter_matches_naive_and_sdpa():
    results = run_under_triton_interpreter(__file__)
    # Per case: 3 errors and 1 flag; then the padding request's error and flag.
    # Then 5 errors, 3 flags for each of the 2 doubling cases and 2 invariance flags.
    assert len(results["errors"]) == 3 * len(INTERPRETER_CASES) + 1 + 5
    assert len(results["flags"]) == len(INTERPRETER_CASES) + 1 + 5 + 2 * 3 + 2
    too_far = {name: err for name, err in results["errors"].items() if not err <= 1e-5}
    assert not too_far, too_far
    failed = [name for name, ok in results["flags"].items() if not ok]
    assert not failed, failed


def test_references_agree_on_cpu():
    """The two references, without Triton: explicit per-node softmax and one masked SDPA."""
    inp = make_inputs([0, 9, 30], 6, 4, 2, 8, torch.float32, "cpu", seed=3, window=7, gapped=True)
    assert rel_err(sdpa_verify(inp), naive_verify(inp)) < 1e-12


# ---- CUDA lane -----------------------------------------------------------------------

CUDA_TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # relative, vs float64 naive
# Up to ~600: empty, one key, under a split, a window's worth (512) and past it.
CUDA_PREFIX_LENS = [0, 1, 17, 255, 511, 512, 600, 333]
# (head_dim, num_heads, num_kv_heads): Gemma 4 E2B's full (512) and sliding (256) layers
# serve 8 query heads from one KV head; then G = 4 at head_dim 64.
CUDA_SHAPES = [(512, 8, 1), (256, 8, 1), (64, 16, 4)]
# Both verify kernels' CUDA cases against naive attention: (dtype, shape, nodes, window),
# chains of 5 and gapped trees of 13 (cuda_case builds them).
CUDA_CASES = [
    pytest.param(
        dtype, shape, n, window, id=f"{dtype}-D{shape[0]}-G{shape[1] // shape[2]}-{n}-{window}"
    )
    for dtype in CUDA_TOLERANCES
    for shape in CUDA_SHAPES
    for n in (5, 13)
    for window in (None, 512)
]  # fmt: skip


def cuda_case(dtype, shape, num_nodes: int, window: int | None) -> VerifyInputs:
    """A CUDA_CASES case's inputs on the GPU."""
    head_dim, num_heads, num_kv_heads = shape
    return make_inputs(
        CUDA_PREFIX_LENS, num_nodes, num_heads, num_kv_heads, head_dim, dtype, "cuda",
        seed=head_dim + num_nodes, window=window, gapped=num_nodes == 13,
    )  # fmt: skip


@pytest.mark.cuda
@needs_gpu
@needs_triton
@pytest.mark.parametrize("dtype,shape,num_nodes,window", CUDA_CASES)
def test_cuda_verify_matches_naive(dtype, shape, num_nodes, window):
    inp = cuda_case(dtype, shape, num_nodes, window)
    out = run_kernel(inp)
    assert out.dtype == dtype and torch.isfinite(out).all()
    naive = naive_verify(inp)
    assert rel_err(sdpa_verify(inp), naive) < 1e-12
    assert rel_err(out.cpu(), naive) < CUDA_TOLERANCES[dtype]


@pytest.mark.cuda
@needs_gpu
@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cuda_verify_rows_equal_decode_rows_bitwise(dtype):
    """Width invariance on the GPU, in 16-bit: decode's splits and blocks."""
    flags = invariance_flags("cuda", dtype, None, None)
    assert all(flags.values()), flags


@pytest.mark.cuda
@needs_gpu
@needs_triton
def test_cuda_long_rows_take_more_splits_and_verify_still_equals_decode():
    """Real lengths in bfloat16, Gemma 4's 8 heads on one KV head: a chain over an
    8,190-token prefix straddles 8,192 keys, where 16 splits become 32 (one program, two
    schedules); a 20,000-token prefix gets 64. Rows equal decode's bit for bit and match
    naive attention; packed and one-node programs both."""
    from graphrt.devices.cuda.triton_decode import max_kv_splits

    max_splits = max_kv_splits(32768)
    assert max_splits == 128
    flags = invariance_flags(
        "cuda", torch.bfloat16, max_splits, None, head_dim=256, prefix_lens=(8190, 20000),
        cases=((False, True, 5, 8, 1, 0), (False, True, 5, 8, 1, 10**9)),
    )  # fmt: skip
    assert all(flags.values()), flags
    inp = make_inputs([8190, 20000], 5, 8, 1, 256, torch.bfloat16, "cuda", seed=5, chain=True)
    out = run_kernel(inp, max_splits)
    assert rel_err(out.cpu(), naive_verify(inp)) < CUDA_TOLERANCES[torch.bfloat16]


@pytest.mark.cuda
@needs_gpu
@needs_triton
@pytest.mark.parametrize("kernel", ["width-invariant", "onepass"])
@pytest.mark.parametrize("dtype", list(CUDA_TOLERANCES), ids=str)
def test_cuda_graph_replay_matches_eager_bitwise(dtype, kernel):
    """Captured once (a full and a windowed launch on one scratch), replayed after every
    input is rewritten in place: new trees, prefixes, positions, slots, q and KV. Both
    verify kernels: this file's and the one-pass default (triton_verify_onepass)."""
    from graphrt.devices.cuda.triton_decode import NUM_KV_SPLITS, allocate_decode_scratch
    from graphrt.devices.cuda.triton_verify import tree_verify_attention
    from graphrt.devices.cuda.triton_verify_onepass import onepass_verify_attention

    attention = tree_verify_attention if kernel == "width-invariant" else onepass_verify_attention

    bs, num_nodes, num_heads, num_kv_heads, head_dim, context = 4, 5, 8, 1, 256, 700
    windows = [None, 512]

    def fresh(seed: int, prefix_lens: list[int]) -> VerifyInputs:
        return make_inputs(
            prefix_lens, num_nodes, num_heads, num_kv_heads, head_dim, dtype, "cuda",
            seed=seed, gapped=seed % 2 == 1, context=context,
        )  # fmt: skip

    static = fresh(0, [1] * bs)
    scratch = allocate_decode_scratch(
        bs * num_nodes, num_heads, head_dim, torch.device("cuda"), NUM_KV_SPLITS
    )
    static_outs = [torch.empty_like(static.q) for _ in windows]

    def forward(inp: VerifyInputs, outs: list[torch.Tensor]) -> None:
        for window, out in zip(windows, outs):
            attention(*inp.tensors(), out, *scratch, inp.sm_scale, sliding_window=window)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        forward(static, static_outs)  # warm-up: compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        forward(static, static_outs)

    for seed, prefix_lens in ((1, [600, 0, 37, 512]), (2, [3, 511, 90, 1]), (3, [250] * bs)):
        live = fresh(seed, prefix_lens)
        for static_t, live_t in zip(static.tensors(), live.tensors()):
            static_t.copy_(live_t)
        for out in static_outs:
            out.fill_(float("nan"))
        graph.replay()
        replayed = [out.clone() for out in static_outs]
        eager = [torch.full_like(static.q, float("nan")) for _ in windows]
        forward(static, eager)
        for window, got, want in zip(windows, replayed, eager):
            assert torch.equal(got, want), f"replay != eager at window {window}, seed {seed}"
            live.window = window
            assert rel_err(got.cpu(), naive_verify(live)) < CUDA_TOLERANCES[dtype]
    graph.reset()


if __name__ == "__main__":
    # The CPU lane's subprocess (TRITON_INTERPRET=1 is already in its environment).
    from helpers import exact_interpreter_dots

    exact_interpreter_dots()  # the invariance flags compare bits across row counts
    torch.manual_seed(0)
    print(json.dumps(interpreter_results()))
