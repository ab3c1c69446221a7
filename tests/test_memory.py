"""KV memory (DESIGN.md layer 1): request slots, token slots, slot 0 reserved for padding."""

from __future__ import annotations

import pytest
import torch
from helpers import CPU

from graphrt.core.errors import KVPoolExhaustedError
from graphrt.core.memory import PADDING_SLOT, KVLayerSpec, ReqToTokenPool, TokenKVPool


def _kv_pool(num_slots: int = 16) -> TokenKVPool:
    specs = [KVLayerSpec(2, 8, 0), KVLayerSpec(2, 8, 1)]
    return TokenKVPool(num_slots, specs, torch.float32, CPU)


# ---- ReqToTokenPool ---------------------------------------------------------------


def test_req_pool_never_hands_out_slot_0_and_exhausts():
    pool = ReqToTokenPool(4, 32, CPU)
    assert pool.req_to_token.shape == (5, 32)  # row 0 is the padding row
    slots = [pool.alloc() for _ in range(4)]
    assert sorted(slots) == [1, 2, 3, 4]
    assert pool.available() == 0
    with pytest.raises(KVPoolExhaustedError, match="4"):
        pool.alloc()


def test_req_pool_round_trip():
    pool = ReqToTokenPool(3, 8, CPU)
    a, b = pool.alloc(), pool.alloc()
    pool.free(a)
    assert pool.available() == 2
    c = pool.alloc()
    assert c == a and c != b  # a freed slot is reused
    pool.free(b)
    pool.free(c)
    assert pool.available() == 3
    assert sorted(pool.alloc() for _ in range(3)) == [1, 2, 3]


def test_req_pool_rejects_freeing_padding_or_free_slot():
    pool = ReqToTokenPool(2, 8, CPU)
    with pytest.raises(AssertionError):
        pool.free(PADDING_SLOT)
    slot = pool.alloc()
    pool.free(slot)
    with pytest.raises(AssertionError):
        pool.free(slot)  # double free


# ---- TokenKVPool ------------------------------------------------------------------


def test_kv_pool_buffers_have_a_padding_row():
    pool = _kv_pool(16)
    assert len(pool.k_buffers) == len(pool.v_buffers) == 2
    assert pool.k_buffers[0].shape == (17, 2, 8)
    assert pool.bytes_per_token == 2 * 2 * (2 * 8) * 4  # K+V, 2 layers, float32


def test_kv_pool_never_hands_out_slot_0_and_exhausts():
    pool = _kv_pool(16)
    slots = torch.cat([pool.alloc(5), pool.alloc(11)])
    assert sorted(slots.tolist()) == list(range(1, 17))
    assert pool.available() == 0
    with pytest.raises(KVPoolExhaustedError) as info:
        pool.alloc(1)
    assert "\n" not in str(info.value)
    assert pool.alloc(0).numel() == 0


def test_kv_pool_round_trip():
    pool = _kv_pool(16)
    a, b = pool.alloc(6), pool.alloc(6)
    pool.free(a)
    assert pool.available() == 10
    c = pool.alloc(10)
    assert set(c.tolist()).isdisjoint(b.tolist())  # never re-hands a live slot
    assert PADDING_SLOT not in c.tolist()
    pool.free(b)
    pool.free(c)
    assert pool.available() == pool.num_slots
    assert sorted(pool.alloc(16).tolist()) == list(range(1, 17))


def test_kv_pool_failed_alloc_takes_nothing():
    pool = _kv_pool(8)
    pool.alloc(5)
    with pytest.raises(KVPoolExhaustedError):
        pool.alloc(4)
    assert pool.available() == 3


def test_kv_pool_rejects_freeing_slot_0():
    pool = _kv_pool(8)
    slots = pool.alloc(3)
    with pytest.raises(AssertionError):
        pool.free(torch.cat([slots, torch.tensor([PADDING_SLOT])]))


def test_kv_pool_set_kv_writes_only_given_slots():
    pool = _kv_pool(8)
    loc = torch.tensor([3, 5])
    k = torch.randn(2, 2, 8)
    v = torch.randn(2, 2, 8)
    pool.set_kv(1, loc, k, v)
    assert torch.equal(pool.k_buffers[1][loc], k) and torch.equal(pool.v_buffers[1][loc], v)
    others = torch.ones(9, dtype=torch.bool)
    others[loc] = False
    assert not pool.k_buffers[1][others].any() and not pool.k_buffers[0].any()


def test_kv_sharing_layers_get_no_buffer():
    specs = [KVLayerSpec(2, 8, 0), KVLayerSpec(2, 8, None), KVLayerSpec(1, 16, 1)]
    pool = TokenKVPool(4, specs, torch.float32, CPU)
    assert [k.shape for k in pool.k_buffers] == [(5, 2, 8), (5, 1, 16)]
