"""The CPU's projections of 2 or more float32 rows on oneDNN's prepacked weights
(devices/cpu/onednn.py): the same results as ``F.linear``, the weights they were packed
from (repacked after a change), a memory budget, and the embedded pair's verify on them."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from helpers import cpu_engine, load_bench

from graphrt.core import pretrained
from graphrt.core.engine import SamplingParams
from graphrt.core.models import load_model
from graphrt.devices import cpu as cpu_device
from graphrt.devices.cpu import CpuDevice
from graphrt.devices.cpu.onednn import MIN_ROWS, PackedWeights, onednn_available
from graphrt.spec import MTPDecoding, SpecConfig

pytestmark = pytest.mark.skipif(not onednn_available(), reason="torch built without oneDNN")

BUDGET = 1 << 30


def _packed_weights(ops) -> PackedWeights:
    """The PackedWeights behind a CPU ops table (its linear's matmul)."""
    return ops.linear.keywords["matmul"].__self__


@pytest.mark.parametrize("bias", [False, True])
def test_every_width_matches_F_linear_and_only_one_row_stays_on_mkl(bias):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(384, 256, generator=gen) / 16
    b = torch.randn(384, generator=gen) if bias else None
    x = torch.randn(300, 256, generator=gen)
    packed = PackedWeights(lambda: BUDGET)
    torch.testing.assert_close(packed.linear(x[:1], weight, b), F.linear(x[:1], weight, b))
    assert packed.packs == 0
    for rows in [*range(MIN_ROWS, 21), 64, 300]:
        got = packed.linear(x[:rows], weight, b)
        torch.testing.assert_close(got, F.linear(x[:rows], weight, b), rtol=1e-5, atol=1e-5)
    # A column slice (rows strided past K) is the same input.
    wide = torch.randn(3, 512, generator=gen)[:, :256]
    torch.testing.assert_close(packed.linear(wide, weight, b), F.linear(wide, weight, b))
    assert packed.packs == 1 and packed.packed_bytes == weight.numel() * 4


def test_a_weight_changed_in_place_or_swapped_is_packed_again():
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(64, 32, generator=gen)
    x = torch.randn(3, 32, generator=gen)
    packed = PackedWeights(lambda: BUDGET)
    packed.linear(x, weight)
    weight.mul_(2)  # its version counter moves
    torch.testing.assert_close(packed.linear(x, weight), F.linear(x, weight))
    param = torch.nn.Parameter(torch.randn(64, 32, generator=gen), requires_grad=False)
    packed.linear(x, param)
    param.data = torch.randn(64, 32, generator=gen)  # new storage, same object
    torch.testing.assert_close(packed.linear(x, param), F.linear(x, param))
    assert packed.packs == 4 and packed.packed_bytes == 2 * 64 * 32 * 4


def test_the_budget_caps_the_packed_copies():
    gen = torch.Generator().manual_seed(2)
    first, second = torch.randn(64, 32, generator=gen), torch.randn(64, 32, generator=gen)
    x = torch.randn(4, 32, generator=gen)
    packed = PackedWeights(lambda: first.numel() * 4)  # room for one
    for weight in (first, second, second):
        torch.testing.assert_close(packed.linear(x, weight), F.linear(x, weight))
    assert packed.packs == 1 and packed.packed_bytes == first.numel() * 4


def test_a_call_recording_a_backward_keeps_F_linear():
    x = torch.randn(3, 8)
    packed = PackedWeights(lambda: BUDGET)
    weight = torch.randn(16, 8, requires_grad=True)
    packed.linear(x, weight).sum().backward()
    torch.testing.assert_close(weight.grad, x.sum(0).expand(16, 8))
    bias = torch.zeros(16, requires_grad=True)  # the weight needs none
    packed.linear(x, weight.detach(), bias).sum().backward()
    torch.testing.assert_close(bias.grad, torch.full((16,), 3.0))
    assert packed.packs == 0


def test_what_onednn_would_read_wrong_keeps_F_linear():
    """A bias that is not one dense row, another dtype, a traced call: F.linear's."""
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(16, 8, generator=gen)
    x = torch.randn(3, 8, generator=gen)
    packed = PackedWeights(lambda: BUDGET)
    for bias in (torch.randn(32, generator=gen)[::2], torch.randn(1, 16, generator=gen)):
        torch.testing.assert_close(packed.linear(x, weight, bias), F.linear(x, weight, bias))
    half = (x.bfloat16(), weight.bfloat16())
    torch.testing.assert_close(packed.linear(*half), F.linear(*half))
    assert packed.packs == 0
    # Under torch.compile the call is traced as F.linear: one graph (fullgraph), no packing.
    traced = torch.compile(packed.linear, backend="eager", fullgraph=True)
    torch.testing.assert_close(traced(x, weight), F.linear(x, weight))
    assert packed.packs == 0


def test_the_cpu_device_budgets_an_eighth_of_the_memory_free_at_the_first_packing(
    monkeypatch,
):
    gen = torch.Generator().manual_seed(4)
    first, second = torch.randn(64, 32, generator=gen), torch.randn(64, 32, generator=gen)
    x = torch.randn(4, 32, generator=gen)
    free = {"bytes": 0}
    monkeypatch.setattr(CpuDevice, "free_memory_bytes", lambda self: free["bytes"])
    ops = CpuDevice().model_ops()
    assert ops.name == "torch-onednn"
    free["bytes"] = int(first.numel() * 4 / cpu_device.PACKED_SHARE)  # read at the packing
    for weight in (first, second):
        torch.testing.assert_close(ops.linear(x, weight, None), F.linear(x, weight))
    packed = _packed_weights(ops)
    assert packed.budget_bytes == first.numel() * 4 and packed.packs == 1
    monkeypatch.setattr(CpuDevice, "free_memory_bytes", lambda self: None)
    unknown = _packed_weights(CpuDevice().model_ops())
    unknown.linear(x, first)
    assert unknown.budget_bytes == cpu_device.PACKED_FALLBACK_BYTES and unknown.packs == 1


def test_the_pair_verifies_on_packed_weights_with_plain_output():
    """The CPU device's ops pack the embedded target's weights at its first verify (rounds
    of 3 rows), and drafting keeps plain decoding's greedy tokens."""
    cpu = CpuDevice()
    target = load_model(str(pretrained.TARGET_DIR), cpu, torch.float32)
    drafter = load_model(str(pretrained.ASSISTANT_DIR), cpu, torch.float32)
    assert target.model.ops.name == "torch-onednn"
    packed = _packed_weights(target.model.ops)
    prompt = [2]  # a one-row prefill: MKL's, as the one-row decode steps
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    plain = cpu_engine(target).generate([prompt], params)[0].output_ids
    assert packed.packs == 0  # one-row decode steps
    spec = cpu_engine(target, MTPDecoding(drafter, SpecConfig(2))).generate([prompt], params)
    assert spec[0].output_ids == plain
    assert packed.packs > 0 and packed.packed_bytes <= packed.budget_bytes


def test_the_rows_bench_times_every_shape(capsys, tmp_path):
    bench = load_bench("cpu_matmul_rows")
    bench.main(["--calls", "2", "--out", str(tmp_path / "rows.json")])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 4")]
    assert len(rows) == 1 and rows[0].count(" / ") == len(bench.ROWS), rows
    written = json.loads((tmp_path / "rows.json").read_text())["results"]
    assert [(r["n"], r["k"]) for r in written] == bench.SHAPES
