"""The GEMV tuner runs each candidate of a shape about a hundred times (an eager call, then
a captured graph of 16 calls replayed six times) on the call's real inputs. cuBLAS's
candidate for a linear with a residual accumulates into that residual (``addmm_``: one
launch, as ``ModelOps.linear`` allows). Timing must not do so into the live residual
stream: stop 64 found a first short prompt's stream on a fresh GPU process taking the sum
of every timed call (random:llama-1b's first request's tokens differed from any later
engine's). Here a stand-in tuner runs every candidate many times and picks one; the op's
result must be that candidate's on the untouched inputs. CPU: cuBLAS's candidate is
torch's addmm on CPU tensors, the GEMV's is never picked (it needs the interpreter)."""

from __future__ import annotations

import pytest
import torch
from helpers import needs_gpu

pytest.importorskip("triton")

from graphrt.devices.cuda import ops as cuda_ops  # noqa: E402
from graphrt.devices.cuda.gemv_tuner import CUBLAS  # noqa: E402


class TimesEveryCandidate:
    """A tuner that calls ``run`` with cuBLAS's candidate ``calls`` times, as timing does,
    then picks cuBLAS (the candidate that writes in place)."""

    def __init__(self, calls: int = 97):
        self.calls, self.timed = calls, 0

    def choose(self, key, rows, weight, run, candidates=None):
        for _ in range(self.calls):
            run(CUBLAS, weight.clone())
        self.timed += 1
        return CUBLAS


def test_timing_a_residual_linear_leaves_the_residual_stream_as_it_was(monkeypatch):
    tuner = TimesEveryCandidate()
    monkeypatch.setattr(cuda_ops, "TUNER", tuner)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 64, generator=gen).bfloat16()
    weight = (0.1 * torch.randn(32, 64, generator=gen)).bfloat16()
    residual = torch.randn(7, 32, generator=gen).bfloat16()
    want = residual.clone().addmm_(x, weight.t())  # the chosen kernel, once
    got = cuda_ops.triton_linear(x, weight, residual=residual.clone())
    assert tuner.timed == 1
    assert torch.equal(got, want)


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("rows", [1, 7])
def test_cuda_the_first_call_of_a_shape_returns_its_chosen_kernels_result(
    monkeypatch, tmp_path, rows
):
    """The real tuner, on a fresh cache: the first call of a residual linear (which times
    cuBLAS and every GEMV configuration on its inputs) returns what the chosen kernel
    computes on the untouched inputs, bit for bit."""
    from graphrt.devices.cuda.gemv_tuner import GemvTuner
    from graphrt.devices.cuda.triton_gemv import gemv

    tuner = GemvTuner()
    tuner.use_cache(tmp_path / "choices.json")
    monkeypatch.setattr(cuda_ops, "TUNER", tuner)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(rows, 2048, generator=gen).bfloat16().cuda()
    weight = (2048**-0.5 * torch.randn(2048, 2048, generator=gen)).bfloat16().cuda()
    residual = torch.randn(rows, 2048, generator=gen).bfloat16().cuda()
    kept = residual.clone()
    got = cuda_ops.triton_linear(x, weight, residual=residual)
    (choice,) = tuner.choices().values()
    if choice is CUBLAS:
        want = kept.clone().addmm_(x, weight.t())
    else:
        want = gemv(x, weight, None, choice, residual=kept.clone())
    assert torch.equal(got, want), choice


@pytest.mark.cuda
@needs_gpu
def test_cuda_a_candidate_that_does_not_fit_the_card_is_skipped(tmp_path):
    """A tile needing more shared memory than the card has raises Triton's OutOfResources
    at its first launch: the tuner times the others and never picks it."""
    from triton.runtime.errors import OutOfResources

    from graphrt.devices.cuda.gemv_tuner import GemvTuner
    from graphrt.devices.cuda.triton_gemv import configs_for, gemv

    tuner = GemvTuner()
    tuner.use_cache(tmp_path / "choices.json")
    x = torch.randn(1, 1024, device="cuda").bfloat16()
    weight = torch.randn(512, 1024, device="cuda").bfloat16()
    too_big, fits = configs_for(1)[:2]

    def run(choice, w):
        if choice is too_big:
            raise OutOfResources(300_000, 232_448, "shared memory")
        return w.new_zeros(1) if choice is CUBLAS else gemv(x, w, None, choice)

    assert tuner.choose("oversized", 1, weight, run, (too_big, fits)) is fits
    with pytest.raises(Exception, match="no GEMV candidate for 'none-fit'"):
        tuner.choose("none-fit", 1, weight, run, (too_big,))
