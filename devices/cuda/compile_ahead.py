"""Compile the Triton kernels of many forwards at once, in parallel, before any runs.

Triton compiles a kernel the first time it is launched with new constants, on the
launching thread, one kernel after another. On a fresh H200 the README's first command
spent 28 of its 39 s that way (88 compiles; ``bench/cold_start.py``). Triton's compiler
passes and ptxas release the GIL, so threads compile side by side (1.8x on 2 cores).

``compile_ahead(runs)`` calls each of ``runs`` (a graph bucket's forward, as its capture
will warm it up) with every Triton launch turned into a compile-only warm-up, queued on a
thread pool through Triton's ``AsyncCompileMode``. It then waits for the compiles, and
builds each kernel's C launcher on the same threads (``_build_launchers``). The warm-ups
and captures that follow find every kernel compiled and launchable.

HAZARD (dry runs compute garbage): no Triton kernel runs during them, so their outputs
hold whatever the allocator left there, and the torch ops in between compute from that.
Only capture-safe forwards may run dry: no host reads of device values, and no index
derived from a Triton kernel's output except through ops that keep it in range (argmax,
top-k). An index out of range would raise a device-side assert and end the process.
Nothing a dry run writes may outlive it: the warm-ups that follow rewrite every buffer a
graph reads. The GEMV tuner times nothing during a dry run (``dry()``); it compiles
every candidate instead, and the warm-up that follows times them (a dry prefill's
shapes: the first real prefill). The engine's dry prefills (core/engine/prefill.py's
``dry_prefills``, a first prompt's kernels) hold to the same rules: their positions and
slots are the host's, and the throwaway requests' garbage KV sits in slots freed after.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

log = logging.getLogger(__name__)

_dry = False  # inside compile_ahead's runs (one thread launches kernels: the engine's)


def dry() -> bool:
    """True while the forward runs dry: Triton launches compile and run nothing."""
    return _dry


@contextlib.contextmanager
def _launches_compile_only() -> Iterator[None]:
    # Every `kernel[grid](...)` goes through JITFunction.run; warmup=True compiles (queued
    # on the async mode's pool) and returns without launching.
    # HAZARD: process-wide. A Triton launch on another thread meanwhile (a second engine
    # in this process stepping while this one captures) compiles and runs nothing, and
    # its outputs are whatever its buffers held. One engine is safe: its lock holds its
    # own steps off while it compiles ahead.
    global _dry
    from triton.runtime.jit import JITFunction

    launch = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        return launch(self, *args, grid=grid, warmup=True, **kwargs)

    JITFunction.run = compile_only
    _dry = True
    try:
        yield
    finally:
        JITFunction.run = launch
        _dry = False


def compile_ahead(runs: Iterable[Callable[[], Any]], threads: int | None = None) -> int:
    """Run each of ``runs`` dry, compiling its Triton kernels on ``threads`` threads
    (default: the CPUs this process may use, at most 32); -> how many compiles were
    queued. Without Triton's async compile mode (triton < 3.4), or inside another
    caller's, the runs are skipped: the warm-ups then compile one kernel at a time."""
    try:
        from triton.runtime._async_compile import AsyncCompileMode, active_mode
    except ImportError:
        return 0
    if active_mode.get() is not None:  # someone else's (torch.compile's): theirs stays
        return 0
    if threads is None:
        usable = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
        threads = min(32, len(usable) if usable else os.cpu_count() or 1)
    start = time.perf_counter()
    with ThreadPoolExecutor(threads, thread_name_prefix="triton-compile") as pool:
        mode = AsyncCompileMode(pool)
        with mode:  # leaving it waits for every compile (and raises the first failure)
            with _launches_compile_only():
                try:
                    for run in runs:
                        run()
                except Exception as e:  # noqa: BLE001 (the warm-ups compile the rest, or fail)
                    log.warning("compiling ahead stopped (%s); the warm-ups compile the rest", e)
            queued = len(mode.raw_futures)
        _build_launchers(pool, [k.kernel for k in mode.future_kernels.values()])
    log.info(
        "compiled %d Triton kernels ahead on %d threads in %.1f s",
        queued, threads, time.perf_counter() - start,
    )  # fmt: skip
    return queued


def _build_launchers(pool: ThreadPoolExecutor, kernels: list[Any]) -> None:
    """Build the C launchers of compiled ``kernels`` on ``pool``, one per distinct launcher.

    Triton builds a kernel's launcher (C source from its signature, through gcc: about 0.3 s,
    kept in Triton's cache by its source) at the kernel's first launch, on the launching
    thread. On a fresh H100 that was 3.9 of the first captures' 4.2 s (12 builds for the
    README's first command; bench/cold_start.py, stop 57). Built here, side by side, the
    first launches find them in the cache. The launcher's source depends on the signature
    alone (constexpr markers included) and tensor descriptors: one build per distinct pair,
    since two threads building one source would both run gcc. A failure here only leaves
    that build to the first launch, as before. (Triton 3.7 launches through one launcher
    of its driver's: nothing to build, and this costs a few objects.)"""
    kernels = [k for k in kernels if k is not None]
    if not kernels:
        return
    try:
        from triton.runtime.driver import driver

        make_launcher = driver.active.launcher_cls
    except (ImportError, AttributeError, RuntimeError):  # another Triton, or no GPU driver
        return
    distinct = {}
    for kernel in kernels:
        signature = getattr(kernel.src, "signature", None)
        tensordesc = getattr(kernel.metadata, "tensordesc_meta", None)
        distinct.setdefault((repr(signature), repr(tensordesc)), kernel)
    builds = [pool.submit(make_launcher, k.src, k.metadata) for k in distinct.values()]
    for kernel, build in zip(distinct.values(), builds, strict=True):
        try:
            build.result()
        except Exception as e:  # noqa: BLE001 (its first launch builds it, or says why)
            log.debug("launcher of %s not built ahead: %s", getattr(kernel, "name", "?"), e)
