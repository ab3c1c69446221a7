"""Tensor parallelism over torch.distributed (DESIGN.md, layer 9): the group
(``graphrt.core.parallel.group``) and the layers whose weights are split across its
ranks (``graphrt.core.parallel.layers``). Only the group is imported here: the model
layers build on ``parallel.group``, and ``parallel.layers`` builds on them."""

from graphrt.core.parallel.group import SINGLE, TPGroup, init_tp

__all__ = ["SINGLE", "TPGroup", "init_tp"]
