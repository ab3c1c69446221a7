"""One layer's paged decode-attention inputs for the kernel benches (decode_splits.py,
decode_mixed.py): a K/V pool, a token table over rows of given lengths, queries, and the
scratch an engine of a given split count allocates. Slots are scattered, as a pool's are,
unless ``contiguous``.
"""

from __future__ import annotations

import torch

from graphrt.devices.cuda.triton_decode import (
    allocate_decode_scratch,
    combine_splits,
    decode_attention,
)

# name -> (query heads, KV heads, head_dim)
SHAPES = {
    "llama-1b": (32, 8, 64),
    "llama-8b": (32, 8, 128),
    "gemma4-sliding": (8, 1, 256),
    "gemma4-global": (8, 1, 512),
    # its MTP assistant's layers, reading the target's KV (draft steps)
    "assistant-sliding": (4, 1, 256),
    "assistant-global": (4, 1, 512),
}


class PagedLayer:
    """Rows of ``lens`` visible keys of ``shape``; the scratch holds ``max_splits`` splits a
    row. ``attend(**options)`` launches decode attention (options: ``decode_attention``'s
    keywords), ``combine(**options)`` the combine alone over the partials it left."""

    def __init__(
        self,
        shape: str,
        lens: list[int],
        device: torch.device,
        dtype: torch.dtype,
        max_splits: int,
        contiguous: bool = False,
    ):
        heads, kv_heads, head_dim = SHAPES[shape]
        torch.manual_seed(0)  # the same K, V and q for every variant compared
        total, longest, bs = sum(lens), max(lens), len(lens)
        slots = 1 + torch.arange(total, device=device)
        if not contiguous:
            slots = slots[torch.randperm(total, device=device)]
        self.k = torch.randn(total + 1, kv_heads, head_dim, device=device, dtype=dtype)
        self.v = torch.randn_like(self.k)
        # Slot 0 and table row 0 are the pool's padding, as an engine's.
        self.table = torch.zeros(bs + 1, longest, dtype=torch.int64, device=device)
        start = 0
        for row, n in enumerate(lens):
            self.table[row + 1, :n] = slots[start : start + n]
            start += n
        self.reqs = torch.arange(1, bs + 1, device=device)
        self.lens = torch.tensor(lens, dtype=torch.int32, device=device)
        self.q = torch.randn(bs, heads, head_dim, device=device, dtype=dtype)
        self.out = torch.empty_like(self.q)
        self.scratch = allocate_decode_scratch(bs, heads, head_dim, device, max_splits)
        self.scale = head_dim**-0.5
        self.kv_bytes = 2 * total * kv_heads * head_dim * torch.finfo(dtype).bits // 8

    def attend(self, **options) -> None:
        decode_attention(
            self.q, self.k, self.v, self.table, self.reqs, self.lens, self.out, *self.scratch,
            self.scale, **options,
        )  # fmt: skip

    def combine(self, **options) -> None:
        """The combine alone, over the partials the last ``attend`` left."""
        combine_splits(*self.scratch, self.out, **options)
