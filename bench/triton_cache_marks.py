"""Triton's file cache, marking each kernel entry a process opens, for bench/h200.sh.

The device tool brings back files of at most 16 MiB. Each call carries the kernel caches
in (``.tcache/kernel-caches.txz``) and saves them again, so every kernel ever compiled,
stale sources included, stayed in the archive until it passed 16 MiB (22 MiB at stop 62)
and came back no more: the next call compiled everything again. With
``TRITON_CACHE_MANAGER=triton_cache_marks:MarkingCacheManager`` every entry that Triton
opens (a hit or a fresh compile, kernels and launcher modules alike) gets a ``.used``
file. h200.sh then saves only the marked entries: those of the work the call ran.
"""

from __future__ import annotations

from pathlib import Path

from triton.runtime.cache import FileCacheManager

MARK = ".used"


class MarkingCacheManager(FileCacheManager):
    """FileCacheManager that marks its entry's directory as used when made: Triton makes
    one per key for each lookup (``get_cache_manager``), before reading or compiling."""

    def __init__(self, key, override=False, dump=False):
        super().__init__(key, override, dump)
        if not (override or dump):  # the override and dump folders are not the cache
            Path(self.cache_dir, MARK).touch()
