"""The `Device` contract: what graphrt needs to know about an accelerator.

A device answers three questions: is it here (`is_available`, a cheap probe
that never raises), can it be used (`ensure_ready`, which imports the device
library and explains a failure in one line), and how to talk to it through
torch (`torch_device`, `synchronize`, `default_dtype`).

NOTE: this module and the device subpackages import torch only inside
methods, so `import graphrt.devices` stays torch-free and the CLI can call
`disable_torch_backend_autoload()` before torch is ever imported.
"""

from __future__ import annotations

import abc
import importlib.metadata
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

from graphrt.core.errors import DeviceUnavailableError, UsageError

if TYPE_CHECKING:
    import torch

    from graphrt.core.attention import AttentionBackend
    from graphrt.core.memory import ReqToTokenPool, TokenKVPool
    from graphrt.core.models.ops import ModelOps
    from graphrt.core.parallel.group import SmallAllReduce, TPGroup
    from graphrt.core.runners.backend import ExecutionBackend


class Device(abc.ABC):
    """One kind of accelerator (or the CPU), selected by `name`."""

    name: ClassVar[str]
    """What users type: `--device NAME` or `GRAPHRT_DEVICE=NAME`."""
    torch_type: ClassVar[str]
    """What `torch.device()` takes for this device."""
    extra: ClassVar[str | None] = None
    """The pip extra of graphrt that installs this device's library, if any."""
    libraries: ClassVar[tuple[str, ...]] = ()
    """Distributions reported by `library_versions` (read from metadata, never imported)."""
    collective_backend: ClassVar[str] = "gloo"
    """torch.distributed's backend for this device's collectives (tensor parallelism)."""
    collective_kernels: ClassVar[str | None] = None
    """A regex matching the names of the collective library's device kernels as the
    profiler records them (bench: a step's time in collectives); None: not known."""
    graphs_capture_collectives: ClassVar[bool] = True
    """Whether this device's graphs record the collective library's calls reliably (tensor
    parallelism on graphs); where not, ``--tp`` runs eagerly only."""
    kv_memory_fraction: ClassVar[float | None] = None
    """The share of free memory (weights loaded) the KV pool takes by default, the context
    then defaulting to the model's (core/engine/kv_plan.py); None: a fixed 1 GiB pool and
    a context of at most 4096 tokens."""
    overlap_by_default: ClassVar[bool] = False
    """Whether engines launch each decode step before the last one's result is read
    (``EngineConfig.overlap`` left None): where the device runs queued work while the host
    prepares the next step. Off where the host is the device (CPU) or not measured."""
    index: int | None = None
    """Which of the host's devices this process drives (``bind_local_rank``); None: the
    current one."""

    @abc.abstractmethod
    def is_available(self) -> bool:
        """Cheap probe used for auto-selection; never raises."""

    @abc.abstractmethod
    def ensure_ready(self) -> None:
        """Make the device usable or raise `DeviceUnavailableError` (one line: problem and fix)."""

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Wait for all queued work on the device (benchmarks time around this)."""

    @abc.abstractmethod
    def describe(self) -> str:
        """A human name for reports, e.g. 'NVIDIA H200'. Call after `ensure_ready`."""

    def torch_device(self) -> torch.device:
        """The torch device tensors are placed on. Call after `ensure_ready`."""
        import torch

        return torch.device(self.torch_type, self.index)

    def bind_local_rank(self, local_rank: int, local_size: int) -> None:
        """Tensor parallelism: this process is rank ``local_rank`` of the ``local_size``
        ranks on its host and drives the host's device of that index (the current device
        for everything that follows: streams, graph pools, the collective's communicator)."""
        import torch

        self.ensure_ready()
        count = torch.accelerator.device_count()
        if local_rank >= count:
            raise self.unavailable(
                f"has {count} device(s) on this host; local rank {local_rank} needs one more "
                "(fewer ranks per host, or more devices)"
            )
        self.index = local_rank
        torch.accelerator.set_device_index(local_rank)

    def small_all_reduce(self, tp: TPGroup) -> SmallAllReduce | None:
        """Tensor parallelism: an all-reduce faster than the collective library's for the
        small messages of decode steps, set up now for ``tp`` (collectively: every rank
        calls this), or None to use the library's for every message."""
        return None

    def default_dtype(self) -> torch.dtype:
        """Accelerators decode in bfloat16; CPU overrides this with float32."""
        import torch

        return torch.bfloat16

    def library_versions(self) -> dict[str, str]:
        """Versions for bug reports and BENCHMARKS.md: torch plus this device's libraries.

        Libraries are read from installed metadata so that reporting a
        version never imports (and so never initialises) a device library.
        """
        import torch

        versions = {"torch": torch.__version__}
        for dist in self.libraries:
            try:
                versions[dist] = importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                continue
        return versions

    def graph_backends(self) -> tuple[str, ...]:
        """Names of the graph backends this device offers; the first is the default."""
        return tuple(self._graph_backend_factories())

    def default_runner(self) -> str:
        """The runner when none is asked for: graphs where the device has a backend."""
        return "graph" if self.graph_backends() else "eager"

    def create_graph_backend(self, name: str | None = None) -> ExecutionBackend:
        """A fresh execution backend (``--graph-backend``); None picks the device's default."""
        factories = self._graph_backend_factories()
        if not factories:
            raise UsageError(f"device '{self.name}' has no graph backend; use --runner eager")
        name = name or next(iter(factories))
        if name not in factories:
            raise UsageError(
                f"device '{self.name}' has no graph backend {name!r}; it offers {', '.join(factories)}"
            )
        return factories[name]()

    def create_attention_backend(
        self, kv_pool: TokenKVPool, req_to_token_pool: ReqToTokenPool
    ) -> AttentionBackend:
        """The fastest attention backend for this device; the torch reference by default."""
        from graphrt.core.attention import TorchAttentionBackend

        return TorchAttentionBackend(kv_pool, req_to_token_pool)

    def free_memory_bytes(self) -> int | None:
        """Bytes this process could still allocate on the device (None: unknown), checked
        before weights and the KV pool are allocated, so a model too large fails in one
        line rather than in the allocator (or, on the host, by the kernel's OOM killer)."""
        return None

    def check_environment(self) -> None:
        """Refuse (UsageError) a bad value of an environment variable this device reads,
        before anything loads. None by default."""
        return None

    def startup_notice(self) -> str | None:
        """One status line for a start that will be long for a reason the user cannot see
        (kernels compiling on a machine's first run), or None."""
        return None

    def model_ops(self, batch_invariant: bool = False) -> ModelOps:
        """The table of elementwise kernels models use here; the torch reference by default.

        ``batch_invariant``: kernels whose every row's result does not depend on the rows
        beside it, where the device has them; the reference's are torch's own (no promise)."""
        from graphrt.core.models.ops import TORCH_OPS

        return TORCH_OPS

    def _graph_backend_factories(self) -> dict[str, Callable[[], ExecutionBackend]]:
        """Graph backend name -> constructor; the first entry is the default."""
        return {}

    def unavailable(self, problem: str) -> DeviceUnavailableError:
        """Build the one-line error `ensure_ready` raises: "device 'x' <problem>"."""
        return DeviceUnavailableError(one_line(f"device '{self.name}' {problem}"))

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


def one_line(text: str) -> str:
    """Collapse whitespace so library error messages fit the CLI's one-line report."""
    return " ".join(text.split())
