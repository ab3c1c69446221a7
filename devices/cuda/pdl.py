"""Programmatic dependent launch (PDL): a kernel starts while the one before it drains.

On sm_90+ a kernel launched with ``launch_pdl=True`` may be scheduled as soon as every
program of the previous kernel has run ``griddepcontrol.launch_dependents`` (or
exited); it must run ``griddepcontrol.wait`` before touching what that kernel wrote.
In a decode step inside a CUDA graph this hides each launch's ramp-up: a GEMV reads
its weight tile, which no kernel writes, while the previous kernel finishes.

The contract every kernel launched with PDL keeps (``triton_gemv``, decode attention's
stage 1; checked in the source by tests/test_pdl_contract.py):
- before the wait it stores nothing and reads only what no kernel of the step's chain
  may still be writing. A PDL kernel may start while several kernels before it still
  run (each may release its successor before its own wait), so that is:
  - weights, biases and norm weights (the GEMV), which no kernel writes;
  - the step's inputs (decode attention's stage 1: each row's length and request slot),
    written before the step's first kernel or by torch's own kernels ahead of the
    model's layers (a round's draft lengths): a torch kernel never releases its
    successor early, so every later kernel sees its writes;
- it always waits, even when it reads nothing of its predecessor's: the wait is what
  orders it after the kernel before that one, too;
- it is launched with ``launch_options()``, so its ``USE_PDL`` constexpr (the wait) and
  the launch attribute never disagree: a kernel compiled without the wait but launched
  with PDL would read half-written inputs.
Kernels that only let their successor start early (``gdc_launch_dependents``, e.g. the
attention combine before the o projection) need no wait of their own for that; a
kernel launched without PDL waits for its predecessor as usual.

The GEMV and decode attention's stage 1 wait; the kernels before stage 1 (the qkv GEMV,
the rope kernel, ``store_kv``) release it early, so its launch, its row's length and
request slot and its split count overlap their tails: Gemma 4 E2B's step 0.3% to 1.1%
faster on an H100 (BENCHMARKS.md, stop 65). Reading its first block's token-table
entries and earlier keys' K/V before the wait as well was slower (Gemma 4 at head_dim
256 by 2%, llama-1b at batch 8 by 2%). The other kernels of a step have nothing to read
before the wait: launched with PDL (each waiting, then releasing its successor), they
gained nothing on an H200 (stop 58: Gemma 4's batch-1 step replayed in 2.395 ms with them
against 2.331 and 2.306 without).

``ENABLED`` is read at every launch, so a benchmark can compare with and without
(bench/profile_step.py); graphs keep what was set when they were captured.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphrt.devices.cuda.triton_ops import _INTERPRETED


def _supported() -> bool:
    # griddepcontrol is sm_90+ PTX; the interpreter runs no PTX at all.
    return (
        not _INTERPRETED
        and torch.cuda.is_available()
        and torch.cuda.get_device_capability() >= (9, 0)
    )


ENABLED = _supported()


def launch_options() -> dict[str, bool]:
    """A PDL kernel's ``USE_PDL`` constexpr and its launch attribute, as ``ENABLED`` is now."""
    return {"USE_PDL": ENABLED, "launch_pdl": ENABLED}


@triton.jit
def wait_for_predecessor():
    """``griddepcontrol.wait``, as every PDL kernel calls it (never ``gdc_wait`` itself:
    the contract test checks): a CPU test stands in for it under the interpreter (which
    runs no PTX), writing what the kernel before would have at that moment
    (tests/test_pdl_contract.py). Inlined: a kernel's instructions are the same as with
    ``gdc_wait`` called in place (the GEMV's PTX compared at stop 67)."""
    tl.extra.cuda.gdc_wait()
