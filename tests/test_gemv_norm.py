"""The GEMV's Llama norm prologue (``gemv(..., norm=PreNorm)``) on the row path against the
two launches it replaces: the RMSNorm kernel, then the same GEMV configuration on its
output. The prologue rounds as that kernel does ((x * inv_rms) to the dtype, times the
weight, to the dtype again), so the outputs must match bit for bit. test_triton_fused
compares the fused GEMV with torch's matmul, within a matmul's tolerance, where one
rounding of the norm left out would pass unseen.

Cases: x read once (one K chunk, and one chunk wider than K); several chunks (the row read
in one load for its sum of squares, ``ROW_K``); one row and three; bfloat16 and float16.
CPU lane only, under TRITON_INTERPRET=1 in a subprocess (see test_triton_ops). On the GPU
the two kernels may sum a row's squares in different orders, so the CUDA tests compare
with torch instead (test_triton_fused).
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import OLD_INTERPRETER, needs_triton, run_under_triton_interpreter

# (K, BLOCK_K): one chunk exactly, one chunk wider than K, several chunks (ROW_K)
CASES = [(64, 64), (96, 128), (200, 64)]
ROWS = (1, 3)
DTYPES = (torch.bfloat16, torch.float16)


def interpreter_results() -> list[dict]:
    from graphrt.core.models.ops import PreNorm
    from graphrt.devices.cuda.triton_gemv import GemvConfig, gemv
    from graphrt.devices.cuda.triton_ops import triton_rms_norm

    gen = torch.Generator().manual_seed(0)
    results = []
    for dtype in DTYPES:
        for k, block_k in CASES:
            config = GemvConfig(8, block_k, block_m=1)  # N 20: three output tiles
            for rows in ROWS:
                x = (3 * torch.randn(rows, k + 8, generator=gen)).to(dtype)[:, :k]  # strided
                weight = (k**-0.5 * torch.randn(20, k, generator=gen)).to(dtype)
                norm = PreNorm((0.2 * torch.randn(k, generator=gen) + 1).to(dtype), 1e-5)
                fused = gemv(x, weight, None, config, norm=norm)
                apart = gemv(triton_rms_norm(x, norm.weight, norm.eps), weight, None, config)
                results.append(
                    {
                        "case": f"{dtype}/K{k}/BLOCK_K{block_k}/M{rows}",
                        "equal": torch.equal(fused, apart),
                        "diff": (fused.float() - apart.float()).abs().max().item(),
                    }
                )
    return results


@needs_triton
@pytest.mark.skipif(OLD_INTERPRETER, reason="triton < 3.7: its interpreter mishandles loop bounds")
def test_gemv_norm_under_interpreter_equals_norm_kernel_then_gemv():
    results = run_under_triton_interpreter(__file__)
    assert len(results) == len(DTYPES) * len(CASES) * len(ROWS)
    bad = [r for r in results if not r["equal"]]
    assert not bad, bad


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(json.dumps(interpreter_results()))
