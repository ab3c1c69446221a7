"""Fused Triton decode kernels against the torch reference table (``TORCH_OPS``):
Gemma 4's chains (devices/cuda/triton_gemma.py) and the skinny-matmul GEMV with its
epilogues (devices/cuda/triton_gemv.py, chosen by gemv_tuner.py).

The contract, per output kind (see test_triton_ops.py for the elementwise one):
- ``chain`` (residual norm, qkv norm + rope, softcap): every rounding where torch
  rounds; the float32 differences are the norm's sum order and tanh/exp, so float32
  outputs are within CHAIN_F32 of the reference relative to the tensor's largest
  value, and 16-bit ones within 2 ulp of that largest value (a flipped rounding
  early in the chain, carried through an add that may cancel).
- ``matmul`` (GEMV, with or without epilogue): the float32 sum runs in another order
  than the reference's matmul; relative to the output's largest value, float32 is
  within MATMUL_F32 and 16-bit within 2 ulp (the matmul's rounding, then the
  epilogue's).
Both also require finite outputs of the right shape and dtype; a wrong row, a missing
bias or a wrong activation misses these bounds by orders of magnitude.

CPU lane: the kernels under TRITON_INTERPRET=1 in a subprocess (see test_triton_ops).
CUDA lane: the same at Gemma 4 E2B / Llama-3.2-1B sizes, every GEMV configuration,
and graph replay against eager, bitwise.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from helpers import OLD_INTERPRETER, needs_gpu, needs_triton, run_under_triton_interpreter

from graphrt.core.attention.base import KVWrite
from graphrt.core.models.ops import TORCH_OPS, PreNorm

EPS = 1e-6
CHAIN_F32 = 2e-6
MATMUL_F32 = 2e-5
ULP_16 = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}  # 1 ulp relative to magnitude


def check(got, want, kind: str) -> dict:
    """Metrics of one output and whether it holds the module's contract."""
    ok_layout = got.shape == want.shape and got.dtype == want.dtype
    if not ok_layout or want.numel() == 0:
        return {"ok": ok_layout, "scaled": 0.0}
    scale = want.double().abs().max().clamp_min(1e-30)
    scaled = ((got.double() - want.double()).abs().max() / scale).item()
    if got.dtype == torch.float32:
        bound = CHAIN_F32 if kind == "chain" else MATMUL_F32
    else:
        bound = 2 * ULP_16[got.dtype]
    finite = bool(torch.isfinite(got).all())
    return {"ok": finite and scaled <= bound, "scaled": scaled, "bound": bound}


def rope_tables(head_dim: int, rotated_pairs: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Gemma's proportional-rope layout: the table spans the head; pairs past
    ``rotated_pairs`` have frequency 0 (cos 1, sin 0)."""
    inv = 1.0 / 10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    inv[rotated_pairs:] = 0
    freqs = torch.outer(torch.arange(256, dtype=torch.float32), inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(device), emb.sin().to(device)


def gemma_cases(ops, dtype, shapes, device, seed=0) -> dict:
    """Gemma's fused chains on random inputs -> {"dtype/case/output": metrics}.

    shapes: (T, hidden, H, Hkv, D, rotated pairs, vocab).
    """
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen)).to(device, dtype)

    name = str(dtype).removeprefix("torch.")
    results = {}
    for t, hidden, heads, kv_heads, head_dim, pairs, vocab in shapes:
        case = f"{name}/T{t}-D{hidden}-H{heads}x{kv_heads}x{head_dim}"
        h = randn(t, hidden + 8, scale=4.0)[:, :hidden]  # strided rows, as a projection's view
        residual = randn(t, hidden)
        w, w_next = randn(hidden, scale=0.3) + 1, randn(hidden, scale=0.3) + 1
        scalar = randn(1, scale=0.2) + 0.5
        for label, kwargs in (
            ("plain", {}),
            ("scalar", {"scalar": scalar}),
            ("next", {"next_weight": w_next}),
            ("both", {"scalar": scalar, "next_weight": w_next}),
        ):
            got = ops.gemma_residual_norm(h, residual, w, EPS, **kwargs)
            want = TORCH_OPS.gemma_residual_norm(h, residual, w, EPS, **kwargs)
            results[f"{case}/residual_norm_{label}_x"] = check(got[0], want[0], "chain")
            if "next_weight" in kwargs:
                results[f"{case}/residual_norm_{label}_next"] = check(got[1], want[1], "chain")
            else:
                results[f"{case}/residual_norm_{label}_next"] = {"ok": got[1] is None}

        q_size, kv_size = heads * head_dim, kv_heads * head_dim
        qkv = randn(t, q_size + 2 * kv_size)
        q = qkv[:, :q_size].view(t, heads, head_dim)
        k = qkv[:, q_size : q_size + kv_size].view(t, kv_heads, head_dim)
        v = qkv[:, q_size + kv_size :].view(t, kv_heads, head_dim)
        q_w, k_w = randn(head_dim, scale=0.3) + 1, randn(head_dim, scale=0.3) + 1
        cos, sin = rope_tables(head_dim, pairs, device)
        positions = torch.randint(0, 256, (t,), generator=gen).to(device)
        before = qkv.clone()
        got = ops.gemma_qkv_norm_rope(positions, q, k, v, q_w, k_w, EPS, cos, sin)
        want = TORCH_OPS.gemma_qkv_norm_rope(positions, q, k, v, q_w, k_w, EPS, cos, sin)
        for part, g, e in zip("qkv", got, want):
            results[f"{case}/qkv_norm_rope_{part}"] = check(g, e, "chain")
        results[f"{case}/qkv_norm_rope_intact"] = {"ok": torch.equal(qkv, before)}
        # With a KVWrite: k and v land in the cache rows at loc instead.
        slots = 2 * t + 3
        loc = torch.randperm(slots, generator=gen)[:t].to(device)
        caches = []
        for table in (ops, TORCH_OPS):
            k_cache, v_cache = (
                torch.zeros(slots, kv_heads, head_dim, dtype=dtype, device=device) for _ in "kv"
            )
            out = table.gemma_qkv_norm_rope(
                positions, q, k, v, q_w, k_w, EPS, cos, sin, kv_write=KVWrite(k_cache, v_cache, loc)
            )
            caches.append((out, k_cache, v_cache))
        (got, got_kc, got_vc), (want, want_kc, want_vc) = caches
        results[f"{case}/qkv_kv_write_q"] = check(got[0], want[0], "chain")
        results[f"{case}/qkv_kv_write_k"] = check(got_kc, want_kc, "chain")
        results[f"{case}/qkv_kv_write_v"] = check(got_vc, want_vc, "chain")
        results[f"{case}/qkv_kv_write_none"] = {"ok": got[1] is None and got[2] is None}
        # k_eq_v: V is the raw K projection (the same view), normed without a scale.
        got = ops.gemma_qkv_norm_rope(positions, q, k, k, q_w, k_w, EPS, cos, sin)
        want = TORCH_OPS.gemma_qkv_norm_rope(positions, q, k, k, q_w, k_w, EPS, cos, sin)
        results[f"{case}/qkv_norm_rope_keqv_v"] = check(got[2], want[2], "chain")
        got = ops.gemma_qkv_norm_rope(positions, q, None, None, q_w, None, EPS, cos, sin)
        want = TORCH_OPS.gemma_qkv_norm_rope(positions, q, None, None, q_w, None, EPS, cos, sin)
        results[f"{case}/qkv_norm_rope_qonly"] = check(got[0], want[0], "chain")
        results[f"{case}/qkv_norm_rope_qonly_none"] = {"ok": got[1] is None and got[2] is None}

        num_layers, per_layer = 3, head_dim
        table = randn(50, num_layers * per_layer)
        proj = randn(t, num_layers * per_layer + 8, scale=8.0)[:, : num_layers * per_layer]
        ids = torch.randint(0, 50, (t,), generator=gen).to(device)
        args = (ids, table, torch.tensor(per_layer**0.5).to(device, dtype), proj, hidden**-0.5)
        args += (randn(per_layer, scale=0.3) + 1, EPS)
        got = ops.gemma_per_layer_inputs(*args)
        results[f"{case}/per_layer_inputs"] = check(
            got, TORCH_OPS.gemma_per_layer_inputs(*args), "chain"
        )

        logits = randn(t, vocab + 4, scale=20.0)[:, :vocab]
        for cap in (30.0, None):
            got = ops.float_logits(logits.contiguous(), cap)
            want = TORCH_OPS.float_logits(logits.contiguous(), cap)
            results[f"{case}/softcap_{cap}"] = check(got, want, "chain")
        out = torch.full((t, vocab), float("nan"), device=device)
        returned = ops.float_logits(logits.contiguous(), 30.0, out)
        want = TORCH_OPS.float_logits(logits.contiguous(), 30.0)
        results[f"{case}/softcap_into_out"] = {
            **check(out, want, "chain"),
            "same": returned.data_ptr() == out.data_ptr(),
        }
        results[f"{case}/softcap_into_out"]["ok"] &= results[f"{case}/softcap_into_out"]["same"]
    return results


def gemv_cases(dtype, shapes, configs_for_rows, device, seed=0) -> dict:
    """The GEMV, its RMSNorm prologue and its epilogues against the reference ops (norm,
    F.linear, act_mul, residual add), per config.

    shapes: (M, N, K, bias); configs_for_rows(M) -> the configurations to run.
    """
    from graphrt.devices.cuda.triton_gemv import gemv

    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen)).to(device, dtype)

    name = str(dtype).removeprefix("torch.")
    results = {}
    for m, n, k, has_bias in shapes:
        x = randn(m, k + 8)[:, :k]  # strided rows
        weight = randn(2 * n, k, scale=k**-0.5)
        bias = randn(2 * n) if has_bias else None
        up = randn(m, n + 4)[:, :n]
        half_bias = None if bias is None else bias[:n]
        norm = PreNorm(randn(k, scale=0.2) + 1, EPS)
        residual = randn(m, n + 2)[:, :n]
        refs = {
            "norm_residual": TORCH_OPS.linear(
                x, weight[:n], half_bias, norm=norm, residual=residual
            ),
            "norm_gated_silu": TORCH_OPS.linear_act_mul(x, weight, bias, "silu", norm=norm),
            "linear": torch.nn.functional.linear(x, weight[:n], half_bias),
            "gated_silu": TORCH_OPS.linear_act_mul(x, weight, bias, "silu"),
            "up_gelu": TORCH_OPS.linear_act_mul(x, weight[:n], half_bias, "gelu_pytorch_tanh", up),
        }
        for config in configs_for_rows(m):
            runs = {
                "norm_residual": gemv(
                    x, weight[:n], half_bias, config, norm=norm, residual=residual
                ),
                "norm_gated_silu": gemv(x, weight, bias, config, act="silu", gated=True, norm=norm),
                "linear": gemv(x, weight[:n], half_bias, config),
                "gated_silu": gemv(x, weight, bias, config, act="silu", gated=True),
                "up_gelu": gemv(x, weight[:n], half_bias, config, act="gelu_pytorch_tanh", up=up),
            }
            tag = config.label.replace(" ", "-")
            for op, got in runs.items():
                results[f"{name}/M{m}-N{n}-K{k}-b{int(has_bias)}/{tag}/{op}"] = check(
                    got, refs[op], "matmul"
                )
    return results


# ---- CPU lane ------------------------------------------------------------------------

CPU_GEMMA_SHAPES = [(1, 48, 2, 1, 32, 8, 300), (3, 40, 2, 1, 16, 8, 100)]
# K > BLOCK_K: the reduction loop runs several times; N not a multiple of BLOCK_N.
CPU_GEMV_SHAPES = [(1, 20, 200, False), (3, 20, 200, True), (16, 36, 72, False)]


def _cpu_configs(rows):
    from graphrt.devices.cuda.triton_gemv import GemvConfig, configs_for

    if rows == 1:
        return (GemvConfig(8, 64, block_m=1), configs_for(rows)[0])
    # one K range a program; at 3 rows of K 200 also split-K (2 splits of 2 chunks: the
    # second split's last chunk masked), swapped operands with and without splits, and
    # splits of one chunk each, operands swapped or not (the weight tile read before the
    # wait, at the split's K offset: 2 splits where 4 were asked, K offering 2 chunks);
    # then the tuner's interpreter pick
    split = ()
    if rows == 3:
        split = tuple(GemvConfig(16, 64, split_k=s, swap_ab=w) for s, w in ((2, 0), (1, 1), (2, 1)))
        split += (GemvConfig(16, 128, split_k=4), GemvConfig(16, 128, split_k=4, swap_ab=True))
    return (GemvConfig(16, 64), *split, configs_for(rows)[0])


def gemv_invariance(dtype, configs, device, row_counts, k=200, seed=0, across=False, n=20) -> dict:
    """Width invariance: every row of an M-row call equals, bit for bit, the same row run
    alone, for each epilogue (norm + residual, norm + gated act, ``up`` product); with
    ``across``, alone under the first configuration (tiles: any tile gives the same bits)."""
    from graphrt.devices.cuda.triton_gemv import gemv

    gen = torch.Generator().manual_seed(seed)
    rows = max(row_counts)

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen)).to(device, dtype)

    x, weight = randn(rows, k), randn(2 * n, k, scale=k**-0.5)
    norm = PreNorm(randn(k, scale=0.2) + 1, EPS)
    residual, up = randn(rows, n), randn(rows, n)
    ops = {
        "norm_residual": lambda c, a, b: gemv(
            x[a:b], weight[:n], None, c, norm=norm, residual=residual[a:b]
        ),
        "norm_gated_silu": lambda c, a, b: gemv(
            x[a:b], weight, None, c, act="silu", gated=True, norm=norm
        ),
        "up_gelu": lambda c, a, b: gemv(
            x[a:b], weight[:n], None, c, act="gelu_pytorch_tanh", up=up[a:b]
        ),
    }
    results = {}
    name = str(dtype).removeprefix("torch.")
    for config in configs:
        tag = config.label.replace(" ", "-")
        for op, run in ops.items():
            solo = configs[0] if across else config
            alone = torch.cat([run(solo, r, r + 1) for r in range(rows)])
            for m in row_counts:
                equal = torch.equal(run(config, 0, m), alone[:m])
                results[f"{name}/invariance/{tag}/{op}/M{m}"] = {"ok": equal}
    return results


def invariant_ops_results(gen: torch.Generator) -> dict:
    """ops.INVARIANT_OPS: each row of 3 and of 20 rows (two 16-row tiles) gets the bits it
    gets alone, through the ops table (norm kernel, then tiles), and no key it tuned is
    served by cuBLAS or the row path."""
    from graphrt.devices.cuda.gemv_tuner import TUNER
    from graphrt.devices.cuda.ops import INVARIANT_OPS as ops

    x = torch.randn(20, 32, generator=gen).bfloat16()
    w = (0.1 * torch.randn(32, 32, generator=gen)).bfloat16()
    norm = PreNorm(torch.rand(32, generator=gen).bfloat16() + 0.5, EPS)
    residual = torch.randn(20, 16, generator=gen).bfloat16()
    calls = {
        "norm_residual": lambda a, b: ops.linear(
            x[a:b], w[:16], None, norm=norm, residual=residual[a:b]
        ),
        "norm_gated_silu": lambda a, b: ops.linear_act_mul(x[a:b], w, None, "silu", norm=norm),
    }
    results = {}
    for name, call in calls.items():
        some = (0, 2, 17)  # in the first tile, and in the second of 20 rows
        alone = torch.cat([call(r, r + 1) for r in some])
        for rows in (3, 20):
            together = call(0, rows)[[r for r in some if r < rows]]
            equal = torch.equal(together, alone[: len(together)])
            results[f"bfloat16/invariant_ops/{name}/M{rows}"] = {"ok": equal}
    tiles_only = all(
        c is not None and c.block_m >= 16 for k, c in TUNER.choices().items() if "-inv" in k[0]
    )
    results["bfloat16/invariant_ops/tiles_only"] = {"ok": tiles_only}
    return results


def interpreter_results() -> dict:
    from graphrt.devices.cuda.ops import TRITON_OPS
    from graphrt.devices.cuda.triton_gemv import invariant_configs

    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        results.update(gemma_cases(TRITON_OPS, dtype, CPU_GEMMA_SHAPES, "cpu"))
        results.update(gemv_cases(dtype, CPU_GEMV_SHAPES, _cpu_configs, "cpu"))
        # Through the ops table (the tuner's interpreter choice: the first configuration).
        gen = torch.Generator().manual_seed(5)
        x = torch.randn(2, 64, generator=gen).to(dtype)
        w = (0.1 * torch.randn(24, 64, generator=gen)).to(dtype)
        name = str(dtype).removeprefix("torch.")
        results[f"{name}/ops/linear"] = check(
            TRITON_OPS.linear(x, w, None), TORCH_OPS.linear(x, w, None), "matmul"
        )
        norm = PreNorm(torch.rand(64, generator=gen).to(dtype) + 0.5, EPS)
        residual = torch.randn(2, 24, generator=gen).to(dtype)
        results[f"{name}/ops/norm_linear_residual"] = check(
            TRITON_OPS.linear(x, w, None, norm=norm, residual=residual),
            TORCH_OPS.linear(x, w, None, norm=norm, residual=residual),
            "matmul",
        )
        results[f"{name}/ops/linear_act_mul"] = check(
            TRITON_OPS.linear_act_mul(x, w, None, "gelu_pytorch_tanh"),
            TORCH_OPS.linear_act_mul(x, w, None, "gelu_pytorch_tanh"),
            "matmul",
        )
        if dtype == torch.bfloat16:  # several K chunks (200 > 64), and one (512)
            # N 12: two blocks of 8 outputs, the second masked as 20's third is; a row
            # is 2 interpreted programs, not 3.
            results.update(gemv_invariance(dtype, _cpu_configs(1), "cpu", (2, 4), n=12))
            # The invariant ops' tiles, swapped or not: a row's bits alone in the first
            # 16-row tile, at 1 and 3 rows (the CUDA test holds the MMAs to it)
            swapped = tuple(c for c in invariant_configs(3) if c.swap_ab)
            assert swapped and all(c.block_m >= 16 for c in invariant_configs(3))
            tiles = invariant_configs(3)[:1] + swapped
            results.update(gemv_invariance(dtype, tiles, "cpu", (1, 3), n=12, across=True))
        if dtype == torch.bfloat16:
            results.update(invariant_ops_results(gen))
        # Past 16 rows: the matmul stays torch's, the activation is the Triton kernel.
        tall = torch.randn(17, 64, generator=gen).to(dtype)
        results[f"{name}/ops/linear_act_mul_17_rows"] = check(
            TRITON_OPS.linear_act_mul(tall, w, None, "silu"),
            TORCH_OPS.linear_act_mul(tall, w, None, "silu"),
            "matmul",
        )
    return results


@needs_triton
@pytest.mark.skipif(OLD_INTERPRETER, reason="triton < 3.7: its interpreter mishandles loop bounds")
def test_fused_kernels_under_interpreter_match_reference():
    results = run_under_triton_interpreter(__file__)
    # 2 dtypes x (2 gemma shapes x 23 outputs + (2 + 7 + 2) gemv configs x 5 ops + 4 ops),
    # and in bfloat16 2 configs x 3 ops x 2 row counts of width invariance, the invariant
    # tiles (the first and the 2 swapped) x 3 ops x 2 row counts, then the batch-invariant
    # ops: 2 ops x 2 row counts and the tiles-only check
    assert len(results) == 2 * (2 * 23 + 11 * 5 + 4) + 12 + 18 + 5
    bad = {key: m for key, m in results.items() if not m["ok"]}
    assert not bad, bad


def test_check_catches_a_wrong_result():
    """The contract check itself: one flipped ulp at the top passes, a wrong value fails."""
    want = torch.linspace(-3, 3, 64, dtype=torch.bfloat16)
    one_ulp = want.clone().view(torch.int16)
    one_ulp[-1] += 1
    assert check(one_ulp.view(torch.bfloat16), want, "matmul")["ok"]
    wrong = want.clone()
    wrong[5] += 0.5
    assert not check(wrong, want, "matmul")["ok"]
    assert not check(want.float() * (1 + 1e-4), want.float(), "chain")["ok"]
    assert not check(want[:-1], want, "chain")["ok"]


@needs_triton
def test_the_tuners_choices_survive_the_process_on_disk(tmp_path):
    """A choice timed once is recalled by the next process's tuner (same file: same card,
    torch and triton); a choice timed among other candidates (no longer one of them, or
    made before new ones were offered), a damaged file and a directory that cannot be
    written are ignored, never an error."""
    pytest.importorskip("triton")
    from graphrt.devices.cuda.gemv_tuner import CUBLAS, GemvTuner, cache_path
    from graphrt.devices.cuda.triton_gemv import configs_for

    candidates = (CUBLAS, *configs_for(1))
    key = ("linear", "1", 2048, 2048, torch.bfloat16, False, True, False)
    path = cache_path("NVIDIA H200")
    assert "NVIDIA_H200" in path.name and "torch" in path.name and "triton" in path.name
    path = tmp_path / "cache" / path.name
    first = GemvTuner()
    first.use_cache(path)
    assert first.recall(key, candidates) == "unset"
    first.remember(key, candidates[2], candidates)
    first.remember(("act_mul",) + key[1:], CUBLAS, candidates)
    second = GemvTuner()
    second.use_cache(path)
    assert second.recall(key, candidates) == candidates[2]
    assert second.recall(("act_mul",) + key[1:], candidates) is CUBLAS
    assert second.recall(key, (CUBLAS, candidates[1])) == "unset"  # no longer a candidate
    assert second.recall(key, (*candidates, configs_for(2)[0])) == "unset"  # one more offered
    # Two processes on one file (tensor-parallel ranks): each keeps what the other wrote
    # after it read the file.
    wide = ("linear", "1", 4096, 2048, torch.bfloat16, False, True, False)
    second.remember(wide, candidates[1], candidates)
    first.remember(("act_mul",) + wide[1:], candidates[3], candidates)
    third = GemvTuner()
    third.use_cache(path)
    assert third.recall(wide, candidates) == candidates[1]
    assert third.recall(("act_mul",) + wide[1:], candidates) == candidates[3]
    assert third.recall(key, candidates) == candidates[2]
    path.write_text("{not json")
    damaged = GemvTuner()
    damaged.use_cache(path)
    assert damaged.recall(key, candidates) == "unset"
    blocked = tmp_path / "file"
    blocked.write_text("")
    unwritable = GemvTuner()
    unwritable.use_cache(blocked / "cache.json")  # its parent is a file: cannot be made
    unwritable.remember(key, candidates[1], candidates)  # no error: the choice stays in the process


@needs_triton
def test_shipped_choices_serve_a_fresh_machine_after_its_own(tmp_path):
    """A card's shipped choices (devices/cuda/gemv_choices) answer where the machine's own
    cache has none, under the same candidates only; its own cache answers first. Each
    shipped card's file holds configurations this code can build."""
    from graphrt.devices.cuda.gemv_tuner import CUBLAS, GemvTuner, _disk_key, shipped_path
    from graphrt.devices.cuda.triton_gemv import GemvConfig, configs_for

    candidates = (CUBLAS, *configs_for(1))
    key = ("linear", "1", 2048, 2048, torch.bfloat16, False, True, False)
    other = ("linear", "1", 4096, 2048, torch.bfloat16, False, True, False)
    shipped = tmp_path / "shipped.json"
    choice = dataclasses.asdict(candidates[2])
    shipped.write_text(json.dumps({_disk_key(key, candidates): choice,
                                   _disk_key(other, candidates): None}))  # fmt: skip
    fresh = GemvTuner()
    fresh.use_cache(tmp_path / "own.json", [shipped])
    assert fresh.recall(key, candidates) == candidates[2]
    assert fresh.recall(other, candidates) is CUBLAS
    assert fresh.recall(key, (CUBLAS, candidates[1])) == "unset"  # timed among others
    fresh.remember(key, candidates[1], candidates)  # timed here: its own file wins
    again = GemvTuner()
    again.use_cache(tmp_path / "own.json", [shipped])
    assert again.recall(key, candidates) == candidates[1]
    for card in ("NVIDIA H200", "NVIDIA H100 80GB HBM3"):
        choices = json.loads(shipped_path(card).read_text())
        assert choices and all(v is None or GemvConfig(**v) for v in choices.values()), card


@needs_triton
def test_a_siblings_shipped_choice_serves_a_shape_the_cards_own_file_lacks(tmp_path):
    """Cards of one architecture stand in for each other's missing shapes (an H200 whose
    file lacks a shape takes the H100's choice instead of compiling every candidate and
    timing them): the card's own file first, then its siblings' in order; a card of
    another architecture reads its own file alone."""
    from graphrt.devices.cuda.gemv_tuner import (
        CUBLAS,
        SIBLINGS,
        GemvTuner,
        _disk_key,
        shipped_path,
        shipped_paths,
    )
    from graphrt.devices.cuda.triton_gemv import configs_for

    h100, h200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
    assert shipped_paths(h200, (9, 0)) == [shipped_path(h200), shipped_path(h100)]
    assert shipped_paths(h100, (9, 0)) == [shipped_path(h100), shipped_path(h200)]
    assert shipped_paths("NVIDIA H20", (9, 0))[1:] == [shipped_path(n) for n in SIBLINGS[9, 0]]
    assert shipped_paths("NVIDIA A100-SXM4-80GB", (8, 0)) == [shipped_path("NVIDIA A100-SXM4-80GB")]
    candidates = (CUBLAS, *configs_for(1))
    both = ("linear", "1", 2048, 2048, torch.bfloat16, False, True, False)
    sibling_only = ("linear", "1", 4096, 2048, torch.bfloat16, False, True, False)
    own, sibling = tmp_path / "own.json", tmp_path / "sibling.json"
    own.write_text(json.dumps({_disk_key(both, candidates): dataclasses.asdict(candidates[1])}))
    sibling.write_text(
        json.dumps(
            {
                _disk_key(both, candidates): dataclasses.asdict(candidates[2]),
                _disk_key(sibling_only, candidates): dataclasses.asdict(candidates[3]),
            }
        )
    )
    tuner = GemvTuner()
    tuner.use_cache(tmp_path / "cache.json", [own, sibling])
    assert tuner.recall(both, candidates) == candidates[1]  # its own file first
    assert tuner.recall(sibling_only, candidates) == candidates[3]
    assert tuner.recall(sibling_only, candidates[:3]) == "unset"  # timed among others
    alone = GemvTuner()
    alone.use_cache(tmp_path / "cache.json", [own])
    assert alone.recall(sibling_only, candidates) == "unset"


def test_the_tuners_report_names_the_path_and_the_splits():
    """A report line says which kernel a shape got: cuBLAS, the row path or a tile, and a
    split-K tile's splits (stop 64 read a split tile's line as a plain tile's), and when
    cuBLAS was not among the candidates timed."""
    from graphrt.devices.cuda.gemv_tuner import CUBLAS, GemvTuner
    from graphrt.devices.cuda.triton_gemv import ROW_CONFIGS, SPLIT_CONFIGS

    tuner = GemvTuner()
    keys = [("linear", "1", 2048, 2048), ("linear", "2-16", 2048, 8192), ("linear", "1", 8, 8)]
    keys.append(("linear-inv", "2-16", 1536, 12288))  # the width-invariant tiles
    choices = (ROW_CONFIGS[0], SPLIT_CONFIGS[0], CUBLAS, SPLIT_CONFIGS[1])
    for key, choice, cublas_ms in zip(keys, choices, (0.010, 0.010, 0.010, None)):
        tuner._choices[key] = choice
        tuner.timings[key] = (cublas_ms, 0.005 if choice is not CUBLAS else 0.010)
    lines = tuner.report(lambda key: key[2] * key[3] * 2)
    row, split, cublas, tiles = (next(ln for ln in lines if ln.startswith(str(k))) for k in keys)
    assert "gemv row 8x512 w4s3 5.0 us (cuBLAS 10.0 us)" in row and "GB/s" in row
    assert f"split{SPLIT_CONFIGS[0].split_k}" in split and "m16" in split
    assert "cuBLAS 10.0 us" in cublas
    assert tiles.endswith("5.0 us (cuBLAS not offered), 7550 GB/s") and "cuBLAS 1" not in tiles


def test_non_decode_matmuls_stay_with_torch():
    """Prefill-sized or float32 matmuls never reach the GEMV or its tuner."""
    from graphrt.devices.cuda.gemv_tuner import TUNER
    from graphrt.devices.cuda.ops import triton_linear

    before = TUNER.choices()
    for rows, dtype in ((17, torch.bfloat16), (64, torch.bfloat16), (1, torch.float32)):
        x, w = torch.randn(rows, 32).to(dtype), torch.randn(8, 32).to(dtype)
        torch.testing.assert_close(triton_linear(x, w), torch.nn.functional.linear(x, w))
    assert TUNER.choices() == before


@needs_triton
def test_activations_without_a_fused_kernel_keep_torchs_arithmetic():
    """An activation the kernels do not know (erf GELU) runs torch's ops on CUDA, at decode
    sizes too, instead of failing in the first forward; an unknown name fails when the
    model is built."""
    from graphrt.core.models.layers import GatedMLP
    from graphrt.devices.cuda.ops import TRITON_OPS

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 32, generator=gen).bfloat16()
    w = torch.randn(16, 32, generator=gen).bfloat16()
    gate, up = torch.randn(2, 3, 8, generator=gen).bfloat16()
    for table in (TRITON_OPS, TORCH_OPS):  # no Triton launch: runs without a GPU
        assert torch.equal(
            table.linear_act_mul(x, w, None, "gelu"), TORCH_OPS.linear_act_mul(x, w, None, "gelu")
        )
        assert torch.equal(table.act_mul(gate, up, "gelu"), TORCH_OPS.act_mul(gate, up, "gelu"))
    with pytest.raises(ValueError, match="unsupported activation 'relu6'"):
        GatedMLP(32, 8, "relu6")


@needs_triton
def test_triton_backend_lets_the_rope_kernel_write_the_kv_of_layers_that_write_kv():
    """Layers that write KV get the cache and the step's slots in every mode (DECODE,
    TARGET_VERIFY, and EXTEND: prefill's kernel reads its keys from the cache too);
    layers that write no KV (KV-sharing layers, the drafter) get None."""
    from types import SimpleNamespace

    from graphrt.core.attention.base import AttentionSpec
    from graphrt.core.batch import ForwardMode
    from graphrt.devices.cuda.attention import TritonAttentionBackend

    caches = [torch.zeros(4, 1, 8) for _ in range(4)]
    pool = SimpleNamespace(k_buffers=caches[:2], v_buffers=caches[2:])
    backend = TritonAttentionBackend(pool, SimpleNamespace())
    loc = torch.tensor([3, 1])
    writer = AttentionSpec(2, 1, 8, 1.0, cache_index=1)
    reader = AttentionSpec(2, 1, 8, 1.0, cache_index=1, writes_kv=False)
    for mode in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.EXTEND):
        target = backend.kv_write_target(writer, SimpleNamespace(mode=mode, out_cache_loc=loc))
        assert target.k_buffer is caches[1] and target.v_buffer is caches[3]
        assert target.loc is loc
        assert (
            backend.kv_write_target(reader, SimpleNamespace(mode=mode, out_cache_loc=loc)) is None
        )


def engine_results(checkpoint: str) -> dict:
    """A tiny Gemma 4 (KV sharing, per-layer inputs, double-wide MLP, softcapping) and
    random:llama-tiny decoded eagerly with the CUDA device's kernels under the interpreter
    (fused ops, GEMV, Triton attention, K/V stored by the rope kernel, or by the GEMV with
    rope in its epilogue: Llama in float16) and with the torch reference, on the CPU."""
    from graphrt.core.attention import TorchAttentionBackend
    from graphrt.core.batch import ForwardMode
    from graphrt.core.engine import Engine, EngineConfig, SamplingParams
    from graphrt.core.models import load_model
    from graphrt.devices.cpu import CpuDevice
    from graphrt.devices.cuda.attention import TritonAttentionBackend
    from graphrt.devices.cuda.ops import TRITON_OPS

    class TritonOnCpu(CpuDevice):
        """The CUDA device's kernels, run by Triton's interpreter on CPU tensors."""

        def model_ops(self, batch_invariant=False):
            return TRITON_OPS

        def create_attention_backend(self, kv_pool, req_to_token_pool):
            # 4 KV splits, not 16: a quarter of the interpreted programs (the splits are
            # test_triton_attention's; these prompts fill at most one 16-key block).
            cls = TorchPrefill if kv_pool.dtype == torch.bfloat16 else TritonAttentionBackend
            return cls(kv_pool, req_to_token_pool, num_kv_splits=4)

    class TorchPrefill(TritonAttentionBackend):
        """16-bit runs prefill with the reference's attention: Triton's interpreter
        computes bfloat16 dots wrongly (the attention kernels' outputs are garbage, on
        the CPU only), and this case is here for the GEMV's 16-bit paths. The attention
        kernels are checked in float32 under the interpreter (test_triton_attention) and
        in 16 bits on the GPU."""

        def kv_write_target(self, spec, batch):
            return (
                None if batch.mode is ForwardMode.EXTEND else super().kv_write_target(spec, batch)
            )

        def forward(self, q, k, v, spec, batch):
            if batch.mode is ForwardMode.EXTEND:
                return TorchAttentionBackend.forward(self, q, k, v, spec, batch)
            return super().forward(q, k, v, spec, batch)

    gen = torch.Generator().manual_seed(40)
    prompts = [torch.randint(3, 300, (n,), generator=gen).tolist() for n in (8, 2)]
    results = {}
    # Tokens per request: the prefill's, then decode steps (each a second or more of
    # interpreted kernels); request 0's decode step (position 8) is past the window (6),
    # request 1's is not.
    cases = [(checkpoint, torch.float32, 2)]
    # Llama in bfloat16 only (its fused-norm GEMV: the 16-bit paths); float32 Llama matches
    # torch in the parity tests. Gemma 4's kernels in bfloat16 are checked one by one in
    # test_fused_kernels_under_interpreter_match_reference, and whole models on the GPU in
    # the CUDA lane: a whole interpreted bfloat16 Gemma 4 cost the CPU lane 28 s.
    cases += [("random:llama-tiny", torch.bfloat16, 1)]
    # Llama's decode steps in float16 (the interpreter's float16 dots are right): the q/k/v
    # GEMV with rope and the K/V store in its epilogue, then Triton's decode attention.
    # Their logits round in float16 where the reference's do elsewhere: compared in it.
    cases += [("random:llama-tiny", torch.float16, 3)]
    for model, dtype, steps in cases:
        params = SamplingParams(max_new_tokens=steps, ignore_eos=True, return_logits=True)
        runs = []
        for device in (TritonOnCpu(), CpuDevice()):
            loaded = load_model(model, device, dtype)
            engine = Engine(loaded, EngineConfig(max_context_len=64, runner="eager"), device)
            runs.append(engine.generate(prompts, params))
        name = f"{model.rpartition('/')[2]}-{str(dtype).removeprefix('torch.')}"
        for i, (fused, reference) in enumerate(zip(*runs)):
            as_is = dtype != torch.float16  # float32 logits of 16-bit models: see above
            logits = [
                check(
                    ours if as_is else ours.to(dtype),
                    theirs if as_is else theirs.to(dtype),
                    "matmul" if dtype == torch.float32 else "chain",
                )  # fmt: skip
                for ours, theirs in zip(fused.output_logits, reference.output_logits)
            ]
            results[f"{name}/request{i}"] = {
                "ok": fused.output_ids == reference.output_ids and all(m["ok"] for m in logits),
                "ids": [fused.output_ids, reference.output_ids],
                "scaled": [m["scaled"] for m in logits],
            }
    return results


@pytest.mark.slow  # ~30 s on 2 cores: two models, every kernel interpreted
@needs_triton
@pytest.mark.skipif(OLD_INTERPRETER, reason="triton < 3.7: its interpreter mishandles loop bounds")
def test_fused_decoding_under_interpreter_matches_reference(gemma4_tiny):
    results = run_under_triton_interpreter(__file__, "engine", str(gemma4_tiny.path))
    assert len(results) == 6  # (Gemma 4 in float32, Llama in bfloat16 and float16) x 2
    bad = {key: m for key, m in results.items() if not m["ok"]}
    assert not bad, bad


# ---- CUDA lane -----------------------------------------------------------------------

# Gemma 4 E2B: hidden 1536, 8 q heads, 1 KV head, head_dim 256 (sliding) / 512 (full).
CUDA_GEMMA_SHAPES = [
    (1, 1536, 8, 1, 256, 128, 262144),
    (16, 1536, 8, 1, 512, 64, 4096),
    (5, 2048, 32, 8, 64, 32, 128256),
]
# Decode projections of Llama-3.2-1B and Gemma 4 E2B, M from 1 to 16.
CUDA_GEMV_SHAPES = [
    (1, 2048, 2048, False),
    (1, 256, 1536, False),
    (1, 1536, 6144, True),
    (5, 2048, 2048, False),
    (16, 3072, 2048, False),
    (16, 1536, 12288, False),
]


# Every GEMV configuration is checked in bfloat16, the first of each path in the other
# dtypes. Each configuration x epilogue x dtype is a compile (150 s for all of bfloat16's
# in one test, the CUDA lane's longest): bfloat16's run as GEMV_SHARDS tests of every
# GEMV_SHARDS-th configuration, and the Gemma 4 ops as one more, so the lane's workers
# share them.
GEMV_SHARDS = 4
FUSED_PARTS = [(torch.float32, "first"), (torch.float16, "first"), (torch.bfloat16, "gemma")]
FUSED_PARTS += [(torch.bfloat16, f"gemv{i}") for i in range(GEMV_SHARDS)]


@pytest.mark.cuda
@pytest.mark.own_worker  # 15-35 s each (mostly compiles): the lane spreads them
@needs_gpu
@needs_triton
@pytest.mark.parametrize("dtype, part", FUSED_PARTS, ids=lambda p: str(p).removeprefix("torch."))
def test_cuda_fused_kernels_match_reference(dtype, part):
    from graphrt.devices.cuda.ops import TRITON_OPS
    from graphrt.devices.cuda.triton_gemv import configs_for

    results = {}
    if part in ("first", "gemma"):
        results.update(gemma_cases(TRITON_OPS, dtype, CUDA_GEMMA_SHAPES, "cuda", seed=1))
    if part != "gemma":
        shard = None if part == "first" else int(part.removeprefix("gemv"))

        def configs(rows):
            every = configs_for(rows)
            return every[:1] if shard is None else every[shard::GEMV_SHARDS]

        results.update(gemv_cases(dtype, CUDA_GEMV_SHAPES, configs, "cuda", seed=2))
    assert results, part
    bad = {key: m for key, m in results.items() if not m["ok"]}
    assert not bad, bad


@pytest.mark.cuda
@pytest.mark.own_worker  # 15-36 s each (mostly compiles): the lane spreads them
@needs_gpu
@needs_triton
@pytest.mark.parametrize("path", ["tiles0", "tiles1", "swapped", "rows"])
@pytest.mark.parametrize("k", [1536, 8192])  # one K chunk for some configurations, several for all
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cuda_gemv_rows_are_batch_invariant(dtype, k, path):
    """Every tile configuration (16 to 128 rows, mma and wgmma, operands swapped or not)
    gives a row the bits it gets alone in the first 16-row tile, at any M; every row-path
    configuration gives a row its own one-row bits. The tiles run in parts (each with the
    first tile, the bits every other must give): their compiles took 100 s in one test."""
    from graphrt.devices.cuda.triton_gemv import (
        DOT_CONFIGS,
        ROW_CONFIGS,
        SWAP_CONFIGS,
        TILE_CONFIGS,
    )

    if path == "rows":
        results = gemv_invariance(dtype, ROW_CONFIGS, "cuda", (2, 6), k=k, seed=k)
    elif path == "swapped":
        tiles = DOT_CONFIGS[:1] + SWAP_CONFIGS
        results = gemv_invariance(dtype, tiles, "cuda", (1, 5, 16, 40), k, k, True)
    else:
        tiles = DOT_CONFIGS + TILE_CONFIGS
        half = tiles[:1] + tiles[1:][int(path.removeprefix("tiles")) :: 2]
        results = gemv_invariance(dtype, half, "cuda", (3, 16, 40, 130), k, k, True)
    bad = [key for key, m in results.items() if not m["ok"]]
    assert results and not bad, bad


@pytest.mark.cuda
@needs_gpu
@needs_triton
def test_cuda_split_k_gemv_is_deterministic_and_leaves_the_counts_at_zero():
    """Split-K tiles: whichever split of a tile finishes last adds the splits' sums in split
    order, so 30 launches give each input its one result bit for bit, eager and replayed
    from a graph, and every tile's arrival count is back at zero afterwards. The launches
    alternate two inputs: a last split that read another split's sums before they were
    written would find the previous launch's, of the other input, and fail."""
    from graphrt.devices.cuda import triton_gemv
    from graphrt.devices.cuda.triton_gemv import SPLIT_CONFIGS, gemv

    gen = torch.Generator(device="cuda").manual_seed(3)
    inputs = [torch.randn(5, 6144, generator=gen, device="cuda").bfloat16() for _ in range(2)]
    x = inputs[0].clone()  # what every launch reads (the graph's input): inputs copied in
    w = (torch.randn(2 * 1536, 6144, generator=gen, device="cuda") / 80).bfloat16()
    for config in SPLIT_CONFIGS:
        for gated in (False, True):

            def run(config=config, gated=gated):
                weight = w if gated else w[:1536]
                return gemv(x, weight, None, config, act="silu" if gated else None, gated=gated)

            firsts = []
            for each in inputs:
                x.copy_(each)
                firsts.append(run())
            assert not torch.equal(firsts[0], firsts[1])
            for i in range(30):
                x.copy_(inputs[i % 2])
                assert torch.equal(run(), firsts[i % 2]), (config, gated, i)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                replayed = run()
            for i in range(6):
                x.copy_(inputs[i % 2])
                replayed.fill_(float("nan"))  # a replay that wrote nothing must not pass
                graph.replay()
                assert torch.equal(replayed, firsts[i % 2]), (config, gated, i)
            graph.reset()
    (arrived,) = triton_gemv._ARRIVED.values()
    assert not arrived.any()


@pytest.mark.cuda
@needs_gpu
@needs_triton
def test_cuda_tuned_ops_replay_bitwise_and_refuse_tuning_under_capture():
    """A Gemma layer's fused ops and tuned matmuls, captured after a warm-up that tunes
    them, replay on new inputs bit for bit as eager; a shape never tuned is refused
    during capture instead of timing kernels inside it."""
    from graphrt.core.errors import GraphrtError
    from graphrt.devices.cuda.gemv_tuner import TUNER
    from graphrt.devices.cuda.ops import TRITON_OPS as ops

    dtype, t, hidden, inter, ple = torch.bfloat16, 4, 1536, 6144, 256
    gen = torch.Generator(device="cuda").manual_seed(7)

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen, device="cuda")).to(dtype)

    w = {
        "gate_up": randn(2 * inter, hidden, scale=hidden**-0.5),
        "down": randn(hidden, inter, scale=inter**-0.5),
        "ple_gate": randn(ple, hidden, scale=hidden**-0.5),
        "norm": randn(hidden, scale=0.1) + 1,
        "scalar": randn(1, scale=0.1) + 1,
    }

    def fresh() -> dict[str, torch.Tensor]:
        return {"x": randn(t, hidden), "h": randn(t, hidden), "ple": randn(t, ple)}

    def forward(inp):
        x, h = ops.gemma_residual_norm(inp["h"], inp["x"], w["norm"], EPS, None, w["norm"])
        h = ops.linear(ops.linear_act_mul(h, w["gate_up"], None, "gelu_pytorch_tanh"), w["down"])
        gated = ops.linear_act_mul(x, w["ple_gate"], None, "gelu_pytorch_tanh", inp["ple"])
        x, nxt = ops.gemma_residual_norm(h, x, w["norm"], EPS, w["scalar"], w["norm"])
        return [x, nxt, gated, ops.float_logits(h, 30.0)]

    static = fresh()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        forward(static)  # tunes every matmul shape of the step
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        static_out = forward(static)
    for _ in range(3):
        new = fresh()
        for name, tensor in new.items():
            static[name].copy_(tensor)
        graph.replay()
        replayed = [o.clone() for o in static_out]
        for i, (got, want) in enumerate(zip(replayed, forward(new))):
            assert torch.equal(got, want), f"output {i}: replay != eager"
    graph.reset()

    untuned = randn(3, 1000), randn(24, 1000)
    assert ("linear", "2-16", 24, 1000, dtype, False) not in TUNER.choices()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(GraphrtError, match="not tuned before graph capture"):
        with torch.cuda.graph(graph, stream=stream):
            ops.linear(*untuned)


if __name__ == "__main__":
    # The CPU lane's subprocesses (TRITON_INTERPRET=1 is already in their environment).
    import sys

    if sys.argv[1:2] == ["engine"]:
        print(json.dumps(engine_results(sys.argv[2])))
    else:
        print(json.dumps(interpreter_results()))
