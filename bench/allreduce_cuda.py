"""Small-message all-reduce on CUDA: NCCL (the raw _c10d_functional op graphrt's TPGroup
issues) against torch's symmetric-memory one-shot all-reduce, both replayed from CUDA
graphs as decode steps replay them (issue 11: at batch 1 a Llama-8B step all-reduces
65 messages of 8 KB).

    torchrun --nproc-per-node 2 bench/allreduce_cuda.py [--hidden 4096] [--rows 1,8,64]
        [--out allreduce.json]

Per message size: microseconds per all-reduce (median of replays of a graph of
``--calls`` back-to-back all-reduces) and whether both give the same sums. NVLink
multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 on these
machines): the one-shot kernel reads its peers' buffers directly, no multimem.
HAZARD: symmetric memory is allocated and rendezvoused eagerly, and every op runs once
eagerly before capture (the communicator and the signal pads must exist first).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives  # noqa: F401 (registers _c10d_functional)
import torch.distributed._symmetric_memory as symm_mem

C10D = torch.ops._c10d_functional


def nccl_all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return C10D.wait_tensor(C10D.all_reduce(x, "sum", group_name))


def graph_us(fn, calls: int, replays: int) -> float:
    """Median microseconds per call of ``fn`` replayed from a graph of ``calls`` calls."""
    fn()  # eager first: communicators, signal pads
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--rows", default="1,8,64")
    ap.add_argument("--calls", type=int, default=65)
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", device_id=device)
    group = dist.group.WORLD.group_name
    results = []
    for rows in map(int, args.rows.split(",")):
        x = torch.randn(rows, args.hidden, device=device, dtype=torch.bfloat16)
        buf = symm_mem.empty(rows, args.hidden, device=device, dtype=torch.bfloat16)
        symm_mem.rendezvous(buf, dist.group.WORLD)
        buf.copy_(x)
        same = torch.equal(
            nccl_all_reduce(x.clone(), group),
            torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", group),
        )
        row = {
            "rows": rows,
            "bytes": x.numel() * x.element_size(),
            "nccl_us": graph_us(lambda x=x: nccl_all_reduce(x, group), args.calls, args.replays),
            "symm_mem_one_shot_us": graph_us(
                lambda buf=buf: torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", group),
                args.calls,
                args.replays,
            ),
            "same_sums": same,
        }
        results.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
    if rank == 0 and args.out:
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                "world_size": dist.get_world_size(), "nccl": ".".join(map(str, torch.cuda.nccl.version()))}  # fmt: skip
        with open(args.out, "w") as f:
            json.dump({**meta, "results": results}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
