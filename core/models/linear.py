"""The model's matmul layers: ``Linear`` runs the device's ``ops.linear`` (with an optional
fused pre-norm and residual add); ``MergedLinear`` stacks several checkpoint projections
into one matmul, column-split under tensor parallelism."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from graphrt.core.models.ops import TORCH_OPS, ModelOps, PreNorm
from graphrt.core.parallel.group import SINGLE, RowSlice, TPGroup


class Linear(nn.Linear):
    """``nn.Linear`` whose matmul is the device's ``ops.linear`` (CUDA: a tuned GEMV for
    decode-sized batches, cuBLAS otherwise), optionally with an RMSNorm before it and a
    residual add after it (``norm(x) @ W.T + b + residual``)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, ops: ModelOps = TORCH_OPS):
        super().__init__(in_features, out_features, bias=bias)
        self.ops = ops

    def forward(
        self, x: torch.Tensor, norm: PreNorm | None = None, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.ops.linear(x, self.weight, self.bias, norm=norm, residual=residual)


class MergedLinear(Linear):
    """One matmul over several checkpoint projections stacked along the output dim.

    ``shards`` maps a checkpoint name suffix (e.g. "q_proj") to its output rows;
    the loader calls ``load_shard`` for each and checks that all were loaded. Under
    tensor parallelism (``tp`` of more than one rank) each projection is column-split:
    this rank holds its slice of every one (q, k, v by heads; gate, up by columns),
    split evenly, or the ``RowSlice`` given for it (KV heads replicated over ranks).
    """

    def __init__(
        self,
        in_features: int,
        shards: Mapping[str, int | RowSlice],
        bias: bool,
        ops: ModelOps = TORCH_OPS,
        tp: TPGroup = SINGLE,
    ):
        local = {
            name: rows if isinstance(rows, RowSlice) else tp.split(rows, f"{name} outputs")
            for name, rows in shards.items()
        }
        super().__init__(in_features, sum(r.size for r in local.values()), bias, ops)
        self.tp = tp
        self.shard_rows = local  # checkpoint rows this rank holds, per projection
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, rows in local.items():
            self.shard_offsets[name] = (offset, rows.size)
            offset += rows.size

    def load_shard(self, param: nn.Parameter, shard: str, tensor) -> torch.Tensor:
        """``tensor``: the checkpoint's whole projection (a torch tensor, or a lazy one that
        reads only the rows asked for). -> the rows copied in."""
        offset, size = self.shard_offsets[shard]
        rows = self.shard_rows[shard]
        if tensor.shape[0] == rows.full:
            tensor = tensor.narrow(0, rows.start, rows.size)  # this rank's rows
        expected = (size, *param.shape[1:])
        if tuple(tensor.shape) != expected:
            raise ValueError(f"shape {tuple(tensor.shape)}, expected {expected}")
        param.data[offset : offset + size].copy_(tensor)
        return tensor
