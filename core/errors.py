"""User-facing errors.

Every error a user can cause (bad flags, bad checkpoints, bad prompts, a
device whose library is missing) is a `GraphrtError`: the CLI prints its
message on one line and exits non-zero without a traceback. Anything else
is a bug in graphrt and keeps its traceback.
"""


class GraphrtError(Exception):
    """An error caused by input or environment, explained in one line."""


class CheckpointError(GraphrtError):
    """A checkpoint directory is missing, malformed or does not fit the model."""


class UnsupportedModelError(GraphrtError):
    """The checkpoint's architecture is not one graphrt implements."""


class DeviceUnavailableError(GraphrtError):
    """The requested device is unknown, absent, or its library is not installed."""


class RequestError(GraphrtError):
    """A request cannot be served (empty prompt, token outside the vocabulary, too long)."""


class KVPoolExhaustedError(GraphrtError):
    """The KV pool has no room for an allocation that cannot wait."""
