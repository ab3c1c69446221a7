"""Bucket choice and padding (core/runners/buckets.py): which sizes get a graph, which
graph a batch runs on."""

from __future__ import annotations

import pytest

from graphrt.core.errors import GraphrtError
from graphrt.core.runners.buckets import DEFAULT_BUCKETS, pad_to_bucket, select_buckets


def test_default_list_is_capped_at_max_bs_and_the_cap_is_a_bucket():
    assert select_buckets(32) == (1, 2, 4, 8, 12, 16, 24, 32)  # 32 is already a bucket
    assert select_buckets(20) == (1, 2, 4, 8, 12, 16, 20)  # cap added: 17..20 have a graph
    assert select_buckets(1) == (1,)
    assert select_buckets(3) == (1, 2, 3)


def test_default_list_above_the_largest_bucket_is_the_whole_list():
    assert select_buckets(DEFAULT_BUCKETS[-1]) == DEFAULT_BUCKETS
    assert select_buckets(10_000) == DEFAULT_BUCKETS  # bigger batches run eager


def test_override_is_kept_exactly_sorted_and_deduplicated():
    assert select_buckets(64, [16, 3, 7]) == (3, 7, 16)  # no cap bucket added
    assert select_buckets(64, (8, 8, 2)) == (2, 8)
    assert select_buckets(10, [4, 12, 10, 64]) == (4, 10)  # sizes above the cap dropped
    assert select_buckets(2, [4, 8]) == ()  # the runner reports an empty list


@pytest.mark.parametrize("override", [[0], [4, -1], [0, 1, 2]])
def test_invalid_override_sizes_raise(override):
    with pytest.raises(GraphrtError, match=">= 1"):
        select_buckets(8, override)


@pytest.mark.parametrize("max_bs", [0, -4])
def test_invalid_cap_raises(max_bs):
    # A cap below 1 would otherwise become a bucket of its own (a graph of 0 rows).
    with pytest.raises(GraphrtError):
        select_buckets(max_bs)


@pytest.mark.parametrize(
    "n, expected",
    [(1, 1), (2, 4), (3, 4), (4, 4), (5, 16), (9, 16), (16, 16), (17, 32), (32, 32)],
)
def test_pad_to_the_smallest_bucket_that_fits(n, expected):
    assert pad_to_bucket(n, (1, 4, 16, 32)) == expected


def test_no_bucket_above_the_largest():
    assert pad_to_bucket(33, (1, 4, 16, 32)) is None
    assert pad_to_bucket(1, ()) is None


def test_exact_mode_only_captured_sizes():
    buckets = (1, 4, 16, 32)
    assert [pad_to_bucket(n, buckets, padding=False) for n in (1, 4, 16, 32)] == [1, 4, 16, 32]
    assert [pad_to_bucket(n, buckets, padding=False) for n in (2, 3, 9, 33)] == [None] * 4
