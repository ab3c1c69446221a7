"""Split-K's hand-off, in the PTX compiled for an H200 (no GPU: Triton's compiler and
ptxas run anywhere). Each split stores its float32 sums from every warp, then counts
itself with one acq_rel atomic; the last to arrive reads every split's sums. Triton issues
a scalar atomic from one thread, and a release orders only what that thread has seen: the
other warps' stores must be made part of it by a CTA barrier before the atomic, or the
last split may add a sum not yet stored (a rare wrong result, never on the CPU lane's
interpreter). Stop 64 found none written in the kernel: Triton's shared-memory hazard
pass happened to place one there for every split configuration. The kernel now asks for
it; this holds every configuration the tuner may pick to it."""

from __future__ import annotations

import pytest
from helpers import needs_triton

# Every pointer of the GEMV by name, as a bfloat16 model launches it.
POINTERS = {
    **dict.fromkeys(
        (
            "X",
            "W",
            "Bias",
            "Up",
            "Residual",
            "NormWeight",
            "Out",
            "Cos",
            "Sin",
            "KCache",
            "VCache",
            "PreResidual",
            "XOut",
            "NextNormWeight",
            "LayerScalar",
        ),
        "*bf16",
    ),  # fmt: skip
    "Partial": "*fp32",
    "Arrived": "*i32",
    "Positions": "*i64",
    "Loc": "*i64",
}
# A 16-row tile split along K with PDL on (a verify's down projection); each case sets the rest
SPLIT_TILE = dict(
    BLOCK_M=16, BLOCK_N=16, BLOCK_K=256, ONE_CHUNK=False, SPLIT_K=4, SWAP_AB=False, ROW_K=0,
    GATED=False,
    HAS_UP=False, HAS_BIAS=False, HAS_RESIDUAL=True, NORM=False, RES_NORM=False,
    RES_SCALAR=False, RES_NORM_NEXT=False, ACT=0, PRECISE=True, USE_PDL=True, ROPE=False,
    HEAD_DIM=1, Q_ROWS=0, KV_ROWS=0,
)  # fmt: skip


def _split_configs():
    try:
        from graphrt.devices.cuda.triton_gemv import SPLIT_CONFIGS, SWAP_SPLIT_CONFIGS
    except ImportError:  # no triton: needs_triton skips
        return []
    return SPLIT_CONFIGS + SWAP_SPLIT_CONFIGS


def _compile_split(config, **constants):
    """SPLIT_TILE with ``config``'s tile and ``constants``, compiled for an H200."""
    from graphrt.devices.cuda.offline_compile import compile_for_h200
    from graphrt.devices.cuda.triton_gemv import _gemv_kernel

    constants = SPLIT_TILE | dict(
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT_K=config.split_k,
        SWAP_AB=config.swap_ab, **constants,
    )  # fmt: skip
    return compile_for_h200(
        _gemv_kernel, constants, num_warps=config.num_warps, pointers=POINTERS,
        num_stages=config.num_stages, aligned=True,
    )  # fmt: skip


@needs_triton
@pytest.mark.parametrize("one_chunk", [False, True], ids=["chunks", "one_chunk"])
@pytest.mark.parametrize("gated", [False, True], ids=["residual", "gated"])
@pytest.mark.parametrize("config", _split_configs(), ids=lambda c: c.label)
def test_a_split_counts_itself_only_after_every_warps_sums_are_stored(config, gated, one_chunk):
    """Whether a split loops over several K chunks or reads its one chunk's weight tile
    before the PDL wait (a split whose K range is one chunk), its sums are stored by every
    warp before it counts itself; and every split configuration fits an H200's shared
    memory either way, gated too (a launch that asks for more fails, and the tuner with
    it)."""
    from graphrt.devices.cuda.offline_compile import H200_SHARED_BYTES

    compiled = _compile_split(
        config, GATED=gated, HAS_RESIDUAL=not gated, ACT=1 if gated else 0, ONE_CHUNK=one_chunk
    )
    assert compiled.metadata.shared <= H200_SHARED_BYTES, compiled.metadata.shared
    lines = [line.strip() for line in compiled.asm["ptx"].splitlines()]
    (count,) = [i for i, line in enumerate(lines) if "atom.global.gpu.acq_rel.add" in line]
    stores = [i for i, line in enumerate(lines[:count]) if line.startswith("st.global")]
    barriers = [i for i, line in enumerate(lines[:count]) if line.startswith("bar.sync")]
    assert stores, "the splits' sums are stored before the count"
    assert barriers and barriers[-1] > stores[-1], "no CTA barrier between the sums and the count"


@needs_triton
@pytest.mark.parametrize("config", _split_configs(), ids=lambda c: c.label)
def test_a_one_chunk_split_reads_its_weight_before_the_pdl_wait(config):
    """A split whose K range is one chunk issues its weight tile's loads before
    ``griddepcontrol.wait`` in sm_90's PTX (they overlap the previous kernel's tail); a
    split over several chunks issues none there. Compiler or code that sank them past the
    wait would keep the bits and lose the overlap: only this notices."""
    import re

    def loads_before_the_wait(one_chunk: bool) -> int:
        compiled = _compile_split(config, ONE_CHUNK=one_chunk)
        before = compiled.asm["ptx"].split("griddepcontrol.wait")[0]
        return len(re.findall(r"\bld\.global|cp\.async\.c[ag]", before))

    assert loads_before_the_wait(True) > 0
    assert loads_before_the_wait(False) == 0


@needs_triton
def test_gemv_launches_a_split_of_one_chunk_as_one_chunk(monkeypatch):
    """The host side of the above: ``gemv`` tells the kernel ONE_CHUNK where each split's
    K range is one BLOCK_K chunk (2 splits where 4 were asked: K 200 is 2 chunks of 128),
    and not where a split loops (2 splits of 2 chunks of 64)."""
    import torch

    from graphrt.devices.cuda import triton_gemv
    from graphrt.devices.cuda.triton_gemv import GemvConfig, gemv

    launched = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append(kwargs)

    monkeypatch.setattr(triton_gemv, "_gemv_kernel", Recorder())
    x, w = torch.randn(3, 200), torch.randn(20, 200)
    for config in (GemvConfig(16, 128, split_k=4), GemvConfig(16, 64, split_k=2)):
        gemv(x, w, None, config)
    assert [(k["SPLIT_K"], k["ONE_CHUNK"]) for k in launched] == [(2, True), (2, False)]
