"""Decode strategies: how the engine advances its running requests by one step.

The engine owns admission, prefill, pools and finishing; a strategy owns what
a decode step *is*. ``PlainDecode`` runs one target forward per step (on a
captured graph where one fits); ``graphrt.spec.MTPDecoding`` runs a
speculative round. ``core/`` knows strategies only through this protocol,
so it imports nothing from ``spec/``; `graphrt bench` times a step's pieces through
``bench_pieces`` the same way.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from graphrt.core.runners import GraphRunner, RunnerOutput

if TYPE_CHECKING:
    from graphrt.core.engine.engine import Engine
    from graphrt.core.engine.request import Request


class DecodeStrategy(abc.ABC):
    name: str = "abstract"
    # The runner serving plain decode steps on graphs (None: the strategy has none).
    graph_runner: GraphRunner | None = None

    def extra_kv_slots(self) -> int:
        """Token slots a step holds per request beyond the request's own tokens."""
        return 0

    @abc.abstractmethod
    def setup(self, engine: Engine) -> None:
        """Build this strategy's runners over ``engine``'s pools and capture their graphs."""

    def after_prefill(self, reqs: list[Request], out: RunnerOutput) -> None:  # noqa: B027
        """See each prefilled request's last-token output (a drafter seeds from its hidden)."""

    @abc.abstractmethod
    def decode(self, reqs: list[Request]) -> list[list[int]]:
        """Advance ``reqs`` by one step; the tokens each request emits, in order.

        The strategy caches what it fed to the model (``req.kv_len`` grows by as
        many tokens as it emits); the engine appends the tokens and finishes requests.
        """

    def cleanup(self) -> None:  # noqa: B027
        """Drop captured graphs."""

    @contextlib.contextmanager
    def bench_pieces(self, reqs: list[Request]) -> Iterator[dict[str, Callable[[bool], bool]]]:
        """The pieces of one step over ``reqs`` that `graphrt bench` times apart, by name in
        step order. Each runs its piece once, on graphs (True) or eagerly (False), returns
        whether a graph ran, and leaves requests and pools as they were. None here: a plain
        step is one piece."""
        yield {}


class PlainDecode(DecodeStrategy):
    """One target forward per step: each request feeds its last token and samples one."""

    name = "plain"

    def setup(self, engine: Engine) -> None:
        self.engine = engine
        if engine.graph_backend is not None:
            self.graph_runner = GraphRunner(
                engine.loaded.model,
                engine.attn_backend,
                engine.graph_backend,
                engine.graph_runner_config(),
                engine.torch_device,
            )
            engine.capture(self.graph_runner)

    def decode(self, reqs: list[Request]) -> list[list[int]]:
        batch = self.engine.build_decode_batch(reqs)
        out = self.engine.run_forward(batch, self.graph_runner)
        return [[token] for token in self.engine.sample_tokens(reqs, out)]

    def cleanup(self) -> None:
        if self.graph_runner is not None:
            self.graph_runner.cleanup()
