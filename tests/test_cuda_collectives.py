"""The small all-reduce of tensor-parallel decode steps (``Device.small_all_reduce``):
the TP group sends a message to it only when it fits; on NVIDIA GPUs torch's
symmetric-memory one-shot all-reduce records into CUDA graphs and gives NCCL's sums
(one GPU: a group of one; two GPUs: against NCCL, both replayed from graphs)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from graphrt.core.errors import UsageError
from graphrt.core.parallel import TPGroup
from graphrt.core.parallel.launch import free_port

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


class _Doubling:
    """A stand-in small all-reduce: two ranks holding the same message."""

    def __init__(self, max_numel: int):
        self.max_numel = max_numel
        self.calls = 0

    def fits(self, x: torch.Tensor) -> bool:
        return x.numel() <= self.max_numel

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return 2 * x


def test_the_group_sends_a_message_to_the_small_all_reduce_only_when_it_fits():
    small = _Doubling(max_numel=8)
    tp = TPGroup(rank=0, size=2, group=None, small_all_reduce=small)
    x = torch.arange(8.0)
    assert torch.equal(tp.all_reduce(x), 2 * x) and small.calls == 1
    with pytest.raises(AttributeError):  # too big: the library's op, on the (absent) group
        tp.all_reduce(torch.arange(9.0))
    assert small.calls == 1
    assert TPGroup(rank=0, size=1, small_all_reduce=small).all_reduce(x) is x  # group of one


def test_graphrt_all_reduce_names_one_of_its_choices(monkeypatch):
    from graphrt.devices.cuda.collectives import choice

    monkeypatch.delenv("GRAPHRT_ALL_REDUCE", raising=False)
    assert choice() == "nccl"
    monkeypatch.setenv("GRAPHRT_ALL_REDUCE", " AUTO ")
    assert choice() == "auto"
    monkeypatch.setenv("GRAPHRT_ALL_REDUCE", "fast")
    with pytest.raises(UsageError, match="GRAPHRT_ALL_REDUCE='fast': expected one of nccl, auto, symm_mem"):  # fmt: skip
        choice()


def _join_nccl(rank: int, size: int, port: int) -> torch.device:
    import os

    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_WORLD_SIZE=str(size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")  # fmt: skip
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", device_id=device)
    return device


def _in_graph(fn, *args) -> torch.Tensor:
    """``fn(*args)`` captured once in a CUDA graph and replayed (after an eager call:
    communicators and signal pads exist before capture)."""
    fn(*args)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*args)
    graph.replay()
    torch.cuda.synchronize()
    return out


def _sums_main(rank: int, size: int, port: int, out_dir: str) -> None:
    """One rank: one-shot and NCCL sums of the same messages, both from graphs."""
    import torch.distributed as dist

    from graphrt.devices.cuda.collectives import SymmMemAllReduce, small_all_reduce

    device = _join_nccl(rank, size, port)
    reducer = small_all_reduce(dist.group.WORLD, device, max_bytes=1 << 20)
    assert isinstance(reducer, SymmMemAllReduce)
    library = TPGroup(rank=rank, size=size, group=dist.group.WORLD)
    results = []
    for dtype in (torch.bfloat16, torch.float32):
        for rows in (1, 8, 64):
            gen = torch.Generator(device=device).manual_seed(100 * rank + rows)
            x = torch.randn(rows, 4096, device=device, dtype=dtype, generator=gen)
            assert reducer.fits(x) == (rows * 4096 * x.element_size() <= 1 << 20)
            if not reducer.fits(x):
                continue
            one_shot = _in_graph(reducer, x)
            nccl = _in_graph(library.all_reduce, x)
            results.append((str(dtype), rows, torch.equal(one_shot, nccl)))
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


def _one_rank_main(rank: int, size: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    from graphrt.devices.cuda.collectives import small_all_reduce

    device = _join_nccl(rank, size, port)
    reducer = small_all_reduce(dist.group.WORLD, device, max_bytes=64 * 4096 * 2)
    checks = []
    for rows in (1, 64):
        x = torch.randn(rows, 4096, device=device, dtype=torch.bfloat16)
        checks.append(torch.equal(_in_graph(reducer, x), x))
    checks.append(reducer.fits(torch.ones(8, device=device)))  # 32 bytes, float32
    checks.append(reducer.fits(torch.ones(65, 4096, device=device, dtype=torch.bfloat16)))
    checks.append(reducer.fits(torch.ones(8, device=device, dtype=torch.float16)))
    torch.save(checks, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.cuda
@needs_cuda
def test_one_shot_all_reduce_of_a_group_of_one_records_into_a_graph(tmp_path, monkeypatch):
    """On one GPU: set up, fits, and capture work (the sum over one rank is the input)."""
    monkeypatch.setenv("GRAPHRT_ALL_REDUCE", "symm_mem")
    args = (1, free_port(), str(tmp_path))
    mp.start_processes(_one_rank_main, args=args, nprocs=1, start_method="spawn")
    assert torch.load(tmp_path / "rank0.pt") == [True, True, True, False, False]


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two NVIDIA GPUs")
def test_one_shot_all_reduce_gives_nccls_sums_in_graphs(tmp_path, monkeypatch):
    # Two operands sum the same in any order, so the two paths agree bit for bit.
    monkeypatch.setenv("GRAPHRT_ALL_REDUCE", "symm_mem")
    mp.start_processes(_sums_main, args=(2, free_port(), str(tmp_path)), nprocs=2,
                       start_method="spawn")  # fmt: skip
    for rank in range(2):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        assert len(results) == 6 and all(same for *_, same in results), results


class _ShortOfMemory:
    """A stand-in SymmMemAllReduce whose allocation fails on rank 1; its rendezvous is a
    collective (a barrier), as the real one is."""

    def __init__(self, group, device, max_bytes):
        import torch.distributed as dist

        if dist.get_rank(group) == 1:
            raise RuntimeError("symmetric memory: out of memory")

    def rendezvous(self) -> None:
        import torch.distributed as dist

        dist.barrier()


def _one_rank_short_main(rank: int, size: int, port: int, out_dir: str) -> None:
    import datetime
    import os

    import torch.distributed as dist

    from graphrt.devices.cuda import collectives

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_WORLD_SIZE=str(size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    torch.set_num_threads(1)
    # A rank left waiting in a collective its peer skipped fails here instead of hanging.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
    collectives.SymmMemAllReduce = _ShortOfMemory
    reducer = collectives.small_all_reduce(dist.group.WORLD, torch.device("cpu"))
    torch.save(reducer is None, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


def test_a_rank_that_cannot_allocate_makes_every_rank_fall_back_without_a_hang(
    tmp_path, monkeypatch, capfd
):
    """``auto``: rank 1 cannot allocate its symmetric buffer; rank 0 could. Both must
    agree before the (collective) rendezvous, so neither waits in it for the other, and
    both take NCCL (here gloo)."""
    monkeypatch.setenv("GRAPHRT_ALL_REDUCE", "auto")
    mp.start_processes(_one_rank_short_main, args=(2, free_port(), str(tmp_path)), nprocs=2,
                       start_method="spawn")  # fmt: skip
    assert [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)] == [True, True]
    assert "unavailable: symmetric memory: out of memory" in capfd.readouterr().err
