"""Triton elementwise ops (devices/cuda/triton_ops.py, triton_rope.py) against the torch reference table
(core/models/ops.py, ``TORCH_OPS``).

What a model swapping ``TRITON_OPS`` in relies on, per output:
- rope (q and k, and v into the cache) is bitwise the reference's in every dtype:
  the kernel rounds where torch rounds and nothing is reordered;
- rms_norm and act_mul (silu, gelu-tanh) differ in float32
  only by the order of the row's float32 sum of squares (torch's reduction tree is not
  Triton's) and by the float32 exp / tanh behind the activation (numpy's under the
  interpreter, libdevice's on the GPU, Sleef's in torch on CPU): at most
  FLOAT32_MAX_REL per element. In 16-bit dtypes those float32 differences flip a
  rounding only when they straddle a rounding midpoint, in at most MISMATCH_FRAC of
  the elements. act_mul's flips are 1 ulp of the activation, then the product rounds:
  at most 1 ulp. gelu-tanh is the exception: for very negative x it is 0.5x(1 + tanh)
  with tanh near -1, so 1 ulp between two tanh implementations is a large relative
  error of a tiny output. gelu_mul is held to GELU_SCALED instead: the difference
  relative to the output's largest magnitude (about 1 ulp there). rms_norm rounds twice (``x.to(dtype)``, then
  ``weight * x``): a flip of the first, 1 ulp of the normalised value, is scaled by
  the weight before the second rounding, so with |weight| up to 2 the output moves
  by at most 2 ulp (seen on an H200 in float16: 2 ulp at D=2048).

CPU lane: the kernels run under Triton's interpreter, which must be switched on
(TRITON_INTERPRET=1) before triton is first imported; other tests may already have
imported it in this process, so the check runs this file as a script in a
subprocess and reads its metrics back as JSON.
CUDA lane: the same comparisons at Llama sizes in float32 / bfloat16 / float16, and
all four ops inside one CUDA graph replayed on new values against eager, bitwise.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import (
    OLD_INTERPRETER,
    needs_gpu,
    needs_triton,
    run_under_triton_interpreter,
)

from graphrt.core.attention.base import KVWrite
from graphrt.core.models.ops import TORCH_OPS

EPS = 1e-5
BITWISE = (
    "rope_q",
    "rope_k",
    "rope_kv_write_q",
    "rope_kv_write_k",
    "rope_kv_write_v",
)
FLOAT32_MAX_REL = 1e-6
MISMATCH_FRAC = {"bfloat16": 1e-3, "float16": 5e-3}  # of the elements that differ at all
# Largest 16-bit difference per output (see the module docstring for why norms allow 2).
# Gemma's norm rounds once, after the float32 weight multiply: a flip is 1 ulp.
MAX_ULP = {
    "rms_norm": 2,
    "silu_mul": 1,
    "gelu_mul": 1,
    "gemma_norm": 1,
    "gemma_norm_noscale": 1,
}

GELU_SCALED = {"float32": 1e-6, "bfloat16": 2.0**-7, "float16": 2.0**-10}

_BITS = {torch.float32: (torch.int32, 31), torch.bfloat16: (torch.int16, 15)}
_BITS[torch.float16] = _BITS[torch.bfloat16]


def compare(actual: torch.Tensor, expected: torch.Tensor) -> dict:
    """Bitwise equality, ulp distance and relative error of one output against the reference."""
    same_layout = actual.shape == expected.shape and actual.dtype == expected.dtype
    if not same_layout or actual.numel() == 0:
        return {"same_layout": same_layout, "equal": same_layout, "max_ulp": 0, "frac": 0.0}
    int_dtype, sign_bit = _BITS[actual.dtype]

    def ordinal(t: torch.Tensor) -> torch.Tensor:  # consecutive floats -> consecutive ints
        bits = t.contiguous().view(int_dtype).long()
        magnitude = bits & ((1 << sign_bit) - 1)
        return torch.where(bits < 0, -magnitude, magnitude)

    ulps = (ordinal(actual) - ordinal(expected)).abs()
    a, e = actual.double(), expected.double()
    rel = ((a - e).abs() / e.abs().clamp_min(1e-30)).max().item()
    return {
        "same_layout": True,
        "equal": bool(torch.equal(actual, expected)),
        "finite": bool(torch.isfinite(actual).all()),
        "max_ulp": int(ulps.max()),
        "frac": (ulps > 0).double().mean().item(),
        "mean_abs": (a - e).abs().mean().item(),
        "max_rel": rel,
        "max_scaled": ((a - e).abs().max() / e.abs().max().clamp_min(1e-30)).item(),
    }


def violations(results: dict[str, dict]) -> dict[str, dict]:
    """Results ("<dtype>/<case>/<output>") that break the contract in the module docstring."""
    bad = {}
    for key, m in results.items():
        dtype, _, output = key.split("/")
        if not (m["same_layout"] and m.get("finite", True) and m.get("inputs_intact", True)):
            ok = False
        elif output in BITWISE:
            ok = m["equal"]
        elif output == "gelu_mul":
            ok = m["max_scaled"] <= GELU_SCALED[dtype]
        elif dtype == "float32":
            ok = m["equal"] or m["max_rel"] <= FLOAT32_MAX_REL
        else:
            ok = m["max_ulp"] <= MAX_ULP[output] and m["frac"] <= MISMATCH_FRAC[dtype]
        if not ok:
            bad[key] = m
    return bad


def rope_tables(positions: int, rot_dim: int, dtype: torch.dtype, device) -> tuple:
    """cos/sin (P, R) in the rotate-half layout of RotaryEmbedding (theta 10000)."""
    inv_freq = 1.0 / 10000 ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim)
    freqs = torch.outer(torch.arange(positions, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(device, dtype), emb.sin().to(device, dtype)


def run_cases(ops, dtype, norm_shapes, silu_shapes, rope_shapes, device, seed=0) -> dict:
    """Every op of ``ops`` against TORCH_OPS on random inputs -> {"dtype/case/output": metrics}.

    Inputs are strided where the model hands over views: rows of a wider buffer for the
    norms and silu, and q/k split out of one (T, (H + 2 Hkv) D) qkv projection for rope.
    """
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen)).to(device, dtype)

    name = str(dtype).removeprefix("torch.")
    results = {}
    for num_rows, dim in norm_shapes:
        case = f"{name}/T{num_rows}-D{dim}"
        x = randn(num_rows, dim + 8)[:, :dim]  # row stride dim + 8
        weight = randn(dim, scale=0.2) + 1
        before = x.clone()
        got = ops.rms_norm(x, weight, EPS)
        results[f"{case}/rms_norm"] = compare(got, TORCH_OPS.rms_norm(x, weight, EPS))
        # The caller may still hold its input: it must come back untouched.
        results[f"{case}/rms_norm"]["inputs_intact"] = torch.equal(x, before)
        # Gemma's q/k norms: 3 heads of a (T, 3, D) view out of a wider projection.
        heads = randn(num_rows, 3 * dim + 8)[:, : 3 * dim].view(num_rows, 3, dim)
        got = ops.gemma_rms_norm(heads, weight, EPS)
        results[f"{case}/gemma_norm"] = compare(got, TORCH_OPS.gemma_rms_norm(heads, weight, EPS))
        got = ops.gemma_rms_norm(x, None, EPS)  # v_norm: no scale
        results[f"{case}/gemma_norm_noscale"] = compare(got, TORCH_OPS.gemma_rms_norm(x, None, EPS))

    for num_rows, inter in silu_shapes:
        x = randn(num_rows, 2 * inter + 16, scale=3.0)[:, : 2 * inter]  # (T, 2I), strided rows
        gate, up = x[:, :inter], x[:, inter:]
        for act, output in (("silu", "silu_mul"), ("gelu_pytorch_tanh", "gelu_mul")):
            got = ops.act_mul(gate, up, act)
            want = TORCH_OPS.act_mul(gate, up, act)
            results[f"{name}/T{num_rows}-I{inter}/{output}"] = compare(got, want)

    for num_tokens, heads, kv_heads, head_dim, rot_dim, table_dtype in rope_shapes:
        case = f"{name}/T{num_tokens}-H{heads}-{kv_heads}-D{head_dim}-R{rot_dim}"
        qkv = randn(num_tokens, (heads + 2 * kv_heads) * head_dim)  # (T, (H + 2Hkv) D)
        q = qkv[:, : heads * head_dim].view(num_tokens, heads, head_dim)
        k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(
            num_tokens, kv_heads, head_dim
        )
        cos, sin = rope_tables(512, rot_dim, table_dtype or dtype, device)
        positions = torch.randint(0, 512, (num_tokens,), generator=gen).to(device)
        before = qkv.clone()
        got_q, got_k = ops.rope(positions, q, k, cos, sin)
        want_q, want_k = TORCH_OPS.rope(positions, q, k, cos, sin)
        results[f"{case}/rope_q"] = compare(got_q, want_q)
        results[f"{case}/rope_k"] = compare(got_k, want_k)
        results[f"{case}/rope_q"]["inputs_intact"] = torch.equal(qkv, before)  # out of place
        # With a KVWrite: rotated k and the raw v land in the cache rows at loc, bitwise.
        slots = 2 * num_tokens + 3
        loc = torch.randperm(slots, generator=gen)[:num_tokens].to(device)
        v = qkv[:, (heads + kv_heads) * head_dim :].view(num_tokens, kv_heads, head_dim)
        caches = []
        for table in (ops, TORCH_OPS):
            k_cache, v_cache = (
                torch.zeros(slots, kv_heads, head_dim, dtype=dtype, device=device) for _ in "kv"
            )
            out_q, out_k = table.rope(
                positions, q, k, cos, sin, v=v, kv_write=KVWrite(k_cache, v_cache, loc)
            )
            caches.append((out_q, out_k, k_cache, v_cache))
        (got_q, got_k, got_kc, got_vc), (want_q, _, want_kc, want_vc) = caches
        results[f"{case}/rope_kv_write_k"] = compare(got_kc, want_kc)
        results[f"{case}/rope_kv_write_v"] = compare(got_vc, want_vc)
        results[f"{case}/rope_kv_write_v"]["inputs_intact"] = got_k is None
        results[f"{case}/rope_kv_write_q"] = compare(got_q, want_q)
    return results


# ---- CPU lane ------------------------------------------------------------------------

CPU_NORM_SHAPES = [(1, 64), (3, 24), (17, 64)]
CPU_SILU_SHAPES = [(1, 64), (3, 24), (17, 64)]
# (T, H, Hkv, D, R, table dtype; None = the activation dtype)
CPU_ROPE_SHAPES = [
    (1, 4, 2, 64, 64, torch.float32),
    (3, 4, 2, 24, 24, None),
    (17, 2, 1, 32, 8, torch.float32),  # partial rotary: dims 8.. pass through
]


def interpreter_results() -> dict:
    """Runs under TRITON_INTERPRET=1 (the subprocess below); every metric for the test to check.

    The interpreter costs ~5 ms per program on 2 cores: shapes stay small.
    """
    from graphrt.devices.cuda import triton_rope
    from graphrt.devices.cuda.ops import TRITON_OPS

    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        results.update(
            run_cases(TRITON_OPS, dtype, CPU_NORM_SHAPES, CPU_SILU_SHAPES, CPU_ROPE_SHAPES, "cpu")
        )
    # Prefill widths' plain rope (a program per token and group of heads, from
    # GROUPED_FROM_TOKENS tokens) on the same shapes, forced from one token: bitwise too.
    triton_rope.GROUPED_FROM_TOKENS = 1
    for dtype in (torch.float32, torch.bfloat16):
        grouped = run_cases(TRITON_OPS, dtype, [], [], CPU_ROPE_SHAPES, "cpu")
        results.update({key.replace("/", "/grouped-", 1): m for key, m in grouped.items()})
    return results


@needs_triton
@pytest.mark.skipif(OLD_INTERPRETER, reason="triton < 3.7: its interpreter mishandles loop bounds")
def test_ops_under_interpreter_match_reference():
    results = run_under_triton_interpreter(__file__)
    # 2 dtypes x (3 norm shapes x 3 outputs + 3 act shapes x 2 + 3 rope shapes x 5 outputs,
    # per-head and grouped programs)
    assert len(results) == 2 * (9 + 6 + 15 + 15)
    assert sum("/grouped-" in key for key in results) == 2 * 15
    bad = violations(results)
    assert not bad, bad


@needs_triton
def test_empty_batch_launches_nothing():
    """T == 0 returns empty outputs of the right shapes and dtypes without a launch
    (here: without the interpreter or a GPU, where a launch would fail)."""
    from graphrt.devices.cuda.ops import TRITON_OPS

    x = torch.empty(0, 24, dtype=torch.bfloat16)
    weight = torch.ones(24, dtype=torch.bfloat16)
    assert TRITON_OPS.rms_norm(x, weight, EPS).shape == (0, 24)
    assert TRITON_OPS.act_mul(x[:, :12], x[:, 12:], "silu").shape == (0, 12)
    cos, sin = rope_tables(8, 16, torch.float32, "cpu")
    q_out, k_out = TRITON_OPS.rope(
        torch.empty(0, dtype=torch.int64),
        torch.empty(0, 4, 24, dtype=torch.bfloat16),
        torch.empty(0, 2, 24, dtype=torch.bfloat16),
        cos,
        sin,
    )
    assert q_out.shape == (0, 4, 24) and k_out.shape == (0, 2, 24)
    assert q_out.dtype == k_out.dtype == torch.bfloat16


def test_violations_flags_each_kind_of_miss():
    """The contract check itself: a 2-ulp or too-frequent 1-ulp miss fails, bitwise outputs
    admit no difference, float32 admits FLOAT32_MAX_REL."""
    ref = torch.linspace(-3, 3, 4096, dtype=torch.bfloat16)
    one_ulp = compare(ref.view(torch.int16).add(1).view(torch.bfloat16), ref)
    assert one_ulp["max_ulp"] == 1 and one_ulp["frac"] == 1.0
    few = ref.clone().view(torch.int16)
    few[:2] += 1
    ok = compare(few.view(torch.bfloat16), ref)
    assert not violations({"bfloat16/c/silu_mul": ok})
    assert violations({"bfloat16/c/rope_q": ok})
    assert violations({"bfloat16/c/silu_mul": one_ulp})
    f32 = torch.linspace(1, 2, 64)
    assert not violations({"float32/c/rms_norm": compare(f32 * (1 + 4e-7), f32)})
    assert violations({"float32/c/rms_norm": compare(f32 * (1 + 4e-6), f32)})


# ---- CUDA lane -----------------------------------------------------------------------

CUDA_NORM_SHAPES = [(1, 2048), (7, 2048), (256, 2048), (256, 3000)]
CUDA_SILU_SHAPES = [(1, 8192), (256, 8192), (5, 1000)]
CUDA_ROPE_SHAPES = [
    (1, 32, 8, 64, 64, torch.float32),  # Llama-3.2-1B
    (256, 32, 8, 64, 64, None),
    (256, 32, 8, 128, 128, torch.float32),
    (64, 32, 8, 128, 64, torch.float32),  # partial rotary
    (64, 16, 4, 96, 96, torch.float32),  # D not a power of two
]


@pytest.mark.cuda
@needs_gpu
@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_cuda_ops_match_reference(dtype):
    from graphrt.devices.cuda.ops import TRITON_OPS

    results = run_cases(
        TRITON_OPS, dtype, CUDA_NORM_SHAPES, CUDA_SILU_SHAPES, CUDA_ROPE_SHAPES, "cuda", seed=1
    )
    bad = violations(results)
    assert not bad, bad


@pytest.mark.cuda
@needs_gpu
@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_cuda_graph_replay_matches_eager_bitwise(dtype):
    """One decode layer's elementwise ops captured once, replayed on new inputs: the
    launchers take no host decision from tensor values, so replay == eager, bit for bit."""
    from graphrt.devices.cuda.ops import TRITON_OPS as ops

    num_tokens, hidden, inter, heads, kv_heads, head_dim = 8, 2048, 8192, 32, 8, 64
    gen = torch.Generator(device="cuda").manual_seed(3)

    def fresh_inputs() -> dict[str, torch.Tensor]:
        def randn(*shape):
            return torch.randn(*shape, generator=gen, device="cuda").to(dtype)

        return {
            "x": randn(num_tokens, hidden),
            "gate_up": randn(num_tokens, 2 * inter),
            "qkv": randn(num_tokens, (heads + 2 * kv_heads) * head_dim),
            "positions": torch.randint(0, 4096, (num_tokens,), generator=gen, device="cuda"),
        }

    weight = (1 + 0.1 * torch.randn(hidden, generator=gen, device="cuda")).to(dtype)
    cos, sin = rope_tables(4096, head_dim, torch.float32, "cuda")

    def forward(inp: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        qkv = inp["qkv"]
        q = qkv[:, : heads * head_dim].view(num_tokens, heads, head_dim)
        k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(
            num_tokens, kv_heads, head_dim
        )
        return [
            ops.rms_norm(inp["x"], weight, EPS),
            ops.act_mul(inp["gate_up"][:, :inter], inp["gate_up"][:, inter:], "silu"),
            *ops.rope(inp["positions"], q, k, cos, sin),
        ]

    static = fresh_inputs()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up: compiles every kernel before capture
            forward(static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        static_out = forward(static)

    for _ in range(3):
        new = fresh_inputs()
        for name, t in new.items():
            static[name].copy_(t)
        graph.replay()
        replayed = [t.clone() for t in static_out]
        eager = forward(new)
        for i, (got, want) in enumerate(zip(replayed, eager)):
            assert torch.equal(got, want), f"output {i}: replay != eager"
    graph.reset()


if __name__ == "__main__":
    # The CPU lane's subprocess (TRITON_INTERPRET=1 is already in its environment).
    print(json.dumps(interpreter_results()))
