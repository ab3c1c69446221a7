"""Tensor-parallel layers over gloo, 2 processes on the CPU: the split layers give the
whole layers' outputs (a column-parallel then row-parallel MLP, the vocabulary-parallel
embedding and LM head over an odd vocabulary, padded to a row a rank more), and the
group of one is the plain layers, collective-free."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from helpers import join_gloo

from graphrt.core.errors import UsageError
from graphrt.core.models.layers import Linear
from graphrt.core.parallel import TPGroup, init_tp
from graphrt.core.parallel.launch import free_port, leave_job
from graphrt.core.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelHead,
    take_shard,
)

HIDDEN, INTERMEDIATE, VOCAB, ROWS = 16, 24, 11, 5  # 11: rank 1 pads a row


def _load(module: torch.nn.Module, full: dict[str, torch.Tensor]) -> None:
    """As the loader will: every parameter takes its shard of the full tensor."""
    with torch.no_grad():
        for name, param in module.named_parameters():
            param.copy_(take_shard(full[name], param))


def _full_weights() -> dict[str, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)  # the same on every rank

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    return {
        "up": {"weight": rand(INTERMEDIATE, HIDDEN), "bias": rand(INTERMEDIATE)},
        "down": {"weight": rand(HIDDEN, INTERMEDIATE), "bias": rand(HIDDEN)},
        "embed": {"weight": rand(VOCAB, HIDDEN)},
        "head": {"weight": rand(VOCAB, HIDDEN)},
        "x": {"x": rand(ROWS, HIDDEN), "residual": rand(ROWS, HIDDEN)},
        "ids": {"ids": torch.tensor([0, 4, 5, 10, 2])},  # 10: the last id, beside the padding
    }


def _outputs(tp: TPGroup) -> dict[str, torch.Tensor]:
    """The layers built for ``tp``, loaded from the same full weights, run on one input."""
    w = _full_weights()
    up = ColumnParallelLinear(HIDDEN, INTERMEDIATE, True, tp)
    down = RowParallelLinear(INTERMEDIATE, HIDDEN, True, tp)
    embed = VocabParallelEmbedding(VOCAB, HIDDEN, tp)
    head = VocabParallelHead(HIDDEN, VOCAB, tp)
    for module, name in ((up, "up"), (down, "down"), (embed, "embed"), (head, "head")):
        _load(module, w[name])
    x, residual = w["x"]["x"], w["x"]["residual"]
    with torch.no_grad():
        return {
            "mlp": down(torch.relu(up(x)), residual=residual.clone()),
            "embed": embed(w["ids"]["ids"]),
            "logits": head(x),
        }


def _reference() -> dict[str, torch.Tensor]:
    """The same computation with whole, plain layers."""
    w = _full_weights()
    x, residual = w["x"]["x"], w["x"]["residual"]
    up, down = Linear(HIDDEN, INTERMEDIATE, True), Linear(INTERMEDIATE, HIDDEN, True)
    _load(up, w["up"])
    _load(down, w["down"])
    with torch.no_grad():
        return {
            "mlp": down(torch.relu(up(x))) + residual,
            "embed": w["embed"]["weight"][w["ids"]["ids"]],
            "logits": x @ w["head"]["weight"].T,
        }


def _rank_main(rank: int, world: int, port: int, out_dir: str) -> None:
    tp = join_gloo(rank, world, port)
    assert (tp.rank, tp.size) == (rank, world)
    torch.save(_outputs(tp), Path(out_dir) / f"rank{rank}.pt")
    del tp  # leave_job frees the group while the interpreter is whole, as a product rank
    leave_job(0)


@pytest.mark.skipif(sys.platform == "win32", reason="gloo over TCP on one host")
def test_two_ranks_over_gloo_give_the_whole_layers_outputs(tmp_path):
    mp.start_processes(
        _rank_main, args=(2, free_port(), str(tmp_path)), nprocs=2, start_method="spawn"
    )
    expected = _reference()
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for name, value in expected.items():
            torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-5, msg=name)


def test_the_group_of_one_is_the_plain_layers():
    got, expected = _outputs(TPGroup.single()), _reference()
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=name)


def test_a_padded_vocabulary_shard_ends_in_zero_rows():
    full = torch.arange(11 * 2, dtype=torch.float32).view(11, 2)
    embed = VocabParallelEmbedding(11, 2, TPGroup(rank=1, size=2))
    assert embed.weight.shape == (6, 2)
    assert torch.equal(take_shard(full, embed.weight), torch.cat([full[6:], torch.zeros(1, 2)]))
    with pytest.raises(ValueError, match="dimension 0 is 12, expected 11"):
        take_shard(torch.zeros(12, 2), embed.weight)


def test_uneven_splits_are_refused_in_one_line():
    with pytest.raises(UsageError, match=r"output features \(10\) does not split evenly over 4"):
        ColumnParallelLinear(HIDDEN, 10, False, TPGroup(rank=0, size=4))


def test_init_without_a_launcher_is_the_group_of_one(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert init_tp("gloo") == TPGroup.single()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(UsageError, match="MASTER_PORT"):
        init_tp("gloo")


@pytest.mark.parametrize(
    ("kv_heads", "size", "expected"),
    [
        (8, 2, [(0, 4), (4, 4)]),  # split evenly
        (2, 4, [(0, 1), (0, 1), (1, 1), (1, 1)]),  # replicated on 2 consecutive ranks each
        (1, 4, [(0, 1)] * 4),  # one KV head (Gemma 4 E2B): every rank holds it
    ],
)
def test_kv_heads_split_or_replicate_over_the_ranks(kv_heads, size, expected):
    got = [TPGroup(rank=r, size=size).kv_heads(kv_heads) for r in range(size)]
    assert [(s.start, s.size) for s in got] == expected
    assert all(s.full == kv_heads for s in got)


@pytest.mark.parametrize(("kv_heads", "size"), [(3, 2), (2, 3), (6, 4)])
def test_kv_heads_that_neither_split_nor_divide_are_refused(kv_heads, size):
    with pytest.raises(UsageError, match="num_key_value_heads"):
        TPGroup(rank=0, size=size).kv_heads(kv_heads)


def test_ranks_agree_over_the_host_group_on_a_host_tensor(monkeypatch):
    """Auto draft lengths are agreed on every step, behind a step launched ahead: a device
    collective would queue behind that step and its read would wait for it."""
    import torch.distributed as dist

    seen = []

    def all_reduce(x, group=None):
        seen.append((x.device.type, group))
        x.add_(7)  # rank 1's share: 0 + what the other ranks add

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    host, device_group = object(), object()
    tp = TPGroup(rank=0, size=2, group=device_group, host_group=host)
    assert tp.agree(5) == 12
    assert seen == [("cpu", host)]
    assert TPGroup(rank=1, size=2, group=device_group, host_group=host).agree(5) == 7
    assert TPGroup.single().agree(5) == 5 and len(seen) == 2
