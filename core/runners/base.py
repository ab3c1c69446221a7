"""BaseRunner: the one contract every runner serves, eager or graph, on any device."""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch
from torch import nn

from graphrt.core.attention.base import AttentionBackend
from graphrt.core.batch import ForwardBatch


@dataclass
class RunnerOutput:
    """Results for the rows of ``batch.logits_indices`` (every token when None)."""

    logits: torch.Tensor | None  # (N, vocab) float32; None for ``batch.greedy_only``
    # (N, hidden) what a speculative draft step is fed next (``model.next_hidden``): a
    # target's final hidden states, a drafter's projection of its own.
    hidden: torch.Tensor
    tokens: torch.Tensor | None = None  # (N,) int64 argmax tokens, for ``batch.greedy_only``


class BaseRunner(abc.ABC):
    """``can_run_graph`` gates dispatch, ``load_batch`` fills inputs, ``execute`` runs one forward."""

    def __init__(self, model: nn.Module, attn_backend: AttentionBackend):
        self.model = model
        self.attn_backend = attn_backend

    @abc.abstractmethod
    def can_run_graph(self, batch: ForwardBatch) -> bool:
        """True when ``execute(batch)`` would replay a captured graph."""

    @abc.abstractmethod
    def load_batch(self, batch: ForwardBatch) -> None:
        """Fill this runner's inputs and attention metadata for ``batch``."""

    @abc.abstractmethod
    def execute(self, batch: ForwardBatch, clone: bool = True) -> RunnerOutput:
        """Run one forward of ``batch``: ``load_batch`` then the model (or its graph).
        ``clone=False``: a graph may return views of its own output memory, which its
        next replay overwrites; for a caller that reads them within the step."""

    def _forward(self, batch: ForwardBatch, logits_out: torch.Tensor | None = None) -> RunnerOutput:
        """The model itself, shared by eager execution and graph capture (``logits_out``:
        where the logits go, (N, vocab) float32; a graph runner's shared buffer)."""
        return forward_model(self.model, self.attn_backend, batch, logits_out)


def forward_model(
    model: nn.Module,
    attn: AttentionBackend,
    batch: ForwardBatch,
    logits_out: torch.Tensor | None = None,
) -> RunnerOutput:
    """One forward of ``model`` over ``batch``: logits (into ``logits_out`` (N, vocab)
    float32 when given), or argmax tokens only (``batch.greedy_only``), and the hidden
    handed on."""
    hidden = model(batch, attn)  # (T, hidden)
    if batch.logits_indices is not None:
        hidden = hidden[batch.logits_indices]  # (N, hidden)
    if batch.greedy_only:
        tokens = greedy_tokens(model, hidden)
        return RunnerOutput(logits=None, hidden=model.next_hidden(hidden), tokens=tokens)
    logits = model.compute_logits(hidden, logits_out)
    return RunnerOutput(logits=logits, hidden=model.next_hidden(hidden))


def greedy_tokens(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """(N,) int64: each row's argmax token, the first maximum as ``argmax`` picks it;
    through the model's own ``greedy_tokens`` where it has a cheaper way than logits."""
    own = getattr(model, "greedy_tokens", None)
    return own(hidden) if own is not None else model.compute_logits(hidden).argmax(dim=-1)
