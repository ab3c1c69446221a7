"""conftest's ``group_by_file``: under ``--dist loadgroup`` (the CUDA lane) a test runs on its
file's worker, as under loadfile, unless marked ``own_worker``."""

from __future__ import annotations

from pathlib import Path

import pytest


class _Item:
    """A collected test as the hook sees it: its id, its marks, and add_marker."""

    def __init__(self, nodeid: str, *marks: str):
        self.nodeid = nodeid
        self.marks = [getattr(pytest.mark, name).mark for name in marks]

    def get_closest_marker(self, name: str):
        return next((m for m in self.marks if m.name == name), None)

    def add_marker(self, mark) -> None:
        self.marks.append(mark.mark)


def test_each_test_joins_its_files_group_unless_it_runs_on_its_own(request):
    path = Path(__file__).with_name("conftest.py")
    plugins = request.config.pluginmanager.get_plugins()
    (conftest,) = [p for p in plugins if getattr(p, "__file__", None) == str(path)]
    items = [
        _Item("tests/test_a.py::test_one"),
        _Item("tests/test_a.py::test_slow[bfloat16]", "own_worker"),
        _Item("tests/test_a.py::Case::test_two[x]"),
        _Item("tests/conformance/test_b.py::test_three"),
    ]
    conftest.group_by_file(items)
    groups = [[m.args for m in item.marks if m.name == "xdist_group"] for item in items]
    assert groups == [[("tests/test_a.py",)], [], [("tests/test_a.py",)],
                      [("tests/conformance/test_b.py",)]]  # fmt: skip


def test_the_lanes_slow_kernel_tests_run_on_their_own():
    """The kernel tests that held one worker of the CUDA lane for about 550 s."""
    import test_triton_fused

    for name in (
        "test_cuda_fused_kernels_match_reference",
        "test_cuda_gemv_rows_are_batch_invariant",
    ):
        marks = getattr(test_triton_fused, name).pytestmark
        assert any(m.name == "own_worker" for m in marks), name
