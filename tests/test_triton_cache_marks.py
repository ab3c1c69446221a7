"""bench/triton_cache_marks.py: with it as Triton's cache manager (bench/h200.sh sets
TRITON_CACHE_MANAGER), every cache entry Triton opens is marked, and only those, so the
device calls save the kernels their work used and no stale ones."""

from __future__ import annotations

from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_triton_marks_each_cache_entry_it_opens_and_no_other(tmp_path, monkeypatch):
    pytest.importorskip("triton")
    from triton.runtime.cache import get_cache_manager, get_override_manager

    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TRITON_OVERRIDE_DIR", str(tmp_path / "override"))
    monkeypatch.setenv("TRITON_CACHE_MANAGER", "triton_cache_marks:MarkingCacheManager")
    (tmp_path / "cache" / "carried-and-unused").mkdir(parents=True)

    # what triton.compile does for a kernel: a manager for its key, then its files
    compiled = get_cache_manager("ab" * 32)
    compiled.put(b"cubin", "kernel.cubin")
    hit = get_cache_manager("cd" * 32)  # a later lookup of an entry already there
    assert type(compiled).__name__ == "MarkingCacheManager"
    get_override_manager("ef" * 32)  # Triton's override folder is not the cache

    marked = sorted(mark.parent.name for mark in (tmp_path / "cache").glob("*/.used"))
    assert marked == sorted([Path(compiled.cache_dir).name, Path(hit.cache_dir).name])
    assert not list((tmp_path / "override").rglob(".used"))
