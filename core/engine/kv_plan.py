"""How many KV slots the engine's pool holds and how long a request's context may be.

An accelerator sizes the pool like a serving engine (vLLM's --gpu-memory-utilization,
SGLang's --mem-fraction-static): a share of the memory left free once the weights are
loaded, less the graphs' logits buffers, and the context defaults to the model's own,
bounded by the pool. The CPU keeps a modest fixed pool (1 GiB) and a context of at most
4096: its graphs read the whole context every step (torch attention), and its memory is
the host's. Explicit sizes win: ``kv_pool_tokens``, then ``kv_cache_bytes``, then
``kv_memory_fraction``.
"""

from __future__ import annotations

from dataclasses import dataclass

from graphrt.core.errors import OutOfMemoryError

FIXED_KV_BYTES = 1 << 30  # devices that do not size from free memory (the CPU)
FIXED_CONTEXT_CAP = 4096  # their default context, at most


@dataclass(frozen=True)
class KVPlan:
    slots: int  # tokens the pool holds
    context: int  # the longest request, prompt and generated tokens
    sized_by: str  # what decided the slots, for the start-up line and `graphrt info`


def plan_kv(
    *,
    model_context: int,
    bytes_per_token: int,
    max_running_requests: int,
    max_context_len: int | None,
    kv_pool_tokens: int | None,
    kv_cache_bytes: int | None,
    memory_fraction: float | None,
    device_fraction: float | None,
    free_bytes: int | None,
    reserved_bytes: int = 0,
) -> KVPlan:
    """``memory_fraction`` (asked), else ``device_fraction`` (the device's default): the
    share of ``free_bytes`` (free device memory, weights loaded) the pool may take,
    ``reserved_bytes`` (the graphs' logits buffers) taken out of that share; neither, or
    free memory unknown: a fixed 1 GiB pool. ``max_context_len`` None: the model's,
    bounded by the pool, and at most 4096 on a device with no fraction of its own."""
    memory_fraction = memory_fraction or device_fraction
    by_fraction = memory_fraction is not None and free_bytes is not None
    explicit_context = max_context_len is not None
    if explicit_context:
        context = min(model_context, max_context_len)
    elif device_fraction is None:
        context = min(model_context, FIXED_CONTEXT_CAP)
    else:
        context = model_context
    most = max_running_requests * context  # no more can be live at once
    if kv_pool_tokens is not None:
        return KVPlan(kv_pool_tokens, context, "as set")
    if kv_cache_bytes is not None:
        budget, sized_by = kv_cache_bytes, f"{kv_cache_bytes / 2**30:.2f} GiB as set"
    elif by_fraction:
        budget = int(memory_fraction * free_bytes) - reserved_bytes
        sized_by = f"{memory_fraction:.0%} of the {free_bytes / 2**30:.1f} GiB free"
        if budget < bytes_per_token:
            raise OutOfMemoryError(
                f"no room for a KV pool: {memory_fraction:.0%} of the "
                f"{free_bytes / 2**30:.2f} GiB free after the weights, less "
                f"{reserved_bytes / 2**30:.2f} GiB for the graphs' logits, is under one "
                "token's KV: raise --kv-memory-fraction, or set --kv-pool-tokens and "
                "--max-running-requests lower"
            )
    else:
        budget, sized_by = FIXED_KV_BYTES, "this device's 1 GiB default"
    slots = max(1, min(budget // max(bytes_per_token, 1), most))
    if slots == most:  # the budget holds more than can ever be live
        sized_by = f"{max_running_requests} requests x {context} tokens, within {sized_by}"
    if not explicit_context:
        context = min(context, slots)  # one request may fill the pool, no more
    return KVPlan(slots, context, sized_by)
