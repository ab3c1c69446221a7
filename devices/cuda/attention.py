"""The Triton attention backend: paged decode, draft and tree-verify kernels.

DECODE stores the step's K/V with ``triton_decode.store_kv`` (one launch for
k and v), unless the model's rope kernel already wrote them where
``kv_write_target`` pointed it, and runs ``triton_decode.decode_attention``. DRAFT rows (the MTP
drafter's query-only steps over the target's KV) run the same decode kernel
and store nothing: it reads each row's live prefix only. TARGET_VERIFY stores
the tree nodes' K/V, then runs each node over its request's prefix plus its
ancestors: ``triton_verify_onepass`` (one pass over a request's prefix for all
its nodes), or for width-invariant models (``AttentionSpec.width_invariant``,
``--batch-invariant``) ``triton_verify``, whose nodes round as decode's rows. Where every
tree is a chain (``VerifyInput.chain``: topk 1, the default) and the batch is small or the
model width-invariant, verify is decode's own kernel, each node a decode row whose last
keys are its chain's nodes (``decode_attention``'s ``chain``).
EXTEND (prefill, eager) is ``triton_extend.extend_attention``: every request's chunk in
one launch a layer, keys through the token table (the new K/V stored first). A chunk of
``SDPA_MIN_CHUNK`` tokens or more in a full-attention layer goes to the reference's SDPA
instead (cuDNN's flash kernel runs one long prompt 1.7x faster than the extend kernel; a
chunk after cached keys as two cuDNN calls merged by their log-sum-exps); the choice
depends on the request's own chunk, never on its neighbours.

Scratch (the kernels' per-split partials) is shared by every layer of one
(num_heads, head_dim, splits) and allocated on first use outside capture:
the graph runner's warm-up runs, largest bucket first, allocate it for the
largest graph batch before any capture begins. Its split dimension is what the
layer's longest row gets (``max_kv_splits`` of the context, or of the sliding
window). Decode and the width-invariant verify kernel take a row's splits from its
own length; for width-invariant models from that alone, so one request's bits never
depend on the batch around it. Other models' decode launches of many (row, KV head) pairs
give short rows fewer splits (``batch_short_splits``: at batch 64 on H100s, llama-1b's step
3-12% shorter over stops 83 and 85, Gemma 4 E2B's 7% at stop 85), and the default one-pass
verify kernel cuts a request's prefix by the batch's programs too.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from graphrt.core.attention.base import AttentionSpec, KVWrite
from graphrt.core.attention.torch_ref import (
    TorchAttentionBackend,
    TorchAttentionMetadata,
    expand_kv_heads,
)
from graphrt.core.batch import ForwardBatch, ForwardMode
from graphrt.core.errors import GraphrtError
from graphrt.core.memory import KVLayerSpec
from graphrt.devices.cuda import triton_decode
from graphrt.devices.cuda.triton_decode import (
    LISTED_ROW_KEYS,
    LONG_ROW_KEYS,
    NUM_KV_SPLITS,
    allocate_decode_scratch,
    batch_short_splits,
    decode_attention,
    long_block_n,
    max_kv_splits,
    store_kv,
)
from graphrt.devices.cuda.triton_extend import extend_attention, extend_metadata
from graphrt.devices.cuda.triton_verify import tree_verify_attention
from graphrt.devices.cuda.triton_verify_onepass import onepass_verify_attention

# Chunks this long (tokens) of full-attention layers run through SDPA, one call a request
# (H200, bf16, bench/extend_blocks.py: SDPA 814 us a layer against the kernel's 1,402 at
# 8,192 tokens; the kernel 62 against 181 at 512, where SDPA's dozen host-side ops a call
# also count). Windowed layers keep the kernel: SDPA would need an n x L mask there.
SDPA_MIN_CHUNK = 4096
# The longest head dim SDPA's flash and cuDNN kernels take (Hopper, torch 2.11).
FUSED_SDPA_MAX_HEAD_DIM = 256
# Verify batches of chains with at most this many (request, KV head) pairs run on decode's
# kernel, a node a row. One layer, H100, bf16, Gemma 4's 8 heads on one KV head, prefix
# 512, 5-node chains (bench/attention_layer.py, "rows us" against the one-pass kernel),
# us at 1 / 2 / 4 / 8 requests: head_dim 256 7.3 / 8.2 / 10.1 / 15.3 against 11.1 / 11.3 /
# 11.5 / 11.5; head_dim 512 11.2 / 13.8 / 19.4 / 29.9 against 20.6 / 20.8 / 20.5 / 21.2.
# Past it the one pass reads a request's prefix once for all its nodes, decode once a node.
CHAIN_ON_DECODE_MAX = 4


@dataclass
class TritonAttentionMetadata(TorchAttentionMetadata):
    # What the decode kernel reads: the batch's own tensors, which in a graph
    # are the runner's static buffers (so a replay sees the copied-in values).
    req_pool_indices: torch.Tensor  # (B,) int64
    seq_lens: torch.Tensor  # (B,) int32
    # EXTEND only (eager): extend_metadata's rows and the longest chunk (host).
    extend_meta: torch.Tensor | None = None
    max_extend_len: int = 0
    # Requests whose chunk full-attention layers send to SDPA, each chunk's first row,
    # and the kernel's rows and longest chunk without them (no such request: the kernel
    # takes every chunk).
    sdpa_requests: tuple[int, ...] = ()
    extend_starts_cpu: tuple[int, ...] = ()
    extend_meta_rest: torch.Tensor | None = None
    max_extend_len_rest: int = 0


class TritonAttentionBackend(TorchAttentionBackend):
    name = "triton"
    # Past flash's and cuDNN's head dims only the memory-efficient kernel is left, which
    # takes Gemma 4's 512 but no GQA, so a GQA call fell to the math kernel: 31.7 ms a
    # layer for an 8k prompt against 5.3 with K/V expanded (H100, torch 2.11,
    # bench/sdpa_prefill.py --shape gemma-global).
    sdpa_gqa_max_head_dim = FUSED_SDPA_MAX_HEAD_DIM

    def __init__(
        self,
        kv_pool,
        req_to_token_pool,
        num_kv_splits: int = NUM_KV_SPLITS,
        sdpa_min_chunk: int = SDPA_MIN_CHUNK,
    ):
        super().__init__(kv_pool, req_to_token_pool)
        self.num_kv_splits = num_kv_splits  # a short row's; longer rows get more
        self.sdpa_min_chunk = sdpa_min_chunk
        self._merge_chunks = True  # _causal_sdpa's cuDNN calls (off once refused)
        self._graph_bs = 0  # rows every scratch buffer holds once graphs are in use
        # (num_heads, head_dim, splits) -> (partial_out, partial_lse, partial_splits), shared
        # across layers.
        self._scratch: dict[tuple[int, int, int], tuple[torch.Tensor, ...]] = {}
        # NOTE: captured graphs keep raw pointers into scratch; a buffer replaced by
        # a larger one stays referenced here so it is never freed under a graph.
        self._retired: list[tuple[torch.Tensor, ...]] = []

    def long_row_keys(self, layers: Sequence[KVLayerSpec]) -> int | None:
        """LONG_ROW_KEYS where some layer with a cache of its own takes larger blocks for
        long rows (``long_block_n``): decode then launches stage 1 twice in batches flagged
        ``long_rows`` (once a layer in the others). Else LISTED_ROW_KEYS where
        LIST_LONG_ROWS: such batches launch stage 1 as one work list (``_decode_listed``)."""
        size = self.kv_pool.dtype.itemsize
        own = [spec for spec in layers if spec.cache_index is not None]
        if any(long_block_n(s.head_dim, size) for s in own):
            return LONG_ROW_KEYS
        return LISTED_ROW_KEYS if triton_decode.LIST_LONG_ROWS else None

    # ---- metadata hooks ----------------------------------------------------------

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        super().init_forward_metadata(batch)
        self._attach(batch, seq_lens=batch.seq_lens.to(torch.int32))
        if batch.mode is ForwardMode.EXTEND:  # one copy a forward, read by every layer
            meta = batch.attn_metadata
            meta.extend_meta = extend_metadata(
                batch.prefix_lens_cpu, batch.extend_lens_cpu, batch.input_ids.device
            )
            meta.max_extend_len = max(batch.extend_lens_cpu)
            lens = batch.extend_lens_cpu
            meta.sdpa_requests = tuple(i for i, n in enumerate(lens) if n >= self.sdpa_min_chunk)
            if meta.sdpa_requests:
                meta.extend_starts_cpu = tuple(itertools.accumulate(lens, initial=0))[:-1]
                meta.extend_meta_rest = extend_metadata(
                    batch.prefix_lens_cpu, lens, batch.input_ids.device, meta.sdpa_requests
                )
                rest = [n for i, n in enumerate(lens) if i not in meta.sdpa_requests]
                meta.max_extend_len_rest = max(rest, default=0)

    def init_graph_state(self, max_bs: int, max_tokens: int) -> None:
        super().init_graph_state(max_bs, max_tokens)
        # Rows, not requests: a verify graph's rows are its tokens.
        self._graph_bs = max(self._graph_bs, max_tokens)
        for key, (partial_out, *_) in list(self._scratch.items()):
            if partial_out.shape[0] < self._graph_bs:
                self._grow(key, self._graph_bs, partial_out.device)

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

    def kv_write_target(self, spec: AttentionSpec, batch: ForwardBatch) -> KVWrite | None:
        # Every mode reads the new K/V back from the cache, so the model's rope kernel
        # may store them there.
        if not spec.writes_kv:
            return None
        i = spec.cache_index
        return KVWrite(self.kv_pool.k_buffers[i], self.kv_pool.v_buffers[i], batch.out_cache_loc)

    def forward(self, q, k, v, spec: AttentionSpec, batch: ForwardBatch) -> torch.Tensor:
        k_buffer = self.kv_pool.k_buffers[spec.cache_index]
        v_buffer = self.kv_pool.v_buffers[spec.cache_index]
        if spec.writes_kv and k is not None:  # None: the model's rope kernel stored them
            # Its own launch, before attention: every split of a row must see the new K/V.
            store_kv(
                k.view(-1, spec.num_kv_heads, spec.head_dim),  # (T, Hkv, D)
                v.view(-1, spec.num_kv_heads, spec.head_dim),
                k_buffer,
                v_buffer,
                batch.out_cache_loc,
            )
        q = q.view(-1, spec.num_heads, spec.head_dim)  # (T, H, D)
        # Inside a graph this comes from the graph's pool, which owns it.
        out = torch.empty_like(q)
        meta = batch.attn_metadata
        if batch.mode is ForwardMode.EXTEND:
            to_sdpa = meta.sdpa_requests if spec.sliding_window is None else ()
            rows, longest = (
                (meta.extend_meta_rest, meta.max_extend_len_rest)
                if to_sdpa
                else (meta.extend_meta, meta.max_extend_len)
            )
            if longest:
                extend_attention(
                    q,
                    k_buffer,
                    v_buffer,
                    out,
                    self.req_to_token_pool.req_to_token,
                    meta.req_pool_indices,
                    rows,
                    longest,
                    spec.scaling,
                    spec.sliding_window,
                )
            for i in to_sdpa:
                self._extend_request(q, out, spec, batch, i, meta.extend_starts_cpu[i])
        elif batch.mode is ForwardMode.TARGET_VERIFY:
            scratch = self._scratch_for(spec.num_heads, spec.head_dim, self._splits(spec), q)
            args = (
                q,
                k_buffer,
                v_buffer,
                self.req_to_token_pool.req_to_token,
                meta.req_pool_indices,
                meta.seq_lens,
                batch.positions,
                batch.out_cache_loc,
                batch.spec_info.tree_mask,
                out,
                *scratch,
                spec.scaling,
                spec.sliding_window,
            )
            if self._chain_on_decode(spec, batch):
                decode_attention(
                    q, k_buffer, v_buffer, self.req_to_token_pool.req_to_token,
                    meta.req_pool_indices, meta.seq_lens, out, *scratch, spec.scaling,
                    spec.sliding_window, short_splits=self.num_kv_splits,
                    chain=(batch.out_cache_loc, batch.num_tokens // batch.batch_size),
                )  # fmt: skip
            elif spec.width_invariant:  # decode's splits and blocks: a node rounds as decode
                tree_verify_attention(*args, short_splits=self.num_kv_splits)
            else:
                onepass_verify_attention(*args)
        else:  # DECODE, and DRAFT rows (which wrote nothing above)
            scratch = self._scratch_for(spec.num_heads, spec.head_dim, self._splits(spec), q)
            long_rows = None  # width-invariant models keep one block size (verify reuses it)
            if batch.long_rows and not spec.width_invariant:
                block_n = long_block_n(spec.head_dim, k_buffer.element_size())
                long_rows = None if block_n is None else (LONG_ROW_KEYS, block_n)
            decode_attention(
                q,
                k_buffer,
                v_buffer,
                self.req_to_token_pool.req_to_token,
                meta.req_pool_indices,
                meta.seq_lens,
                out,
                *scratch,
                spec.scaling,
                spec.sliding_window,
                short_splits=self._decode_short_splits(spec, q.shape[0]),
                long_rows=long_rows,
                work_list=long_rows is None and self._decode_listed(spec, batch),
            )
        return out.view(-1, spec.num_heads * spec.head_dim)

    @staticmethod
    def _decode_listed(spec: AttentionSpec, batch: ForwardBatch) -> bool:
        """Stage 1 as one work list (``triton_decode.LIST_LONG_ROWS``): in batches flagged
        ``long_rows``, where a row's splits may queue on its own programs, and in layers
        that see rows of LISTED_ROW_KEYS keys (not a shorter window). A host fact of the
        graph's variant, as the flag is; the list changes no bit. HAZARD: in a model where
        some layers take long rows' blocks (long_row_keys gives LONG_ROW_KEYS), the others
        would list from 2,048 keys, where the list was not measured to pay (no such model
        yet)."""
        window = spec.sliding_window or 0
        see_long = window == 0 or window >= LISTED_ROW_KEYS
        return triton_decode.LIST_LONG_ROWS and batch.long_rows and see_long

    def _decode_short_splits(self, spec: AttentionSpec, rows: int) -> int:
        """A short row's splits in a decode launch of ``rows`` rows: fewer at large batches
        (``batch_short_splits``), except for width-invariant models, whose verify rows
        must round as decode rows at any batch (they keep ``num_kv_splits``). A host fact
        of the launch's shape: a graph's is its bucket's."""
        if spec.width_invariant:
            return self.num_kv_splits
        return batch_short_splits(rows * spec.num_kv_heads, self.num_kv_splits)

    @staticmethod
    def _chain_on_decode(spec: AttentionSpec, batch: ForwardBatch) -> bool:
        """Whether a verify batch runs on decode's kernel, each node a decode row (its
        chain's nodes as the row's last keys): where every tree is a chain, for a
        width-invariant model always (its rows then round as decode's by construction, and
        faster than ``triton_verify`` at every batch size), otherwise up to
        ``CHAIN_ON_DECODE_MAX`` (request, KV head) pairs, where the one-pass kernel's few
        programs leave the GPU idle. Host facts only: a graph's choice is its capture's."""
        if not getattr(batch.spec_info, "chain", False):
            return False
        return spec.width_invariant or batch.batch_size * spec.num_kv_heads <= CHAIN_ON_DECODE_MAX

    # ---- long chunks through SDPA ------------------------------------------------

    def _causal_sdpa(
        self, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, gqa: bool
    ) -> torch.Tensor:
        """A chunk after cached keys as two cuDNN calls merged by their log-sum-exps: the
        cached keys (all visible) and the chunk's own (causal), where the reference's one
        call needs a lower-right mask that cuDNN's fast kernel does not take (flash's
        serves it). H100, llama-1b's shape, a layer: 8,192 tokens after 8,192 2.35 ms
        against 2.93, after 24,576 4.72 against 6.50 (bench/sdpa_prefill.py, K/V expanded
        in both). Not at Gemma 4's head dim 512, where the split was slower (19.2 against
        17.0 ms), nor float32, which cuDNN does not take."""
        n, length, head_dim = q.shape[2], key.shape[2], q.shape[3]
        wide = head_dim > FUSED_SDPA_MAX_HEAD_DIM
        if n == length or wide or q.dtype == torch.float32 or not self._merge_chunks:
            return super()._causal_sdpa(q, key, value, scale, gqa)
        if gqa:  # (cuDNN's calls below take as many KV heads as query heads)
            key, value = expand_kv_heads(key, value, q.shape[1])
        # The layouts bench/sdpa_prefill.py checked the merge on: q contiguous (the chunk's
        # rows come strided, (1, H, n, D) over (n, H, D)), K/V expanded and sliced.
        q, cached = q.contiguous(), length - n
        try:
            cached_part = cudnn_with_lse(q, key[:, :, :cached], value[:, :, :cached], False, scale)
            own_part = cudnn_with_lse(q, key[:, :, cached:], value[:, :, cached:], True, scale)
        except RuntimeError:  # this torch or cuDNN refuses the call: the reference's, from now
            self._merge_chunks = False
            return super()._causal_sdpa(q, key, value, scale, False)
        return merge_by_lse(*cached_part, *own_part)  # (1, H, n, D)

    # ---- scratch -----------------------------------------------------------------

    def _splits(self, spec: AttentionSpec) -> int:
        """The scratch's split dimension for ``spec``'s layers: the splits of its longest
        visible range (the context, or the sliding window)."""
        keys = self.req_to_token_pool.req_to_token.shape[1]
        if spec.sliding_window:
            keys = min(keys, spec.sliding_window)
        return max_kv_splits(keys, self.num_kv_splits)

    def _scratch_for(
        self, num_heads: int, head_dim: int, splits: int, q: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows, key = q.shape[0], (num_heads, head_dim, splits)
        scratch = self._scratch.get(key)
        if scratch is None or scratch[0].shape[0] < rows:
            if q.is_cuda and torch.cuda.is_current_stream_capturing():
                raise GraphrtError(
                    f"triton attention scratch for {num_heads} heads x {head_dim} dims x {splits} "
                    f"splits, {rows} rows, is missing during graph capture; run a warm-up forward first"
                )
            # Powers of two: a run of growing eager batches reallocates a few times only.
            scratch = self._grow(key, max(1 << (rows - 1).bit_length(), self._graph_bs), q.device)
        return scratch

    def _grow(
        self, key: tuple[int, int, int], rows: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        old = self._scratch.get(key)
        if old is not None and self._graph_bs:  # graphs may have captured it
            self._retired.append(old)
        num_heads, head_dim, splits = key
        scratch = allocate_decode_scratch(rows, num_heads, head_dim, device, splits)
        self._scratch[key] = scratch
        return scratch


def cudnn_with_lse(
    q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """cuDNN's SDPA with its log-sum-exp (the public call returns no log-sum-exp):
    (1, H, n, D) and (1, H, L, D) -> (1, H, n, D), and (1, H, n, 1) float32."""
    out = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, key, value, None, True, 0.0, causal, False, scale=scale
    )
    return out[0], out[1].float().reshape(*q.shape[:3], 1)


def merge_by_lse(
    out1: torch.Tensor, lse1: torch.Tensor, out2: torch.Tensor, lse2: torch.Tensor
) -> torch.Tensor:
    """Attention over two disjoint sets of keys, (1, H, n, D) each with its (1, H, n, 1)
    log-sum-exp, as one over both: each weighed by its share of the softmax's sum."""
    top = torch.maximum(lse1, lse2)
    w1, w2 = torch.exp(lse1 - top), torch.exp(lse2 - top)
    return ((out1.float() * w1 + out2.float() * w2) / (w1 + w2)).to(out1.dtype)
