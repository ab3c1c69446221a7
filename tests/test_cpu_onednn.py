"""The CPU's projections of 2 to 16 float32 rows on oneDNN's prepacked weights
(devices/cpu/onednn.py): the same results as ``F.linear``, the weights they were packed
from (repacked after a change), a memory budget, and the embedded pair's verify on them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import cpu_engine, load_bench

from graphrt.core import pretrained
from graphrt.core.engine import SamplingParams
from graphrt.core.models import load_model
from graphrt.devices.cpu import CpuDevice
from graphrt.devices.cpu.onednn import MAX_ROWS, MIN_ROWS, PackedWeights, onednn_available
from graphrt.spec import MTPDecoding, SpecConfig

pytestmark = pytest.mark.skipif(not onednn_available(), reason="torch built without oneDNN")

BUDGET = 1 << 30


def _packed_weights(ops) -> PackedWeights:
    """The PackedWeights behind a CPU ops table (its linear's matmul)."""
    return ops.linear.keywords["matmul"].__self__


@pytest.mark.parametrize("bias", [False, True])
def test_every_width_matches_F_linear_and_only_2_to_16_rows_pack(bias):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(384, 256, generator=gen) / 16
    b = torch.randn(384, generator=gen) if bias else None
    x = torch.randn(20, 256, generator=gen)
    packed = PackedWeights(BUDGET)
    for rows in (1, MAX_ROWS + 1, 20):  # MKL's: nothing packed
        torch.testing.assert_close(
            packed.linear(x[:rows], weight, b), F.linear(x[:rows], weight, b)
        )
    assert packed.packs == 0
    for rows in range(MIN_ROWS, MAX_ROWS + 1):
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
    packed = PackedWeights(BUDGET)
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
    packed = PackedWeights(first.numel() * 4)  # room for one
    for weight in (first, second, second):
        torch.testing.assert_close(packed.linear(x, weight), F.linear(x, weight))
    assert packed.packs == 1 and packed.packed_bytes == first.numel() * 4


def test_a_call_recording_a_backward_keeps_F_linear():
    weight = torch.randn(16, 8, requires_grad=True)
    x = torch.randn(3, 8)
    packed = PackedWeights(BUDGET)
    packed.linear(x, weight).sum().backward()
    assert packed.packs == 0
    torch.testing.assert_close(weight.grad, x.sum(0).expand(16, 8))


def test_the_pair_verifies_on_packed_weights_with_plain_output():
    """The CPU device's ops pack the embedded target's weights at its first verify (rounds
    of 3 rows), and drafting keeps plain decoding's greedy tokens."""
    cpu = CpuDevice()
    target = load_model(str(pretrained.TARGET_DIR), cpu, torch.float32)
    drafter = load_model(str(pretrained.ASSISTANT_DIR), cpu, torch.float32)
    assert target.model.ops.name == "torch-onednn"
    packed = _packed_weights(target.model.ops)
    prompt = list(range(2, 2 + MAX_ROWS + 4))  # a prefill past MAX_ROWS: MKL's
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    plain = cpu_engine(target).generate([prompt], params)[0].output_ids
    assert packed.packs == 0  # one-row decode steps
    spec = cpu_engine(target, MTPDecoding(drafter, SpecConfig(2))).generate([prompt], params)
    assert spec[0].output_ids == plain
    assert packed.packs > 0 and packed.packed_bytes <= packed.budget_bytes


def test_the_rows_bench_times_every_shape(capsys, monkeypatch):
    bench = load_bench("cpu_matmul_rows")
    monkeypatch.setattr("sys.argv", ["cpu_matmul_rows.py", "2"])
    bench.main()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 4")]
    assert len(rows) == 1 and rows[0].count(" / ") == len(bench.ROWS), rows
