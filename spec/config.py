"""Speculative-decoding configuration: one frozen dataclass."""

from __future__ import annotations

from dataclasses import dataclass

from graphrt.core.engine.request import is_int
from graphrt.core.errors import UsageError


@dataclass(frozen=True)
class SpecConfig:
    """Frozen-KV MTP drafting: ``num_steps`` draft steps, ``topk`` branches per step.

    ``num_draft_tokens`` counts the tokens verified per round *including* the
    root (the last accepted token), as upstream does; default ``num_steps + 1``
    for a chain (topk 1), which then verifies every drafted token.
    """

    num_steps: int = 4
    topk: int = 1
    num_draft_tokens: int | None = None
    # True (``--spec-steps auto``): each step is a round or a plain decode step, whichever
    # the measured costs and acceptance say emits more tokens a second (spec.adaptive).
    adaptive: bool = False
    # True: each round on one captured graph (spec.round_graph) where attention is
    # capture-safe; False (``--round-graphs two``), and always on a breakable backend: the
    # draft loop's graph, then verify's. On the H200 the embedded pair's rounds of 4 on one
    # graph decoded 1.23x the tokens/s of two at batch 1, 1.085x at 64 (BENCHMARKS.md,
    # stop 43); random:gemma4-e2b's, device-bound, the same.
    one_graph: bool = True

    def __post_init__(self):
        for name in ("num_steps", "topk", "num_draft_tokens"):
            value = getattr(self, name)
            if value is not None and not is_int(value):
                raise UsageError(f"SpecConfig.{name} must be an integer, got {value!r}")
        for name in ("adaptive", "one_graph"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise UsageError(f"SpecConfig.{name} must be True or False, got {value!r}")
        if self.num_steps < 1:
            raise UsageError(f"--spec-steps must be >= 1, got {self.num_steps}")
        if self.topk < 1:
            raise UsageError(f"--spec-topk must be >= 1, got {self.topk}")
        if self.num_draft_tokens is None:
            object.__setattr__(
                self,
                "num_draft_tokens",
                self.num_steps + 1
                if self.topk == 1
                else min(self.max_draft_tokens, 2 * self.num_steps + 2),
            )
        if not 2 <= self.num_draft_tokens <= self.max_draft_tokens:
            raise UsageError(
                f"--spec-draft-tokens must be in [2, {self.max_draft_tokens}] for "
                f"{self.num_steps} steps and topk {self.topk}, got {self.num_draft_tokens}"
            )

    def for_steps(self, num_steps: int) -> SpecConfig:
        """The rounds of ``num_steps`` (<= this config's) that ``--spec-steps auto`` may
        run: the same topk, a tree no wider than this one's nor than that length's default."""
        if num_steps == self.num_steps:
            return self
        default = SpecConfig(num_steps=num_steps, topk=self.topk).num_draft_tokens
        return SpecConfig(
            num_steps=num_steps,
            topk=self.topk,
            num_draft_tokens=min(self.num_draft_tokens, default),
            one_graph=self.one_graph,
        )

    @property
    def max_draft_tokens(self) -> int:
        """Root plus every node the draft loop scores: topk + (steps - 1) * topk^2."""
        return 1 + self.topk + (self.num_steps - 1) * self.topk * self.topk
