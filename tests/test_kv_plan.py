"""KV pool and context sizing (core/engine/kv_plan.py): a share of free memory on an
accelerator, the model's context bounded by the pool; a fixed pool and a capped context
on the CPU; explicit sizes win; no room is one error naming the flags."""

from __future__ import annotations

import pytest
import torch
from helpers import CPU, cpu_engine

from graphrt.core.engine import EngineConfig
from graphrt.core.engine.kv_plan import FIXED_CONTEXT_CAP, FIXED_KV_BYTES, plan_kv
from graphrt.core.errors import OutOfMemoryError, UsageError
from graphrt.core.models import load_model
from graphrt.devices.cpu import CpuDevice

GIB = 1 << 30
PER_TOKEN = 32 * 1024  # llama-1b's KV a token in bfloat16: 16 layers x 2 x 8 heads x 64 x 2


def plan(**overrides):
    args = dict(
        model_context=131072,
        bytes_per_token=PER_TOKEN,
        max_running_requests=32,
        max_context_len=None,
        kv_pool_tokens=None,
        kv_cache_bytes=None,
        memory_fraction=None,
        device_fraction=0.85,
        free_bytes=100 * GIB,
        reserved_bytes=0,
    )
    return plan_kv(**{**args, **overrides})


def test_an_accelerator_gives_the_pool_a_share_of_free_memory_and_the_model_its_context():
    p = plan(reserved_bytes=GIB)
    assert p.slots == (int(0.85 * 100 * GIB) - GIB) // PER_TOKEN  # 2,752,102 tokens
    assert p.context == 131072  # the model's: no 4096 cap
    assert p.sized_by == "85% of the 100.0 GiB free"
    # An asked fraction beats the device's; the graphs' reserve comes out of the share.
    assert plan(memory_fraction=0.5).slots == int(0.5 * 100 * GIB) // PER_TOKEN


def test_the_context_is_bounded_by_the_pool_unless_asked():
    small = plan(free_bytes=GIB)  # 0.85 GiB: 27,852 tokens, under the model's 131,072
    assert small.slots == int(0.85 * GIB) // PER_TOKEN
    assert small.context == small.slots  # one request may fill the pool, no more
    asked = plan(free_bytes=GIB, max_context_len=65536)
    assert asked.context == 65536  # asked for: kept (requests wait for slots)
    assert plan(max_context_len=10**9).context == 131072  # never past the model's


def test_the_pool_never_holds_more_than_every_request_at_full_context():
    p = plan(max_running_requests=2, max_context_len=1000)
    assert (p.slots, p.context) == (2000, 1000)
    assert p.sized_by == "2 requests x 1000 tokens, within 85% of the 100.0 GiB free"


def test_explicit_sizes_win_in_order():
    assert plan(kv_pool_tokens=512, kv_cache_bytes=GIB).slots == 512
    assert plan(kv_pool_tokens=512).sized_by == "as set"
    by_bytes = plan(kv_cache_bytes=GIB, memory_fraction=0.5)
    assert by_bytes.slots == GIB // PER_TOKEN and by_bytes.sized_by == "1.00 GiB as set"


def test_a_device_with_no_fraction_keeps_a_fixed_pool_and_a_capped_context():
    cpu = plan(device_fraction=None)
    assert cpu.slots == FIXED_KV_BYTES // PER_TOKEN
    assert cpu.context == FIXED_CONTEXT_CAP
    assert cpu.sized_by == "this device's 1 GiB default"
    # Free memory unknown: the fixed pool, but the device's uncapped context.
    assert plan(free_bytes=None).slots == FIXED_KV_BYTES // PER_TOKEN
    # A fraction asked on such a device sizes the pool; the context stays capped.
    asked = plan(device_fraction=None, memory_fraction=0.5)
    assert asked.slots == min(int(0.5 * 100 * GIB) // PER_TOKEN, 32 * FIXED_CONTEXT_CAP)
    assert asked.context == FIXED_CONTEXT_CAP


def test_no_room_for_a_pool_is_one_error_naming_the_flags():
    with pytest.raises(OutOfMemoryError, match="no room for a KV pool") as e:
        plan(free_bytes=GIB, reserved_bytes=GIB)
    assert "--kv-memory-fraction" in str(e.value) and "\n" not in str(e.value)


class _Accelerator(CpuDevice):
    """The CPU, sizing its KV pool like an accelerator with 512 KiB free."""

    kv_memory_fraction = 0.5

    def free_memory_bytes(self) -> int | None:
        return 512 << 10


def test_the_engine_sizes_its_pool_and_context_from_its_plan():
    loaded = load_model("random:llama-tiny", CPU, torch.float32)
    per_token = sum(2 * s.num_kv_heads * s.head_dim * 4 for s in loaded.model.kv_layer_specs())
    engine = cpu_engine(loaded, device=_Accelerator())
    slots = (256 << 10) // per_token  # half of 512 KiB: 512 tokens of 512 bytes
    assert engine.kv_pool.num_slots == engine.kv_plan.slots == slots == 512
    model_context = loaded.model.max_context_len
    assert engine.max_context_len == slots < model_context  # bounded by the pool
    # The CPU itself: the fixed pool, the capped context.
    cpu = cpu_engine(loaded)
    assert cpu.max_context_len == min(model_context, FIXED_CONTEXT_CAP)
    assert cpu.kv_plan.sized_by == "32 requests x 1024 tokens, within this device's 1 GiB default"


@pytest.mark.parametrize("fraction", [0, 1.5, -0.1, True, "half"])
def test_a_bad_fraction_is_refused(fraction):
    with pytest.raises(UsageError, match="kv_memory_fraction must be in"):
        EngineConfig(kv_memory_fraction=fraction)
