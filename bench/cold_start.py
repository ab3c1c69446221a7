"""Where a first start's seconds go (issue 21, "start in seconds").

Runs the README's first command (`graphrt generate --prompt ...`) in this process and
splits its wall time: imports, Triton compiles (count and seconds by kernel), the GEMV
tuner's timing (compiles inside it excluded), graph captures, the rest.

    python bench/cold_start.py --cold     # empty Triton and graphrt caches (fresh dirs)
    python bench/cold_start.py            # the caches as they are

--cold points TRITON_CACHE_DIR and GRAPHRT_CACHE_DIR at new temporary directories
before Triton is imported, so it is cold on any machine.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import threading
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cold", action="store_true", help="start from empty caches")
    parser.add_argument("--prompt", default="def fibonacci(n):")
    parser.add_argument("generate_args", nargs="*", help="more `graphrt generate` flags")
    args = parser.parse_args()
    if args.cold:
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-cold-")
        os.environ["GRAPHRT_CACHE_DIR"] = tempfile.mkdtemp(prefix="graphrt-cold-")

    start = time.perf_counter()
    import torch  # noqa: F401

    import_torch_s = time.perf_counter() - start
    import triton.compiler

    cache = os.environ.get("TRITON_CACHE_DIR") or triton.knobs.cache.dir
    cold = not (os.path.isdir(cache) and os.listdir(cache))
    from graphrt.core.cli.main import main as cli_main
    from graphrt.core.runners.graph import GraphRunner
    from graphrt.devices.cuda import compile_ahead, gemv_tuner

    import_s = time.perf_counter() - start

    # Triton's JIT looks `compile` up in triton.compiler when a kernel first runs.
    compile_s: collections.Counter = collections.Counter()
    compile_n: collections.Counter = collections.Counter()
    # compile seconds inside each phase ("both": tuning within a capture's warm-up)
    inner = {"tuner": 0.0, "capture": 0.0, "both": 0.0}
    phases: list[str] = []  # the phases running now, innermost last (tuning runs inside capture)
    real_compile = triton.compiler.compile

    def timed_compile(src, *a, **k):
        t = time.perf_counter()
        try:
            return real_compile(src, *a, **k)
        finally:
            dt = time.perf_counter() - t
            name = getattr(getattr(src, "fn", None), "__name__", None) or getattr(src, "name", "?")
            compile_s[name] += dt
            compile_n[name] += 1
            if threading.current_thread() is not threading.main_thread():
                ahead["thread_s"] += dt  # compiling ahead, side by side
            else:
                for running in set(phases):
                    inner[running] += dt
                if {"tuner", "capture"} <= set(phases):
                    inner["both"] += dt

    triton.compiler.compile = timed_compile

    tuner = {"s": 0.0, "n": 0, "in_capture": 0.0}  # in_capture: tuning seconds within captures
    real_time = gemv_tuner.GemvTuner._time

    def timed_tuning(self, *a, **k):
        phases.append("tuner")
        t = time.perf_counter()
        try:
            return real_time(self, *a, **k)
        finally:
            phases.pop()
            dt = time.perf_counter() - t
            tuner["s"] += dt
            tuner["n"] += 1
            if "capture" in phases:
                tuner["in_capture"] += dt

    gemv_tuner.GemvTuner._time = timed_tuning

    # Compiling ahead: its wall time; its compiles run on pool threads, side by side.
    ahead = {"s": 0.0, "thread_s": 0.0}
    real_ahead = compile_ahead.compile_ahead

    def timed_ahead(*a, **k):
        t = time.perf_counter()
        try:
            return real_ahead(*a, **k)
        finally:
            ahead["s"] += time.perf_counter() - t

    compile_ahead.compile_ahead = timed_ahead

    captures = {"s": 0.0, "n": 0}
    real_capture = GraphRunner.capture

    def timed_capture(self, *a, **k):
        phases.append("capture")
        t = time.perf_counter()
        try:
            return real_capture(self, *a, **k)
        finally:
            captures["s"] += time.perf_counter() - t
            captures["n"] += 1
            phases.pop()

    GraphRunner.capture = timed_capture

    run_start = time.perf_counter()
    rc = cli_main(["generate", "--prompt", args.prompt, *args.generate_args])
    total = time.perf_counter() - start
    on_main = sum(compile_s.values()) - ahead["thread_s"]  # compiles the main thread waited on
    tuning_s = tuner["s"] - inner["tuner"]
    # Tuning runs inside the captures' warm-ups: take it (and every compile) out.
    capture_s = captures["s"] - inner["capture"] - (tuner["in_capture"] - inner["both"])
    print(f"\n== {'cold' if cold else 'warm'} start: exit {rc}, {total:.1f} s in process")
    rows = [
        ("import torch", import_torch_s),
        ("import graphrt, triton", import_s - import_torch_s),
        (f"compiling ahead ({ahead['thread_s']:.1f} s of compiles on its threads)", ahead["s"]),
        ("Triton compiles on the main thread", on_main),
        (f"GEMV tuner timing ({tuner['n']} shapes; its compiles excluded)", tuning_s),
        (f"graph captures ({captures['n']} runners; compiles, tuning excluded)", capture_s),
        ("the rest of the command",
         total - import_s - ahead["s"] - on_main - tuning_s - capture_s),
    ]  # fmt: skip
    print("| part | s |\n|---|---:|")
    for label, seconds in rows:
        print(f"| {label} | {seconds:.2f} |")
    print(
        f"(the command itself {total - (run_start - start):.1f} s; compiles inside tuning "
        f"{inner['tuner']:.2f} s, inside captures {inner['capture']:.2f} s)"
    )
    print(f"\n{sum(compile_n.values())} compiles (cache hits included):")
    print("| kernel | compiles | s (thread time) |\n|---|---:|---:|")
    for name, seconds in compile_s.most_common(20):
        print(f"| {name} | {compile_n[name]} | {seconds:.2f} |")
    return rc


if __name__ == "__main__":
    sys.exit(main())
