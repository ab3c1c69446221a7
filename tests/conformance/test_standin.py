"""The stand-in device module behaves like a device graph: replay re-runs recorded ops
into the captured addresses, and never the Python that recorded them."""

from __future__ import annotations

import pytest
import torch
from standin import CaptureError, StandInGraphModule
from torch import nn


class CountingModule(nn.Module):
    """A forward with a Python side effect that a graph replay must not repeat."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = torch.relu(self.linear(x))
        return h * 2 + x.sum(-1, keepdim=True)


def _capture(module, fn):
    graph = module.CUDAGraph()
    with module.graph(graph, pool=module.graph_pool_handle(), stream=module.Stream()):
        out = fn()
    return graph, out


@pytest.mark.parametrize("inference", [True, False])
def test_replay_reruns_recorded_ops_not_python(inference):
    torch.manual_seed(0)
    module, net = StandInGraphModule(), CountingModule()
    static_in = torch.zeros(2, 4)
    mode = torch.inference_mode if inference else torch.no_grad
    with mode():
        graph, static_out = _capture(module, lambda: net(static_in))
        assert net.calls == 1
        for seed in range(3):
            x = torch.randn(2, 4, generator=torch.Generator().manual_seed(seed))
            static_in.copy_(x)
            graph.replay()
            assert net.calls == 1  # no Python re-run: only the recorded ops
            expected = net(x)
            net.calls -= 1
            assert torch.equal(static_out, expected)  # written into the captured output
    assert graph.replays == 3


def test_chained_and_in_place_ops_see_replay_values():
    module = StandInGraphModule()
    a, cache = torch.zeros(3), torch.zeros(5)
    slots = torch.tensor([1, 3, 4])
    with torch.inference_mode():

        def step():
            b = a * 2  # fresh output, copied back on replay
            c = b.view(3, 1).squeeze(1)  # a view: aliases b, never copied
            cache[slots] = c + 1  # in-place write into a static buffer
            return c.sum()

        graph, total = _capture(module, step)
        a.copy_(torch.tensor([1.0, 2.0, 3.0]))
        slots.copy_(torch.tensor([0, 1, 2]))
        cache.zero_()
        graph.replay()
    assert torch.equal(cache, torch.tensor([3.0, 5.0, 7.0, 0.0, 0.0]))
    assert total.item() == 12.0


def test_capture_refuses_what_a_device_refuses():
    module = StandInGraphModule()
    x = torch.ones(2)
    graph = module.CUDAGraph()
    with pytest.raises(CaptureError, match="non-default stream"):
        graph.capture_begin()  # on the default stream
    with pytest.raises(CaptureError, match="syncs with the host"):
        _capture(module, lambda: (x * 2).sum().item())
    assert module.capturing == 0  # the failed capture was closed by graph()'s exit


def test_npu_update_needs_auto_dispatch_capture_and_is_recorded():
    module = StandInGraphModule()
    x = torch.ones(2)
    plain, _ = _capture(module, lambda: x + 1)
    with pytest.raises(CaptureError, match="auto_dispatch_capture"):
        plain.update(cpu_update_input=[{}])
    graph = module.NPUGraph()
    with module.graph(graph, stream=module.Stream(), auto_dispatch_capture=True):
        x + 1
    assert module.graph_contexts[-1]["auto_dispatch_capture"] is True
    graph.update(cpu_update_input=[{"actual_seq_lengths_kv": [3]}])
    graph.replay()
    assert graph.calls[-2:] == [
        ("update", [{"actual_seq_lengths_kv": [3]}]),
        ("replay", None),
    ]


def test_reset_graph_cannot_replay():
    module = StandInGraphModule()
    graph, _ = _capture(module, lambda: torch.ones(2) + 1)
    graph.reset()
    with pytest.raises(CaptureError):
        graph.replay()
