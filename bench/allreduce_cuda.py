"""Small-message all-reduce on CUDA, each replayed from CUDA graphs as decode steps
replay them (issue 11: at batch 1 a Llama-8B step all-reduces 65 messages of 8 KB):
- nccl: the raw _c10d_functional op graphrt's TPGroup issues by default;
- one_shot: graphrt's SymmMemAllReduce (devices/cuda/collectives.py), torch's
  symmetric-memory one_shot_all_reduce_copy (copy in, one kernel);
- two_shot: torch's two_shot_all_reduce_ after a copy into the symmetric buffer.

    torchrun --nproc-per-node 2 bench/allreduce_cuda.py [--hidden 4096]
        [--rows 1,8,64,256,1024] [--out allreduce.json]

Per message size: microseconds per all-reduce (median of replays of a graph of
``--calls`` back-to-back all-reduces) and whether the sums equal NCCL's. NVLink
multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 on these
machines): the symmetric-memory kernels read their peers' buffers directly, no multimem.
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

from graphrt.devices.cuda.collectives import SymmMemAllReduce

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
    ap.add_argument("--rows", default="1,8,64,256,1024")
    ap.add_argument("--calls", type=int, default=65)
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", device_id=device)
    group = dist.group.WORLD.group_name
    rows_list = [int(r) for r in args.rows.split(",")]
    max_bytes = max(rows_list) * args.hidden * 2
    one_shot = SymmMemAllReduce(dist.group.WORLD, device, max_bytes)
    results = []
    for rows in rows_list:
        x = torch.randn(rows, args.hidden, device=device, dtype=torch.bfloat16)
        staging = one_shot.buffer[: x.numel() * 2].view(torch.bfloat16).view(x.shape)

        def two_shot(x=x, staging=staging):
            staging.copy_(x)
            return torch.ops.symm_mem.two_shot_all_reduce_(staging, "sum", group)

        nccl = nccl_all_reduce(x.clone(), group)
        row = {"rows": rows, "bytes": x.numel() * x.element_size()}
        row["one_shot_same_sums"] = torch.equal(one_shot(x), nccl)
        row["two_shot_same_sums"] = torch.equal(two_shot().clone(), nccl)
        for name, fn in (("nccl", lambda x=x: nccl_all_reduce(x, group)),
                         ("one_shot", lambda x=x: one_shot(x)), ("two_shot", two_shot)):  # fmt: skip
            row[f"{name}_us"] = graph_us(fn, args.calls, args.replays)
        results.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
    if rank == 0 and args.out:
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                "world_size": dist.get_world_size(), "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                "calls_per_graph": args.calls, "replays": args.replays}  # fmt: skip
        with open(args.out, "w") as f:
            json.dump({**meta, "results": results}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
