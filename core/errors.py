"""User-facing errors, each with the CLI exit status of its kind.

Every error a user can cause (bad flags, bad checkpoints, bad prompts, a
device whose library is missing, sizes that do not fit in memory) is a
`GraphrtError`: the CLI prints its message on one line and exits with the
class's ``exit_code``, without a traceback. Anything else is a bug in graphrt
and keeps its traceback.

Exit statuses: 1 a request or run that cannot be served (``GraphrtError``,
``RequestError``), 2 usage (``UsageError``; argparse's own errors too), 3 a bad
checkpoint, 4 an unavailable device, 5 out of memory, 6 a tensor-parallel rank
that failed or could not be reached, 130 interrupted.
"""


class GraphrtError(Exception):
    """An error caused by input or environment, explained in one line."""

    exit_code = 1


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread by the CLI's handler: it stops work the way
    Ctrl-C does (everything produced is printed first), and the process exits 143."""

    exit_code = 143


def interrupted_status(stop: KeyboardInterrupt) -> tuple[str, int]:
    """The CLI's line and exit status for a SIGINT (130) or a SIGTERM (143)."""
    if isinstance(stop, Terminated):
        return "terminated (SIGTERM)", Terminated.exit_code
    return "interrupted", 130


class UsageError(GraphrtError):
    """Command-line flags or API arguments that are wrong in themselves or together."""

    exit_code = 2


class CheckpointError(GraphrtError):
    """A checkpoint directory is missing, malformed or does not fit the model."""

    exit_code = 3


class UnsupportedModelError(CheckpointError):
    """The checkpoint's architecture is not one graphrt implements."""


class DeviceUnavailableError(GraphrtError):
    """The requested device is unknown, absent, or its library is not installed."""

    exit_code = 4


class OutOfMemoryError(GraphrtError):
    """An allocation graphrt was asked to make (KV pool, buffers, weights) does not fit."""

    exit_code = 5


class RankFailedError(GraphrtError):
    """A rank of a tensor-parallel job died, failed or cannot be reached (the job stops)."""

    exit_code = 6


class RequestError(GraphrtError):
    """A request cannot be served (empty prompt, token outside the vocabulary, too long)."""


class KVPoolExhaustedError(GraphrtError):
    """The KV pool has no room for an allocation that cannot wait."""


def first_line(error: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none)."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def collective_failure(error: BaseException) -> bool:
    """Whether ``error`` comes from torch.distributed: a peer rank that died or cannot be
    reached, a collective that timed out."""
    import torch.distributed as dist

    # gloo's transport errors reach Python as plain RuntimeErrors naming its source file.
    return isinstance(error, dist.DistError) or "/gloo/" in str(error)


def out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is an allocation failure: torch.OutOfMemoryError (an accelerator),
    the CPU allocator's RuntimeError ("can't allocate memory") or Python's MemoryError."""
    if isinstance(error, MemoryError) or type(error).__name__ == "OutOfMemoryError":
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and (
        "can't allocate memory" in text or "out of memory" in text.lower()
    )
