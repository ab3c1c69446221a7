"""The Triton attention backend: the paged decode kernel, the torch reference elsewhere.

DECODE stores the step's K/V with ``triton_decode.store_kv`` (one launch for
k and v) and runs ``triton_decode.decode_attention``; every other mode
(extend, verify, draft) is the torch reference's, inherited unchanged.

Scratch (the kernel's per-split partials) is shared by every layer of one
(num_heads, head_dim) and allocated on first use outside capture: the graph
runner's warm-up runs, largest bucket first, allocate it for the largest
graph batch before any capture begins.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from graphrt.core.attention.base import AttentionSpec
from graphrt.core.attention.torch_ref import TorchAttentionBackend, TorchAttentionMetadata
from graphrt.core.batch import ForwardBatch, ForwardMode
from graphrt.core.errors import GraphrtError
from graphrt.devices.cuda.triton_decode import (
    NUM_KV_SPLITS,
    allocate_decode_scratch,
    decode_attention,
    store_kv,
)


@dataclass
class TritonAttentionMetadata(TorchAttentionMetadata):
    # What the decode kernel reads: the batch's own tensors, which in a graph
    # are the runner's static buffers (so a replay sees the copied-in values).
    req_pool_indices: torch.Tensor  # (B,) int64
    seq_lens: torch.Tensor  # (B,) int32


class TritonAttentionBackend(TorchAttentionBackend):
    name = "triton"

    def __init__(self, kv_pool, req_to_token_pool, num_kv_splits: int = NUM_KV_SPLITS):
        super().__init__(kv_pool, req_to_token_pool)
        self.num_kv_splits = num_kv_splits
        self._graph_bs = 0  # rows every scratch buffer holds once graphs are in use
        # (num_heads, head_dim) -> (partial_out, partial_lse), shared across layers.
        self._scratch: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        # NOTE: captured graphs keep raw pointers into scratch; a buffer replaced by
        # a larger one stays referenced here so it is never freed under a graph.
        self._retired: list[tuple[torch.Tensor, torch.Tensor]] = []

    # ---- metadata hooks ----------------------------------------------------------

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        super().init_forward_metadata(batch)
        self._attach(batch, seq_lens=batch.seq_lens.to(torch.int32))

    def init_graph_state(self, max_bs: int, max_tokens: int) -> None:
        super().init_graph_state(max_bs, max_tokens)
        self._graph_bs = max(self._graph_bs, max_bs)
        for (num_heads, head_dim), (partial_out, _) in list(self._scratch.items()):
            if partial_out.shape[0] < self._graph_bs:
                self._grow(num_heads, head_dim, self._graph_bs, partial_out.device)

    def init_metadata_for_capture(self, batch: ForwardBatch) -> None:
        super().init_metadata_for_capture(batch)
        self._attach(batch, seq_lens=batch.seq_lens)

    def init_metadata_for_replay(self, batch: ForwardBatch) -> None:
        # No host sync, no allocation: the static buffers already hold this step.
        super().init_metadata_for_replay(batch)
        self._attach(batch, seq_lens=batch.seq_lens)

    def _attach(self, batch: ForwardBatch, seq_lens: torch.Tensor) -> None:
        # Wraps what the reference's hook just set (it may already be ours: the
        # reference's capture hook calls the replay hook, which is overridden here).
        inherited = {
            f.name: getattr(batch.attn_metadata, f.name) for f in fields(TorchAttentionMetadata)
        }
        batch.attn_metadata = TritonAttentionMetadata(
            **inherited, req_pool_indices=batch.req_pool_indices, seq_lens=seq_lens
        )

    # ---- forward -----------------------------------------------------------------

    def forward(self, q, k, v, spec: AttentionSpec, batch: ForwardBatch) -> torch.Tensor:
        if batch.mode is not ForwardMode.DECODE:
            return super().forward(q, k, v, spec, batch)
        k_buffer = self.kv_pool.k_buffers[spec.cache_index]
        v_buffer = self.kv_pool.v_buffers[spec.cache_index]
        if spec.writes_kv:
            # Its own launch, before attention: every split of a row must see the new K/V.
            store_kv(
                k.view(-1, spec.num_kv_heads, spec.head_dim),  # (B, Hkv, D)
                v.view(-1, spec.num_kv_heads, spec.head_dim),
                k_buffer,
                v_buffer,
                batch.out_cache_loc,
            )
        q = q.view(-1, spec.num_heads, spec.head_dim)  # (B, H, D)
        # Inside a graph this comes from the graph's pool, which owns it.
        out = torch.empty_like(q)
        partial_out, partial_lse = self._scratch_for(spec.num_heads, spec.head_dim, q)
        meta = batch.attn_metadata
        decode_attention(
            q,
            k_buffer,
            v_buffer,
            self.req_to_token_pool.req_to_token,
            meta.req_pool_indices,
            meta.seq_lens,
            out,
            partial_out,
            partial_lse,
            spec.scaling,
            spec.sliding_window,
        )
        return out.view(-1, spec.num_heads * spec.head_dim)

    # ---- scratch -----------------------------------------------------------------

    def _scratch_for(
        self, num_heads: int, head_dim: int, q: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        bs = q.shape[0]
        scratch = self._scratch.get((num_heads, head_dim))
        if scratch is None or scratch[0].shape[0] < bs:
            if q.is_cuda and torch.cuda.is_current_stream_capturing():
                raise GraphrtError(
                    f"triton decode scratch for {num_heads} heads x {head_dim} dims, batch {bs}, "
                    "is missing during graph capture; run a warm-up forward before capturing"
                )
            # Powers of two: a run of growing eager batches reallocates a few times only.
            rows = max(1 << (bs - 1).bit_length(), self._graph_bs)
            scratch = self._grow(num_heads, head_dim, rows, q.device)
        return scratch

    def _grow(
        self, num_heads: int, head_dim: int, rows: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        old = self._scratch.get((num_heads, head_dim))
        if old is not None and self._graph_bs:  # graphs may have captured it
            self._retired.append(old)
        scratch = allocate_decode_scratch(rows, num_heads, head_dim, device, self.num_kv_splits)
        self._scratch[(num_heads, head_dim)] = scratch
        return scratch
