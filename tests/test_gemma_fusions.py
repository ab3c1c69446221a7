"""Gemma 4's decode fusions as a whole model: a float16 Gemma 4 at one request on the CUDA
device's kernels under Triton's interpreter, with its fusions and without them, must decode
bit for bit alike (each fusion computes what its launches do, rounding as they do), every
fusion counted as taken, and with the torch reference's tokens.

The fusions: the GEMVs forming the residual stream in their prologues
(``gemma_residual_linear``: after attention, after the MLP, and the layer scalar with the
next layer's input norm). Each is checked kernel by kernel in test_gemv_residual_linear;
here the model's plumbing is. Its own file, so that the CPU lane's second worker runs it beside
test_triton_fused's engine test.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest
import torch
from helpers import OLD_INTERPRETER, needs_triton, run_under_triton_interpreter

from graphrt.devices.cpu import CpuDevice


class TritonOnCpu(CpuDevice):
    """The CUDA device's kernels, run by Triton's interpreter on CPU tensors (float16: the
    interpreter's bfloat16 dots are wrong, see test_triton_fused)."""

    def model_ops(self, batch_invariant=False):
        from graphrt.devices.cuda.ops import TRITON_OPS

        return TRITON_OPS

    def create_attention_backend(self, kv_pool, req_to_token_pool):
        from graphrt.devices.cuda.attention import TritonAttentionBackend

        # 4 KV splits, not 16: a quarter of the interpreted programs
        return TritonAttentionBackend(kv_pool, req_to_token_pool, num_kv_splits=4)


def gemma_fusions(checkpoint: str) -> dict:
    """Gemma 4 in float16, one request (decode at one row), on the CUDA kernels under the
    interpreter: with its decode fusions (the GEMVs forming the residual stream in their
    prologues: after attention, after the MLP, and the layer scalar with the next layer's
    input norm) and without them (the norm kernel, then the GEMV). The fused ops compute
    what the two launches do, rounding as they do, so the two runs must agree bit for bit,
    and both take the reference's tokens. (A whole float16 Gemma 4 strays from the torch
    reference's logits by more than one op's bound: they are not compared here.)"""
    from graphrt.core.engine import Engine, EngineConfig, SamplingParams
    from graphrt.core.models import load_model
    from graphrt.devices.cpu import CpuDevice
    from graphrt.devices.cuda import ops as cuda_ops

    device_cls = TritonOnCpu
    # One prompt token: the fusions live in decode's one-row GEMVs, and an 8-token prompt
    # doubled the interpreted time (35 s -> 17.5 s alone) in prefill kernels they never
    # touch; a prologue that skipped either rounding (the residual add's, the layer
    # scalar's) still fails with one.
    prompt = torch.randint(3, 300, (1,), generator=torch.Generator().manual_seed(40)).tolist()
    unfused_ops = dataclasses.replace(
        cuda_ops.TRITON_OPS, gemma_residual_linear=cuda_ops.UNFUSED_RESIDUAL_LINEAR
    )

    class Unfused(device_cls):
        def model_ops(self, batch_invariant=False):
            return unfused_ops

    calls = {"prologue": 0, "scalar": 0}
    gemv = cuda_ops.gemv

    def counted_gemv(*args, residual_norm=None, **kwargs):
        calls["prologue"] += residual_norm is not None
        calls["scalar"] += residual_norm is not None and residual_norm.scalar is not None
        return gemv(*args, residual_norm=residual_norm, **kwargs)

    params = SamplingParams(max_new_tokens=2, ignore_eos=True, return_logits=True)
    runs, counts = {}, {}
    for name, device in (("fused", device_cls()), ("unfused", Unfused()), ("torch", CpuDevice())):
        cuda_ops.gemv = counted_gemv
        try:
            loaded = load_model(checkpoint, device, torch.float16)
            engine = Engine(loaded, EngineConfig(max_context_len=64, runner="eager"), device)
            runs[name] = engine.generate([prompt], params)[0]
        finally:
            cuda_ops.gemv = gemv
        counts[name] = dict(calls)
        calls.update(dict.fromkeys(calls, 0))
    fused, unfused = runs["fused"], runs["unfused"]
    bitwise = (
        all(torch.equal(a, b) for a, b in zip(fused.output_logits, unfused.output_logits))
        and len(fused.output_logits) == 2
    )
    # The fused run took every fusion at its decode step, the other none.
    took = counts["fused"]["prologue"] > counts["fused"]["scalar"] > 0
    took &= counts["unfused"]["prologue"] == 0
    ids = [run.output_ids for run in runs.values()]
    return {"ok": bitwise and took and ids[0] == ids[1] == ids[2], "ids": ids, "calls": counts}


@pytest.mark.slow  # ~18 s alone: two interpreted runs of a 7-layer model, two steps each
@needs_triton
@pytest.mark.skipif(OLD_INTERPRETER, reason="triton < 3.7: its interpreter mishandles loop bounds")
def test_gemma4_decodes_bit_for_bit_with_and_without_its_fusions(gemma4_tiny):
    result = run_under_triton_interpreter(__file__, str(gemma4_tiny.path))
    assert result["ok"], result


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(json.dumps(gemma_fusions(sys.argv[1])))
