"""The ledger: the one owner of request slots, KV slots and the token table.

Admission reserves a request's whole KV budget and a request slot; prefill places
prompts; a plain decode step appends one slot per request; a speculative round holds
its tree's slots, then keeps the accepted ones and frees the rest; finishing frees
everything. The engine calls it for plain steps and speculative rounds alike;
strategies say what a step keeps and never touch the pools.

The device token table (``req_to_token``, what kernels read) and its host mirror are
written together, so freeing reads nothing back from the device. Two exceptions, each
settled by ``keep``: a speculative round commits its accepted slots into the device
table on the device (inside its graphs), and the ledger writes the mirror when the
round's one host read tells it which they were; a plain step launched behind a round not
read yet writes the device table at positions only the device knows (``LaggingLengths``),
and the mirror once the round before is settled.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from graphrt.core.engine.request import Request
from graphrt.core.host import to_device
from graphrt.core.memory import ReqToTokenPool, TokenKVPool


@dataclass(frozen=True)
class LaggingLengths:
    """A plain step launched behind a round not read yet: the host's ``kv_len`` lag by
    what that round accepts, so positions come from the device and the host's
    bookkeeping waits for the step's read (``Ledger.append_one``)."""

    cached: torch.Tensor  # (B,) device: each request's cached length, the new position
    slots: torch.Tensor  # (B,) host ids held for the new tokens (``Ledger.hold_host``)
    in_flight: int  # the most tokens the host has not counted yet: host bounds

    def __post_init__(self):  # the host reads these ids as a list: never a device read
        assert self.slots.device.type == "cpu", f"held slots on {self.slots.device}"


@dataclass
class HeldSlots:
    """Token slots a step holds until it says which to keep: host and device copies."""

    host: torch.Tensor  # (n,) int64
    device: torch.Tensor  # (n,) int64, copied without a sync

    def __post_init__(self):  # a round's settling reads ``host`` as lists: never a device read
        assert self.host.device.type == "cpu", f"held slots' host ids on {self.host.device}"


class Ledger:
    def __init__(self, req_pool: ReqToTokenPool, kv_pool: TokenKVPool):
        self.req_pool = req_pool
        self.kv_pool = kv_pool
        self.reserved_tokens = 0  # the KV budgets of the running requests

    @property
    def req_to_token(self) -> torch.Tensor:
        """(max requests + 1, context) the device token table kernels and graphs read."""
        return self.req_pool.req_to_token

    # ---- admission and finishing ---------------------------------------------------

    def fits(self, kv_budget: int) -> bool:
        return self.reserved_tokens + kv_budget <= self.kv_pool.num_slots

    def admit(self, req: Request) -> None:
        req.req_slot = self.req_pool.alloc()
        self.reserved_tokens += req.kv_budget

    def release(self, req: Request) -> None:
        """Free ``req``'s KV slots, request slot and reservation (from the host mirror)."""
        self.kv_pool.free(self.req_pool.host[req.req_slot, : req.kv_len].clone())
        self.req_pool.free(req.req_slot)
        self.reserved_tokens -= req.kv_budget
        req.req_slot = None

    def recover(self, running: Sequence[Request]) -> None:
        """After a failed step: every slot not held by ``running`` is free again (a step
        that failed midway may hold slots nothing else tracks)."""
        held = [self.req_pool.host[r.req_slot, : r.kv_len] for r in running]
        self.kv_pool.keep_only(torch.cat(held) if held else torch.zeros(0, dtype=torch.int64))
        self.req_pool.keep_only([r.req_slot for r in running])
        self.reserved_tokens = sum(r.kv_budget for r in running)

    # ---- slots for a step ------------------------------------------------------------

    def place_prompts(
        self, reqs: Sequence[Request], lens: Sequence[int], device: torch.device
    ) -> torch.Tensor:
        """Slots for each request's next ``lens`` prompt tokens (a chunk, positions from
        its ``kv_len`` on), written into both tables; -> (sum of lens,) device slots in
        request order. Each request's ``kv_len`` grows by its chunk."""
        locs_host = self.kv_pool.alloc_host(sum(lens))
        # Where each slot goes, (2, T): the token table's flat index of (request slot,
        # position), and the slot; one copy and one index_copy_ on the device (a copy a
        # request made a 40-prompt prefill 80 launches). Not table[rows, cols] = slots: an
        # 8k prefill's profile on the H200 gave its two `_index_put_impl_` (that one and the
        # host mirror's, 16 us on a CPU) 3.2 ms of host time; append_one's cost 44 us a step.
        rows = torch.repeat_interleave(torch.tensor([r.req_slot for r in reqs]), torch.tensor(lens))
        cols = torch.cat([torch.arange(r.kv_len, r.kv_len + n) for r, n in zip(reqs, lens)])
        flat = rows * self.req_pool.host.shape[1] + cols
        moved = to_device(torch.stack([flat, locs_host]), device)
        self.req_pool.req_to_token.view(-1).index_copy_(0, moved[0], moved[1])
        # numpy, as append_one: torch's index_put on the host mirror is the one
        # `_index_put_impl_` an 8k prefill's profile on an H100 still showed (1.28 ms of
        # host time there, stop 56; 19 us here against numpy's 8).
        self.req_pool.host.view(-1).numpy()[flat.numpy()] = locs_host.numpy()
        for req, n in zip(reqs, lens):
            req.kv_len += n
        return moved[1]

    def append_one(
        self,
        reqs: Sequence[Request],
        device: torch.device,
        last_tokens: torch.Tensor | None = None,
        lagging: LaggingLengths | None = None,
    ) -> torch.Tensor:
        """One new slot per request at position ``kv_len``, in both tables; each ``kv_len``
        grows by one (``lagging``: see below). -> (6, B) device rows (one copy): slot,
        request slot, position, last token, sequence length with the new token
        (position + 1), and the token table's flat index of (request slot, position).

        ``last_tokens``: (B,) device tokens, each request's last where the host has not
        read it yet (a step launched behind the one sampling it); None: ``output_ids``.
        ``lagging``: behind a round not read yet, the positions are its device lengths
        and the slots its held ones; the device table takes them now, while the host
        mirror and each ``kv_len`` wait for ``keep`` (the step keeps its slots) once the
        round before has been settled."""
        # Built and scattered in numpy: torch ops on a few ints cost microseconds each
        # (this took 13.7 us in torch, 5.9 in numpy, batch 1 on a 2-core CPU host).
        host_table = self.req_pool.host.numpy()
        rows = np.empty((6, len(reqs)), dtype=np.int64)
        rows[1] = [r.req_slot for r in reqs]
        rows[2] = [r.kv_len for r in reqs]
        if lagging is None:
            rows[0] = self.kv_pool.alloc_host(len(reqs)).numpy()
        else:  # host placeholders, bounds of the device's values
            rows[0] = lagging.slots.numpy()
            rows[2] += lagging.in_flight
        if last_tokens is None:
            rows[3] = [r.output_ids[-1] for r in reqs]
        np.add(rows[2], 1, out=rows[4])
        np.add(rows[1] * host_table.shape[1], rows[2], out=rows[5])
        if lagging is None:
            host_table[rows[1], rows[2]] = rows[0]
        on_device = to_device(torch.from_numpy(rows), device)
        if last_tokens is not None:
            # A BAD_LOGITS mark (-1) becomes token 0, a valid input: that request fails
            # when its token is read, and this step's output for it is dropped.
            torch.clamp(last_tokens, min=0, out=on_device[3])
        if lagging is not None:  # positions, lengths and table indices from the device's
            cached = lagging.cached.long()  # (a plain step's lengths are int32)
            on_device[2].copy_(cached)
            torch.add(cached, 1, out=on_device[4])
            torch.add(cached, on_device[1], alpha=host_table.shape[1], out=on_device[5])
        # One index_copy_ into the flattened table, not table[rows, cols] = slots: the
        # 2-D advanced-index assignment took 44 us of host time a step under the profiler
        # on an H200 host (indices broadcast and checked each call).
        self.req_pool.req_to_token.view(-1).index_copy_(0, on_device[5], on_device[0])
        if lagging is None:
            for r in reqs:
                r.kv_len += 1
        return on_device

    def hold(self, n: int, device: torch.device) -> HeldSlots:
        """``n`` slots a step holds until ``keep`` and ``free`` settle them."""
        host = self.hold_host(n)
        return HeldSlots(host=host, device=to_device(host, device))

    def hold_host(self, n: int) -> torch.Tensor:
        """``hold``'s slots as host ids alone, for a step that sends them to the device
        in its own inputs' copy (a speculative round: one copy, not two)."""
        return self.kv_pool.alloc_host(n)

    def keep(self, reqs: Sequence[Request], slots: Sequence[Sequence[int]]) -> None:
        """``slots[i]`` (host ids) hold ``reqs[i]``'s next tokens' KV, in position order:
        into the host mirror in one scatter (the device table has them already), and
        each ``kv_len`` grows by its count."""
        rows, cols, values = [], [], []
        for req, kept in zip(reqs, slots):
            rows += [req.req_slot] * len(kept)
            cols += range(req.kv_len, req.kv_len + len(kept))
            values += kept
            req.kv_len += len(kept)
        self.req_pool.host.numpy()[rows, cols] = values  # numpy: see append_one

    def free(self, slots: torch.Tensor) -> None:
        """Held ``slots`` (host) no request keeps."""
        if slots.numel():
            self.kv_pool.free(slots)
