"""Skinny matmuls for decode (M <= 16 rows): a Triton GEMV with fused epilogues.

At batch 1 cuBLAS reads a 2048 x 2048 projection at about 45% of copy
bandwidth on an H200 (bench profile, 2026-11-30). This kernel streams the
weight once, ``BLOCK_N`` output rows per program, with no split-K (every
program owns whole output rows, so no atomics, no workspace, no second
launch), and can finish the layer's next elementwise op in registers:

- ``GATED``: the weight stacks gate rows over up rows ((2I, K), as
  ``GatedMLP.gate_up_proj``); the program reads both halves for its outputs
  and writes ``act(gate) * up`` (T, I), one launch instead of matmul + act.
- ``up`` given: ``act(x @ W^T) * up`` with ``up`` another tensor (Gemma 4's
  per-layer-input gate).
- ``norm`` given (a ``PreNorm``): x is first RMS-normalised as Llama's RMSNorm does
  (``weight * (x * inv_rms).to(dtype)``), each program computing the row's inv_rms
  itself (a first pass over x, an L1 hit in the second), so the norm is no launch.
- ``residual`` given: ``residual + x @ W^T``, the block's residual add, in the store.

Two paths. The row path (``block_m`` 1, decode's M = 1) computes a row with CUDA-core
products summed in a (BLOCK_N, BLOCK_K) tile; it serves any M, one program for every row
of its outputs, each row a one-row call's arithmetic. Tensor-core tiles (``block_m`` 16
to 128) serve more rows; their sums follow the MMAs' k order, so a row's bits do not
depend on M or the tile (batch invariance, see TILE_CONFIGS), and the fused norm's sum of
squares is the diagonal of x @ x.T for that reason (a tl.sum's tree follows the layout).

With ``norm`` before the projection that reads the residual stream and ``residual``
after the one that writes it, a Llama layer is 7 launches: qkv, rope, attention
(2), o, gate/up, down.

Launched with programmatic dependent launch where the card has it (``pdl``: read
that file's contract before touching the order of loads here): with one K chunk the
weight tile is read before ``griddepcontrol.wait``, while the previous kernel drains;
x, ``up`` and ``residual`` after it.

Rounding follows the unfused reference: the matmul's result is rounded to the
activation dtype, then each elementwise step rounds as torch does
(``triton_ops._round``); only the matmul's float32 summation order differs
from cuBLAS. Which configuration (or cuBLAS) serves a shape is decided once by
``gemv_tuner``; this module only launches.

Capture-safe: no host reads of tensor values, outputs from ``torch.empty``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from graphrt.core.models.ops import PreNorm
from graphrt.devices.cuda import pdl
from graphrt.devices.cuda.triton_ops import (
    _INTERPRETED,
    _activate,
    _round,
    activation_code,
    inv_rms,
)

MAX_ROWS = 16  # M above this goes to cuBLAS: tensor-core tiles win there


@dataclass(frozen=True)
class GemvConfig:
    block_n: int  # output rows per program
    block_k: int  # reduction chunk per loop iteration
    num_warps: int = 4
    num_stages: int = 3
    block_m: int = 16  # x rows per program: 1 is the CUDA-core row path, else tensor-core tiles


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


# The row path's product tiles a thread may hold at once, in float32 registers: rows per pass
# over the weight (row_group) grow until this is spent. Their sums do not depend on it.
ROW_GROUP_REGISTERS = 128


def row_group(config: GemvConfig, rows: int, k: int, gated: bool) -> int:
    """How many rows the row path takes per pass over the weight: 1, 2, 4 or 8, enough for
    ``rows`` where the registers allow (each row holds BLOCK_N x BLOCK_K float32 products
    spread over the program's threads, twice with the up half)."""
    if config.block_m != 1:
        return 1
    per_row = config.block_n * config.block_k // (32 * config.num_warps) * (2 if gated else 1)
    # One chunk: no tile is carried across a loop, the products are formed as the sum takes
    # them (sm_90 ptxas: 8 rows of 2 x 2048 in 236 registers, no spill; gated, 16: spills).
    budget = ROW_GROUP_REGISTERS * (2 if k <= config.block_k else 1)
    group = 1
    while group < min(rows, 8) and 2 * group * per_row <= budget:
        group *= 2
    return group


def configs_for(rows: int) -> tuple[GemvConfig, ...]:
    return ROW_CONFIGS if rows == 1 else DOT_CONFIGS


def invariant_configs(rows: int) -> tuple[GemvConfig, ...]:
    """Tensor-core tiles only: the row path sums in another order than the tiles."""
    return DOT_CONFIGS if rows <= MAX_ROWS else DOT_CONFIGS + TILE_CONFIGS


@triton.jit
def _dot(acc, x, w, PRECISE: tl.constexpr):
    """acc (16, BLOCK_N) += x (16, BLOCK_K) @ w (BLOCK_N, BLOCK_K).T on tensor cores."""
    if PRECISE:  # 16-bit products are exact in float32
        if x.dtype == tl.float32:  # not TF32: float32 keeps float32 products
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    else:  # the interpreter's dot mishandles bfloat16 operands (triton 3.7): float32 ones
        acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc)
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
    x_rows, m_mask, K, eps, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, PRECISE: tl.constexpr
):
    """(BLOCK_M, 1) float32 inv_rms of the x rows, as the RMSNorm kernel computes it."""
    if BLOCK_M == 1:
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
        x = _round(g * _round(x * row_inv_rms, dtype), dtype)
    return x


@triton.jit
def _row_begin(
    X, row, M, stride_xm, K, eps, ON: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, NORM: tl.constexpr, PRECISE: tl.constexpr,
):  # fmt: skip
    """The row path's row ``row``: its (1, 1) inv_rms (0 without NORM or past M) and zeroed
    (BLOCK_N, BLOCK_K) float32 product tiles (the up half's beside). ``ON`` false: unused."""
    row_m = row + tl.arange(0, 1)
    row_inv_rms = tl.zeros((1, 1), dtype=tl.float32)
    if ON and NORM:
        row_inv_rms = _inv_rms_rows(
            X + row_m[:, None] * stride_xm, row_m < M, K, eps, 1, BLOCK_K, PRECISE
        )
    part = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    return row_inv_rms, part, part


@triton.jit
def _row_fma(
    part, part_up, X, row, M, stride_xm, row_inv_rms, NormWeight, k0, K, w, w_up,
    ON: tl.constexpr, BLOCK_K: tl.constexpr, NORM: tl.constexpr, GATED: tl.constexpr, dtype,
):  # fmt: skip
    """Adds row ``row``'s products with the float32 weight chunk at k0 to its tiles. No branch
    on M: a row past it loads nothing (masked) and adds zeros, and the group's loads issue
    together (a branch per row serialised them: 5 rows took 5 rows' latency)."""
    if ON:
        row_m = row + tl.arange(0, 1)
        x_row = X + row_m[:, None] * stride_xm  # (1, 1)
        x = _load_x(x_row, row_m < M, NormWeight, row_inv_rms, k0, K, BLOCK_K, NORM, dtype)
        part = tl.fma(x, w, part)  # one instruction a product (the kernel fuses nothing itself)
        if GATED:
            part_up = tl.fma(x, w_up, part_up)
    return part, part_up


@triton.jit
def _add2(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton.jit
def _add4(a0, a1, a2, a3, b0, b1, b2, b3):
    return a0 + b0, a1 + b1, a2 + b2, a3 + b3


@triton.jit
def _add8(a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7):
    return a0 + b0, a1 + b1, a2 + b2, a3 + b3, a4 + b4, a5 + b5, a6 + b6, a7 + b7


@triton.jit
def _row_sums(t0, t1, t2, t3, t4, t5, t6, t7, ROW_GROUP: tl.constexpr, MERGED: tl.constexpr):
    """The group's (BLOCK_N, BLOCK_K) tiles each summed across K, (1, BLOCK_N) each (past
    ROW_GROUP: the first's, unused). MERGED: one reduction of several operands, one round
    of shuffles and barriers for the group, each tile summed in tl.sum's order (one layout,
    one tree); else a tl.sum a tile (the interpreter sums tl.sum with numpy, and any other
    reduction element by element in Python: other bits, and slow)."""
    if MERGED and ROW_GROUP == 8:
        s0, s1, s2, s3, s4, s5, s6, s7 = tl.reduce((t0, t1, t2, t3, t4, t5, t6, t7), 1, _add8)
    elif MERGED and ROW_GROUP == 4:
        s0, s1, s2, s3 = tl.reduce((t0, t1, t2, t3), 1, _add4)
        s4, s5, s6, s7 = s0, s0, s0, s0
    elif MERGED and ROW_GROUP == 2:
        s0, s1 = tl.reduce((t0, t1), 1, _add2)
        s2, s3, s4, s5, s6, s7 = s0, s0, s0, s0, s0, s0
    else:
        s0 = tl.sum(t0, axis=1)
        s1, s2, s3, s4, s5, s6, s7 = s0, s0, s0, s0, s0, s0, s0
        if ROW_GROUP > 1:
            s1 = tl.sum(t1, axis=1)
        if ROW_GROUP > 2:
            s2, s3 = tl.sum(t2, axis=1), tl.sum(t3, axis=1)
        if ROW_GROUP > 4:
            s4, s5 = tl.sum(t4, axis=1), tl.sum(t5, axis=1)
            s6, s7 = tl.sum(t6, axis=1), tl.sum(t7, axis=1)
    return (
        s0[None, :], s1[None, :], s2[None, :], s3[None, :],
        s4[None, :], s5[None, :], s6[None, :], s7[None, :],
    )  # fmt: skip


@triton.jit
def _row_end(
    acc, acc_up, row, M, offs_n, n_mask, Bias, Up, Residual, Out, N, stride_um, stride_rm,
    ON: tl.constexpr, dtype: tl.constexpr, GATED: tl.constexpr, HAS_UP: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, ACT: tl.constexpr, PRECISE: tl.constexpr,
):  # fmt: skip
    """Row ``row``'s epilogue and store from its (1, BLOCK_N) sums (a row past M: nothing)."""
    if ON:
        if row < M:
            row_m = row + tl.arange(0, 1)
            _epilogue(
                acc, acc_up, row_m, row_m < M, offs_n, n_mask, Bias, Up, Residual, Out, N,
                stride_um, stride_rm, dtype, GATED, HAS_UP, HAS_BIAS, HAS_RESIDUAL, ACT, PRECISE,
            )  # fmt: skip


@triton.jit
def _gemv_kernel(
    X,  # (M, K), unit stride in K
    W,  # (N_w, K) row-major: N output rows, or 2N (gate rows, then up rows) when GATED
    Bias,  # (N_w,), read when HAS_BIAS
    Up,  # (M, N), read when HAS_UP
    Residual,  # (M, N), read when HAS_RESIDUAL
    NormWeight,  # (K,), read when NORM
    Out,  # (M, N) contiguous
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_um,
    stride_rm,
    eps,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ONE_CHUNK: tl.constexpr,  # K <= BLOCK_K: the weight tile is loaded before the PDL wait
    ROW_GROUP: tl.constexpr,  # the row path's rows a pass over the weight: 1, 2, 4 or 8
    GATED: tl.constexpr,
    HAS_UP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    NORM: tl.constexpr,
    ACT: tl.constexpr,  # activation_code(): 0 none
    PRECISE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    dtype = Out.dtype.element_ty
    if BLOCK_M == 1:  # the row path: one program serves every row of its BLOCK_N outputs
        m_tiles = 1
        offs_m = tl.arange(0, 1)
    else:
        # Row tiles vary fastest in launch order: the tiles sharing a weight tile run
        # together and read it once from memory, the others from L2. (One grid axis: the
        # second is limited to 65535 programs, fewer than an LM head needs.)
        m_tiles = tl.cdiv(M, BLOCK_M)
        offs_m = (tl.program_id(0) % m_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = (tl.program_id(0) // m_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    w_rows = W + offs_n.to(tl.int64)[:, None] * stride_wn  # (BLOCK_N, 1) row pointers
    up_offset = N * stride_wn
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()  # the next kernel may start its weight reads
    # One chunk: the whole weight tile is read first, overlapping the previous kernel's tail.
    if ONE_CHUNK:
        w_first, w_up_first = _load_w(w_rows, up_offset, 0, K, n_mask, BLOCK_K, GATED)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the previous kernel's outputs (x, up, residual) are ready
    if BLOCK_M == 1:
        # Width invariance: each row runs exactly the arithmetic of a one-row call, whatever
        # M (a verify forward's rows equal decode's bit for bit). Products are accumulated
        # in the row's own (BLOCK_N, BLOCK_K) float32 tile, summed across K once at the end
        # (a sum per chunk costs shuffles every iteration). ROW_GROUP rows share each weight
        # chunk's load, their x loads issue together (no branch on M between them) and their
        # sums share one reduction: a pass over the weight per group, where a row at a time
        # re-read it (6 rows of Gemma 4's 262144 x 1536 head: 537 us against 180 for one,
        # H200). Eight rows, one name each (Triton has no arrays of tiles); a row past
        # ROW_GROUP is compiled out, one past M adds zeros and stores nothing.
        if ONE_CHUNK:  # converted once for every row
            w_first, w_up_first = w_first.to(tl.float32), w_up_first.to(tl.float32)
        for row0 in range(0, M, ROW_GROUP):
            # fmt: off
            i0, p0, u0 = _row_begin(X, row0 + 0, M, stride_xm, K, eps, True, BLOCK_N, BLOCK_K, NORM, PRECISE)
            i1, p1, u1 = _row_begin(X, row0 + 1, M, stride_xm, K, eps, ROW_GROUP > 1, BLOCK_N, BLOCK_K, NORM, PRECISE)
            i2, p2, u2 = _row_begin(X, row0 + 2, M, stride_xm, K, eps, ROW_GROUP > 2, BLOCK_N, BLOCK_K, NORM, PRECISE)
            i3, p3, u3 = _row_begin(X, row0 + 3, M, stride_xm, K, eps, ROW_GROUP > 3, BLOCK_N, BLOCK_K, NORM, PRECISE)
            i4, p4, u4 = _row_begin(X, row0 + 4, M, stride_xm, K, eps, ROW_GROUP > 4, BLOCK_N, BLOCK_K, NORM, PRECISE)
            i5, p5, u5 = _row_begin(X, row0 + 5, M, stride_xm, K, eps, ROW_GROUP > 5, BLOCK_N, BLOCK_K, NORM, PRECISE)
            i6, p6, u6 = _row_begin(X, row0 + 6, M, stride_xm, K, eps, ROW_GROUP > 6, BLOCK_N, BLOCK_K, NORM, PRECISE)
            i7, p7, u7 = _row_begin(X, row0 + 7, M, stride_xm, K, eps, ROW_GROUP > 7, BLOCK_N, BLOCK_K, NORM, PRECISE)
            if ONE_CHUNK:
                p0, u0 = _row_fma(p0, u0, X, row0 + 0, M, stride_xm, i0, NormWeight, 0, K, w_first, w_up_first, True, BLOCK_K, NORM, GATED, dtype)
                p1, u1 = _row_fma(p1, u1, X, row0 + 1, M, stride_xm, i1, NormWeight, 0, K, w_first, w_up_first, ROW_GROUP > 1, BLOCK_K, NORM, GATED, dtype)
                p2, u2 = _row_fma(p2, u2, X, row0 + 2, M, stride_xm, i2, NormWeight, 0, K, w_first, w_up_first, ROW_GROUP > 2, BLOCK_K, NORM, GATED, dtype)
                p3, u3 = _row_fma(p3, u3, X, row0 + 3, M, stride_xm, i3, NormWeight, 0, K, w_first, w_up_first, ROW_GROUP > 3, BLOCK_K, NORM, GATED, dtype)
                p4, u4 = _row_fma(p4, u4, X, row0 + 4, M, stride_xm, i4, NormWeight, 0, K, w_first, w_up_first, ROW_GROUP > 4, BLOCK_K, NORM, GATED, dtype)
                p5, u5 = _row_fma(p5, u5, X, row0 + 5, M, stride_xm, i5, NormWeight, 0, K, w_first, w_up_first, ROW_GROUP > 5, BLOCK_K, NORM, GATED, dtype)
                p6, u6 = _row_fma(p6, u6, X, row0 + 6, M, stride_xm, i6, NormWeight, 0, K, w_first, w_up_first, ROW_GROUP > 6, BLOCK_K, NORM, GATED, dtype)
                p7, u7 = _row_fma(p7, u7, X, row0 + 7, M, stride_xm, i7, NormWeight, 0, K, w_first, w_up_first, ROW_GROUP > 7, BLOCK_K, NORM, GATED, dtype)
            else:
                for k0 in range(0, K, BLOCK_K):
                    w, w_up = _load_w(w_rows, up_offset, k0, K, n_mask, BLOCK_K, GATED)
                    w, w_up = w.to(tl.float32), w_up.to(tl.float32)
                    p0, u0 = _row_fma(p0, u0, X, row0 + 0, M, stride_xm, i0, NormWeight, k0, K, w, w_up, True, BLOCK_K, NORM, GATED, dtype)
                    p1, u1 = _row_fma(p1, u1, X, row0 + 1, M, stride_xm, i1, NormWeight, k0, K, w, w_up, ROW_GROUP > 1, BLOCK_K, NORM, GATED, dtype)
                    p2, u2 = _row_fma(p2, u2, X, row0 + 2, M, stride_xm, i2, NormWeight, k0, K, w, w_up, ROW_GROUP > 2, BLOCK_K, NORM, GATED, dtype)
                    p3, u3 = _row_fma(p3, u3, X, row0 + 3, M, stride_xm, i3, NormWeight, k0, K, w, w_up, ROW_GROUP > 3, BLOCK_K, NORM, GATED, dtype)
                    p4, u4 = _row_fma(p4, u4, X, row0 + 4, M, stride_xm, i4, NormWeight, k0, K, w, w_up, ROW_GROUP > 4, BLOCK_K, NORM, GATED, dtype)
                    p5, u5 = _row_fma(p5, u5, X, row0 + 5, M, stride_xm, i5, NormWeight, k0, K, w, w_up, ROW_GROUP > 5, BLOCK_K, NORM, GATED, dtype)
                    p6, u6 = _row_fma(p6, u6, X, row0 + 6, M, stride_xm, i6, NormWeight, k0, K, w, w_up, ROW_GROUP > 6, BLOCK_K, NORM, GATED, dtype)
                    p7, u7 = _row_fma(p7, u7, X, row0 + 7, M, stride_xm, i7, NormWeight, k0, K, w, w_up, ROW_GROUP > 7, BLOCK_K, NORM, GATED, dtype)
            s0, s1, s2, s3, s4, s5, s6, s7 = _row_sums(p0, p1, p2, p3, p4, p5, p6, p7, ROW_GROUP, PRECISE)
            t0, t1, t2, t3, t4, t5, t6, t7 = s0, s1, s2, s3, s4, s5, s6, s7  # the up halves' sums
            if GATED:
                t0, t1, t2, t3, t4, t5, t6, t7 = _row_sums(u0, u1, u2, u3, u4, u5, u6, u7, ROW_GROUP, PRECISE)
            _row_end(s0, t0, row0 + 0, M, offs_n, n_mask, Bias, Up, Residual, Out, N, stride_um, stride_rm, True, dtype, GATED, HAS_UP, HAS_BIAS, HAS_RESIDUAL, ACT, PRECISE)
            _row_end(s1, t1, row0 + 1, M, offs_n, n_mask, Bias, Up, Residual, Out, N, stride_um, stride_rm, ROW_GROUP > 1, dtype, GATED, HAS_UP, HAS_BIAS, HAS_RESIDUAL, ACT, PRECISE)
            _row_end(s2, t2, row0 + 2, M, offs_n, n_mask, Bias, Up, Residual, Out, N, stride_um, stride_rm, ROW_GROUP > 2, dtype, GATED, HAS_UP, HAS_BIAS, HAS_RESIDUAL, ACT, PRECISE)
            _row_end(s3, t3, row0 + 3, M, offs_n, n_mask, Bias, Up, Residual, Out, N, stride_um, stride_rm, ROW_GROUP > 3, dtype, GATED, HAS_UP, HAS_BIAS, HAS_RESIDUAL, ACT, PRECISE)
            _row_end(s4, t4, row0 + 4, M, offs_n, n_mask, Bias, Up, Residual, Out, N, stride_um, stride_rm, ROW_GROUP > 4, dtype, GATED, HAS_UP, HAS_BIAS, HAS_RESIDUAL, ACT, PRECISE)
            _row_end(s5, t5, row0 + 5, M, offs_n, n_mask, Bias, Up, Residual, Out, N, stride_um, stride_rm, ROW_GROUP > 5, dtype, GATED, HAS_UP, HAS_BIAS, HAS_RESIDUAL, ACT, PRECISE)
            _row_end(s6, t6, row0 + 6, M, offs_n, n_mask, Bias, Up, Residual, Out, N, stride_um, stride_rm, ROW_GROUP > 6, dtype, GATED, HAS_UP, HAS_BIAS, HAS_RESIDUAL, ACT, PRECISE)
            _row_end(s7, t7, row0 + 7, M, offs_n, n_mask, Bias, Up, Residual, Out, N, stride_um, stride_rm, ROW_GROUP > 7, dtype, GATED, HAS_UP, HAS_BIAS, HAS_RESIDUAL, ACT, PRECISE)
            # fmt: on
    else:
        m_mask = offs_m < M
        x_rows = X + offs_m[:, None] * stride_xm  # (BLOCK_M, 1)
        row_inv_rms = tl.zeros((BLOCK_M, 1), dtype=tl.float32)
        if NORM:
            row_inv_rms = _inv_rms_rows(x_rows, m_mask, K, eps, BLOCK_M, BLOCK_K, PRECISE)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if ONE_CHUNK:
            x = _load_x(x_rows, m_mask, NormWeight, row_inv_rms, 0, K, BLOCK_K, NORM, dtype)
            acc = _dot(acc, x.to(dtype), w_first, PRECISE)
            if GATED:
                acc_up = _dot(acc_up, x.to(dtype), w_up_first, PRECISE)
        else:
            for k0 in range(0, K, BLOCK_K):
                x = _load_x(x_rows, m_mask, NormWeight, row_inv_rms, k0, K, BLOCK_K, NORM, dtype)
                w, w_up = _load_w(w_rows, up_offset, k0, K, n_mask, BLOCK_K, GATED)
                acc = _dot(acc, x.to(dtype), w, PRECISE)  # (BLOCK_M, BLOCK_K) x (BLOCK_N, BLOCK_K)
                if GATED:
                    acc_up = _dot(acc_up, x.to(dtype), w_up, PRECISE)
        _epilogue(
            acc, acc_up, offs_m, m_mask, offs_n, n_mask, Bias, Up, Residual, Out, N,
            stride_um, stride_rm, dtype, GATED, HAS_UP, HAS_BIAS, HAS_RESIDUAL, ACT, PRECISE,
        )  # fmt: skip


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
) -> torch.Tensor:
    """``norm(x) @ weight.T (+ bias)`` for (M <= 16, K) ``x``, then optionally ``act`` and a
    product (with ``gated`` the weight's second half is the up projection; with ``up`` the
    factor is that (M, N) tensor), then ``+ residual``. Returns a new (M, N) tensor in
    ``x``'s dtype."""
    rows, k = x.shape
    n = weight.shape[0] // (2 if gated else 1)
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
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows == 0 or n == 0:
        return out
    m_tiles = 1 if config.block_m == 1 else triton.cdiv(rows, config.block_m)
    _gemv_kernel[(m_tiles * triton.cdiv(n, config.block_n),)](
        x,
        weight,
        weight if bias is None else bias,
        out if up is None else up,
        out if residual is None else residual,
        weight if norm is None else norm.weight,
        out,
        rows,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        0 if up is None else up.stride(0),
        0 if residual is None else residual.stride(0),
        0.0 if norm is None else float(norm.eps),
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        ONE_CHUNK=k <= config.block_k,
        ROW_GROUP=row_group(config, rows, k, gated),
        GATED=gated,
        HAS_UP=up is not None,
        HAS_BIAS=bias is not None,
        HAS_RESIDUAL=residual is not None,
        NORM=norm is not None,
        ACT=activation_code(act),
        PRECISE=not _INTERPRETED,
        USE_PDL=pdl.ENABLED,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        enable_fp_fusion=False,
        launch_pdl=pdl.ENABLED,
    )
    return out
