"""`graphrt` entry point: parse, dispatch, and turn user errors into one line.

A ``GraphrtError`` (bad input, bad checkpoint, missing device library, a size
that does not fit in memory) is printed as ``graphrt: error: <message>`` and
exits with its class's status (graphrt.core.errors: 1 request, 2 usage,
3 checkpoint, 4 device, 5 out of memory, 6 a tensor-parallel rank lost); argparse usage
errors exit 2. torch's out-of-memory errors become status 5 too, torch.distributed's
failures (a peer rank died) status 6. Anything else is a bug and keeps its traceback.

``--tp N`` outside a job (no torchrun environment) starts the job: N copies of this
command, one per device (graphrt.core.parallel.launch). Inside a job every rank runs
the command; errors name the rank.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from graphrt.core.cli import start_up

if __name__ == "__main__":  # python -m: a Ctrl-C while importing is one line too
    start_up.guard()

from graphrt import devices  # noqa: E402

# HAZARD: must run before anything imports torch (see devices.disable_torch_backend_autoload).
devices.disable_torch_backend_autoload()

from graphrt.core.cli.args import build_parser  # noqa: E402
from graphrt.core.errors import (  # noqa: E402
    GraphrtError,
    OutOfMemoryError,
    RankFailedError,
    Terminated,
    collective_failure,
    first_line,
    interrupted_status,
    out_of_memory,
)


def _raise_terminated(signum, frame) -> None:
    raise Terminated


def main(argv: list[str] | None = None) -> int:
    # SIGTERM stops work as Ctrl-C does: what was produced is printed, then one line.
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if in_main_thread else None
    if in_main_thread:
        start_up.release()  # a Ctrl-C now raises KeyboardInterrupt, handled below
    try:
        return _main(sys.argv[1:] if argv is None else argv)
    except KeyboardInterrupt as stop:  # during start-up (imports, parsing): one line
        return _interrupted(stop, rank="")
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous)


def _main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    from graphrt.core.parallel.launch import in_job, leave_job, spawn_ranks  # torch: after --help

    try:  # the job's environment (torchrun's variables), the launcher's own checks
        if getattr(args, "tp", None) and args.tp > 1 and not in_job():
            _check_before_launch(args)
            return spawn_ranks(args.tp, argv)
        single = not in_job()
    except GraphrtError as e:
        print(f"graphrt: error: {e}", file=sys.stderr)
        return e.exit_code
    if single:
        return _run_command(args, rank="")
    # In a job, every rank may fail: its error line says which one it is.
    status = _run_command(args, rank=f"rank {os.environ.get('RANK', '?')}: ")
    leave_job(status)
    return status


def _check_before_launch(args) -> None:
    """A ``--tp`` job's flag checks that need no device: a bad flag costs no rank start-up."""
    if args.command == "bench":
        from graphrt.core.cli.bench import check_bench_args

        check_bench_args(args, args.tp)


def _interrupted(stop: KeyboardInterrupt, rank: str) -> int:
    line, status = interrupted_status(stop)
    print(f"graphrt: {rank}{line}", file=sys.stderr)
    return status


def _run_command(args, rank: str) -> int:
    try:
        if args.command == "generate":
            from graphrt.core.cli.generate import run_generate

            return run_generate(args)
        if args.command == "bench":
            from graphrt.core.cli.bench import run_bench

            return run_bench(args)
        if args.command == "serve":
            from graphrt.core.cli.serve import run_serve

            return run_serve(args)
        if args.command == "info":
            from graphrt.core.cli.info import run_info

            return run_info(args)
    except GraphrtError as e:
        print(f"graphrt: error: {rank}{e}", file=sys.stderr)
        return e.exit_code
    except (MemoryError, RuntimeError) as e:
        if out_of_memory(e):  # torch.OutOfMemoryError, the CPU allocator's, Python's
            print(f"graphrt: error: {rank}out of memory: {first_line(e)}", file=sys.stderr)
            return OutOfMemoryError.exit_code
        if rank and collective_failure(e):
            print(f"graphrt: error: {rank}lost the other ranks: {first_line(e)}", file=sys.stderr)
            return RankFailedError.exit_code
        raise
    except KeyboardInterrupt as stop:  # SIGINT or SIGTERM: what was produced is already out
        return _interrupted(stop, rank)
    except BrokenPipeError:  # `graphrt info | head -1`: the reader left; nothing to report
        # Point stdout at devnull so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    raise AssertionError(f"unhandled command {args.command}")


if __name__ == "__main__":
    sys.exit(main())
