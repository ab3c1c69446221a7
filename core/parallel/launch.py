"""Starting and joining a tensor-parallel job.

``graphrt generate --tp N`` and ``graphrt bench --tp N`` on one host: the command runs
itself N times (``spawn_ranks``), one process per device, each with torchrun's
environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
Under torchrun, on one host or several, the processes exist already. Either way every
rank calls ``join`` and then runs the same schedule (SPMD).

Output: rank 0 alone prints. The launcher passes rank 0's stdout and stderr through and
keeps the other ranks' stderr only to name a failure.

Failure: the first rank that exits non-zero (or is killed) stops the job. The launcher
gives the others ``GRACE_S`` to exit on their own (a rank waiting in a collective on a
dead peer fails within that on gloo; NCCL may wait until the process group's timeout),
then kills them, and prints one line naming the rank that failed first and why.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from typing import TYPE_CHECKING, NoReturn

from graphrt.core.errors import (
    RankFailedError,
    Terminated,
    UsageError,
    first_line,
    interrupted_status,
)

if TYPE_CHECKING:
    from graphrt.core.parallel.group import TPGroup
# HAZARD: no torch at module level. `graphrt generate --tp N` imports this to start its
# ranks, and that launcher process never needs torch (1.5-2 s of CPU a launch); join
# and leave_job, which run in the ranks, import it.

GRACE_S = 3.0  # after the first failure, how long the other ranks get to exit on their own
POLL_S = 0.05
ERROR_PREFIX = "graphrt: error: "


def is_output_rank() -> bool:
    """Whether this process prints: rank 0 of a job, or a process that is not in one."""
    return os.environ.get("RANK", "0") == "0"


def in_job() -> bool:
    """Whether this process is a rank of a job (started by ``spawn_ranks`` or torchrun)."""
    return _job_env("WORLD_SIZE", 1) > 1


def _job_env(name: str, default: int) -> int:
    """A count torchrun's environment gives (WORLD_SIZE, RANK, LOCAL_RANK): a UsageError
    naming the variable for anything but a whole number >= 0, not int()'s traceback."""
    value = os.environ.get(name)
    if value is None:
        return default
    if not value.strip().isdigit():
        raise UsageError(f"environment variable {name}={value!r} must be a whole number >= 0")
    return int(value)


def join(requested: int | None, device) -> TPGroup:
    """This process's tensor-parallel group: the job's ranks when it is one of them,
    else the group of one. Binds the rank's device first (the collective library opens
    its communicator on the current device)."""
    from graphrt.core.parallel.group import SINGLE, init_tp

    world = _job_env("WORLD_SIZE", 1)
    if requested is not None and requested != world:
        raise UsageError(
            f"--tp {requested}, but this job has {world} processes (WORLD_SIZE): "
            f"pass --tp {world} or leave --tp out under torchrun"
        )
    if world == 1:
        return SINGLE
    local_rank = _job_env("LOCAL_RANK", _job_env("RANK", 0))
    device.bind_local_rank(local_rank, _job_env("LOCAL_WORLD_SIZE", world))
    try:
        accelerator = device.torch_device() if device.index is not None else None
        tp = init_tp(device.collective_backend, device_id=accelerator)
        tp = dataclasses.replace(tp, small_all_reduce=device.small_all_reduce(tp))
    except (RuntimeError, ValueError) as e:  # rendezvous: unreachable master, timeout
        raise RankFailedError(f"cannot join the tensor-parallel group: {first_line(e)}") from None
    if not is_output_rank():
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (for the life of the process)
    return tp


def leave_job(status: int) -> None:
    """Ends this rank's part in the job while the interpreter is whole: the process group
    is destroyed and its threads joined here, not during interpreter shutdown.

    HAZARD: the collective library frees a finished collective's work on its own thread
    (gloo: ``ProcessGroupGloo::runLoop``), after ``wait`` returned. A tensor of that work
    whose Python object was dropped meanwhile owns the object, and freeing it takes the
    GIL. Python ends a thread that takes the GIL once the interpreter is finalizing
    (``pthread_exit``), and that unwinding through the noexcept
    ``TensorImpl::decref_pyobject`` is std::terminate: "terminate called without an
    active exception", a finished rank's SIGABRT. ``destroy_process_group`` alone leaves
    the group alive, hence its threads: the model's layers refer to it
    (``TPGroup.group``), in reference cycles that only the collector frees."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    if status == RankFailedError.exit_code:
        # Lost peers: the group's destructor joins threads that may be stuck with them.
        _exit_now(status)
    group = weakref.ref(dist.group.WORLD)
    dist.destroy_process_group()
    gc.collect()  # frees the group: its destructor joins its threads
    if group() is not None:  # still referenced: its threads would outlive the interpreter
        _exit_now(status)


def _exit_now(status: int) -> NoReturn:
    """Ends the process without interpreter shutdown (no atexit handlers, no finalizers,
    nothing a library thread could race), its standard streams flushed first."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def default_runner(device, tp: TPGroup) -> str:
    """The device's default runner, eager under tensor parallelism where its graphs do not
    record collectives."""
    if tp.size > 1 and not device.graphs_capture_collectives:
        return "eager"
    return device.default_runner()


def check_runner(device, runner: str, tp: TPGroup) -> None:
    """Graphs under tensor parallelism only where the device's graphs record collectives."""
    if runner == "graph" and tp.size > 1 and not device.graphs_capture_collectives:
        raise UsageError(
            f"{device.name} graphs do not record {device.collective_backend} collectives "
            "reliably yet: use --runner eager with --tp"
        )


class _Rank:
    """One spawned rank: its process, and a thread that reads its stderr (forwarding
    rank 0's, keeping every rank's error line)."""

    def __init__(self, rank: int, size: int, port: int, argv: list[str]):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(size),
            "LOCAL_WORLD_SIZE": str(size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        self.rank = rank
        self.error_line: str | None = None  # its "graphrt: error: ..." line, if it printed one
        self.last_line = ""
        self.forward = rank == 0
        self.process = subprocess.Popen(
            [sys.executable, "-m", "graphrt.core.cli.main", *argv],
            env=env,
            stdout=None if rank == 0 else subprocess.DEVNULL,  # rank 0's results go straight out
            stderr=subprocess.PIPE,
        )
        self.reader = threading.Thread(target=self._read_stderr, daemon=True)
        self.reader.start()

    def _read_stderr(self) -> None:
        # Line by line, keeping "\r" updates (progress bars) whole; error lines are held
        # back: the launcher prints the one that explains the failure.
        pending = b""
        while chunk := os.read(self.process.stderr.fileno(), 4096):
            pending += chunk
            *lines, pending = pending.replace(b"\r", b"\r\n").split(b"\n")
            for raw in lines:
                self._take(raw.decode(errors="replace"))
        if pending:
            self._take(pending.decode(errors="replace"))

    def _take(self, line: str) -> None:
        text = line.rstrip("\r")
        if text.startswith(ERROR_PREFIX):
            self.error_line = self.error_line or text.removeprefix(ERROR_PREFIX)
            return
        if text.startswith("graphrt: rank "):  # "rank 0: interrupted": the job says it once
            return
        if text.strip():
            self.last_line = text.strip()
        if self.forward:
            sys.stderr.write(line if line.endswith("\r") else line + "\n")
            sys.stderr.flush()

    def failure(self) -> str:
        status = self.process.returncode
        if self.error_line:  # already names the rank (main prefixes it in a job)
            return self.error_line
        if status < 0:
            return f"rank {self.rank} was killed by {signal.Signals(-status).name}"
        return f"rank {self.rank} exited with status {status}: {self.last_line}"


def spawn_ranks(size: int, argv: list[str]) -> int:
    """Runs the command ``argv`` as ``size`` ranks on this host; -> the job's exit status.
    More ranks than max(8, CPU cores) is refused before any starts: each rank is a process
    (a device per rank is checked by the ranks, which import the device's library; a few
    ranks over the cores is fine for small CPU jobs)."""
    cores = os.cpu_count() or 1
    if size > max(8, cores):
        raise UsageError(
            f"--tp {size} starts {size} processes on this host, which has {cores} CPU cores "
            f"(at most {max(8, cores)} ranks): use one rank per device (under torchrun, one "
            "per device of each host)"
        )
    port = free_port()
    ranks: list[_Rank] = []
    try:
        # Spawned inside the try: a signal while starting them still stops those started.
        for r in range(size):
            ranks.append(_Rank(r, size, port, argv))
        first_failed = _wait(ranks)
    except KeyboardInterrupt as stop:  # SIGINT, or SIGTERM (errors.Terminated)
        # Forward it: each rank stops as a single process would (rank 0 prints what it
        # produced), then is reaped; one line for the job.
        line, status = interrupted_status(stop)
        _stop(ranks, signal.SIGTERM if status == Terminated.exit_code else signal.SIGINT)
        for r in ranks:
            r.reader.join(timeout=5)
        print(f"graphrt: {line}", file=sys.stderr)
        return status
    for r in ranks:
        r.reader.join(timeout=5)
    if first_failed is None:
        return 0
    for r in ranks:  # a failure stops forwarding: the other ranks' errors follow from it
        r.forward = False
    print(ERROR_PREFIX + first_failed.failure(), file=sys.stderr)
    status = first_failed.process.returncode
    return status if 0 < status < RankFailedError.exit_code else RankFailedError.exit_code


def _wait(ranks: list[_Rank]) -> _Rank | None:
    """Until every rank has exited -> the first to fail, or None; stops the others
    ``GRACE_S`` after a failure."""
    first_failed, deadline = None, None
    while [r.process.poll() for r in ranks].count(None):  # polls every rank (not any())
        if first_failed is None:
            first_failed = next((r for r in ranks if r.process.returncode not in (None, 0)), None)
            if first_failed is not None:
                deadline = time.monotonic() + GRACE_S
        if deadline is not None and time.monotonic() > deadline:
            _stop(ranks)
            break
        time.sleep(POLL_S)
    if first_failed is None:
        first_failed = next((r for r in ranks if r.process.returncode != 0), None)
    return first_failed


def _stop(ranks: list[_Rank], sig: int = signal.SIGTERM) -> None:
    for r in ranks:
        if r.process.poll() is None:
            r.process.send_signal(sig)
    deadline = time.monotonic() + GRACE_S
    for r in ranks:
        try:
            r.process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            r.process.kill()
            r.process.wait()


def free_port() -> int:
    """A TCP port free on this host now (the job's rendezvous port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
