"""Tensor parallelism over torch.distributed (DESIGN.md, layer 9): the group and the
layers whose weights are split across its ranks."""

from graphrt.core.parallel.group import TPGroup, init_tp
from graphrt.core.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelHead,
    take_shard,
)

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "TPGroup",
    "VocabParallelEmbedding",
    "VocabParallelHead",
    "init_tp",
    "take_shard",
]
