"""Sessions: one per hardware lane, plus lint and bench.

`nox` alone runs lint, then the CPU lane: the README's test command and CI's.
`nox -s tests-cuda` (or -npu, -xpu) runs a device lane; `nox -s bench -- ARGS`
runs `graphrt bench ARGS`. Anything after `--` goes to pytest in tests-* lanes.

Lanes, runners and install steps are listed once in ci/matrix.json.
"""

import json
import os
import shutil
from pathlib import Path

import nox

nox.options.sessions = ["lint", "tests-cpu"]  # lint first: pytest's summary prints last

ROOT = Path(__file__).parent
PYPROJECT = nox.project.load_toml(ROOT / "pyproject.toml")
# Which pyproject extra each lane installs is said once, in ci/matrix.json.
LANES = {
    lane["nox_session"]: lane
    for lane in json.loads((ROOT / "ci" / "matrix.json").read_text())["lanes"]
}

# The CPU lane pins the small CPU build and installs it before graphrt: with no
# torch present, pyproject's plain range makes pip fetch the multi-GB CUDA build.
# GRAPHRT_TORCH_INDEX_URL (ci/install/cpu.sh sets it on GitHub runners) points
# pip at the CPU-only wheel index; unset, pip uses its configured sources.
TORCH_CPU = "torch==2.13.0"
# Plain triton wheel: CPU tests run the Triton kernels under TRITON_INTERPRET=1.
# Pinned to the release torch 2.13's Linux wheels require, so torch.compile's
# inductor sees the triton it was built against.
TRITON_CPU = "triton==3.7.1"

# pytest exits 5 when it collects no test. A lane whose tests are all
# deselected by marker (e.g. a device lane before that device has tests) has
# nothing to run; that is not a failure. Failures and errors still fail.
PYTEST_SUCCESS = [0, 5]

# Device machines bring a vendor torch build (CUDA, torch-npu's, XPU's), put
# there by ci/install/<device>.sh. Their venvs see the system site-packages so
# pip keeps that torch when it satisfies pyproject's range instead of
# downloading another build.
DEVICE_VENV = ["--system-site-packages"]


def _install_graphrt(session: nox.Session) -> None:
    session.install("-e", f".[{LANES[session.name]['extra']}]")


def _pytest(session: nox.Session, marker: str, *options: str) -> None:
    # The slowest tests are printed: what makes a lane slow shows in every CI log.
    args = ["-m", marker, "--durations=15", *options, *session.posargs]
    session.run("pytest", *args, success_codes=PYTEST_SUCCESS)


@nox.session(python=None)
def lint(session: nox.Session) -> None:
    # The lint extra's tools only: installing graphrt would pull torch for nothing.
    extras = PYPROJECT["project"]["optional-dependencies"]
    session.install(*(req for name in LANES["lint"]["extra"].split(",") for req in extras[name]))
    paths = session.posargs or ["."]
    session.run("ruff", "check", *paths)
    session.run("ruff", "format", "--check", *paths)


@nox.session(name="tests-cpu", python=None)
def tests_cpu(session: nox.Session) -> None:
    torch_args = [TORCH_CPU]
    if index_url := os.environ.get("GRAPHRT_TORCH_INDEX_URL"):
        torch_args += ["--index-url", index_url]
    # --no-compile: pip would write bytecode for every file of torch, triton and
    # transformers (about 30 s); the tests import a fraction of them, compiled on first
    # import and written beside them (see PYTHONDONTWRITEBYTECODE below).
    session.install("--no-compile", *torch_args)
    # tests/test_packaging.py builds the wheel without build isolation. One pip run for the
    # rest: each run resolves the environment anew.
    extra = LANES[session.name]["extra"]
    build = PYPROJECT["build-system"]["requires"]
    session.install("--no-compile", TRITON_CPU, *build, "-e", f".[{extra}]")
    # HAZARD: some images set PYTHONDONTWRITEBYTECODE=1; with --no-compile every test
    # process (xdist workers, TP ranks, CLI subprocesses) would then compile torch anew.
    session.env["PYTHONDONTWRITEBYTECODE"] = ""
    # One torch thread per process: the tests' tiny matmuls lose more to two threads
    # waiting on each other than they gain (a sampling test: 76 s, 8.5 s with one).
    session.env["OMP_NUM_THREADS"] = "1"
    # One inductor cache for the lane, fresh each run: the CPU compile cases of several
    # tests, and their subprocesses, compile the same graphs once.
    cache = Path(session.create_tmp()) / "inductor-cache"
    shutil.rmtree(cache, ignore_errors=True)
    session.env["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
    # Scalar C++ from inductor: no SIMD probe per process (about 10 s: it builds and loads
    # a test library per instruction set) and less codegen. The CPU compile cases check
    # graphrt's compiled graphs against eager; inductor's vectorisation is torch's to test.
    session.env["TORCHINDUCTOR_VEC_ISA_OK"] = "0"
    # Inductor compiles in the test process: xdist keeps both cores busy already, and a
    # pool of compile workers per process would only add start-ups.
    session.env["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
    # A worker per core (up to 4): most tests use one core, several wait on subprocesses.
    # loadfile: a module's tests on one worker, so that its costly fixtures (rank pairs,
    # captured harnesses, compiled engines) are built once.
    workers = min(4, os.cpu_count() or 1)
    # Files in conftest's order (slow first), not by their number of tests.
    xdist = ["-n", str(workers), "--dist", "loadfile", "--no-loadscope-reorder"]
    xdist = xdist if workers > 1 else []
    _pytest(session, "not cuda and not npu and not xpu", *xdist)


@nox.session(name="tests-cuda", python=None, venv_params=DEVICE_VENV)
def tests_cuda(session: nox.Session) -> None:
    _install_graphrt(session)
    _pytest(session, "cuda")


@nox.session(name="tests-npu", python=None, venv_params=DEVICE_VENV)
def tests_npu(session: nox.Session) -> None:
    # NOTE: torch_npu's backend auto-load makes `import torch` fail without the
    # Ascend toolkit; graphrt imports torch_npu itself when the NPU is selected.
    session.env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    _install_graphrt(session)
    _pytest(session, "npu")


@nox.session(name="tests-xpu", python=None, venv_params=DEVICE_VENV)
def tests_xpu(session: nox.Session) -> None:
    _install_graphrt(session)
    _pytest(session, "xpu")


@nox.session(python=None, venv_params=DEVICE_VENV)
def bench(session: nox.Session) -> None:
    session.install("-e", ".[bench,cuda]")
    session.run("graphrt", "bench", *session.posargs)
