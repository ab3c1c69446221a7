"""Where a first start's seconds go (issue 21, "start in seconds").

Runs the README's first command (`graphrt generate --prompt ...`) in this process and
splits its wall time: imports, Triton compiles (count and seconds by kernel), the GEMV
tuner's timing (compiles inside it excluded), graph captures, the rest.

    python bench/cold_start.py --cold     # empty Triton and graphrt caches (fresh dirs)
    python bench/cold_start.py            # the caches as they are
    python bench/cold_start.py --cold --profile-captures 30
                                          # and the captures' 30 costliest calls (cProfile,
                                          # main thread): on the H200 captures took 4.6 s
                                          # cold against 0.14 warm with no compile inside
    python bench/cold_start.py --profile-ahead 30
                                          # compiling ahead's 30 costliest calls (its dry
                                          # runs and its waits; warm: 1.1 s on an H100)

--cold points TRITON_CACHE_DIR and GRAPHRT_CACHE_DIR at new temporary directories
before Triton is imported, so it is cold on any machine.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import os
import pstats
import sys
import tempfile
import threading
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cold", action="store_true", help="start from empty caches")
    parser.add_argument("--prompt", default="def fibonacci(n):", help='"": none (--prompt-ids)')
    parser.add_argument(
        "--profile-captures", type=int, default=0, metavar="N",
        help="print the N calls of the graph captures with the most cumulative time",
    )  # fmt: skip
    parser.add_argument(
        "--profile-ahead", type=int, default=0, metavar="N",
        help="print the N calls of compiling ahead (its dry runs, its waits) with the most "
        "cumulative time, on the main thread",
    )  # fmt: skip
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
    from graphrt.core.engine import Engine
    from graphrt.core.runners.graph import GraphRunner
    from graphrt.devices.cuda import compile_ahead, gemv_tuner

    import_s = time.perf_counter() - start

    # Triton's JIT looks `compile` up in triton.compiler when a kernel first runs.
    compile_s: collections.Counter = collections.Counter()
    compile_n: collections.Counter = collections.Counter()
    # Main-thread compile seconds inside each phase ("both": tuning within a capture's
    # warm-up); compiles on other threads are compiling ahead's, side by side.
    inner: collections.Counter = collections.Counter()
    # Main-thread compiles by the phases they ran in (outermost first), by kernel: what
    # compiling ahead left to the engine's start-up timing, its first prefill, its decode
    # steps, and the settling of steps launched ahead (--overlap: it launches the next).
    where: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
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
                inner["threads"] += dt
            else:
                where["/".join(phases) or "other"][name] += 1
                for running in set(phases):
                    inner[running] += dt
                if {"tuner", "capture"} <= set(phases):
                    inner["both"] += dt

    triton.compiler.compile = timed_compile

    def time_calls(owner, name: str, phase: str) -> collections.Counter:
        """Wraps ``owner.name``: -> its calls' seconds ("s"), count ("n") and seconds
        inside a capture ("in_capture"); ``phase`` is on the stack while one runs."""
        totals: collections.Counter = collections.Counter()
        real = getattr(owner, name)

        def timed(*a, **k):
            phases.append(phase)
            t = time.perf_counter()
            try:
                return real(*a, **k)
            finally:
                phases.pop()
                dt = time.perf_counter() - t
                totals["s"] += dt
                totals["n"] += 1
                if "capture" in phases:
                    totals["in_capture"] += dt

        setattr(owner, name, timed)
        return totals

    def profile_calls(owner, name: str, wanted: int) -> cProfile.Profile | None:
        """Wraps ``owner.name`` in one profiler (its calls never nest) when ``wanted``."""
        if not wanted:
            return None
        profiler, real = cProfile.Profile(), getattr(owner, name)

        def profiled(*a, **k):
            profiled.calls += 1
            profiler.enable()
            try:
                return real(*a, **k)
            finally:
                profiler.disable()

        profiled.calls = 0
        setattr(owner, name, profiled)
        profiler.wrapper = profiled  # its calls: pstats refuses a profiler that never ran
        return profiler

    tuner = time_calls(gemv_tuner.GemvTuner, "_time", "tuner")
    ahead_profiler = profile_calls(compile_ahead, "compile_ahead", args.profile_ahead)
    ahead = time_calls(compile_ahead, "compile_ahead", "ahead")  # its compiles: on threads
    profiler = profile_calls(GraphRunner, "capture", args.profile_captures)
    captures = time_calls(GraphRunner, "capture", "capture")
    timing = time_calls(Engine, "_time_steps", "start-up timing")
    real_step = Engine._step

    def step(self, chunks):  # the engine's prefill and decode steps, as phases
        phases.append("prefill" if chunks else "decode")
        try:
            return real_step(self, chunks)
        finally:
            phases.pop()

    Engine._step = step
    time_calls(Engine, "_settle", "settle")  # a launched step, and the one launched behind it

    run_start = time.perf_counter()
    prompt = ["--prompt", args.prompt] if args.prompt else []  # "": --prompt-ids given
    rc = cli_main(["generate", *prompt, *args.generate_args])
    total = time.perf_counter() - start
    on_main = sum(compile_s.values()) - inner["threads"]  # compiles the main thread waited on
    tuning_s = tuner["s"] - inner["tuner"]
    # Tuning runs inside the captures' warm-ups: take it (and every compile) out.
    capture_s = captures["s"] - inner["capture"] - (tuner["in_capture"] - inner["both"])
    print(f"\n== {'cold' if cold else 'warm'} start: exit {rc}, {total:.1f} s in process")
    rows = [
        ("import torch", import_torch_s),
        ("import graphrt, triton", import_s - import_torch_s),
        (f"compiling ahead ({inner['threads']:.1f} s of compiles on its threads)", ahead["s"]),
        ("Triton compiles on the main thread", on_main),
        (f"GEMV tuner timing ({tuner['n']} shapes; its compiles excluded)", tuning_s),
        (f"graph captures ({captures['n']} runners; compiles, tuning excluded)", capture_s),
        ("the rest of the command",
         total - import_s - ahead["s"] - on_main - tuning_s - capture_s),
        ("(of the command: the engine's start-up step timing, its compiles included)",
         timing["s"]),
    ]  # fmt: skip
    print("| part | s |\n|---|---:|")
    for label, seconds in rows:
        print(f"| {label} | {seconds:.2f} |")
    print(
        f"(the command itself {total - (run_start - start):.1f} s; compiles inside tuning "
        f"{inner['tuner']:.2f} s, inside captures {inner['capture']:.2f} s)"
    )
    print("\nmain-thread compiles by phase:")
    for phase, kernels in sorted(where.items()):
        listed = ", ".join(f"{name} x{n}" for name, n in kernels.most_common())
        print(f"- {phase}: {sum(kernels.values())}: {listed}")
    print(f"\n{sum(compile_n.values())} compiles (cache hits included):")
    print("| kernel | compiles | s (thread time) |\n|---|---:|---:|")
    for name, seconds in compile_s.most_common(20):
        print(f"| {name} | {compile_n[name]} | {seconds:.2f} |")
    for title, prof, top in (
        ("graph captures", profiler, args.profile_captures),
        ("compiling ahead", ahead_profiler, args.profile_ahead),
    ):
        if prof is not None and not prof.wrapper.calls:
            print(f"\n{title}: none ran (nothing to profile)")
        elif prof is not None:
            print(f"\n{title}, the {top} calls with the most cumulative time:")
            pstats.Stats(prof, stream=sys.stdout).sort_stats("cumulative").print_stats(top)
    return rc


if __name__ == "__main__":
    sys.exit(main())
