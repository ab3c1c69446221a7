"""The tensor-parallel group: which shard of the model this process holds, and the
collectives that join the shards, over torch.distributed with the device's own
collective library (``Device.collective_backend``: nccl, hccl, xccl, gloo).

Ranks run one schedule (SPMD): every rank steps the same batches, so the collectives
line up and every rank samples the same tokens. ``TPGroup.single()`` is the group of
one, whose collectives return their input: a model built for it is today's model.

HAZARD: a rank that dies mid-collective leaves the others waiting in it. The process
group is created with a timeout so that they fail (one line, via the CLI) instead of
hanging; keep every collective on this group.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives  # noqa: F401 (registers _c10d_functional)

from graphrt.core.errors import UsageError

_C10D = torch.ops._c10d_functional
DEFAULT_TIMEOUT_S = 120.0  # long enough for a first capture, short enough not to hang


@dataclass(frozen=True)
class TPGroup:
    rank: int
    size: int
    group: Any = None  # the torch.distributed ProcessGroup; None for the group of one

    @classmethod
    def single(cls) -> TPGroup:
        return cls(rank=0, size=1)

    @property
    def is_single(self) -> bool:
        return self.size == 1

    def shard(self, full: int, what: str) -> int:
        """This rank's part of ``full`` (heads, columns, vocabulary rows), which must split
        evenly: uneven shards would need padding the checkpoint does not have."""
        if full % self.size:
            raise UsageError(f"{what} ({full}) does not split evenly over {self.size} ranks")
        return full // self.size

    # The functional collective ops (torch.ops._c10d_functional), called raw: ops of the
    # dispatcher, so graph capture records them (CUDA graphs capture the NCCL kernels,
    # the tests' stand-in records the op) and torch.compile traces them. Not
    # ``dist.all_reduce`` (it calls the process group from Python, invisible to both: a
    # graph would replay without it) nor funcol's wrappers (their AsyncCollectiveTensor
    # subclass has no storage a recorder can address).

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` summed over the ranks (the row-parallel matmul's partial sums)."""
        if self.is_single:
            return x
        out = _C10D.all_reduce(x.contiguous(), "sum", self.group.group_name)
        return _C10D.wait_tensor(out)

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """(..., n) on every rank -> (..., size * n), rank 0's columns first (the
        vocabulary-parallel LM head's logits)."""
        if self.is_single:
            return x
        # Gathered along a new leading dim: (size * rows, n) -> (rows, size * n)
        rows = x.reshape(-1, x.shape[-1])
        out = _C10D.all_gather_into_tensor(rows.contiguous(), self.size, self.group.group_name)
        out = _C10D.wait_tensor(out).view(self.size, *rows.shape)  # (size, rows, n)
        return out.permute(1, 0, 2).reshape(*x.shape[:-1], self.size * x.shape[-1])


SINGLE = TPGroup.single()  # the group of one: plain layers, no collectives


def init_tp(backend: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> TPGroup:
    """The group of every process of this job, from torchrun's environment (``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``; graphrt's own launcher sets the
    same). Without them: the group of one."""
    if "WORLD_SIZE" not in os.environ or int(os.environ["WORLD_SIZE"]) == 1:
        return TPGroup.single()
    missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise UsageError(
            f"WORLD_SIZE is set but {', '.join(missing)} is not (launch with torchrun)"
        )
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return TPGroup(rank=dist.get_rank(), size=dist.get_world_size(), group=dist.group.WORLD)
