"""The attention-backend interface (DESIGN.md layer 3).

A backend owns the per-forward metadata that its kernels need and the
hooks a graph runner calls around capture and replay. Models call
``forward`` once per attention layer with that layer's ``AttentionSpec``.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from graphrt.core.batch import ForwardBatch
from graphrt.core.graph_breaks import run_breakable
from graphrt.core.memory import KVLayerSpec, ReqToTokenPool, TokenKVPool


@dataclass(frozen=True)
class AttentionSpec:
    """One attention layer as the backend sees it."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    cache_index: int  # KV buffer this layer reads (and writes, if writes_kv)
    sliding_window: int | None = None  # key j visible to query p iff j > p - window
    writes_kv: bool = True  # False for KV-sharing consumers and the frozen-KV drafter
    # Verify rows must round as decode rows do (the model's matmuls are width-invariant:
    # ``ModelOps.width_invariant``); otherwise a backend may verify on a faster schedule.
    width_invariant: bool = False


@dataclass(frozen=True)
class KVWrite:
    """Where a layer's new K/V go when the model's fused q/k op writes them itself:
    ``k_buffer[loc[t]] = k[t]``, the same for V (cast to the buffers' dtype)."""

    k_buffer: torch.Tensor  # (slots, Hkv, D)
    v_buffer: torch.Tensor
    loc: torch.Tensor  # (T,) int64 token slots (padding rows: the padding slot)


class AttentionBackend(abc.ABC):
    name: str = "abstract"
    # False: decode reads host metadata or has data-dependent shapes, so a graph
    # backend must run it eagerly between graph segments (the "breakable" backend).
    capture_safe: bool = True

    def __init__(self, kv_pool: TokenKVPool, req_to_token_pool: ReqToTokenPool):
        self.kv_pool = kv_pool
        self.req_to_token_pool = req_to_token_pool

    @abc.abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Eager path: build this forward's metadata from the batch (host info allowed)."""

    @abc.abstractmethod
    def init_graph_state(self, max_bs: int, max_tokens: int) -> None:
        """Allocate the static metadata buffers every captured graph will read."""

    @abc.abstractmethod
    def init_metadata_for_capture(self, batch: ForwardBatch) -> None:
        """Point the metadata at the static buffers for a capture of ``batch``'s shape."""

    @abc.abstractmethod
    def init_metadata_for_replay(self, batch: ForwardBatch) -> None:
        """Refresh the static buffers for a replay: no host syncs, no allocations."""

    def long_row_keys(self, layers: Sequence[KVLayerSpec]) -> int | None:
        """Rows of this many visible keys and more run on a schedule of their own in some of
        ``layers`` (a batch flagged ``long_rows``): worth decode graphs of their own, taken
        when a batch's longest row reaches it. None (the default): one schedule for all."""
        return None

    def seq_len_fill_value(self) -> int:
        """Sequence length given to padding rows; must keep their attention finite."""
        return 1

    def kv_write_target(self, spec: AttentionSpec, batch: ForwardBatch) -> KVWrite | None:
        """Where the model may write this layer's new K/V itself, in the kernel that ropes
        them (one launch fewer per layer); it then calls ``attend`` with k = v = None.
        None (the default): the model passes k and v, and ``forward`` stores them."""
        return None

    def attend(self, q, k, v, spec: AttentionSpec, batch: ForwardBatch) -> torch.Tensor:
        """What models call: ``forward``, marked as a graph break when not capture-safe."""
        if self.capture_safe:
            return self.forward(q, k, v, spec, batch)
        return run_breakable(self.forward, q, k, v, spec, batch)

    @abc.abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # (T, H * D)
        k: torch.Tensor | None,  # (T, Hkv * D); None: no KV to write, or already written
        # through ``kv_write_target``
        v: torch.Tensor | None,
        spec: AttentionSpec,
        batch: ForwardBatch,
    ) -> torch.Tensor:  # (T, H * D)
        """Store this layer's new K/V (if it writes KV), then attend over the cache."""
