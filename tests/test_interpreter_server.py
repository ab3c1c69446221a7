"""tests/interpreter_server.py, which runs the CPU lane's Triton-interpreter scripts:
failures reach the test that ran the script, and a launch patches Triton's language once
for its nested jit functions without leaving any of them uninterpreted."""

from __future__ import annotations

import textwrap

import pytest
from helpers import OLD_INTERPRETER, needs_triton, run_under_triton_interpreter

# A nested helper whose module holds ``triton.language.core`` and not ``tl``: the launch's
# own patch (the kernel's module holds ``tl`` only) leaves ``core``'s builtins as they are,
# so this helper's first call must still patch them.
CORE_HELPER = """
import triton
from triton.language import core


@triton.jit
def plus_one(x):
    return x + core.full([4], 1, core.int32)
"""

# The kernel calls two nested helpers, each several times a program, over two programs.
KERNEL_SCRIPT = """
import json
import sys

import torch
import triton
import triton.language as tl
from triton.runtime import interpreter

from core_helper import plus_one

# Per launch: how often the language modules themselves were patched.
patches = []
patch_builtin = interpreter._patch_builtin


def counting_patch_builtin(pkg, *args):
    for name, module in (("tl", tl), ("core", tl.core)):
        patches[-1][name] += pkg is module
    return patch_builtin(pkg, *args)


interpreter._patch_builtin = counting_patch_builtin


@triton.jit
def twice(x):
    return x * 2


@triton.jit
def kernel(out_ptr):
    offs = tl.program_id(0) * 4 + tl.arange(0, 4)
    x = offs
    for _ in range(3):
        x = twice(x)
        x = plus_one(x)
    tl.store(out_ptr + offs, x)


out = torch.zeros(8, dtype=torch.int32)
for _ in range(int(sys.argv[1])):
    patches.append({"tl": 0, "core": 0})
    kernel[(2,)](out)
print(json.dumps({"out": out.tolist(), "patches": patches}))
"""


@needs_triton
@pytest.mark.skipif(OLD_INTERPRETER, reason="triton < 3.7: its interpreter mishandles loop bounds")
def test_nested_jit_functions_are_interpreted_and_the_language_patched_once_a_launch(tmp_path):
    (tmp_path / "core_helper.py").write_text(CORE_HELPER)
    script = tmp_path / "kernel_script.py"
    script.write_text(textwrap.dedent(KERNEL_SCRIPT))
    result = run_under_triton_interpreter(str(script), "3")
    want = []
    for x in range(8):
        for _ in range(3):
            x = x * 2 + 1
        want.append(x)
    assert result["out"] == want
    # Each launch patches tl, and plus_one's first call in it patches core. From the
    # second launch on, plus_one's module holds tl too (Triton's interpreter copies its
    # own globals into the module of each function it rewrites), so that call patches tl
    # again. Triton's interpreter alone patches at each of the 6 calls of each helper:
    # core 6 times a launch, tl 12 then 13.
    assert result["patches"] == [{"tl": 1, "core": 1}] + [{"tl": 2, "core": 1}] * 2


@needs_triton  # the server imports triton
def test_a_script_that_fails_fails_its_test_with_its_traceback(tmp_path):
    script = tmp_path / "failing.py"
    script.write_text("raise ValueError('planted in the script')\n")
    with pytest.raises(AssertionError, match=r"(?s)exit 1: .*ValueError: planted in the script"):
        run_under_triton_interpreter(str(script))
    script.write_text("import sys\nsys.exit(3)\n")
    with pytest.raises(AssertionError, match="exit 3"):
        run_under_triton_interpreter(str(script))
    script.write_text("import sys\nsys.exit('planted message')\n")
    with pytest.raises(AssertionError, match="exit 1: planted message"):
        run_under_triton_interpreter(str(script))
    # The server goes on serving the next script.
    script.write_text("print('[1, 2]')\n")
    assert run_under_triton_interpreter(str(script)) == [1, 2]
