"""Torch reference attention (DESIGN.md layer 3) against naive softmax attention in float64:
decode, extend over a cached prefix, GQA, sliding windows, padding rows."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import CPU

from graphrt.core.attention import AttentionSpec, TorchAttentionBackend
from graphrt.core.batch import ForwardBatch, ForwardMode
from graphrt.core.memory import PADDING_SLOT, KVLayerSpec, ReqToTokenPool, TokenKVPool

H, HKV, D = 4, 2, 8
CONTEXT = 48
DTYPE = torch.float64


def _spec(window: int | None) -> AttentionSpec:
    return AttentionSpec(H, HKV, D, scaling=D**-0.5, cache_index=0, sliding_window=window)


class Cache:
    """Pools whose live requests hold random K/V at scattered (non-contiguous) slots."""

    def __init__(self, num_requests: int = 6, seed: int = 0):
        self.gen = torch.Generator().manual_seed(seed)
        self.req_pool = ReqToTokenPool(num_requests, CONTEXT, CPU)
        self.kv_pool = TokenKVPool(num_requests * CONTEXT, [KVLayerSpec(HKV, D, 0)], DTYPE, CPU)
        # Scatter: slot order unrelated to position order, as after frees and reuse.
        perm = torch.randperm(self.kv_pool.num_slots, generator=self.gen)
        self.kv_pool.free(self.kv_pool.alloc_host(self.kv_pool.num_slots)[perm])
        self.backend = TorchAttentionBackend(self.kv_pool, self.req_pool)

    def rand(self, *shape) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen, dtype=DTYPE)

    def new_request(self, cached: int) -> int:
        """A request slot whose first ``cached`` positions hold random K/V."""
        slot = self.req_pool.alloc()
        if cached:
            loc = self.kv_pool.alloc(cached)
            self.req_pool.req_to_token[slot, :cached] = loc
            self.kv_pool.set_kv(0, loc, self.rand(cached, HKV, D), self.rand(cached, HKV, D))
        return slot

    def kv(self, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        loc = self.req_pool.req_to_token[slot, :length]
        return self.kv_pool.k_buffers[0][loc].clone(), self.kv_pool.v_buffers[0][loc].clone()


def naive_attention(q, k, v, q_positions, window):
    """q: (n, H, D) at q_positions; k, v: (L, Hkv, D) at positions 0..L-1. Loops, no SDPA."""
    out = torch.zeros_like(q)
    group = H // HKV
    for i, p in enumerate(q_positions):
        for h in range(H):
            kh, vh = k[:, h // group], v[:, h // group]  # (L, D)
            visible = [j for j in range(len(k)) if j <= p and (window is None or j > p - window)]
            scores = torch.stack([q[i, h] @ kh[j] / math.sqrt(D) for j in visible])
            weights = torch.softmax(scores, dim=0)
            out[i, h] = sum(w * vh[j] for w, j in zip(weights, visible))
    return out


def _decode_batch(cache: Cache, slots: list[int], seq_lens: list[int]) -> ForwardBatch:
    """One new token per request at position seq_len - 1 (padding rows: slot 0, length 1)."""
    locs = []
    for slot, n in zip(slots, seq_lens):
        if slot == PADDING_SLOT:
            locs.append(PADDING_SLOT)
            continue
        loc = cache.kv_pool.alloc(1)
        cache.req_pool.req_to_token[slot, n - 1] = loc
        locs.append(int(loc))
    return ForwardBatch(
        mode=ForwardMode.DECODE,
        input_ids=torch.zeros(len(slots), dtype=torch.int64),
        positions=torch.tensor([n - 1 for n in seq_lens]),
        req_pool_indices=torch.tensor(slots),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        out_cache_loc=torch.tensor(locs),
        seq_lens_cpu=list(seq_lens),
        extend_lens_cpu=[1] * len(slots),
    )


@pytest.mark.parametrize("window", [None, 1, 5])
def test_decode_matches_naive(window):
    cache = Cache(seed=1)
    seq_lens = [1, 4, 7, 19, 33]
    slots = [cache.new_request(n - 1) for n in seq_lens]
    batch = _decode_batch(cache, slots, seq_lens)
    q, k, v = cache.rand(5, H * D), cache.rand(5, HKV * D), cache.rand(5, HKV * D)
    cache.backend.init_forward_metadata(batch)
    out = cache.backend.forward(q, k, v, _spec(window), batch).view(5, H, D)
    for i, (slot, n) in enumerate(zip(slots, seq_lens)):
        keys, values = cache.kv(slot, n)
        # The new token's K/V were written at its slot before attending.
        assert torch.equal(keys[-1], k[i].view(HKV, D)) and torch.equal(
            values[-1], v[i].view(HKV, D)
        )
        expected = naive_attention(q[i].view(1, H, D), keys, values, [n - 1], window)[0]
        torch.testing.assert_close(out[i], expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("window", [None, 6])
def test_decode_graph_metadata_matches_eager(window):
    """Graph replay reads max_kv_len = the context length; masking keeps results identical."""
    cache = Cache(seed=2)
    seq_lens = [3, 12, 30]
    slots = [cache.new_request(n - 1) for n in seq_lens]
    batch = _decode_batch(cache, slots, seq_lens)
    q, k, v = cache.rand(3, H * D), cache.rand(3, HKV * D), cache.rand(3, HKV * D)
    backend = cache.backend
    backend.init_forward_metadata(batch)
    eager = backend.forward(q, k, v, _spec(window), batch)
    backend.init_graph_state(max_bs=4, max_tokens=4)
    backend.init_metadata_for_replay(batch)
    assert batch.attn_metadata.max_kv_len == CONTEXT
    replay = backend.forward(q, k, v, _spec(window), batch)
    torch.testing.assert_close(replay, eager, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("window", [None, 4])
def test_extend_with_cached_prefix_matches_naive(window):
    cache = Cache(seed=3)
    prefixes, news = [0, 6, 13], [5, 1, 9]
    slots = [cache.new_request(p) for p in prefixes]
    locs = cache.kv_pool.alloc(sum(news))
    start = 0
    for slot, p, n in zip(slots, prefixes, news):
        cache.req_pool.req_to_token[slot, p : p + n] = locs[start : start + n]
        start += n
    seq_lens = [p + n for p, n in zip(prefixes, news)]
    batch = ForwardBatch(
        mode=ForwardMode.EXTEND,
        input_ids=torch.zeros(sum(news), dtype=torch.int64),
        positions=torch.cat([torch.arange(p, p + n) for p, n in zip(prefixes, news)]),
        req_pool_indices=torch.tensor(slots),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        out_cache_loc=locs,
        seq_lens_cpu=seq_lens,
        extend_lens_cpu=news,
    )
    T = sum(news)
    q, k, v = cache.rand(T, H * D), cache.rand(T, HKV * D), cache.rand(T, HKV * D)
    cache.backend.init_forward_metadata(batch)
    out = cache.backend.forward(q, k, v, _spec(window), batch).view(T, H, D)
    start = 0
    for slot, p, n in zip(slots, prefixes, news):
        keys, values = cache.kv(slot, p + n)
        assert torch.equal(keys[p:], k[start : start + n].view(n, HKV, D))
        q_i = q[start : start + n].view(n, H, D)
        expected = naive_attention(q_i, keys, values, list(range(p, p + n)), window)
        torch.testing.assert_close(out[start : start + n], expected, rtol=1e-10, atol=1e-12)
        start += n


@pytest.mark.parametrize("window", [None, 3])
def test_padding_row_is_finite_and_writes_only_slot_0(window):
    cache = Cache(seed=4)
    seq_lens = [9, 17]
    slots = [cache.new_request(n - 1) for n in seq_lens]
    # Garbage in the padding slot from earlier padded steps must not matter.
    cache.kv_pool.k_buffers[0][PADDING_SLOT] = 1e6
    q, k, v = cache.rand(3, H * D), cache.rand(3, HKV * D), cache.rand(3, HKV * D)

    real = _decode_batch(cache, slots, seq_lens)
    cache.backend.init_forward_metadata(real)
    expected = cache.backend.forward(q[:2], k[:2], v[:2], _spec(window), real)

    fill = cache.backend.seq_len_fill_value()
    assert fill == 1
    padded = ForwardBatch(
        mode=ForwardMode.DECODE,
        input_ids=torch.zeros(3, dtype=torch.int64),
        positions=torch.cat([real.positions, torch.tensor([fill - 1])]),
        req_pool_indices=torch.tensor([*slots, PADDING_SLOT]),
        seq_lens=torch.tensor([*seq_lens, fill], dtype=torch.int32),
        out_cache_loc=torch.cat([real.out_cache_loc, torch.tensor([PADDING_SLOT])]),
        seq_lens_cpu=[*seq_lens, fill],
        extend_lens_cpu=[1, 1, 1],
    )
    before_k = cache.kv_pool.k_buffers[0].clone()
    before_v = cache.kv_pool.v_buffers[0].clone()
    cache.backend.init_forward_metadata(padded)
    out = cache.backend.forward(q, k, v, _spec(window), padded)

    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[:2], expected, rtol=1e-12, atol=1e-12)  # real rows unaffected
    changed = (cache.kv_pool.k_buffers[0] != before_k).flatten(1).any(1)
    changed |= (cache.kv_pool.v_buffers[0] != before_v).flatten(1).any(1)
    assert changed.nonzero().flatten().tolist() == [PADDING_SLOT]
    assert cache.req_pool.req_to_token[PADDING_SLOT].eq(PADDING_SLOT).all()


@pytest.mark.parametrize("source", ["random:llama-tiny", "gemma4_tiny", "gemma4_assistant"])
def test_width_invariant_ops_reach_every_attention_layer(source, request):
    """A model's ops say whether its rows are width-invariant (``--batch-invariant``);
    every attention layer hands that to the backend (``AttentionSpec``), which verifies
    on decode's split schedule then, in one pass a request otherwise."""
    import dataclasses

    from graphrt.core.bench.timing import attention_specs
    from graphrt.core.models import TORCH_OPS, load_model

    if not source.startswith("random:"):
        source = str(request.getfixturevalue(source).path)
    for invariant in (False, True):
        ops = dataclasses.replace(TORCH_OPS, width_invariant=invariant)
        loaded = load_model(source, CPU, torch.float32, ops=ops)
        specs = list(attention_specs(loaded.model))
        assert specs and all(spec.width_invariant is invariant for spec in specs)
