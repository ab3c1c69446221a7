"""Every graph capture fails, in the test process and in every process it starts.

tests/test_graphs_required.py puts this folder on PYTHONPATH with
GRAPHRT_TEST_FAIL_CAPTURES=1, so that Python runs it at start-up in pytest, in spawned
tensor-parallel ranks and in CLI subprocesses alike: graph runners then drop every
bucket (with a warning) and run eagerly, and each test marked ``graphs`` must fail.
"""

from __future__ import annotations

import os

FAIL_CAPTURES = "GRAPHRT_TEST_FAIL_CAPTURES"


def fail_every_capture() -> None:
    from graphrt.devices.cpu.compile import CompiledGraphBackend
    from graphrt.devices.graphs import BreakableStreamGraphBackend, StreamGraphBackend

    def fail(self, key, *args, **kwargs):
        raise RuntimeError(f"capture of {key} forced to fail ({FAIL_CAPTURES}=1)")

    for backend in (StreamGraphBackend, BreakableStreamGraphBackend, CompiledGraphBackend):
        backend.capture_one = fail


if os.environ.get(FAIL_CAPTURES) == "1":
    try:
        fail_every_capture()
    except ImportError:  # an interpreter without graphrt (a packaging test's build)
        pass
