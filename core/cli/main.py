"""`graphrt` entry point: parse, dispatch, and turn user errors into one line.

A ``GraphrtError`` (bad input, bad checkpoint, missing device library, a size
that does not fit in memory) is printed as ``graphrt: error: <message>`` and
exits with its class's status (graphrt.core.errors: 1 request, 2 usage,
3 checkpoint, 4 device, 5 out of memory); argparse usage errors exit 2. torch's
out-of-memory errors become status 5 too. Anything else is a bug and keeps its
traceback.
"""

from __future__ import annotations

import os
import sys

from graphrt import devices

# HAZARD: must run before anything imports torch (see devices.disable_torch_backend_autoload).
devices.disable_torch_backend_autoload()

from graphrt.core.cli.args import build_parser  # noqa: E402
from graphrt.core.errors import GraphrtError, OutOfMemoryError, out_of_memory  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            from graphrt.core.cli.generate import run_generate

            return run_generate(args)
        if args.command == "bench":
            from graphrt.core.cli.bench import run_bench

            return run_bench(args)
        if args.command == "info":
            from graphrt.core.cli.info import run_info

            return run_info(args)
    except GraphrtError as e:
        print(f"graphrt: error: {e}", file=sys.stderr)
        return e.exit_code
    except (MemoryError, RuntimeError) as e:
        if not out_of_memory(e):  # torch.OutOfMemoryError, the CPU allocator's, Python's
            raise
        print(f"graphrt: error: out of memory: {_first_line(e)}", file=sys.stderr)
        return OutOfMemoryError.exit_code
    except KeyboardInterrupt:
        print("graphrt: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `graphrt info | head -1`: the reader left; nothing to report
        # Point stdout at devnull so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    raise AssertionError(f"unhandled command {args.command}")


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


if __name__ == "__main__":
    sys.exit(main())
