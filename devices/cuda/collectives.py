"""The small all-reduce of tensor-parallel decode steps on NVIDIA GPUs: torch's
symmetric-memory one-shot all-reduce, beside NCCL.

A decode step all-reduces two small messages per layer (batch x hidden; 8 KB at batch 1
of a Llama-8B), so each one's latency, not bandwidth, sets its cost. The one-shot
kernel (``torch.ops.symm_mem.one_shot_all_reduce_copy``) is one launch: it copies the
local partial sums into this rank's symmetric buffer, waits for the peers' (signal
pads), and sums every rank's buffer read straight over NVLink. NCCL, captured in the
same graph, runs its protocol for the same bytes. Messages above ``max_bytes`` (prefill)
go to NCCL, whose bandwidth wins there.

``GRAPHRT_ALL_REDUCE`` picks: ``nccl`` (the default: NCCL alone), ``auto`` (one-shot
where every rank is on this host and could set it up, else NCCL), ``symm_mem``
(one-shot, or a one-line error where it cannot be set up). NCCL stays the default until
the two are timed against each other on two GPUs (bench/allreduce_cuda.py, and
``graphrt bench --tp 2`` under each): issue 11 keeps the faster, and no machine with two
GPUs has been lent yet.

HAZARDS:
- One symmetric buffer serves every call: calls must not overlap (one stream, which
  graphrt's runners keep). The kernel's closing barrier is what lets the next call
  overwrite the buffer: no rank leaves before every peer has read it.
- Every rank must take the same path for the same message: ``fits`` depends only on
  shape and dtype, which SPMD ranks share.
- A peer that dies mid-step leaves this rank's kernel spinning on its signal pad: no
  process-group timeout covers a kernel. The job still ends in bounded time because
  ``--tp``'s launcher (or torchrun's agent) stops the other ranks when one fails.
- Multicast stays off (``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` unless set): the one-shot
  kernel reads peers through P2P mappings and never needs a multicast object, whose
  creation costs memory and, on hosts whose GPUs are shared, is refused or harmful.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from graphrt.core.errors import UsageError, first_line

ENV_VAR = "GRAPHRT_ALL_REDUCE"
CHOICES = ("nccl", "auto", "symm_mem")
DEFAULT = "nccl"  # see the module's docstring: unmeasured on two GPUs so far
DEFAULT_MAX_BYTES = 1 << 20  # decode messages (64 rows x 4096 bf16 = 512 KiB) fit
# The one-shot kernel's dtypes (torch's AT_DISPATCH_FLOAT_AND_BFLOAT16); others use NCCL.
DTYPES = (torch.bfloat16, torch.float32)
VECTOR_BYTES = 16  # the kernel's widest load; other message sizes go to NCCL


class SymmMemAllReduce:
    """One-shot all-reduce through a symmetric buffer of ``max_bytes``, for the messages
    that ``fits``; built eagerly (allocation and rendezvous are host-side and must not
    happen inside a graph capture). Constructing it allocates this rank's buffer;
    ``rendezvous`` (collective) then maps the peers'."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, max_bytes: int):
        import torch.distributed._symmetric_memory as symm_mem

        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")  # see HAZARDS
        self.group = group
        self.group_name = group.group_name
        self.max_bytes = max_bytes
        self.buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)

    def rendezvous(self) -> None:
        """Collective: every rank of the group calls it, once each holds its buffer."""
        import torch.distributed._symmetric_memory as symm_mem

        symm_mem.rendezvous(self.buffer, self.group)

    def fits(self, x: torch.Tensor) -> bool:
        nbytes = x.numel() * x.element_size()
        return (
            x.dtype in DTYPES
            and 0 < nbytes <= self.max_bytes
            and nbytes % VECTOR_BYTES == 0
            and x.is_contiguous()
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # The first nbytes of the buffer seen as x: the kernel wants the two alike.
        staging = self.buffer[: x.numel() * x.element_size()].view(x.dtype).view(x.shape)
        return torch.ops.symm_mem.one_shot_all_reduce_copy(staging, x, "sum", self.group_name)


def choice() -> str:
    value = os.environ.get(ENV_VAR, DEFAULT).strip().lower() or DEFAULT
    if value not in CHOICES:
        raise UsageError(f"{ENV_VAR}={value!r}: expected one of {', '.join(CHOICES)}")
    return value


def small_all_reduce(
    group: dist.ProcessGroup, device: torch.device, max_bytes: int = DEFAULT_MAX_BYTES
) -> SymmMemAllReduce | None:
    """The one-shot all-reduce for ``group``, or None for NCCL alone.

    ``auto`` takes it only where every rank is on this host (symmetric memory maps the
    peers' buffers through NVLink/PCIe P2P, not across hosts) and where every rank set
    it up; a rank that could not makes all of them fall back, agreed over NCCL, so that
    no two ranks take different paths."""
    wanted = choice()
    world = dist.get_world_size(group)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if wanted == "nccl" or (wanted == "auto" and local != world):
        return None
    if wanted == "symm_mem" and local != world:
        raise UsageError(
            f"{ENV_VAR}=symm_mem needs every rank on one host ({local} of {world} are here)"
        )
    try:
        reducer, why = SymmMemAllReduce(group, device, max_bytes), ""
    except (RuntimeError, OSError) as e:  # no P2P, old driver
        reducer, why = None, first_line(e)
    # The rendezvous is collective: a rank that could not allocate must not leave the
    # others waiting in it, so the ranks agree before it, and again after it (a handle
    # exchange refused on one rank).
    ready = _on_every_rank(reducer is not None, group, device)
    if ready:
        try:
            reducer.rendezvous()
        except (RuntimeError, OSError) as e:
            reducer, why = None, first_line(e)
        ready = _on_every_rank(reducer is not None, group, device)
    if ready:
        return reducer
    if wanted == "symm_mem":
        raise UsageError(
            f"{ENV_VAR}=symm_mem: symmetric memory could not be set up on every rank"
            f"{': ' + why if why else ''} (use {ENV_VAR}=nccl)"
        )
    if dist.get_rank(group) == 0 or why:
        print(
            f"graphrt: symmetric-memory all-reduce unavailable{': ' + why if why else ''}; "
            "all-reduces go through NCCL",
            file=sys.stderr,
        )
    return None


def _on_every_rank(holds: bool, group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether ``holds`` on every rank of ``group`` (one small all-reduce, read)."""
    agreed = torch.tensor([holds], dtype=torch.int32, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
    return bool(agreed.item())
