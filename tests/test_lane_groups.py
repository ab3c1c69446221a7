"""conftest's ``group_by_file``: under ``--dist loadgroup`` (the CUDA lane) a test runs on its
file's worker, as under loadfile, unless marked ``own_worker``."""

from __future__ import annotations

from helpers import ProbeItem, folder_conftest


def test_each_test_joins_its_files_group_unless_it_runs_on_its_own(request):
    conftest = folder_conftest(request.config)
    items = [
        ProbeItem("tests/test_a.py::test_one"),
        ProbeItem("tests/test_a.py::test_slow[bfloat16]", "own_worker"),
        ProbeItem("tests/test_a.py::Case::test_two[x]"),
        ProbeItem("tests/conformance/test_b.py::test_three"),
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
