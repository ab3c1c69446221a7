"""Tensor-parallel layers: each rank holds a slice of a weight and computes its part;
one collective per pair of layers joins the parts.

- ``ColumnParallelLinear``: output features split (q/k/v by heads, gate/up by columns);
  each rank's output is its slice of the features, no collective.
- ``RowParallelLinear``: input features split (o_proj, down_proj); each rank multiplies
  its slice of the input, the partial sums are all-reduced, then bias and residual are
  added once.
- ``VocabParallelEmbedding`` / ``VocabParallelHead``: vocabulary rows split; ids outside
  a rank's rows embed to zero before the all-reduce; the head's logits are gathered. A
  vocabulary that does not split evenly is padded to a multiple of the rank count (the
  last rank's extra rows are zeros; ``vocab_logits`` drops their logits), as vLLM pads.

Parameters are built at their shard's size and marked with ``tp_dim``; ``take_shard``
cuts a full checkpoint tensor to this rank's part along that dimension. For the group of
one every layer is its plain counterpart (same weights, same ops, no collective).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from graphrt.core.errors import UsageError
from graphrt.core.models.linear import Linear
from graphrt.core.models.ops import TORCH_OPS, ModelOps, PreNorm
from graphrt.core.parallel.group import TPGroup


def mark_sharded(param: nn.Parameter, dim: int, tp: TPGroup, full: int | None = None) -> None:
    """Record that ``param`` holds rank ``tp.rank``'s slice of a full tensor along ``dim``;
    ``full``: that dimension's size in the checkpoint when the shards pad it (a
    vocabulary), else shards x ranks."""
    param.tp_dim = dim
    param.tp_group = tp
    param.tp_full = param.shape[dim] * tp.size if full is None else full


def take_shard(tensor: torch.Tensor, param: nn.Parameter) -> torch.Tensor:
    """The slice of a full checkpoint ``tensor`` that ``param`` holds (all of it when
    ``param`` is not sharded). A view (safetensors' lazy slices cut the same way), or, for
    a padded vocabulary's last rows, the slice followed by zero rows."""
    dim = getattr(param, "tp_dim", None)
    if dim is None:
        return tensor
    tp: TPGroup = param.tp_group
    local = param.shape[dim]
    if tensor.shape[dim] != param.tp_full:
        raise ValueError(
            f"dimension {dim} is {tensor.shape[dim]}, expected {param.tp_full} "
            f"({local} a rank x {tp.size} ranks)"
        )
    start = tp.rank * local
    present = max(0, min(local, param.tp_full - start))
    if present == local:
        return tensor.narrow(dim, start, local)
    piece = tensor.narrow(dim, start, present)
    padding = list(piece.shape)
    padding[dim] = local - present
    return torch.cat([piece, piece.new_zeros(padding)], dim)


class _ShardedLinear(Linear):
    """A ``Linear`` holding this rank's slice of the weight along ``split_dim``: 0 splits
    the output features (and the bias), 1 the input features (the bias stays whole: a
    row-parallel layer adds it once, after the sum)."""

    split_dim: int

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        tp: TPGroup,
        ops: ModelOps = TORCH_OPS,
    ):
        if self.split_dim == 0:
            out_features = tp.shard(out_features, "output features")
        else:
            in_features = tp.shard(in_features, "input features")
        super().__init__(in_features, out_features, bias, ops)
        self.tp = tp
        mark_sharded(self.weight, self.split_dim, tp)
        if self.split_dim == 0 and self.bias is not None:
            mark_sharded(self.bias, 0, tp)


class ColumnParallelLinear(_ShardedLinear):
    split_dim = 0


class RowParallelLinear(_ShardedLinear):
    split_dim = 1

    def forward(
        self, x: torch.Tensor, norm: PreNorm | None = None, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        if self.tp.is_single:
            return super().forward(x, norm=norm, residual=residual)
        if norm is not None:  # a norm needs the whole row, and this rank sees a slice
            raise UsageError("a row-parallel linear layer cannot apply a norm to its input")
        out = self.tp.all_reduce(self.ops.linear(x, self.weight, None))  # (rows, out)
        if self.bias is not None:
            out = out + self.bias
        return out if residual is None else out + residual


class VocabParallelEmbedding(nn.Embedding):
    def __init__(self, vocab_size: int, dim: int, tp: TPGroup):
        super().__init__(tp.vocab_rows(vocab_size), dim)
        self.tp = tp
        self.first = tp.rank * self.num_embeddings  # this rank's first token id
        mark_sharded(self.weight, 0, tp, full=vocab_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.is_single:
            return super().forward(ids)
        local = ids - self.first
        outside = (local < 0) | (local >= self.num_embeddings)
        x = F.embedding(local.clamp(0, self.num_embeddings - 1), self.weight)  # (..., dim)
        return self.tp.all_reduce(x.masked_fill(outside.unsqueeze(-1), 0))


class VocabParallelHead(Linear):
    """The LM head split by vocabulary rows (padded as the embedding's): every rank ends
    with all the logits."""

    def __init__(self, dim: int, vocab_size: int, tp: TPGroup, ops: ModelOps = TORCH_OPS):
        super().__init__(dim, tp.vocab_rows(vocab_size), False, ops)
        self.tp = tp
        self.vocab_size = vocab_size
        mark_sharded(self.weight, 0, tp, full=vocab_size)

    def forward(self, x: torch.Tensor, norm: PreNorm | None = None, residual=None) -> torch.Tensor:
        local = super().forward(x, norm=norm)  # (rows, padded vocab / size)
        return vocab_logits(self.tp, local, self.vocab_size)


def vocab_logits(tp: TPGroup, local: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(rows, rows of this rank's vocabulary shard) logits -> every rank's: (rows, vocab),
    a padded vocabulary's extra columns dropped."""
    logits = tp.all_gather_last(local)  # (rows, padded vocab)
    return logits if logits.shape[-1] == vocab_size else logits[..., :vocab_size]
