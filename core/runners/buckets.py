"""Which batch sizes get a graph, and which graph a batch runs on: small pure functions."""

from __future__ import annotations

import bisect
from collections.abc import Iterable

from graphrt.core.errors import UsageError

DEFAULT_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256)


def select_buckets(max_bs: int, override: Iterable[int] | None = None) -> tuple[int, ...]:
    """Sorted bucket sizes, capped at ``max_bs`` (max running requests, or what the KV pool holds).

    With an override (``--graph-bs``) exactly those sizes are kept, minus any above the cap.
    """
    if max_bs < 1:
        raise UsageError(f"max batch size must be >= 1, got {max_bs}")
    sizes = DEFAULT_BUCKETS if override is None else tuple(override)
    if any(s < 1 for s in sizes):
        raise UsageError(f"graph batch sizes must be >= 1, got {sorted(sizes)}")
    kept = sorted({s for s in sizes if s <= max_bs})
    if override is None and max_bs not in kept and max_bs < DEFAULT_BUCKETS[-1]:
        kept.append(max_bs)  # every admissible batch has a bucket to pad to (above the
        # largest default bucket, batches past it run eagerly)
    return tuple(kept)


def pad_to_bucket(n: int, buckets: tuple[int, ...], padding: bool = True) -> int | None:
    """The bucket a batch of ``n`` runs on: the smallest >= n with padding, n itself without.

    None when no captured graph can take the batch (it then runs eager).
    """
    if not padding:
        return n if n in buckets else None
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None
