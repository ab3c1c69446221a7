"""Reference attention in plain torch: runs on every device, defines correctness.

Decode, draft and verify are written with static shapes (every request
gathers ``max_kv_len`` cached keys and masks the tail) so the same code can
be captured or compiled; the eager path sets ``max_kv_len`` to the batch's
longest sequence, a graph to the context length. Only EXTEND (prefill, always
eager) loops over requests. With ``capture_safe=False`` graphs also use the
batch's longest sequence, and the decode attention runs eagerly between
graph segments (breakable backends only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from graphrt.core.attention.base import AttentionBackend, AttentionSpec
from graphrt.core.batch import ForwardBatch, ForwardMode


@dataclass
class TorchAttentionMetadata:
    max_kv_len: int


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    # The longest head dim whose prefill SDPA call may leave K/V at their own heads
    # (``enable_gqa``); longer ones get K/V expanded to every query head first. None: any
    # (the CPU's kernels take GQA at every head dim). A device whose fused kernels refuse
    # GQA beyond some head dim sets it: SDPA would fall back to its math kernel.
    sdpa_gqa_max_head_dim: int | None = None

    def __init__(self, kv_pool, req_to_token_pool, capture_safe: bool = True):
        super().__init__(kv_pool, req_to_token_pool)
        self.capture_safe = capture_safe

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        batch.attn_metadata = TorchAttentionMetadata(max_kv_len=max(batch.seq_lens_cpu))

    def init_graph_state(self, max_bs: int, max_tokens: int) -> None:
        # Nothing to preallocate: the decode path derives its masks inside the
        # graph from the runner's static seq_lens / req_pool_indices buffers.
        self._graph_kv_len = self.req_to_token_pool.max_context_len

    def init_metadata_for_capture(self, batch: ForwardBatch) -> None:
        self.init_metadata_for_replay(batch)

    def init_metadata_for_replay(self, batch: ForwardBatch) -> None:
        # Host lengths come with the batch, so neither branch syncs the device.
        kv_len = self._graph_kv_len if self.capture_safe else max(batch.seq_lens_cpu)
        batch.attn_metadata = TorchAttentionMetadata(max_kv_len=kv_len)

    def forward(self, q, k, v, spec: AttentionSpec, batch: ForwardBatch) -> torch.Tensor:
        if spec.writes_kv:
            self.kv_pool.set_kv(
                spec.cache_index,
                batch.out_cache_loc,
                k.view(-1, spec.num_kv_heads, spec.head_dim),
                v.view(-1, spec.num_kv_heads, spec.head_dim),
            )
        q = q.view(-1, spec.num_heads, spec.head_dim)
        if batch.mode in (ForwardMode.DECODE, ForwardMode.DRAFT):
            # DRAFT rows are decode rows that read the target's KV and write none.
            out = self._decode(q, spec, batch)
        elif batch.mode is ForwardMode.TARGET_VERIFY:
            out = self._verify(q, spec, batch)
        else:
            out = self._extend(q, spec, batch)
        return out.reshape(-1, spec.num_heads * spec.head_dim)

    def _decode(self, q: torch.Tensor, spec: AttentionSpec, batch: ForwardBatch) -> torch.Tensor:
        kv_len = batch.attn_metadata.max_kv_len
        k_buf = self.kv_pool.k_buffers[spec.cache_index]
        v_buf = self.kv_pool.v_buffers[spec.cache_index]
        slots = self.req_to_token_pool.req_to_token[batch.req_pool_indices, :kv_len]  # (B, L)
        key = _gather_slots(k_buf, slots).transpose(1, 2)  # (B, Hkv, L, D)
        value = _gather_slots(v_buf, slots).transpose(1, 2)
        pos = torch.arange(kv_len, device=q.device)
        seq_lens = batch.seq_lens.unsqueeze(1)  # (B, 1)
        visible = pos < seq_lens  # (B, L)
        if spec.sliding_window is not None:
            visible &= pos > seq_lens - 1 - spec.sliding_window
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2).to(key.dtype),  # (B, H, 1, D)
            key,
            value,
            attn_mask=visible[:, None, None, :],
            scale=spec.scaling,
            enable_gqa=spec.num_heads != spec.num_kv_heads,
        )
        return out.squeeze(2).to(q.dtype)  # (B, H, D)

    def _verify(self, q: torch.Tensor, spec: AttentionSpec, batch: ForwardBatch) -> torch.Tensor:
        # Every request scores n tree nodes. Keys: its cached prefix (req_to_token, the
        # first seq_len - n positions), then the n nodes (out_cache_loc: tree nodes are
        # not in req_to_token yet), which a node sees through the tree's ancestor mask.
        bs, n = batch.batch_size, batch.num_tokens // batch.batch_size
        # Prefixes end inside the table even when a tree runs past the context's end.
        kv_len = min(batch.attn_metadata.max_kv_len, self.req_to_token_pool.max_context_len)
        k_buf = self.kv_pool.k_buffers[spec.cache_index]
        v_buf = self.kv_pool.v_buffers[spec.cache_index]
        slots = torch.cat(
            [
                self.req_to_token_pool.req_to_token[batch.req_pool_indices, :kv_len],
                batch.out_cache_loc.view(bs, n),
            ],
            dim=1,
        )  # (B, L + n)
        key = _gather_slots(k_buf, slots).transpose(1, 2)  # (B, Hkv, L + n, D)
        value = _gather_slots(v_buf, slots).transpose(1, 2)
        prefix = (batch.seq_lens - n).unsqueeze(1)  # (B, 1)
        cached = torch.arange(kv_len, device=q.device) < prefix  # (B, L)
        visible = torch.cat(
            [cached.unsqueeze(1).expand(bs, n, kv_len), batch.spec_info.tree_mask], dim=2
        )  # (B, n, L + n)
        if spec.sliding_window is not None:
            q_pos = batch.positions.view(bs, n, 1)
            k_pos = torch.cat(
                [torch.arange(kv_len, device=q.device).expand(bs, kv_len), q_pos.view(bs, n)], 1
            )  # (B, L + n)
            visible &= k_pos.unsqueeze(1) > q_pos - spec.sliding_window
        out = F.scaled_dot_product_attention(
            q.view(bs, n, spec.num_heads, spec.head_dim).transpose(1, 2).to(key.dtype),
            key,
            value,
            attn_mask=visible.unsqueeze(1),  # (B, 1, n, L + n)
            scale=spec.scaling,
            enable_gqa=spec.num_heads != spec.num_kv_heads,
        )  # (B, H, n, D)
        return out.transpose(1, 2).reshape(bs * n, spec.num_heads, spec.head_dim).to(q.dtype)

    def _extend(self, q: torch.Tensor, spec: AttentionSpec, batch: ForwardBatch) -> torch.Tensor:
        # One SDPA per request (prefill runs eager). Host lengths and no 0-dim device
        # index (see _extend_request): no syncs.
        out = torch.empty_like(q)
        start = 0
        for i, n_new in enumerate(batch.extend_lens_cpu):
            self._extend_request(q, out, spec, batch, i, start)
            start += n_new
        return out

    def _extend_request(
        self, q: torch.Tensor, out: torch.Tensor, spec: AttentionSpec, batch: ForwardBatch,
        i: int, start: int,
    ) -> None:  # fmt: skip
        """Request ``i``'s chunk (rows ``start`` on of q, (T, H, D)) into the same rows of
        ``out``: one SDPA. Keys: the request's cached tokens this chunk can see
        (req_to_token), then its new tokens (out_cache_loc). No mask is built where
        causality implies it (see _causal): a prompt's chunks need no n x L mask, so a
        long prompt runs through SDPA's flash-class kernels. A sliding window reads only
        the keys inside it."""
        k_buf = self.kv_pool.k_buffers[spec.cache_index]
        v_buf = self.kv_pool.v_buffers[spec.cache_index]
        req_to_token = self.req_to_token_pool.req_to_token
        window = spec.sliding_window
        gqa = spec.num_heads != spec.num_kv_heads
        prefix, n_new = batch.prefix_lens_cpu[i], batch.extend_lens_cpu[i]
        new = slice(start, start + n_new)
        # The chunk's first query (position ``prefix``) sees keys past prefix - window.
        first = 0 if window is None else max(0, prefix - window + 1)
        # HAZARD: the row through a (1,) index, never req_pool_indices[i]: indexing with a
        # 0-dim device tensor reads it to the host (pytorch#105641), a wait on the device
        # every layer (16 a step of an 8k llama-1b prompt, 10 of its 52 ms on an H100).
        row = req_to_token[batch.req_pool_indices[i : i + 1], first:prefix][0]
        # (L,): positions first .. prefix + n_new - 1
        slots = torch.cat([row, batch.out_cache_loc[new]])
        key = k_buf[slots].transpose(0, 1).unsqueeze(0)  # (1, Hkv, L, D)
        value = v_buf[slots].transpose(0, 1).unsqueeze(0)
        limit = self.sdpa_gqa_max_head_dim
        if gqa and limit is not None and spec.head_dim > limit:
            key, value = expand_kv_heads(key, value, spec.num_heads)
            gqa = False
        q_i = q[new].transpose(0, 1).unsqueeze(0).to(key.dtype)  # (1, H, n, D)
        if window is None:
            o = self._causal_sdpa(q_i, key, value, spec.scaling, gqa)
        else:
            q_pos = batch.positions[new].unsqueeze(1)  # (n, 1)
            k_pos = torch.cat([torch.arange(first, prefix, device=q.device), q_pos[:, 0]])
            visible = (k_pos <= q_pos) & (k_pos > q_pos - window)  # (n, L)
            o = F.scaled_dot_product_attention(
                q_i, key, value, attn_mask=visible, scale=spec.scaling, enable_gqa=gqa
            )
        out[new] = o[0].transpose(0, 1).to(q.dtype)

    def _causal_sdpa(
        self, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, gqa: bool
    ) -> torch.Tensor:
        """A chunk's causal attention (see _causal); a device may serve it otherwise."""
        return _causal(q, key, value, scale, gqa)


def _gather_slots(buf: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``buf[slots]``: a KV buffer's (S, Hkv, D) rows at ``slots`` (any shape), by one
    ``index_select``: advanced indexing took 3-4x as long on the CPU (BENCHMARKS.md,
    stop 78)."""
    return buf.index_select(0, slots.reshape(-1)).view(*slots.shape, *buf.shape[1:])


def _causal(
    q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, gqa: bool
) -> torch.Tensor:
    """Causal attention of q, the last n of key's L positions: (1, H, n, D) -> same.
    A whole prompt (n == L) is SDPA's is_causal; a chunk after cached tokens is causal
    aligned to the lower right (torch's CausalBias), which SDPA serves with its flash or
    memory-efficient kernels where the device has them, never an n x L mask on the GPU."""
    n, length = q.shape[2], key.shape[2]
    if n == length:
        return F.scaled_dot_product_attention(
            q, key, value, is_causal=True, scale=scale, enable_gqa=gqa
        )
    # Imported here: the module imports dynamo (1.7 s, and triton), a cost only a prompt
    # longer than one prefill step should pay.
    from torch.nn.attention.bias import causal_lower_right

    if gqa:  # CausalBias's kernels take as many KV heads as query heads
        key, value = expand_kv_heads(key, value, q.shape[1])
    return F.scaled_dot_product_attention(
        q, key, value, attn_mask=causal_lower_right(n, length), scale=scale
    )


def expand_kv_heads(
    key: torch.Tensor, value: torch.Tensor, num_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V (1, Hkv, L, D) -> (1, num_heads, L, D) each, every KV head repeated for its
    group of query heads: for SDPA kernels that take no GQA."""
    group = num_heads // key.shape[1]
    return key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
