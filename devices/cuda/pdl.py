"""Programmatic dependent launch (PDL): a kernel starts while the one before it drains.

On sm_90+ a kernel launched with ``launch_pdl=True`` may be scheduled as soon as every
program of the previous kernel has run ``griddepcontrol.launch_dependents`` (or
exited); it must run ``griddepcontrol.wait`` before touching what that kernel wrote.
In a decode step inside a CUDA graph this hides each launch's ramp-up: a GEMV reads
its weight tile, which no kernel writes, while the previous kernel finishes.

The contract every kernel launched with PDL keeps (``triton_gemv``; checked in the
source by tests/test_pdl_contract.py):
- before the wait it reads only tensors no kernel writes (weights, biases, norm
  weights) and stores nothing;
- it always waits, even when it reads nothing of its predecessor's: the wait is what
  orders it after the kernel before that one, too;
- it is launched with ``launch_options()``, so its ``USE_PDL`` constexpr (the wait) and
  the launch attribute never disagree: a kernel compiled without the wait but launched
  with PDL would read half-written inputs.
Kernels that only let their successor start early (``gdc_launch_dependents``, e.g. the
attention combine before the o projection) need no wait of their own for that; a
kernel launched without PDL waits for its predecessor as usual.

Only the GEMV waits: the other kernels of a step have nothing to read before the wait.
Launched with PDL as well (each waiting, then releasing its successor), they gained
nothing on an H200 (BENCHMARKS.md, stop 58: Gemma 4's batch-1 step replayed in 2.395 ms
with them against 2.331 and 2.306 without).

``ENABLED`` is read at every launch, so a benchmark can compare with and without
(bench/profile_step.py); graphs keep what was set when they were captured.
"""

from __future__ import annotations

import torch

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
