"""bench/ship_choices.py: a device call's tuner cache file, merged into the card's shipped
choices, answers a fresh machine's tuner for the shapes it timed and keeps the shapes
shipped before (stop 63: the shipped choices lacked the 30 shapes stop 61 added, and a
fresh H100's first command took 26.2 s against 12.1)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_shipped_merge_answers_a_fresh_tuner_and_keeps_older_choices(tmp_path, monkeypatch):
    pytest.importorskip("triton")
    from graphrt.devices.cuda.gemv_tuner import (
        CUBLAS,
        GemvTuner,
        _disk_key,
        cache_path,
        shipped_path,
    )
    from graphrt.devices.cuda.triton_gemv import ROW_CONFIGS

    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.setenv("GRAPHRT_CACHE_DIR", str(tmp_path / "cache"))
    from ship_choices import main, ship

    card = "NVIDIA H100 80GB HBM3"
    candidates = (CUBLAS, *ROW_CONFIGS)
    old_key, new_key, moved_key = (("linear", "1", n, 256) for n in (512, 1024, 2048))
    shipped_dir = tmp_path / "shipped"
    shipped_dir.mkdir()
    target = shipped_dir / shipped_path(card).name
    target.write_text(
        json.dumps({
            _disk_key(old_key, candidates): None,
            _disk_key(moved_key, candidates): None,
        })
    )  # fmt: skip

    # what a device's cold start leaves: the tuner's own cache file, the shapes it timed
    timed = GemvTuner()
    timed.use_cache(cache_path(card))
    timed.remember(new_key, ROW_CONFIGS[2], candidates)
    timed.remember(moved_key, ROW_CONFIGS[1], candidates)

    assert ship(cache_path(card), shipped_dir) == (target, 1, 1)
    fresh = GemvTuner()
    fresh.use_cache(tmp_path / "own.json", [target])
    assert fresh.recall(new_key, candidates) == ROW_CONFIGS[2]
    assert fresh.recall(moved_key, candidates) == ROW_CONFIGS[1]
    assert fresh.recall(old_key, candidates) is CUBLAS
    assert fresh.recall(("linear", "1", 4096, 256), candidates) == "unset"

    # a file that is not a tuner cache file: one line, exit 1
    stray = tmp_path / "choices.json"
    stray.write_text("{}")
    monkeypatch.setattr("sys.argv", ["ship_choices.py", str(stray), "--into", str(shipped_dir)])
    assert main() == 1


def test_every_shipped_choice_was_timed_among_candidates_offered_today():
    """A shipped choice counts only among the candidates it was timed among (their digest
    is in its key). A change to the candidate sets, or to how a configuration prints (the
    digest hashes reprs: a new GemvConfig field left every old one's repr as it was, stop
    73), silently sends a fresh machine back to timing every shape: such a change must come
    with shipped files timed anew. Each entry's digest is one of today's candidate sets
    (one row class's default candidates, the residual linear's one-chunk row
    configurations, or the batch-invariant ops' tiles), and its choice is one of that set."""
    pytest.importorskip("triton")
    import hashlib

    from graphrt.devices.cuda.gemv_tuner import CUBLAS, SHIPPED_DIR, default_candidates
    from graphrt.devices.cuda.triton_gemv import (
        ROW_CONFIGS,
        GemvConfig,
        invariant_configs,
    )

    sets = [default_candidates(rows) for rows in (1, 2)]
    sets += [(CUBLAS, *(c for c in ROW_CONFIGS if c.block_k >= k)) for k in (512, 1024, 2048)]
    sets += [invariant_configs(rows) for rows in (1, 17)]  # the batch-invariant ops' tiles
    offered = {hashlib.sha1(repr(s).encode()).hexdigest()[:12]: s for s in sets}
    files = sorted(SHIPPED_DIR.glob("*.json"))
    assert files
    for path in files:
        for key, fields in json.loads(path.read_text()).items():
            digest = key.rsplit(" among ", 1)[1]
            assert digest in offered, f"{path.name}: {key} was timed among candidates gone"
            choice = None if fields is None else GemvConfig(**fields)
            assert choice in offered[digest], f"{path.name}: {key} chose {choice}"
