"""Skinny matmuls for decode (M <= 16 rows): a Triton GEMV with fused epilogues.

At batch 1 cuBLAS reads a 2048 x 2048 projection at about 45% of copy
bandwidth on an H200 (bench profile, 2026-11-30). This kernel streams the
weight once, ``BLOCK_N`` output rows per program (a program owns whole output rows: no
atomics, no workspace, no second launch; split-K tiles, SPLIT_CONFIGS, are the one
exception, below), and can finish the layer's next elementwise op in registers:

- ``GATED``: the weight stacks gate rows over up rows ((2I, K), as
  ``GatedMLP.gate_up_proj``); the program reads both halves for its outputs
  and writes ``act(gate) * up`` (T, I), one launch instead of matmul + act.
- ``up`` given: ``act(x @ W^T) * up`` with ``up`` another tensor (Gemma 4's
  per-layer-input gate).
- ``norm`` given (a ``PreNorm``): x is first RMS-normalised as Llama's RMSNorm does
  (``weight * (x * inv_rms).to(dtype)``), each program computing the row's inv_rms
  itself (a first pass over x, an L1 hit in the second), so the norm is no launch.
- ``residual`` given: ``residual + x @ W^T``, the block's residual add, in the store.
- ``residual_norm`` given (a ``ResidualNorm``; one row, one K chunk): x is a Gemma 4
  block's output and the matmul reads the residual stream after it, ``(residual +
  gemma_norm(x) * weight) [* scalar]``, or that stream's next norm, and the first output
  tile's programs store the stream: the residual norm kernel's launch goes (the MLP's
  gate/up, the per-layer input's gate, and the next layer's input projection after the
  layer scalar: ``gemma_residual_linear``).
- ``rope`` given (a ``RopeWrite``): W is a Llama attention's q, k and v heads; each
  program owns rope pairs (a head's output j and j + D/2), rotates q and k as the rope
  kernel does (``triton_rope._rope_epilogue``), stores k and v into the KV cache and
  returns q: the rope kernel's launch goes.

Two paths. The row path (``block_m`` 1, decode's M = 1) computes a row with CUDA-core
products summed in a (BLOCK_N, BLOCK_K) tile; it serves any M, one program for every row
of its outputs, each row a one-row call's arithmetic. Tensor-core tiles (``block_m`` 16
to 128) serve more rows; their sums follow the MMAs' k order, so a row's bits do not
depend on M or the tile (batch invariance, see TILE_CONFIGS), and the fused norm's sum of
squares is the diagonal of x @ x.T for that reason (a tl.sum's tree follows the layout).
A tile may swap the MMA's operands (``swap_ab``: w @ x.T, the weight tile on the left), so
that 64 weight rows reach Hopper's wide MMA whatever M; the products and their k order are
the same, and so are the bits (SWAP_CONFIGS).

With ``norm`` before the projection that reads the residual stream, ``residual`` after
the one that writes it and ``rope`` on q/k/v, a Llama decode layer is 6 launches: qkv,
attention (2), o, gate/up, down.

Launched with programmatic dependent launch where the card has it (``pdl``: read
that file's contract before touching the order of loads here): where a program's K range
is one chunk (all of K, or a split-K tile's split) its weight tile is read before
``griddepcontrol.wait``, while the previous kernel drains; x, ``up`` and ``residual`` after
it.

Rounding follows the unfused reference: the matmul's result is rounded to the
activation dtype, then each elementwise step rounds as torch does
(``triton_ops._round``); only the matmul's float32 summation order differs
from cuBLAS. Which configuration (or cuBLAS) serves a shape is decided once by
``gemv_tuner``; this module only launches.

Split-K tiles (2 to 16 rows, few output tiles) split K over programs in one launch: each
split stores float32 sums in a workspace and counts itself in its tile's arrival count;
the last to arrive adds the sums in split order (the bits do not depend on which split
finished last), resets the count and runs the epilogue.

Capture-safe: no host reads of tensor values, outputs and the split-K workspace from
``torch.empty``; the arrival counts are one buffer per device, made before any capture.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from graphrt.core.attention.base import KVWrite
from graphrt.core.errors import GraphrtError
from graphrt.core.models.ops import PreNorm
from graphrt.devices.cuda import pdl
from graphrt.devices.cuda.triton_ops import (
    _INTERPRETED,
    _activate,
    _round,
    activation_code,
    inv_rms,
)
from graphrt.devices.cuda.triton_rope import _rope_epilogue

MAX_ROWS = 16  # M above this goes to cuBLAS: tensor-core tiles win there


@dataclass(frozen=True, repr=False)
class GemvConfig:
    block_n: int  # output rows per program
    block_k: int  # reduction chunk per loop iteration
    num_warps: int = 4
    num_stages: int = 3
    block_m: int = 16  # x rows per program: 1 is the CUDA-core row path, else tensor-core tiles
    split_k: int = 1  # tiles: programs along K per output tile, their sums added in split order
    # tiles: the weight tile is the MMA's left operand (BLOCK_N rows) and x's rows its right
    # (BLOCK_M columns), so BLOCK_N of 64 and more reaches the wide MMAs at any M
    swap_ab: bool = False

    def __repr__(self) -> str:
        # The tuner's cache keys digest reprs of candidates: configurations made before
        # swap_ab existed keep theirs (the shipped choices stay valid).
        fields = ", ".join(
            f"{f.name}={getattr(self, f.name)!r}"
            for f in dataclasses.fields(self)
            if f.name != "swap_ab" or self.swap_ab
        )
        return f"GemvConfig({fields})"

    @property
    def label(self) -> str:
        """Short and whole: the row path or the tile's rows, outputs x K chunk, warps,
        stages, splits, swapped operands (no two configurations read alike in a report)."""
        path = "row" if self.block_m == 1 else f"m{self.block_m}"
        split = f" split{self.split_k}" if self.split_k > 1 else ""
        swap = " swap" if self.swap_ab else ""
        launch = f"w{self.num_warps}s{self.num_stages}"
        return f"{path} {self.block_n}x{self.block_k} {launch}{split}{swap}"


# What the tuner tries (and the interpreter's default is the first): small blocks keep
# every SM busy on 1536..4096-row projections; big K chunks keep bytes in flight.
ROW_CONFIGS = (  # M == 1: a broadcast multiply and a row sum, no tensor cores
    GemvConfig(8, 512, block_m=1),
    GemvConfig(2, 1024, block_m=1),
    GemvConfig(4, 2048, num_warps=8, block_m=1),  # a whole 1536/2048 row in one iteration
    GemvConfig(2, 2048, block_m=1),
    GemvConfig(8, 1024, num_warps=8, block_m=1),
    GemvConfig(16, 512, num_warps=8, block_m=1),
    GemvConfig(16, 256, block_m=1),
)
DOT_CONFIGS = (  # 2 <= M <= 16: one 16-row tensor-core tile, rows beyond M masked
    GemvConfig(16, 256),
    GemvConfig(16, 512, num_warps=8),
    GemvConfig(16, 128, num_stages=4),
    GemvConfig(32, 128),
    GemvConfig(32, 256, num_warps=8),
    GemvConfig(64, 128, num_warps=8),
)


# Batch-invariant mode (ops.INVARIANT_OPS) runs every decode and verify matmul on tiles:
# all of them, 16 to 128 rows a tile, whatever BLOCK_N, BLOCK_K, warps and stages, give
# each row the same bits at any M (measured on the H200, bench/probe_invariance.py: the
# MMAs add in k order whatever the tile), so the tuner may pick per row class freely.
TILE_CONFIGS = (
    GemvConfig(32, 128, block_m=32),
    GemvConfig(64, 64, block_m=64),
    GemvConfig(64, 128, block_m=64),
    GemvConfig(128, 64, block_m=64),
    GemvConfig(128, 64, num_warps=8, block_m=128),
    GemvConfig(64, 128, num_warps=8, block_m=128),
)


# 2 <= M <= 16 on few output tiles (N = 1536 is 96 tiles of 16): K is split over programs,
# one launch (cuBLAS's split-K reduces in a second kernel, outside the PDL chain). A row's
# bits depend on the split: never offered where width invariance is asked for. Offered to
# the tuner: on the H200 they took the decode step of random:gemma4-e2b from 3.190 to
# 2.926 ms at batch 8 and the speculative round at batch 1 from 4.465 to 4.173 ms
# (BENCHMARKS.md, "Split-K GEMV tiles").
#
# A split whose K range is one chunk reads its weight tile before the PDL wait, as the
# row path does at one row. The last two are for that: 64 weight rows on the MMA's left
# (swap_ab), up to 16 splits of one chunk each (K up to 4096 and 8192; a K of 1536 in 6
# and 3 splits). On an H100 at 5 rows, timed the tuner's way, they took Gemma 4 E2B's
# sliding qkv from 5.7 us (cuBLAS, the best before) to 4.3, its sliding q from 5.4 to 4.0
# and its sliding o from 5.7 to 4.1; a round of 4 at batch 1 moved within its noise
# (BENCHMARKS.md, stop 75). Their few stages keep a gated tile that does loop (K over 16
# chunks) within shared memory (tests/test_gemv_split_order.py).
SPLIT_CONFIGS = (
    GemvConfig(16, 256, split_k=4),
    GemvConfig(16, 128, num_stages=4, split_k=4),
    GemvConfig(16, 256, split_k=8),
    GemvConfig(16, 128, num_stages=4, split_k=8),
    GemvConfig(32, 128, split_k=4),
    GemvConfig(64, 256, num_stages=2, split_k=16, swap_ab=True),
    GemvConfig(64, 512, num_warps=8, num_stages=1, split_k=16, swap_ab=True),
)


# Tiles with the operands swapped (w @ x.T): the weight tile is the MMA's left operand, so a
# tile of 64 weight rows runs Hopper's wide MMA (wgmma, 64 rows a warpgroup) with x's rows,
# padded to 16, as its columns. They give every row the 16-row tile's bits (every Gemma 4
# E2B and llama-1b projection at 1 and 5 rows, bench/swap_tiles.py; the CUDA invariance
# test), and are the faster tiles at 1 to 16 rows on most projections: on an H100 the
# batch-invariant ops' projections of a decode step at batch 1 took 2,115 us instead of
# 2,440 (Gemma 4 E2B) and 1,346 instead of 1,813 (llama-1b), and random:gemma4-e2b's
# --batch-invariant step 3.241 ms instead of 3.865 (BENCHMARKS.md, stop 73). These two
# were each within 1.8% of the best of seven tried, on every projection.
SWAP_CONFIGS = (
    GemvConfig(64, 128, num_stages=5, swap_ab=True),
    GemvConfig(64, 256, swap_ab=True),
)
# Split along K as well, each split over several chunks (the down projections' few output
# tiles want it). These and SWAP_CONFIGS took 2-3% off the default ops' projections at 5
# rows on an H100, measured per projection only (stop 73), and are not offered to them
# (bench/swap_tiles.py times them); the two swapped tiles in SPLIT_CONFIGS are, for their
# one-chunk splits' 20-28% on the small projections (stop 75, also per projection only).
SWAP_SPLIT_CONFIGS = (
    GemvConfig(64, 128, split_k=4, swap_ab=True),
    GemvConfig(64, 128, num_stages=4, split_k=8, swap_ab=True),
    GemvConfig(32, 256, split_k=4, swap_ab=True),
)


def configs_for(rows: int) -> tuple[GemvConfig, ...]:
    if rows == 1:
        return ROW_CONFIGS
    return DOT_CONFIGS + SPLIT_CONFIGS


def invariant_configs(rows: int) -> tuple[GemvConfig, ...]:
    """Tensor-core tiles only, swapped or not: the row path sums in another order."""
    return DOT_CONFIGS + SWAP_CONFIGS if rows <= MAX_ROWS else DOT_CONFIGS + TILE_CONFIGS


@triton.jit
def _dot(acc, x, w, PRECISE: tl.constexpr, SWAP_AB: tl.constexpr = False):
    """acc (BLOCK_M, BLOCK_N) += x (BLOCK_M, BLOCK_K) @ w (BLOCK_N, BLOCK_K).T on tensor
    cores; with ``SWAP_AB`` acc is (BLOCK_N, BLOCK_M) and gains w @ x.T (the same products
    in the same k order, the operands' roles swapped)."""
    if not PRECISE:  # the interpreter's dot mishandles bfloat16 operands (triton 3.7)
        x, w = x.to(tl.float32), w.to(tl.float32)
    a, b = x, tl.trans(w)
    if SWAP_AB:
        a, b = w, tl.trans(x)
    if PRECISE and x.dtype == tl.float32:  # not TF32: float32 keeps float32 products
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:  # 16-bit products are exact in float32
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _load_w(w_rows, up_offset, k0, K, n_mask, BLOCK_K: tl.constexpr, GATED: tl.constexpr):
    """The (BLOCK_N, BLOCK_K) weight tile at k0, and the up half's when GATED (else the same)."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    w_mask = n_mask[:, None] & (offs_k < K)[None, :]
    w = tl.load(w_rows + offs_k[None, :], mask=w_mask, other=0.0)
    w_up = w
    if GATED:
        w_up = tl.load(w_rows + up_offset + offs_k[None, :], mask=w_mask, other=0.0)
    return w, w_up


@triton.jit
def _inv_rms_rows(
    x_rows,
    m_mask,
    K,
    eps,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISE: tl.constexpr,
    ROW_K: tl.constexpr = 0,
):
    """(BLOCK_M, 1) float32 inv_rms of the x rows, as the RMSNorm kernel computes it.
    ``ROW_K`` (the row path, a power of two >= K): the whole row in one load, so the norm
    costs one memory latency after the PDL wait, not one per BLOCK_K chunk."""
    if BLOCK_M == 1:
        if ROW_K > 0:
            offs_k = tl.arange(0, ROW_K)
            mask = m_mask[:, None] & (offs_k < K)[None, :]
            x = tl.load(x_rows + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
            sum_sq = tl.sum(x * x, axis=1)[:, None]
        else:
            sq = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                mask = m_mask[:, None] & (offs_k < K)[None, :]
                x = tl.load(x_rows + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
                sq += x * x
            sum_sq = tl.sum(sq, axis=1)[:, None]
    else:
        # The diagonal of x @ x.T on tensor cores (16-bit products are exact): the MMAs add
        # in k order whatever the tile, so a row's sum does not depend on BLOCK_M, BLOCK_K or
        # the warps, as a tl.sum's reduction tree does (through the layout). Width invariance.
        gram = tl.zeros((BLOCK_M, BLOCK_M), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask = m_mask[:, None] & (offs_k < K)[None, :]
            x = tl.load(x_rows + offs_k[None, :], mask=mask, other=0.0)
            gram = _dot(gram, x, x, PRECISE)
        offs = tl.arange(0, BLOCK_M)
        diagonal = offs[:, None] == offs[None, :]
        sum_sq = tl.sum(tl.where(diagonal, gram, 0.0), axis=1)[:, None]  # one term a row: exact
    return inv_rms(sum_sq, K, eps, PRECISE)


@triton.jit
def _llama_normed(x, g, row_inv_rms, dtype: tl.constexpr):
    """float32 (R, C) x normed as Llama's RMSNorm rounds: (x * inv_rms) to the dtype, times
    the (1, C) weight ``g``, to the dtype again."""
    return _round(g * _round(x * row_inv_rms, dtype), dtype)


@triton.jit
def _gemma_normed(x, g, K, eps, dtype: tl.constexpr, PRECISE: tl.constexpr):
    """float32 (1, C) row x (masked lanes 0) normed as Gemma's RMSNorm in the residual norm
    kernel (``triton_gemma``): x * inv_rms * the (C,) weight ``g``, one rounding."""
    inv = inv_rms(tl.sum(x * x, axis=1)[:, None], K, eps, PRECISE)  # (1, 1)
    return _round(x * inv * g[None, :], dtype)


@triton.jit
def _residual_normed(
    h, g, PreResidual, XOut, row_m, m_mask, K, eps, stride_prm, store, scalar,
    BLOCK_K: tl.constexpr, dtype: tl.constexpr, PRECISE: tl.constexpr,
    HAS_SCALAR: tl.constexpr,
):  # fmt: skip
    """(1, BLOCK_K) x = (residual + gemma_norm(h) * g) [* scalar] of a row's float32 ``h``
    (one chunk, masked lanes 0), in the residual norm kernel's arithmetic
    (``triton_gemma``), stored to XOut where ``store``; float32 values of ``dtype``."""
    offs_k = tl.arange(0, BLOCK_K)
    mask = m_mask[:, None] & (offs_k < K)[None, :]
    normed = _gemma_normed(h, g, K, eps, dtype, PRECISE)
    r = tl.load(PreResidual + row_m[:, None] * stride_prm + offs_k[None, :], mask=mask, other=0.0)
    x = _round(r.to(tl.float32) + normed, dtype)
    if HAS_SCALAR:
        x = _round(x * scalar, dtype)
    if store:
        tl.store(XOut + row_m[:, None] * K + offs_k[None, :], x.to(dtype), mask=mask)
    return x


@triton.jit
def _load_x(
    x_rows, m_mask, NormWeight, row_inv_rms, k0, K, BLOCK_K: tl.constexpr, NORM: tl.constexpr, dtype
):
    """The (BLOCK_M, BLOCK_K) x chunk at k0 in float32, RMS-normalised when NORM, rounding as
    Llama's RMSNorm: (x * inv_rms) to the dtype, times the weight, to the dtype again."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    k_mask = offs_k < K
    x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
    x = x.to(tl.float32)
    if NORM:
        g = tl.load(NormWeight + offs_k, mask=k_mask, other=0.0).to(tl.float32)[None, :]
        x = _llama_normed(x, g, row_inv_rms, dtype)
    return x


@triton.jit
def _gemv_kernel(
    X,  # (M, K), unit stride in K
    W,  # (N_w, K) row-major: N output rows, or 2N (gate rows, then up rows) when GATED
    Bias,  # (N_w,), read when HAS_BIAS
    Up,  # (M, N), read when HAS_UP
    Residual,  # (M, N), read when HAS_RESIDUAL
    NormWeight,  # (K,), read when NORM or RES_NORM (the post norm's weight)
    Out,  # (M, N) contiguous
    Partial,  # float32 (tiles, SPLIT_K, [2,] BLOCK_M, BLOCK_N): the splits' sums, when SPLIT_K > 1
    Arrived,  # int32 (tiles,), zero between launches: the splits of each tile that are done
    Positions,  # (M,) int64, read when ROPE
    Cos,  # (P, HEAD_DIM) rope tables, read when ROPE (cast to the dtype: _rotated)
    Sin,
    KCache,  # (slots, Hkv, HEAD_DIM): the k rows' destination when ROPE, as is VCache the v's
    VCache,
    Loc,  # (M,) int64 KV slots, read when ROPE
    PreResidual,  # (M, K), read when RES_NORM
    XOut,  # (M, K) contiguous, written when RES_NORM (by the first output tile's programs)
    NextNormWeight,  # (K,), read when RES_NORM_NEXT
    LayerScalar,  # (1,), read when RES_SCALAR
    M,
    N,
    K,
    k_per_split,  # a multiple of BLOCK_K: the K range of one split
    stride_xm,
    stride_wn,
    stride_um,
    stride_rm,
    stride_prm,
    stride_cos,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_slot,
    stride_vc_head,
    eps,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    # a program's K range (all of K, or its split's) is one BLOCK_K chunk: the weight tile is
    # loaded before the PDL wait
    ONE_CHUNK: tl.constexpr,
    SPLIT_K: tl.constexpr,  # tiles only: programs along K per output tile (1: none)
    SWAP_AB: tl.constexpr,  # tiles only: w @ x.T, the weight the MMA's left operand
    ROW_K: tl.constexpr,  # the row path's norm over several chunks: x's row in one load
    GATED: tl.constexpr,
    HAS_UP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    NORM: tl.constexpr,
    # x is Gemma's residual stream after a block: PreResidual + gemma_norm(X) * NormWeight,
    # rounded as the residual norm kernel rounds; stored to XOut, then multiplied (the row
    # path with one chunk only)
    RES_NORM: tl.constexpr,
    RES_SCALAR: tl.constexpr,  # ... x is that times LayerScalar (rounded), as Gemma's layer end
    RES_NORM_NEXT: tl.constexpr,  # ... and the matmul reads gemma_norm(x) * NextNormWeight
    ACT: tl.constexpr,  # activation_code(): 0 none
    PRECISE: tl.constexpr,
    USE_PDL: tl.constexpr,
    ROPE: tl.constexpr,  # W is q, k, v heads: rope on q and k, k and v into the KV cache
    HEAD_DIM: tl.constexpr,  # ROPE: each head's rows, all rotated (rotate-half)
    Q_ROWS: tl.constexpr,  # ROPE: q's rows (Out's width), then KV_ROWS of k, KV_ROWS of v
    KV_ROWS: tl.constexpr,
):
    dtype = Out.dtype.element_ty
    # Splits vary slowest in launch order: the first programs read the first K range of
    # every output tile, the last ones (the likely finishers) the last range.
    tiles = tl.num_programs(0) // SPLIT_K
    tile = tl.program_id(0) % tiles
    split = tl.program_id(0) // tiles
    if BLOCK_M == 1:  # the row path: one program serves every row of its BLOCK_N outputs
        m_tiles = 1
        offs_m = tl.arange(0, 1)
    else:
        # Row tiles vary fastest in launch order: the tiles sharing a weight tile run
        # together and read it once from memory, the others from L2. (One grid axis: the
        # second is limited to 65535 programs, fewer than an LM head needs.)
        m_tiles = tl.cdiv(M, BLOCK_M)
        offs_m = (tile % m_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
    if ROPE:
        # A program's outputs are rope pairs: output j of a head beside output j + D/2,
        # which rope mixes ([lo0, hi0, lo1, hi1, ...]); any BLOCK_N serves, since a pair
        # never straddles a head.
        lane = tl.arange(0, BLOCK_N)
        pair = (tile // m_tiles) * (BLOCK_N // 2) + lane // 2
        half = HEAD_DIM // 2
        offs_n = (pair // half) * HEAD_DIM + (lane % 2) * half + pair % half
    else:
        offs_n = (tile // m_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    w_rows = W + offs_n.to(tl.int64)[:, None] * stride_wn  # (BLOCK_N, 1) row pointers
    up_offset = N * stride_wn
    k_lo = split * k_per_split  # this program's K range (0 but for split-K tiles)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()  # the next kernel may start its weight reads
    # One chunk: the whole weight tile is read first, overlapping the previous kernel's tail.
    if ONE_CHUNK:
        w_first, w_up_first = _load_w(w_rows, up_offset, k_lo, K, n_mask, BLOCK_K, GATED)
        if (NORM or RES_NORM) and BLOCK_M == 1:  # the norm's weight (never written)
            offs_k = tl.arange(0, BLOCK_K)
            g_first = tl.load(NormWeight + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
            g_next = g_first
            if RES_NORM_NEXT:
                g_next = tl.load(NextNormWeight + offs_k, mask=offs_k < K, other=0.0)
                g_next = g_next.to(tl.float32)
            layer_scalar = 1.0
            if RES_SCALAR:  # a parameter, like the weights
                layer_scalar = tl.load(LayerScalar).to(tl.float32)
    if USE_PDL:
        pdl.wait_for_predecessor()  # the previous kernel's outputs (x, up, residual) are ready
    if BLOCK_M == 1:
        # Width invariance: each row runs exactly the arithmetic of a one-row call, whatever
        # M (a verify forward's rows equal decode's bit for bit). Elementwise products are
        # summed in a (BLOCK_N, BLOCK_K) float32 tile, reduced across K once at the end (a
        # reduction per chunk costs shuffles every iteration). With one chunk the weight tile
        # stays in registers for every row; else each row re-reads it (from L1/L2).
        for row in range(0, M):
            row_m = row + offs_m  # (1,)
            m_mask = row_m < M
            x_rows = X + row_m[:, None] * stride_xm  # (1, 1)
            part = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
            part_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
            if ONE_CHUNK:
                # x read once: its sum of squares and its normalised values both from it
                x = _load_x(x_rows, m_mask, NormWeight, None, 0, K, BLOCK_K, False, dtype)
                if NORM:
                    row_inv_rms = inv_rms(tl.sum(x * x, axis=1)[:, None], K, eps, PRECISE)
                    x = _llama_normed(x, g_first[None, :], row_inv_rms, dtype)
                if RES_NORM:
                    x = _residual_normed(
                        x, g_first, PreResidual, XOut, row_m, m_mask, K, eps, stride_prm,
                        tile == 0, layer_scalar, BLOCK_K, dtype, PRECISE, RES_SCALAR,
                    )  # fmt: skip
                    if RES_NORM_NEXT:  # as the residual norm kernel's next norm
                        x = _gemma_normed(x, g_next, K, eps, dtype, PRECISE)
                part += x * w_first.to(tl.float32)
                if GATED:
                    part_up += x * w_up_first.to(tl.float32)
            else:
                row_inv_rms = tl.zeros((1, 1), dtype=tl.float32)
                if NORM:
                    row_inv_rms = _inv_rms_rows(x_rows, m_mask, K, eps, 1, BLOCK_K, PRECISE, ROW_K)
                for k0 in range(0, K, BLOCK_K):
                    x = _load_x(
                        x_rows, m_mask, NormWeight, row_inv_rms, k0, K, BLOCK_K, NORM, dtype
                    )
                    w, w_up = _load_w(w_rows, up_offset, k0, K, n_mask, BLOCK_K, GATED)
                    part += x * w.to(tl.float32)
                    if GATED:
                        part_up += x * w_up.to(tl.float32)
            acc = tl.sum(part, axis=1)[None, :]  # (1, BLOCK_N)
            acc_up = tl.sum(part_up, axis=1)[None, :]
            if ROPE:
                _rope_epilogue(
                    acc, row_m, m_mask, offs_n, Bias, Out, Positions, Cos, Sin, KCache, VCache,
                    Loc, stride_cos, stride_kc_slot, stride_kc_head, stride_vc_slot,
                    stride_vc_head, dtype, HAS_BIAS, 1, BLOCK_N, HEAD_DIM, Q_ROWS, KV_ROWS,
                )  # fmt: skip
            else:
                _epilogue(
                    acc, acc_up, row_m, m_mask, offs_n, n_mask, Bias, Up, Residual, Out, N,
                    stride_um, stride_rm, dtype, GATED, HAS_UP, HAS_BIAS, HAS_RESIDUAL, ACT,
                    PRECISE,
                )  # fmt: skip
    else:
        m_mask = offs_m < M
        x_rows = X + offs_m[:, None] * stride_xm  # (BLOCK_M, 1)
        row_inv_rms = tl.zeros((BLOCK_M, 1), dtype=tl.float32)
        if NORM:
            row_inv_rms = _inv_rms_rows(x_rows, m_mask, K, eps, BLOCK_M, BLOCK_K, PRECISE)
        if SWAP_AB:  # the sums transposed until the loop ends
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = acc
        if ONE_CHUNK:  # all of K, or one split's chunk (the splits' sums below)
            x = _load_x(x_rows, m_mask, NormWeight, row_inv_rms, k_lo, K, BLOCK_K, NORM, dtype)
            acc = _dot(acc, x.to(dtype), w_first, PRECISE, SWAP_AB)
            if GATED:
                acc_up = _dot(acc_up, x.to(dtype), w_up_first, PRECISE, SWAP_AB)
        else:
            k_hi = K
            if SPLIT_K > 1:  # this program's K range
                k_hi = tl.minimum(K, k_lo + k_per_split)
            for k0 in range(k_lo, k_hi, BLOCK_K):
                x = _load_x(x_rows, m_mask, NormWeight, row_inv_rms, k0, K, BLOCK_K, NORM, dtype)
                w, w_up = _load_w(w_rows, up_offset, k0, K, n_mask, BLOCK_K, GATED)
                # x (BLOCK_M, BLOCK_K), w (BLOCK_N, BLOCK_K)
                acc = _dot(acc, x.to(dtype), w, PRECISE, SWAP_AB)
                if GATED:
                    acc_up = _dot(acc_up, x.to(dtype), w_up, PRECISE, SWAP_AB)
        if SWAP_AB:  # (BLOCK_N, BLOCK_M) -> (BLOCK_M, BLOCK_N), as the epilogues take them
            acc, acc_up = tl.trans(acc), tl.trans(acc_up)
        finish = True
        if SPLIT_K > 1:  # the tile's last split to arrive adds up all of them and finishes
            acc, acc_up, finish = _split_sums(
                acc, acc_up, Partial, Arrived, tile, split, BLOCK_M, BLOCK_N, SPLIT_K, GATED
            )
        if finish and ROPE:
            _rope_epilogue(
                acc, offs_m, m_mask, offs_n, Bias, Out, Positions, Cos, Sin, KCache, VCache, Loc,
                stride_cos, stride_kc_slot, stride_kc_head, stride_vc_slot, stride_vc_head,
                dtype, HAS_BIAS, BLOCK_M, BLOCK_N, HEAD_DIM, Q_ROWS, KV_ROWS,
            )  # fmt: skip
        elif finish:
            _epilogue(
                acc, acc_up, offs_m, m_mask, offs_n, n_mask, Bias, Up, Residual, Out, N,
                stride_um, stride_rm, dtype, GATED, HAS_UP, HAS_BIAS, HAS_RESIDUAL, ACT, PRECISE,
            )  # fmt: skip


@triton.jit
def _split_sums(
    acc, acc_up, Partial, Arrived, tile, split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT_K: tl.constexpr, GATED: tl.constexpr,
):  # fmt: skip
    """Split-K without atomics on the sums: each split stores its (BLOCK_M, BLOCK_N) float32
    sums (and the up half's), then counts itself in ``Arrived[tile]``. The one that counts
    last adds every split's sums in split order, so the bits do not depend on which split
    finished last, resets the count for the next launch and returns True (the others:
    False, their sums unused)."""
    halves: tl.constexpr = 2 if GATED else 1
    size: tl.constexpr = BLOCK_M * BLOCK_N
    offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    tile_sums = Partial + tile.to(tl.int64) * (SPLIT_K * halves * size)
    tl.store(tile_sums + split * (halves * size) + offs, acc)
    if GATED:
        tl.store(tile_sums + split * (halves * size) + size + offs, acc_up)
    # Every warp's stores before the count: Triton issues a scalar atomic from one thread
    # (then a barrier, so all see its result), and a release orders only what that thread
    # has seen; this barrier makes the other warps' stores part of it. (Stop 64, the PTX
    # for sm_90: Triton's shared-memory hazard pass had put one there for every split
    # configuration, the stores' layout conversion sharing memory with the atomic's
    # result, but nothing promised it; tests/test_gemv_split_order.py.)
    tl.debug_barrier()
    # acq_rel at GPU scope: the stores above are visible to the program that reads a later
    # count, and that program's loads below see every earlier split's stores.
    arrived = tl.atomic_add(Arrived + tile, 1, sem="acq_rel")
    last = arrived == SPLIT_K - 1
    if last:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):  # L2 only (.cg): other SMs wrote them
            acc += tl.load(tile_sums + s * (halves * size) + offs, cache_modifier=".cg")
            if GATED:
                acc_up += tl.load(
                    tile_sums + s * (halves * size) + size + offs, cache_modifier=".cg"
                )
        tl.store(Arrived + tile, 0)
    return acc, acc_up, last


@triton.jit
def _epilogue(
    acc, acc_up, offs_m, m_mask, offs_n, n_mask, Bias, Up, Residual, Out, N, stride_um, stride_rm,
    dtype: tl.constexpr, GATED: tl.constexpr, HAS_UP: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, ACT: tl.constexpr, PRECISE: tl.constexpr,
):  # fmt: skip
    """Bias, activation, gate product, ``up`` product and residual on the float32
    (rows, BLOCK_N) sums, rounding where the unfused ops round; stores the rows."""
    if HAS_BIAS:
        acc += tl.load(Bias + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y = _round(acc, dtype)
    if ACT != 0:
        y = _round(_activate(y, ACT, PRECISE), dtype)
    if GATED:
        if HAS_BIAS:
            acc_up += tl.load(Bias + N + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        y = _round(y * _round(acc_up, dtype), dtype)
    out_mask = m_mask[:, None] & n_mask[None, :]
    if HAS_UP:
        up = tl.load(Up + offs_m[:, None] * stride_um + offs_n[None, :], mask=out_mask, other=0.0)
        y = _round(y * up.to(tl.float32), dtype)
    if HAS_RESIDUAL:  # torch's residual add: in float32, rounded once
        res = tl.load(Residual + offs_m[:, None] * stride_rm + offs_n[None, :], mask=out_mask)
        y = _round(y + res.to(tl.float32), dtype)
    tl.store(Out + offs_m[:, None] * N + offs_n[None, :], y.to(dtype), mask=out_mask)


# Split-K's arrival counts, one per output tile, zero between launches (the last split of a
# tile resets its own): one buffer per device, for every launch. HAZARD: two split launches
# must not run at once on one device (one stream; PDL is safe: a kernel touches the counts
# only after its griddepcontrol.wait, when the one before has finished).
MAX_SPLIT_TILES = 1 << 16
_ARRIVED: dict[torch.device, torch.Tensor] = {}


def _splits(config: GemvConfig, k: int, tiles: int, gated: bool, device: torch.device):
    """(K per split, splits, the splits' float32 sums, the arrival counts) for a launch;
    one split (and the output standing in for both buffers) where there is nothing to
    split: the row path, one K chunk, or more tiles than the counts cover."""
    chunks = triton.cdiv(k, config.block_k)
    if config.block_m == 1 or config.split_k == 1 or chunks == 1 or tiles > MAX_SPLIT_TILES:
        return k, 1, None, None
    k_per_split = triton.cdiv(chunks, config.split_k) * config.block_k
    splits = triton.cdiv(k, k_per_split)
    arrived = _ARRIVED.get(device)
    if arrived is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # its zeros would be the graph's memory, freed with the graph
            raise GraphrtError("a split-K GEMV first ran under graph capture: warm up first")
        arrived = _ARRIVED[device] = torch.zeros(MAX_SPLIT_TILES, dtype=torch.int32, device=device)
    halves = 2 if gated else 1
    partial = torch.empty(
        tiles * splits * halves * config.block_m * config.block_n,
        dtype=torch.float32,
        device=device,
    )
    return k_per_split, splits, partial, arrived


class RopeWrite(NamedTuple):
    """The GEMV's q/k/v epilogue: rope on q and k (rotate-half over every lane of a head),
    k and v stored into the KV cache, q returned; the weight's rows are q's heads, then
    k's, then v's (a Llama-family attention's merged projection)."""

    positions: torch.Tensor  # (M,) int64
    cos: torch.Tensor  # (P, D): the model's tables (its dtype, or float32), read as rope reads them
    sin: torch.Tensor
    kv_write: KVWrite  # caches (slots, Hkv, D), loc (M,) int64
    num_heads: int

    @property
    def head_dim(self) -> int:
        return self.kv_write.k_buffer.shape[-1]

    @property
    def q_rows(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_rows(self) -> int:
        return self.kv_write.k_buffer.shape[-2] * self.head_dim

    def check(self, x: torch.Tensor, weight: torch.Tensor, other_epilogue: bool) -> None:
        k_buffer, v_buffer, loc = self.kv_write.k_buffer, self.kv_write.v_buffer, self.kv_write.loc
        assert not other_epilogue, "rope: no activation, product or residual beside it"
        assert weight.shape[0] == self.q_rows + 2 * self.kv_rows, (
            f"weight {tuple(weight.shape)}: q {self.q_rows} + k, v {self.kv_rows} rows each"
        )
        assert self.head_dim % 2 == 0 and self.cos.shape[1] == self.head_dim, (
            f"cos {tuple(self.cos.shape)}: rope over all {self.head_dim} lanes of a head"
        )
        assert self.cos.stride() == self.sin.stride() and self.cos.stride(1) == 1
        assert self.positions.shape == loc.shape == (x.shape[0],)
        assert k_buffer.shape == v_buffer.shape and k_buffer.stride(-1) == v_buffer.stride(-1) == 1

    def tensors(self) -> tuple[torch.Tensor, ...]:
        w = self.kv_write
        return self.positions, self.cos, self.sin, w.k_buffer, w.v_buffer, w.loc

    def strides(self) -> tuple[int, ...]:
        w = self.kv_write
        return self.cos.stride(0), *w.k_buffer.stride()[:2], *w.v_buffer.stride()[:2]


class ResidualNorm(NamedTuple):
    """The GEMV's Gemma prologue: its input is ``(residual + gemma_norm(x) * weight) [*
    scalar]`` (the residual stream after a block whose output is x), stored into ``x_out``
    (the same shape, contiguous) as the residual norm kernel would, or that stream's next
    norm: one launch fewer."""

    residual: torch.Tensor  # (M, K), unit stride in K
    weight: torch.Tensor  # (K,)
    eps: float
    x_out: torch.Tensor  # (M, K) contiguous, written
    # (K,): the matmul reads gemma_norm(x) * next_weight instead (the next block's norm)
    next_weight: torch.Tensor | None = None
    scalar: torch.Tensor | None = None  # (1,): the layer scalar, after the add

    def check(self, x: torch.Tensor, config: GemvConfig, other_prologue: bool) -> None:
        assert not other_prologue, "residual_norm: no Llama norm or residual add beside it"
        assert config.block_m == 1 and x.shape[1] <= config.block_k, (
            f"{config}: the residual norm runs on the row path with one K chunk"
        )
        assert self.residual.shape == x.shape and self.residual.stride(1) == 1
        assert self.x_out.shape == x.shape and self.x_out.is_contiguous()
        for w in (self.weight, self.next_weight):
            assert w is None or (w.shape == (x.shape[1],) and w.stride(0) == 1)
        assert self.scalar is None or self.scalar.numel() == 1, f"scalar {self.scalar.shape}"

    def tensors(self) -> tuple[torch.Tensor, ...]:
        nxt = self.weight if self.next_weight is None else self.next_weight
        return self.residual, self.x_out, nxt, self.weight if self.scalar is None else self.scalar


# The row path's norm reads x's row in one load up to this K (a float32 register each 128
# columns a thread at four warps); wider rows sum chunk by chunk.
ROW_K_MAX = 8192


def _row_k(config: GemvConfig, k: int, norm: bool) -> int:
    """``ROW_K``: x's row in one load for the row path's norm over several chunks, else 0."""
    if not norm or config.block_m != 1 or k <= config.block_k or k > ROW_K_MAX:
        return 0
    return triton.next_power_of_2(k)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: GemvConfig,
    act: str | None = None,
    gated: bool = False,
    up: torch.Tensor | None = None,
    norm: PreNorm | None = None,
    residual: torch.Tensor | None = None,
    rope: RopeWrite | None = None,
    residual_norm: ResidualNorm | None = None,
) -> torch.Tensor:
    """``norm(x) @ weight.T (+ bias)`` for (M <= 16, K) ``x``, then optionally ``act`` and a
    product (with ``gated`` the weight's second half is the up projection; with ``up`` the
    factor is that (M, N) tensor), then ``+ residual``. Returns a new (M, N) tensor in
    ``x``'s dtype. With ``rope`` (a ``RopeWrite``) the weight is q's heads, k's and v's:
    q and k are rotated, k and v go into the KV cache, and q (M, H * D) returns. With
    ``residual_norm`` (a ``ResidualNorm``; the row path, one K chunk) x is a block's output
    h, and the matmul reads Gemma's residual stream after it, stored into ``x_out``."""
    rows, k = x.shape
    n = weight.shape[0] // (2 if gated else 1)
    if rope is not None:
        rope.check(x, weight, gated or act is not None or up is not None or residual is not None)
    if residual_norm is not None:
        residual_norm.check(x, config, norm is not None or residual is not None)
        norm = PreNorm(residual_norm.weight, residual_norm.eps)  # its weight and eps
    assert weight.shape[1] == k and weight.stride(1) == 1 and x.stride(1) == 1, (
        f"x {tuple(x.shape)} / weight {tuple(weight.shape)}: K must match, unit stride"
    )
    assert weight.dtype == x.dtype, f"weight {weight.dtype} vs x {x.dtype}"
    if up is not None:
        assert up.shape == (rows, n) and up.stride(1) == 1, f"up {tuple(up.shape)}"
    if residual is not None:
        assert residual.shape == (rows, n) and residual.stride(1) == 1, (
            f"residual {tuple(residual.shape)}, expected {(rows, n)}"
        )
    if norm is not None:
        assert norm.weight.shape == (k,) and norm.weight.dtype == x.dtype, (
            f"norm weight {tuple(norm.weight.shape)} {norm.weight.dtype}, x {x.dtype} K={k}"
        )
        assert norm.weight.stride(0) == 1, f"norm weight stride {norm.weight.stride()}"
    if bias is not None:  # read with unit stride, both halves where gated
        assert bias.shape == (weight.shape[0],) and bias.stride(0) == 1, (
            f"bias {tuple(bias.shape)} (stride {bias.stride()}), weight {tuple(weight.shape)}"
        )
    width = n if rope is None else rope.q_rows
    out = torch.empty((rows, width), dtype=x.dtype, device=x.device)
    if rows == 0 or n == 0:
        return out
    m_tiles = 1 if config.block_m == 1 else triton.cdiv(rows, config.block_m)
    tiles = m_tiles * triton.cdiv(n, config.block_n)
    k_per_split, splits, partial, arrived = _splits(config, k, tiles, gated, x.device)
    _gemv_kernel[(tiles * splits,)](
        x,
        weight,
        weight if bias is None else bias,
        out if up is None else up,
        out if residual is None else residual,
        weight if norm is None else norm.weight,
        out,
        out if partial is None else partial,
        out if arrived is None else arrived,
        *(rope.tensors() if rope is not None else (out,) * 6),
        *(out,) * 4 if residual_norm is None else residual_norm.tensors(),
        rows,
        n,
        k,
        k_per_split,
        x.stride(0),
        weight.stride(0),
        0 if up is None else up.stride(0),
        0 if residual is None else residual.stride(0),
        0 if residual_norm is None else residual_norm.residual.stride(0),
        *(rope.strides() if rope is not None else (0,) * 5),
        0.0 if norm is None else float(norm.eps),
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        ONE_CHUNK=k_per_split <= config.block_k,
        SPLIT_K=splits,
        SWAP_AB=config.swap_ab,
        ROW_K=_row_k(config, k, norm is not None),
        GATED=gated,
        HAS_UP=up is not None,
        HAS_BIAS=bias is not None,
        HAS_RESIDUAL=residual is not None,
        NORM=norm is not None and residual_norm is None,
        RES_NORM=residual_norm is not None,
        RES_SCALAR=residual_norm is not None and residual_norm.scalar is not None,
        RES_NORM_NEXT=residual_norm is not None and residual_norm.next_weight is not None,
        ACT=activation_code(act),
        PRECISE=not _INTERPRETED,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        enable_fp_fusion=False,
        **pdl.launch_options(),
        ROPE=rope is not None,
        HEAD_DIM=1 if rope is None else rope.head_dim,
        Q_ROWS=0 if rope is None else rope.q_rows,
        KV_ROWS=0 if rope is None else rope.kv_rows,
    )
    return out
