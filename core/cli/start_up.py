"""A Ctrl-C before ``main()`` runs is one line, as one during it is.

``main()`` turns a KeyboardInterrupt into ``graphrt: interrupted`` (exit 130), but the
module that holds it imports first: about 0.1 s (the device registry, argparse), in
which Python would print a KeyboardInterrupt traceback. The console script (``run``)
and ``python -m graphrt.core.cli.main`` call ``guard()`` before those imports; until
``main()`` calls ``release()``, SIGINT writes main's line and exits 130. Nothing has
been produced by then, so nothing is lost.
"""

from __future__ import annotations

import os
import signal


def _exit_interrupted(signum, frame) -> None:
    os.write(2, b"graphrt: interrupted\n")  # main()'s line for a Ctrl-C at start-up
    os._exit(130)


def guard() -> None:
    # Only where Ctrl-C would raise KeyboardInterrupt: a command started with SIGINT
    # ignored (nohup, a shell's `&`) keeps ignoring it.
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _exit_interrupted)


def release() -> None:
    """From here a Ctrl-C raises KeyboardInterrupt again (main() handles it)."""
    if signal.getsignal(signal.SIGINT) is _exit_interrupted:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def run() -> int:
    """The `graphrt` console script."""
    guard()
    from graphrt.core.cli.main import main

    return main()
