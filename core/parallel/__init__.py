"""Tensor parallelism over torch.distributed (DESIGN.md, layer 9): the group
(``graphrt.core.parallel.group``) and the layers whose weights are split across its
ranks (``graphrt.core.parallel.layers``). Only the group is exported here, on first
use: ``parallel.launch`` starts a job's ranks without torch, and importing it runs this
file first. The model layers build on ``parallel.group``; ``parallel.layers`` on them."""

__all__ = ["SINGLE", "TPGroup", "init_tp"]


def __getattr__(name: str):
    if name in __all__:
        from graphrt.core.parallel import group

        return getattr(group, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
