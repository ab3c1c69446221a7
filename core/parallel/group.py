"""The tensor-parallel group: which shard of the model this process holds, and the
collectives that join the shards, over torch.distributed with the device's own
collective library (``Device.collective_backend``: nccl, hccl, xccl, gloo).

Ranks run one schedule (SPMD): every rank steps the same batches, so the collectives
line up and every rank samples the same tokens. ``TPGroup.single()`` is the group of
one, whose collectives return their input: a model built for it is today's model.

HAZARD: a rank that dies mid-collective leaves the others waiting in it. The process
group is created with a timeout so that they fail (one line, via the CLI) instead of
hanging; keep every collective on this group (or on ``TPGroup.host_group``, its ranks over
gloo with the same timeout, for host values).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives  # noqa: F401 (registers _c10d_functional)

from graphrt.core.errors import UsageError

_C10D = torch.ops._c10d_functional
DEFAULT_TIMEOUT_S = 120.0  # long enough for a first capture, short enough not to hang


@dataclass(frozen=True)
class RowSlice:
    """Rows [start, start + size) of a checkpoint tensor of ``full`` rows: the part one
    rank holds (all of it for the group of one)."""

    start: int
    size: int
    full: int

    def scaled(self, k: int) -> RowSlice:
        """The same slice in units ``k`` times smaller (heads -> rows of head_dim each)."""
        return RowSlice(self.start * k, self.size * k, self.full * k)


class SmallAllReduce(Protocol):
    """A device's own all-reduce for the small messages of decode steps, where it beats
    the collective library's (``Device.small_all_reduce``). It must record into the
    device's graphs like the library's ops, and give every rank the same ``fits``."""

    def fits(self, x: torch.Tensor) -> bool: ...

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class TPGroup:
    rank: int
    size: int
    group: Any = None  # the torch.distributed ProcessGroup; None for the group of one
    small_all_reduce: SmallAllReduce | None = None  # for the messages it fits; else the library
    # The same ranks over gloo, for host values (``agree``): a device collective would queue
    # behind the step in flight, and reading it would wait for that step.
    host_group: Any = None

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

    def vocab_rows(self, vocab_size: int) -> int:
        """This rank's rows of a vocabulary, padded up to a multiple of the rank count (the
        padding rows are zeros, their logits dropped: parallel.layers)."""
        return -(-vocab_size // self.size)

    def split(self, full: int, what: str) -> RowSlice:
        """This rank's slice of ``full`` rows split evenly over the ranks."""
        size = self.shard(full, what)
        return RowSlice(self.rank * size, size, full)

    def kv_heads(self, num_kv_heads: int) -> RowSlice:
        """The KV heads this rank holds, in heads. With at least as many KV heads as ranks
        they split evenly; with fewer (Gemma 4 E2B has one) each is replicated on
        ``size / num_kv_heads`` consecutive ranks, the ranks whose query heads read it
        (query heads split evenly, so rank r's queries share KV head r // replicas)."""
        if num_kv_heads >= self.size:
            return self.split(num_kv_heads, "num_key_value_heads")
        if self.size % num_kv_heads:
            raise UsageError(
                f"num_key_value_heads ({num_kv_heads}) neither splits over nor divides "
                f"{self.size} ranks"
            )
        return RowSlice(self.rank // (self.size // num_kv_heads), 1, num_kv_heads)

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
        if self.small_all_reduce is not None and self.small_all_reduce.fits(x):
            return self.small_all_reduce(x)
        out = _C10D.all_reduce(x.contiguous(), "sum", self.group.group_name)
        return _C10D.wait_tensor(out)

    def agree(self, value: int) -> int:
        """Rank 0's ``value`` on every rank: a choice each rank makes from its own timings
        (auto draft lengths) must be one choice, or the ranks' collectives part ways.
        One small all-reduce of a host tensor over ``host_group``: the ranks wait for each
        other's hosts, never for the device (the step launched ahead goes on running);
        nothing for the group of one."""
        if self.is_single:
            return value
        x = torch.tensor([value if self.rank == 0 else 0], dtype=torch.int64)
        dist.all_reduce(x, group=self.host_group)
        return int(x.item())

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


def init_tp(
    backend: str, timeout_s: float = DEFAULT_TIMEOUT_S, device_id: torch.device | None = None
) -> TPGroup:
    """The group of every process of this job, from torchrun's environment (``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``; graphrt's own launcher sets the
    same). Without them: the group of one.

    ``device_id``: the accelerator this rank drives. Given, the collective library opens
    its communicator now, eagerly. HAZARD: otherwise NCCL creates it at the first
    collective, and that must not be inside a graph capture (the runners warm up before
    capturing, which creates it in time)."""
    if "WORLD_SIZE" not in os.environ or int(os.environ["WORLD_SIZE"]) == 1:
        return TPGroup.single()
    missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise UsageError(
            f"WORLD_SIZE is set but {', '.join(missing)} is not (launch with torchrun)"
        )
    timeout = datetime.timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timeout, device_id=device_id)
    # Every rank creates it, in this order (new_group is itself collective); over gloo too,
    # so the CPU lane runs the path the accelerators take.
    host_group = dist.new_group(backend="gloo", timeout=timeout)
    return TPGroup(
        rank=dist.get_rank(),
        size=dist.get_world_size(),
        group=dist.group.WORLD,
        host_group=host_group,
    )
