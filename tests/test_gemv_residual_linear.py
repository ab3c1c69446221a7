"""The GEMV's Gemma 4 prologue (``gemv(..., residual_norm=ResidualNorm)``: the matmul reads
the residual stream after a block, ``(residual + gemma_norm(h) * weight) [* scalar]``, and
stores it) against the two launches it replaces: the residual norm kernel, then the same
GEMV configuration on its x. The prologue rounds as that kernel does, so x and the
matmul's output must match bit for bit; the ops table's ``gemma_residual_linear``
likewise against its two ops.

Cases: one row, and three (a verify's rows: each its own norms); the per-layer input
gate's epilogue (gelu times the per-layer input), a plain one, the MLP's gate/up on the
stream's next norm (the pre-feed-forward norm), and the next layer's input projection (no
activation) on the next norm of the stream after the layer scalar; one output tile and
several (only the first stores x); K below and at the chunk.

CPU lane: under TRITON_INTERPRET=1 in a subprocess (see test_triton_ops). CUDA lane:
Gemma 4 E2B's gate (256 x 1536), every configuration the tuner may pick, bfloat16 and
float16.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import OLD_INTERPRETER, needs_gpu, needs_triton, run_under_triton_interpreter


def gate_case(k: int, n: int, dtype, device, seed=0, rows=1):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen)).to(device, dtype)

    h = randn(rows, k + 8, scale=3.0)[:, :k]  # strided rows, far from unit RMS
    residual = randn(rows, k + 4)[:, :k]
    weight = randn(k, scale=0.2) + 1
    gate = randn(2 * n, k, scale=k**-0.5)  # [gate; up] stacked, or its first half alone
    up = randn(rows, n)
    next_weight = randn(k, scale=0.2) + 1
    scalar = randn(1, scale=0.2) + 0.6  # Gemma 4's layer scalars are below 1
    return h, residual, weight, gate, up, next_weight, scalar


def scaled(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference over ``want``'s largest magnitude."""
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def x_roundings(x_got, x_want, h, residual, weight, scale) -> float:
    """The largest difference in x over what one rounding of the norm term and one of x
    allow at each value: where the two launches' row sums order apart, the norm term
    ``gemma_norm(h) * weight`` may round one place apart, and x = (residual + it) [* scale]
    carries that place (at the term's magnitude, not x's) plus its own roundings. Over 1:
    more apart than that."""
    eps = torch.finfo(x_want.dtype).eps  # eps * |v| >= one last place of v
    h32 = h.float()
    term = h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.float()
    stream = residual.float() + term
    allowed = eps * (term.abs() + stream.abs())
    if scale is not None:
        allowed = allowed * scale.float().abs()
    allowed = allowed + eps * x_want.float().abs()
    excess = (x_got.float() - x_want.float()).abs() / allowed.clamp_min(
        torch.finfo(torch.float32).tiny
    )
    return float(excess.max())


def compare(dtype, device, configs, shapes) -> list[dict]:
    from graphrt.devices.cuda.triton_gemma import gemma_residual_norm
    from graphrt.devices.cuda.triton_gemv import ResidualNorm, gemv

    results = []
    for k, n, *rows in shapes:  # (K, N) or (K, N, rows): one row unless given
        h, residual, weight, gate, up, next_weight, scalar = gate_case(
            k, n, dtype, device, rows=rows[0] if rows else 1
        )
        # the per-layer input's gate (gelu times up), a plain one, the MLP's gate/up (gelu
        # of gate times up, on the next norm of x), the next layer's input projection (on
        # the next norm of x after the layer scalar)
        variants = [("gelu_pytorch_tanh", up, None, None), (None, None, None, None),
                    ("gelu_pytorch_tanh", None, next_weight, None),
                    (None, None, next_weight, scalar)]  # fmt: skip
        for config in configs(k):
            for act, product, nxt, scale in variants:
                x_want, normed = gemma_residual_norm(h, residual, weight, 1e-6, scale, nxt)
                gated = product is None and act is not None
                w = gate if gated else gate[:n]
                want = gemv(x_want if nxt is None else normed, w, None, config, act=act,
                            gated=gated, up=product)  # fmt: skip
                x_got = torch.full_like(x_want, float("nan"))
                norm = ResidualNorm(residual, weight, 1e-6, x_got, nxt, scale)
                got = gemv(h, w, None, config, act=act, gated=gated, up=product,
                           residual_norm=norm)  # fmt: skip
                results.append(
                    {
                        "case": f"{str(dtype)[6:]}/K{k}-N{n}-M{h.shape[0]}/{config.block_n}x"
                        f"{config.block_k}"
                        f"/{act}-gated{int(gated)}-next{int(nxt is not None)}"
                        f"-scalar{int(scale is not None)}",
                        "x": torch.equal(x_got, x_want),
                        "out": torch.equal(got, want),
                        "x_scaled": scaled(x_got, x_want),
                        "x_roundings": x_roundings(x_got, x_want, h, residual, weight, scale),
                        "out_scaled": scaled(got, want),
                    }
                )
    return results


def ops_results(dtype, device) -> list[dict]:
    """``TRITON_OPS.gemma_residual_linear`` against the table's residual norm then its
    linear or linear_act_mul (interpreter: both take the first row configuration, one chunk
    at K 200), and against the torch reference within rounding."""
    from graphrt.core.models.ops import TORCH_OPS, residual_norm_then_linear
    from graphrt.devices.cuda.ops import TRITON_OPS

    h, residual, weight, gate, up, next_weight, scalar = gate_case(200, 24, dtype, device, seed=1)
    gelu = "gelu_pytorch_tanh"
    results = []
    for kind, args, kwargs in (
        ("per-layer gate", (h, residual, weight, 1e-6, gate[:24]), {"act": gelu, "up": up}),
        ("mlp", (h, residual, weight, 1e-6, gate), {"act": gelu, "next_weight": next_weight}),
        ("in_proj", (h, residual, weight, 1e-6, gate[:24]),
         {"scalar": scalar, "next_weight": next_weight}),
    ):  # fmt: skip
        x, out = TRITON_OPS.gemma_residual_linear(*args, **kwargs)
        t = TRITON_OPS
        two_ops = residual_norm_then_linear(t.gemma_residual_norm, t.linear, t.linear_act_mul)
        x_want, out_want = two_ops(*args, **kwargs)
        x_ref, out_ref = TORCH_OPS.gemma_residual_linear(*args, **kwargs)
        scale = out_ref.float().abs().max()
        near = ((out.float() - out_ref.float()).abs().max() / scale) < 0.05
        near &= ((x.float() - x_ref.float()).abs().max() / x_ref.float().abs().max()) < 0.02
        results.append(
            {
                "case": f"{str(dtype)[6:]}/ops-{kind}",
                "x": torch.equal(x, x_want),
                "out": torch.equal(out, out_want),
                "reference": bool(near),
            }
        )
    return results


def check(results: list[dict]) -> None:
    bad = [r for r in results if not (r["x"] and r["out"] and r.get("reference", True))]
    assert not bad, bad


def _cpu_configs(k):
    from graphrt.devices.cuda.triton_gemv import GemvConfig

    # one output tile (BLOCK_N 32 of N 24) and three; a chunk K exactly, and K below it
    return (GemvConfig(32, 256, block_m=1), GemvConfig(8, 256, block_m=1))


# (K, N[, rows]): K below and at the chunk; three rows (a verify's, or a batch's draft
# rows: each row its own norms, its x stored by the first output tile's programs)
CPU_SHAPES = [(200, 24), (256, 24), (200, 24, 3)]


def interpreter_results() -> list[dict]:
    cpu = torch.device("cpu")
    return [
        r for dtype in (torch.bfloat16, torch.float16)
        for r in compare(dtype, cpu, _cpu_configs, CPU_SHAPES) + ops_results(dtype, cpu)
    ]  # fmt: skip


@needs_triton
@pytest.mark.skipif(OLD_INTERPRETER, reason="triton < 3.7: its interpreter mishandles loop bounds")
def test_gemv_residual_linear_under_interpreter_equals_norm_kernel_then_gemv():
    results = run_under_triton_interpreter(__file__)
    assert len(results) == 2 * (len(CPU_SHAPES) * 2 * 4 + 3)
    check(results)


@needs_gpu
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_gemv_residual_linear_equals_norm_kernel_then_gemv(dtype):
    """On the GPU the two launches' row sums may order apart (the norm kernel's warps
    against the GEMV's): x and the output must then still agree within a rounding or two
    at their scale (not in each value's own last place: x = residual + norm(h) * w may
    cancel, so that one rounding of the norm is many of x's smallest values), and each x
    within one rounding of its norm term and one of its own."""
    from graphrt.devices.cuda.triton_gemv import ROW_CONFIGS

    def one_chunk(k):
        return tuple(c for c in ROW_CONFIGS if c.block_k >= k)

    results = compare(dtype, torch.device("cuda"), one_chunk, [(1536, 256), (1536, 256, 5)])
    ulp = torch.finfo(dtype).eps
    bad = [
        r for r in results
        if r["x_scaled"] > 2 * ulp or r["x_roundings"] > 1 or r["out_scaled"] > 2 * ulp
    ]  # fmt: skip
    assert results and not bad, bad


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(json.dumps(interpreter_results()))
