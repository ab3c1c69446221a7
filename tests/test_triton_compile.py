"""Every fused decode kernel compiles for an H100/H200 (sm_90), on a machine without a GPU.

The interpreter (the other Triton tests of the CPU lane) runs only the branches a launch
takes; the compiler reads all of them, runtime branches included. A name defined under
one constexpr and used in a branch compiled for the other fails only here (it did: the
rope kernel's v branch, which used a name defined only under ``if WRITE_KV``). Compiling needs
triton's bundled CUDA toolchain, not a GPU or a driver.
"""

from __future__ import annotations

import inspect

import pytest
from helpers import needs_triton

pytestmark = needs_triton

# Pointer parameters that are not 16-bit activations; all other capitalised parameters
# are (the kernels name tensors in capitals, scalars in lower case).
POINTERS = {
    "Positions": "i64",
    "Loc": "i64",
    "InputIds": "i64",
    "Cos": "fp32",
    "Sin": "fp32",
    "Partial": "fp32",
    "Arrived": "i32",
}
FLOATS = {"eps", "cap", "proj_scale"}


def compile_for_sm90(kernel, constexprs: dict, types: dict | None = None):
    """``types``: signature types by parameter for what the naming rule gets wrong
    (e.g. the GEMV's scalar M, N, K; the softcap's float32 output)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(inspect.signature(kernel.fn).parameters)
    signature = {}
    for name in names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in (types or {}):
            signature[name] = types[name]
        elif name[0].isupper():
            signature[name] = "*" + POINTERS.get(name, "bf16")
        else:
            signature[name] = "fp32" if name in FLOATS else "i32"
    missing = {p.name for p in kernel.params if p.is_constexpr} - set(constexprs)
    assert not missing, f"constexprs not given: {missing}"
    source = ASTSource(
        fn=kernel,
        signature=signature,
        constexprs={(names.index(k),): v for k, v in constexprs.items()},
    )
    return triton.compile(source, target=GPUTarget("cuda", 90, 32))


def _cases():
    from graphrt.devices.cuda import (
        triton_argmax,
        triton_gemma,
        triton_gemv,
        triton_ops,
        triton_rope,
    )

    norm = {"D": 2048, "BLOCK": 2048, "TORCH_CUDA_MATH": True}
    rope = {"NUM_Q_HEADS": 8, "NUM_KV_HEADS": 1, "HEAD_DIM": 256, "ROT_DIM": 256, "BLOCK_D": 256,
            "GROUPED": False, "BLOCK_HQ": 8, "BLOCK_HKV": 1}  # fmt: skip
    gemv = {"BLOCK_N": 16, "BLOCK_K": 256, "HAS_BIAS": False, "PRECISE": True, "ROPE": False,
            "HEAD_DIM": 1, "Q_ROWS": 0, "KV_ROWS": 0, "RES_NORM": False,
            "RES_NORM_NEXT": False, "RES_SCALAR": False, "SWAP_AB": False}  # fmt: skip
    yield "rms_norm", triton_ops._rms_norm_kernel, norm, None
    yield (
        "gemma_norm",
        triton_ops._gemma_rms_norm_kernel,
        {**norm, "H": 1, "HAS_WEIGHT": False},
        None,
    )
    for act in (1, 2):
        yield (
            f"act_mul{act}",
            triton_ops._act_mul_kernel,
            {"BLOCK": 1024, "ACT": act, "PRECISE": True},
            None,
        )
    for normed in (False, True):
        for write in (False, True):
            yield (
                f"qkv_rope-norm{normed}-write{write}",
                triton_rope._qkv_rope_kernel,
                {
                    **rope,
                    "NORM": normed,
                    "WRITE_KV": write,
                    "TORCH_CUDA_MATH": True,
                    "LAUNCH_DEPENDENTS": True,
                },  # fmt: skip
                None,
            )
    grouped = {"NUM_Q_HEADS": 32, "NUM_KV_HEADS": 8, "HEAD_DIM": 64, "ROT_DIM": 64,
               "BLOCK_D": 64, "NORM": False, "TORCH_CUDA_MATH": True, "GROUPED": True,
               "BLOCK_HQ": 32, "BLOCK_HKV": 8}  # fmt: skip
    for write in (False, True):  # prefill widths' plain rope (a program per group of heads)
        yield (
            f"qkv_rope-grouped-write{write}",
            triton_rope._qkv_rope_kernel,
            {**grouped, "WRITE_KV": write, "LAUNCH_DEPENDENTS": False},
            None,
        )
    for scalar, nxt in ((False, False), (True, True)):
        yield (
            f"residual_norm-{scalar}-{nxt}",
            triton_gemma._residual_norm_kernel,
            {**norm, "HAS_SCALAR": scalar, "HAS_NEXT": nxt, "LAUNCH_DEPENDENTS": nxt},
            None,
        )
    for cap in (False, True):
        yield (
            f"float_logits-{cap}",
            triton_gemma._softcap_kernel,
            {"HAS_CAP": cap, "BLOCK": 2048, "TORCH_CUDA_MATH": True},
            {"Out": "*fp32"},
        )
    yield (
        "selected_max",
        triton_gemma._selected_max_kernel,
        {"CLUSTER": 128, "HIDDEN": 256, "BLOCK_H": 64, "BLOCK_S": 128},
        {"Clusters": "*i64", "Top": "*i64", "PartialMax": "*fp32", "PartialToken": "*i64"},
    )
    yield "topk_set", triton_gemma._topk_set_kernel, {"K": 32, "BLOCK_C": 2048}, {"Out": "*i64"}
    for mark_bad in (False, True):  # the centroid head's second stage, greedy decoding's
        yield (
            f"blocks_best-{mark_bad}",
            triton_argmax._blocks_best_kernel,
            {"BLOCK_P": 32, "MARK_BAD": mark_bad, "BAD": -1},
            {"PartialMax": "*fp32", "PartialToken": "*i64", "Out": "*i64"},
        )
    yield (
        "row_best",
        triton_argmax._row_best_kernel,
        {"BLOCK": 4096},
        {"Logits": "*fp32", "PartialMax": "*fp32", "PartialToken": "*i64"},
    )
    yield (
        "per_layer_inputs",
        triton_gemma._per_layer_inputs_kernel,
        {"NUM_LAYERS": 35, "P": 256, "BLOCK": 256, "TORCH_CUDA_MATH": True},
        None,
    )
    # (gated, up, act, norm, residual, one chunk + PDL): each epilogue, and Llama's two
    # fused shapes (norm + gate/up with the weight read before the PDL wait; residual add).
    variants = (
        (False, False, 0, False, False, False),
        (True, False, 1, False, False, False),
        (False, True, 2, False, False, False),
        (True, False, 1, True, False, True),
        (False, False, 0, True, True, True),
        (False, False, 0, False, True, False),
        (True, False, 1, True, False, False),  # the norm over several chunks
    )
    # Split-K (tiles only: the last split of a tile sums them all) on the multi-chunk ones.
    for rows, split in ((1, 1), (16, 1), (16, 4)):
        for gated, up, act, norm, residual, pdl in variants:
            one_chunk = pdl
            if split > 1 and pdl:
                # split-K under PDL on the H200: norm + gate/up over several chunks a split,
                # and norm + residual add on one chunk a split (its weight read before the
                # wait, at its split's K offset)
                if (gated, norm) != (True, True) and not (norm and residual):
                    continue
                one_chunk = not gated
            yield (
                f"gemv-M{rows}-split{split}-gated{gated}-up{up}-act{act}-norm{norm}"
                f"-res{residual}-pdl{pdl}-onechunk{one_chunk}",
                triton_gemv._gemv_kernel,
                {
                    **gemv,
                    "SPLIT_K": split,
                    "ROW_K": 2048 if rows == 1 and norm and not one_chunk else 0,
                    "BLOCK_M": rows,
                    "GATED": gated,
                    "HAS_UP": up,
                    "ACT": act,
                    "NORM": norm,
                    "HAS_RESIDUAL": residual,
                    "ONE_CHUNK": one_chunk,
                    "USE_PDL": pdl,
                },
                {"M": "i32", "N": "i32", "K": "i32"},
            )

    # Swapped operands (w @ x.T: 64 weight rows a tile, Hopper's wide MMA) under PDL, with
    # and without split-K: the norm and gate fused, or the residual add.
    for split, gated, norm, residual in ((1, True, True, False), (1, False, False, True),
                                         (4, True, True, False)):  # fmt: skip
        yield (
            f"gemv_swap-split{split}-gated{gated}-norm{norm}-res{residual}",
            triton_gemv._gemv_kernel,
            {
                **gemv,
                "BLOCK_N": 64,
                "BLOCK_K": 128,
                "SWAP_AB": True,
                "SPLIT_K": split,
                "ROW_K": 0,
                "BLOCK_M": 16,
                "GATED": gated,
                "HAS_UP": False,
                "ACT": int(gated),
                "NORM": norm,
                "HAS_RESIDUAL": residual,
                "ONE_CHUNK": False,
                "USE_PDL": True,
            },  # fmt: skip
            {"M": "i32", "N": "i32", "K": "i32"},
        )

    # Llama's q/k/v with rope and the KV write in the epilogue: the row path (norm fused, its
    # weight read before the PDL wait) and a tile, several chunks, and split-K's tile.
    rope = {**gemv, "ROPE": True, "HEAD_DIM": 64, "Q_ROWS": 2048, "KV_ROWS": 512, "GATED": False,
            "HAS_UP": False, "ACT": 0, "HAS_RESIDUAL": False, "NORM": True, "ROW_K": 0}  # fmt: skip
    # (rows, split, one chunk, bias, swapped operands)
    for rows, split, one_chunk, bias, swap in ((1, 1, True, False, False),
                                               (1, 1, False, True, False),
                                               (16, 1, False, True, False),
                                               (16, 4, False, False, False),
                                               (16, 4, False, False, True)):  # fmt: skip
        yield (
            f"gemv_rope-M{rows}-split{split}-onechunk{one_chunk}-bias{bias}-swap{swap}",
            triton_gemv._gemv_kernel,
            {
                **rope,
                "BLOCK_M": rows,
                "SPLIT_K": split,
                "SWAP_AB": swap,
                "ONE_CHUNK": one_chunk,
                "USE_PDL": one_chunk,
                "HAS_BIAS": bias,
            },  # fmt: skip
            {"M": "i32", "N": "i32", "K": "i32"},
        )

    # Gemma 4's GEMVs reading the residual stream they compute (the row path, one chunk):
    # the per-layer input's gate (gelu times the per-layer input) under PDL and without;
    # the MLP's gate/up on the stream's next norm; the next layer's input projection (no
    # activation) on the next norm of the stream after the layer scalar, under PDL and
    # without. (name, PDL, next norm, layer scalar, gated, activation code)
    for name, pdl, nxt, scalar, gated, act in (
        ("gate", False, False, False, False, 2), ("gate", True, False, False, False, 2),
        ("gate", True, True, False, True, 2), ("in_proj", False, True, True, False, 0),
        ("in_proj", True, True, True, False, 0),
    ):  # fmt: skip
        prologue = {"BLOCK_M": 1, "BLOCK_K": 2048, "SPLIT_K": 1, "ONE_CHUNK": True,
                    "USE_PDL": pdl, "RES_NORM": True, "RES_NORM_NEXT": nxt,
                    "RES_SCALAR": scalar, "NORM": False, "ROW_K": 0, "GATED": gated,
                    "HAS_UP": act != 0 and not gated, "ACT": act,
                    "HAS_RESIDUAL": False}  # fmt: skip
        yield (
            f"gemv_residual_{name}-pdl{pdl}-next{nxt}",
            triton_gemv._gemv_kernel,
            {**gemv, **prologue},
            {"M": "i32", "N": "i32", "K": "i32"},
        )


def _case_ids():
    try:
        return [case[0] for case in _cases()]
    except ImportError:  # no triton: the whole module is skipped anyway
        return ["no-triton"]


@pytest.mark.parametrize("name", _case_ids())
def test_kernel_compiles_for_sm90(name):
    kernel, constexprs, types = next(c[1:] for c in _cases() if c[0] == name)
    compiled = compile_for_sm90(kernel, constexprs, types)
    assert compiled.asm["ptx"] and compiled.asm["cubin"]
