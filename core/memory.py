"""KV memory: request slots, token slots and the per-layer KV buffers.

Slot 0 of both pools is reserved for padding rows: a padded row's request
slot maps every position to token slot 0, and it writes its K/V there. No
live request ever owns slot 0, so padding can never overwrite live KV.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from graphrt.core.errors import KVPoolExhaustedError
from graphrt.core.host import to_device

PADDING_SLOT = 0


class ReqToTokenPool:
    """Maps (request slot, position) -> token slot in the KV pool.

    ``req_to_token`` is what kernels read; ``host`` is the engine's copy of it on
    the host, written alongside, so that freeing a finished request's slots
    reads nothing back from the device.
    """

    def __init__(self, max_requests: int, max_context_len: int, device: torch.device):
        # Row 0 is the padding row and stays all zeros (token slot 0).
        self.req_to_token = torch.zeros(
            (max_requests + 1, max_context_len), dtype=torch.int64, device=device
        )
        self.host = torch.zeros((max_requests + 1, max_context_len), dtype=torch.int64)
        self.max_requests = max_requests
        self.max_context_len = max_context_len
        self._free = list(range(max_requests, 0, -1))  # pop() hands out 1 first

    def available(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        if not self._free:
            raise KVPoolExhaustedError(f"all {self.max_requests} request slots are in use")
        return self._free.pop()

    def free(self, slot: int) -> None:
        assert slot != PADDING_SLOT and slot not in self._free, f"bad request slot {slot}"
        self._free.append(slot)

    def keep_only(self, held: Sequence[int]) -> None:
        """Every slot but ``held`` free again (after a failed step: nothing else is used)."""
        kept = set(held)
        self._free = [s for s in range(self.max_requests, 0, -1) if s not in kept]


@dataclass(frozen=True)
class KVLayerSpec:
    """Shape of one attention layer's cache. ``cache_index`` None = reads another layer's KV."""

    num_kv_heads: int
    head_dim: int
    cache_index: int | None


class TokenKVPool:
    """Per-layer K and V buffers indexed by token slot, with a free list of slots.

    ``k_buffers[i]`` / ``v_buffers[i]``: (num_slots + 1, num_kv_heads, head_dim).
    Layers that share another layer's KV (Gemma 4) get no buffer of their own.
    """

    def __init__(
        self,
        num_slots: int,
        layers: Sequence[KVLayerSpec],
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.num_slots = num_slots
        self.dtype = dtype
        self.device = device
        owners = [spec for spec in layers if spec.cache_index is not None]
        assert [s.cache_index for s in owners] == list(range(len(owners))), "cache indices"
        self.k_buffers = [
            torch.zeros((num_slots + 1, s.num_kv_heads, s.head_dim), dtype=dtype, device=device)
            for s in owners
        ]
        self.v_buffers = [torch.zeros_like(k) for k in self.k_buffers]
        # Free slots: a stack in one preallocated host tensor, ``_num_free`` deep. Alloc
        # takes n from the top, free pushes n: O(n) copies, never O(pool) (a free that
        # concatenated onto the free list copied the whole pool per finished request).
        # Slot 1 is on top, so a fresh pool hands out 1, 2, 3...
        self._stack = torch.arange(num_slots, 0, -1, dtype=torch.int64)
        self._num_free = num_slots

    @property
    def bytes_per_token(self) -> int:
        return sum(2 * k[0].numel() * k.element_size() for k in self.k_buffers)

    def available(self) -> int:
        return self._num_free

    def alloc_host(self, n: int) -> torch.Tensor:
        """n fresh token slots, as a host tensor; raises when the pool is exhausted."""
        if n > self._num_free:
            raise KVPoolExhaustedError(
                f"KV pool exhausted: need {n} token slots, {self._num_free} of "
                f"{self.num_slots} free"
            )
        top, self._num_free = self._num_free, self._num_free - n
        # A copy: the stack's memory is overwritten by later frees.
        return self._stack[self._num_free : top].flip(0)

    def alloc(self, n: int) -> torch.Tensor:
        """n fresh token slots on the pool's device (copied without a device sync)."""
        return to_device(self.alloc_host(n), self.device)

    def free(self, slots: torch.Tensor) -> None:
        # A device tensor is read back here (a sync); the engine frees host copies.
        slots = slots.to("cpu", torch.int64).flatten().numpy()  # numpy: a us, not several
        n = slots.size
        assert not (slots == PADDING_SLOT).any(), "slot 0 is reserved for padding"
        # Cheap guard against a double free corrupting every later allocation.
        assert self._num_free + n <= self.num_slots, "KV slots freed twice"
        self._stack.numpy()[self._num_free : self._num_free + n] = slots
        self._num_free += n

    def keep_only(self, held: torch.Tensor) -> None:
        """Every slot but the ``held`` host tensor free again (after a failed step, whose
        half-done allocations nothing else tracks)."""
        used = torch.zeros(self.num_slots + 1, dtype=torch.bool)
        used[held.to(torch.int64)] = True
        used[PADDING_SLOT] = True
        free = torch.nonzero(~used).flatten().flip(0)  # lowest slot on top
        self._num_free = free.numel()
        self._stack[: self._num_free] = free

    def set_kv(self, cache_index: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        # loc: (T,), k/v: (T, Hkv, D)
        self.k_buffers[cache_index][loc] = k.to(self.dtype)
        self.v_buffers[cache_index][loc] = v.to(self.dtype)
