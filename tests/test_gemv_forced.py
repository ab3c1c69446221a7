"""bench/gemv_forced.py: a variant's choices file, where a tuner reads it, answers the forced
projections with the forced configuration (of the named row class only) and every other
shape as tuned; a configuration the tuner would not keep is refused up front."""

from __future__ import annotations

import json

import pytest
from helpers import load_bench


def test_a_forced_file_answers_the_tuner_with_the_forced_choice_only(tmp_path):
    pytest.importorskip("triton")
    import torch

    from graphrt.devices.cuda.gemv_tuner import CUBLAS, GemvTuner, _read_choices, default_candidates
    from graphrt.devices.cuda.triton_gemv import ROW_CONFIGS, GemvConfig, configs_for

    forced_bench = load_bench("gemv_forced")
    candidates = (CUBLAS, *ROW_CONFIGS)
    # The keys as ops.py builds them: (op, row class, N, K, dtype, ...); 2 to 16 rows are
    # one class.
    rope = ("linear_rope", "1", 3072, 2048, torch.bfloat16, False, True, 64)
    rope_8 = ("linear_rope", "2-16", 3072, 2048, torch.bfloat16, False, True, 64)
    o = ("linear", "1", 2048, 2048, torch.bfloat16, False, False, True)
    gate = ("linear", "1", 16384, 2048, torch.bfloat16, False, False, False)
    tuned = GemvTuner()
    tuned.use_cache(tmp_path / "tuned.json")
    for key in (rope, o, gate):
        tuned.remember(key, ROW_CONFIGS[4], candidates)  # 8:1024:8
    tuned.remember(rope_8, configs_for(8)[0], default_candidates(8))

    forced = forced_bench.parse_variant("linear_rope:3072x2048=4:2048:8,linear:2048x2048=2:2048:4")
    assert forced == {
        ("linear_rope", 3072, 2048): GemvConfig(4, 2048, num_warps=8, block_m=1),
        ("linear", 2048, 2048): GemvConfig(2, 2048, block_m=1),
    }
    entries = forced_bench.forced_file(_read_choices(tmp_path / "tuned.json"), forced, "1")
    (tmp_path / "forced.json").write_text(json.dumps(entries))
    reader = GemvTuner()
    reader.use_cache(tmp_path / "forced.json")
    assert reader.recall(rope, candidates) == GemvConfig(4, 2048, num_warps=8, block_m=1)
    assert reader.recall(o, candidates) == GemvConfig(2, 2048, block_m=1)
    assert reader.recall(gate, candidates) == ROW_CONFIGS[4]  # not named: as tuned
    assert reader.recall(rope_8, default_candidates(8)) == configs_for(8)[0]  # 2 to 16 rows
    assert forced_bench.parse_variant("tuned") == {}

    with pytest.raises(SystemExit, match="not a row-path configuration"):
        forced_bench.parse_variant("linear:2048x2048=4:4096:8")
    with pytest.raises(SystemExit, match="is not OP:NxK=N:K:W"):
        forced_bench.parse_variant("linear:2048=4:2048:8")
    with pytest.raises(SystemExit, match="no tuned choice for linear 4096x2048"):
        forced_bench.forced_file(entries, {("linear", 4096, 2048): ROW_CONFIGS[0]}, "1")
