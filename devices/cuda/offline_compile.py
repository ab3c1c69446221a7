"""Compile a Triton kernel for an H200 (sm_90) on any machine: Triton's own compiler and
ptxas, no GPU. The CPU lane compiles the attention kernels this way (Triton's
interpreter runs them without the compiler's type checks), and bench/kernel_resources.py
reads their registers and spills from the result.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

H200 = GPUTarget("cuda", 90, 32)
# Pointer arguments of the attention kernels, by name, as a bfloat16 model launches them.
ATTENTION_POINTERS = {
    "Q": "*bf16", "K": "*bf16", "V": "*bf16", "Out": "*bf16", "ReqToToken": "*i64",
    "ReqPoolIndices": "*i64", "SeqLens": "*i32", "Positions": "*i64", "OutCacheLoc": "*i64",
    "TreeMask": "*u8", "PartialOut": "*fp32", "PartialLse": "*fp32", "PartialSplits": "*i32",
    "TreeLoc": "*i64",
}  # fmt: skip


# Shared memory a block may use on an H200 (227 KiB; Triton's launch refuses more).
H200_SHARED_BYTES = 232448


def compile_for_h200(
    kernel,
    constants: dict,
    num_warps: int,
    pointers: dict | None = None,
    num_stages: int | None = None,
    aligned: bool = False,
):
    """``kernel`` compiled for sm_90 with ``constants`` (its constexpr arguments); other
    arguments are the named pointers, ``sm_scale`` float32, the rest int32. ``aligned``:
    every pointer and integer divisible by 16, as a launch specialises them (its loads
    then vectorise and pipeline through cp.async, and their shared memory counts).
    Raises Triton's CompilationError where the kernel does not compile; the result's
    ``metadata.shared`` is the shared memory a launch asks for."""
    pointers = ATTENTION_POINTERS if pointers is None else pointers
    signature = {
        n: "constexpr" if n in constants else pointers.get(n, "fp32" if n == "sm_scale" else "i32")
        for n in kernel.arg_names
    }
    constexprs = {(i,): constants[n] for i, n in enumerate(kernel.arg_names) if n in constants}
    divisible = [
        (i,) for i, n in enumerate(kernel.arg_names) if signature[n] not in ("constexpr", "fp32")
    ]
    attrs = {i: [["tt.divisibility", 16]] for i in divisible} if aligned else None
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": num_warps} | ({"num_stages": num_stages} if num_stages else {})
    return triton.compile(source, target=H200, options=options)


def registers_and_stack(compiled) -> tuple[int, int]:
    """(registers a thread, local-memory stack bytes a thread: spills) of a kernel from
    ``compile_for_h200``, as the CUDA toolkit's cuobjdump (shipped in Triton's wheel)
    reads its cubin."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run(
            [tool, "-res-usage", cubin.name], capture_output=True, text=True, check=True
        )
    found = re.search(r"REG:(\d+).*?STACK:(\d+)", usage.stdout, re.S)
    return int(found.group(1)), int(found.group(2))
