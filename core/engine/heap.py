"""Start-up's objects out of the garbage collector's way, as vLLM does after its start-up.

Start-up leaves a few hundred thousand long-lived Python objects (the model's modules,
the graphs, kernels' launchers) that every full collection walks, and speculative rounds
allocate enough short-lived ones that full collections come round while decoding: one
stalled a batch-64 decode for 88 ms on an H200 (BENCHMARKS.md, stop 41). ``gc.freeze``
moves everything alive into a permanent generation no collection walks; what is garbage
is collected first, so nothing that could be freed is kept.

HAZARD: process-wide. An object frozen here and later left in a reference cycle is never
collected (objects freed by reference counting, as engines are, still go).
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Collect what is garbage now, then freeze the rest (process-wide)."""
    gc.collect()
    gc.freeze()
