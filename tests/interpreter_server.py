"""Runs test scripts under Triton's interpreter for one pytest process
(``helpers.run_under_triton_interpreter``).

Started once with TRITON_INTERPRET=1, it imports torch and triton, then forks a child
for each script. A script thus pays neither Python's start nor torch's import: 2 s each
on 2 cores, for 17 scripts in the CPU lane, which had come within seconds of its 6 minutes.
Each child is a fresh copy of the server, so what a script patches dies with it: module
constants, the interpreter's dot (``helpers.exact_interpreter_dots``).

The protocol is one JSON line each way, on stdin and stdout:

- the request: ``{"argv": [script, *args], "env": {...}, "out": path, "err": path,
  "timeout": s}``;
- the reply: ``{"status": exit code}`` once the child has ended (negative: the signal
  that ended it, SIGALRM past ``timeout``).

Triton's interpreter patches ``triton.language`` again at every call of a nested
``@triton.jit`` function, though the launch around it has already patched it: 0.9 ms a
call, a third of an interpreted whole model's time. The server skips those repeats
(``patch_language_once_per_launch``); what the kernels compute does not change.

Hazard: a fork copies only the forking thread. The server runs nothing before it forks,
so no other thread exists to hold a lock the child would need. torch's intra-op pool
starts at its first parallel op, in the child.
"""

from __future__ import annotations

import inspect
import json
import os
import runpy
import signal
import sys
import traceback

import torch  # noqa: F401  (imported here once: every child shares it)
import triton  # noqa: F401
import triton.language as tl
from triton.runtime import interpreter


def patch_language_once_per_launch() -> None:
    """Within one interpreted launch, patch each language module once.

    ``interpreter._patch_lang(fn)`` swaps every builtin of the language modules that
    ``fn``'s globals hold (``tl``, ``tl.core``) for its interpreted form. A launch
    (``GridExecutor``) does so and restores them when its grid has run; a nested jit
    function's call does so again, with nothing to swap that the launch has not swapped
    unless its module holds another language module, and never restores. A nested call
    whose modules the running launch has already patched is skipped here; any other call
    patches as before. Hazard: written against Triton 3.7's interpreter; where
    ``_patch_lang`` or ``GridExecutor`` is missing, nothing is changed."""
    original = getattr(interpreter, "_patch_lang", None)
    executor = getattr(interpreter, "GridExecutor", None)
    if original is None or executor is None:
        return
    launch = executor.__call__
    patched: set[int] | None = None  # the running launch's language modules (ids)

    def run_launch(self, *args, **kwargs):
        nonlocal patched
        patched = set()
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched = None

    def patch_lang(fn):
        langs = {
            id(value)
            for value in fn.__globals__.values()
            if inspect.ismodule(value) and value in (tl, tl.core)
        }
        if patched is not None and langs and langs <= patched:
            return None  # a nested call's: Triton discards it
        scope = original(fn)
        if patched is not None:
            patched.update(langs)
        return scope

    executor.__call__ = run_launch
    interpreter._patch_lang = patch_lang


def run_script(request: dict) -> None:
    """In the child: ``request``'s script as ``__main__``, its output in its files; never
    returns."""
    for fd, path in ((1, request["out"]), (2, request["err"])):
        file = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(file, fd)
        os.close(file)
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = list(request["argv"])
    sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))  # as `python script`
    signal.alarm(request["timeout"])  # SIGALRM's default action ends a script that hangs
    status = 0
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as stop:
        status = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
        if stop.code is not None and not isinstance(stop.code, int):
            print(stop.code, file=sys.stderr)  # as Python prints sys.exit("message")
    except BaseException:
        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # not the server's exit handlers, nor its stdin's buffered lines


def main() -> None:
    patch_language_once_per_launch()
    while line := sys.stdin.readline():  # until the pytest process closes stdin (or exits)
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            run_script(request)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"status": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    main()
