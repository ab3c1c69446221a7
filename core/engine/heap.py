"""Start-up's objects out of the garbage collector's way, as vLLM does after its start-up.

An engine's start-up leaves a few hundred thousand long-lived Python objects behind: the
model's modules, the captured graphs and their static tensors, compiled kernels'
launchers, the tokenizer. Python's full collections walk every one of them, and a
speculative round allocates a few thousand short-lived objects (per-request lists and
logs), so full collections come round every hundred or so rounds: on an H200 one took
88 ms in the middle of the embedded pair's decoding at batch 64 (Python 3.12), nearly a
millisecond a round on average, in one stall. ``gc.freeze`` moves every object alive now
into a permanent generation no collection walks; what is garbage now is collected first,
so nothing that could be freed is kept.

Hazard: an object frozen here and later left in a reference cycle is never collected
(objects freed by reference counting, as the engine's are, still go). Engines built one
after another in one process (tests, benchmarks) each freeze what is alive at their end.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Collect what is garbage now, then freeze the rest (process-wide)."""
    gc.collect()
    gc.freeze()
