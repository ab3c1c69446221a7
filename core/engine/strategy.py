"""Decode strategies: how the engine advances its running requests by one step.

The engine owns admission, prefill, the ledger (every slot and the token table),
finishing and the stats; a strategy owns what a decode step *is*, and returns what
it produced (``StepOutcome``) for the engine to apply. ``PlainDecode`` runs one
target forward per step (on a captured graph where one fits);
``graphrt.spec.MTPDecoding`` runs a speculative round. ``core/`` knows strategies
only through this protocol, so it imports nothing from ``spec/``; `graphrt bench`
times a step's pieces through ``bench_pieces`` the same way.

A strategy sees a ``StepContext``, never the engine: an engine <-> strategy cycle
kept dropped engines, and their graphs, alive until the cycle collector ran.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from graphrt.core.batch import ForwardBatch, ForwardMode
from graphrt.core.engine.ledger import LaggingLengths
from graphrt.core.engine.sampling import draw_tokens, greedy_tokens
from graphrt.core.host import HostRead
from graphrt.core.models.ops import model_ops
from graphrt.core.runners import (
    BaseRunner,
    EagerRunner,
    GraphRunner,
    GraphRunnerConfig,
    GraphShape,
    RunnerOutput,
)
from graphrt.core.runners.graph import DECODE_SHAPE, LONG_DECODE_SHAPE

if TYPE_CHECKING:
    from graphrt.core.attention.base import AttentionBackend
    from graphrt.core.engine.ledger import Ledger
    from graphrt.core.engine.request import Request
    from graphrt.core.models.loader import LoadedModel
    from graphrt.core.runners.backend import ExecutionBackend


@dataclass(frozen=True)
class StepContext:
    """What a strategy builds its steps on: the engine's model, ledger and runners."""

    loaded: LoadedModel
    ledger: Ledger
    attn_backend: AttentionBackend
    eager_runner: EagerRunner
    graph_backend: ExecutionBackend | None  # None: the engine runs eagerly
    graph_config: GraphRunnerConfig
    device: torch.device
    max_context_len: int

    @property
    def graphs_read_device_lengths(self) -> bool:
        """Do captured graphs take every sequence length from the device: capture-safe
        attention, and a backend that pushes no host length list into them (Ascend's
        updatable ops)? Then a step may run on lengths only the device knows."""
        return (
            self.graph_backend is not None
            and self.attn_backend.capture_safe
            and not self.graph_backend.one_length_list
        )

    def room_behind(self, reqs: Sequence[Request], in_flight: int, tokens: int) -> bool:
        """Can a step caching ``tokens`` more a request go behind one not read yet, which
        may add up to ``in_flight`` the host has not counted (``LaunchedStep.uncounted``)?
        Its furthest position must stay inside the context for every request."""
        assert in_flight > 0, "behind a step not read yet: what it may add bounds positions"
        return all(r.kv_len + in_flight + tokens <= self.max_context_len for r in reqs)

    def forward(
        self, batch: ForwardBatch, graph: BaseRunner | None, clone: bool = True
    ) -> tuple[RunnerOutput, bool]:
        """One target forward: on ``graph`` where it can run the batch, else eager;
        -> (output, whether a graph ran). ``clone``: see ``BaseRunner.execute``."""
        if graph is not None and graph.can_run_graph(batch):
            return graph.execute(batch, clone), True
        return self.eager_runner.execute(batch), False

    def decode_batch(
        self,
        reqs: Sequence[Request],
        last_tokens: torch.Tensor | None = None,
        lagging: LaggingLengths | None = None,
    ) -> ForwardBatch:
        """The next decode batch for ``reqs`` (running requests): one new KV slot each,
        from the ledger, at each request's next position. ``last_tokens``, ``lagging``:
        see ``Ledger.append_one`` (lagging, the host lengths are bounds: placeholders
        for a graph whose attention reads the device's)."""
        rows = self.ledger.append_one(reqs, self.device, last_tokens, lagging)  # (6, B)
        slots, req_slots, positions, input_ids, seq_lens, _ = rows
        ahead = 0 if lagging is None else lagging.in_flight + 1  # (kv_len grows later)
        return ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=input_ids,
            positions=positions,
            req_pool_indices=req_slots,
            seq_lens=seq_lens.to(torch.int32),  # the new token is cached now
            out_cache_loc=slots,
            seq_lens_cpu=[r.kv_len + ahead for r in reqs],
            extend_lens_cpu=[1] * len(reqs),
            packed_rows=rows[:4],
        )


@dataclass
class RoundLog:
    """One request's speculative round: what it drafted and accepted."""

    num_steps: int  # draft steps the round ran
    draft_tokens: list[int]  # every drafted node's token (the root, not drafted, left out)
    accepted_tokens: list[int]  # the drafts the target accepted, in order


@dataclass
class StepOutcome:
    """What one decode step produced, per request in the step's order, for the engine to
    apply: tokens to append, slots to keep or free, and what to count."""

    tokens: list[list[int]]  # emitted tokens, in order
    # A step that held slots (``Ledger.hold``): per request, the held slots that now hold
    # its next tokens' KV, in position order (host ids); the rest go back to the pool.
    kept: list[list[int]] | None = None
    released: torch.Tensor | None = None
    graph_forwards: int = 0  # target forwards replayed from a graph
    eager_forwards: int = 0
    rounds: list[RoundLog] | None = None  # a speculative step: each request's round
    graph_rounds: int = 0  # request rounds on graphs (the round's one, or draft's and verify's)
    plain_steps: int = 0  # a speculative strategy's plain decode steps (spec.adaptive)


@dataclass
class LaunchedStep:
    """A decode step (or speculative round) queued on the device, its result not read yet:
    the engine launches the next step behind it, fed by ``feed`` on the device, before it
    waits for this one (``Engine`` with ``overlap``), so the host prepares a step while
    the device runs one."""

    reqs: list[Request]
    read: HostRead  # the step's result on its way to the host, queued behind the step
    # The read values -> what the step produced (the engine then settles it).
    settle: Callable[[list], StepOutcome]
    # -> (B,) each request's last token on the device, and (B,) its cached length after
    # this step where the host cannot know it yet (a round's acceptance, or a plain step
    # behind one), else None: what a step launched behind this one is fed
    # (``DecodeStrategy.launch``).
    feed: Callable[[], tuple[torch.Tensor, torch.Tensor | None]]
    # The strategy's bookkeeping of the step's seconds and outcome (its ``step_done``).
    record: Callable[[float, StepOutcome], None] | None = None
    # The most tokens the step may add to a request's cache that the host has not counted
    # (its ``kv_len`` grows when the step is settled): a round's drafts and bonus token, a
    # plain step's one behind a round; 0 for a plain step counted at its launch. What the
    # positions of a step launched behind it are bounded by (``DecodeStrategy.launch``).
    uncounted: int = 0
    start: float = 0.0  # perf_counter() from which the step's seconds count
    # Host seconds its launch took, behind the step before (``Engine._settle``): charged to
    # this step, not to that one. 0 for a step launched on its own (its seconds hold it).
    launch_s: float = 0.0

    def finish(self) -> StepOutcome:
        """Wait for the result (the step's one wait); -> the step's outcome."""
        return self.settle(self.read.wait())


class DecodeStrategy(abc.ABC):
    name: str = "abstract"
    # The runner serving plain decode steps on graphs (None: the strategy has none).
    graph_runner: GraphRunner | None = None
    # Set by the engine before each decode step is planned: the batch only shrinks (one
    # call's requests, ``Engine.await_all``, none waiting to join), so it ends when its
    # slowest request does.
    closed_batch: bool = False
    # Whether every token it emits is drawn from its own row of logits on the way
    # (``draw_tokens``), so a request can keep them (``SamplingParams.return_logits``).
    keeps_logits: bool = True
    # Whether engines launch this strategy's steps ahead of the read where the device does
    # by default (``EngineConfig.overlap`` left None; ``Device.overlap_by_default``).
    overlap_by_default: bool = True

    def extra_kv_slots(self) -> int:
        """Token slots a step holds per request beyond the request's own tokens."""
        return 0

    @abc.abstractmethod
    def setup(self, ctx: StepContext) -> Sequence[GraphRunner]:
        """Build this strategy's runners over ``ctx``; -> the graph runners the engine
        captures, in that order (one backend, one pool: the largest graphs first)."""

    def captures_before(self, reqs: list[Request]) -> Sequence[GraphRunner]:
        """Runners the next step of ``reqs`` needs that start-up left uncaptured (graphs
        most engines never use): the engine captures them, then calls ``decode``."""
        return ()

    def deferred_captures(self) -> Sequence[GraphRunner]:
        """Every runner start-up left for ``captures_before`` to hand out, handed out now
        (a server captures them all at start-up: no capture stalls mid-traffic)."""
        return ()

    def refuse_capture(self, runner: GraphRunner) -> None:
        """``runner`` (from ``captures_before``) will not be captured (the graph memory
        cap): plan without it. Steps it would have served run eagerly unless the strategy
        avoids them."""
        raise NotImplementedError(f"{type(self).__name__} captures nothing after start-up")

    def step_timing(self) -> tuple[Sequence[int], Sequence[int]]:
        """What the engine times at start-up for a strategy that chooses between kinds of
        step by their cost: (batch sizes, the kinds of step to run at each, in order; each
        run through ``force_step``), on throwaway requests. ((), ()): nothing."""
        return (), ()

    def force_step(self, kind: int | None) -> None:  # noqa: B027
        """Make the next steps of the kind ``step_timing`` named (None: back to choosing).
        They time that kind only: what they emit teaches nothing else."""

    def step_done(self, seconds: float) -> None:  # noqa: B027
        """The last ``decode`` step's wall time, the engine's settling of it included (its
        slots, its tokens, finished requests): what a strategy that weighs kinds of step
        by their cost should time, as settling grows with the tokens a step emits. Not
        called for a step that raised."""

    def after_prefill(self, reqs: list[Request], out: RunnerOutput) -> None:  # noqa: B027
        """See each prefilled request's last-token output (a drafter seeds from its hidden)."""

    @abc.abstractmethod
    def decode(self, reqs: list[Request]) -> StepOutcome:
        """Advance ``reqs`` by one step. Each request's ``kv_len`` grows (through the
        ledger) by as many tokens as it emits; the engine appends them and finishes
        requests."""

    def launch(
        self,
        reqs: list[Request],
        last_tokens: torch.Tensor | None = None,
        kv_lens: torch.Tensor | None = None,
        in_flight: int = 0,
    ) -> LaunchedStep | None:
        """Queue the next step of ``reqs`` without reading its result, where this strategy
        can and it needs no capture; else None (the engine then calls ``decode``). Behind
        a step not read yet (``LaunchedStep.feed``): ``last_tokens``, (B,) each request's
        last token on the device; ``kv_lens``, (B,) its cached length on the device where
        the host's ``kv_len`` is behind (a round not read yet), else None, and then
        ``in_flight`` bounds how far (that step's ``uncounted``). Its ``record`` stands
        for ``step_done``."""
        return None

    def cleanup(self) -> None:  # noqa: B027
        """Drop captured graphs."""

    def plain_runner_for(self, batch: ForwardBatch) -> GraphRunner | None:
        """The graph runner a plain decode step of ``batch`` takes (flagging the batch as
        that runner's graphs are)."""
        return self.graph_runner

    @contextlib.contextmanager
    def bench_pieces(self, reqs: list[Request]) -> Iterator[dict[str, Callable[[bool], bool]]]:
        """The pieces of one step over ``reqs`` that `graphrt bench` times apart, by name in
        step order. Each runs its piece once, on graphs (True) or eagerly (False), returns
        whether a graph ran, and leaves requests and pools as they were. None here: a plain
        step is one piece."""
        yield {}


class PlainDecode(DecodeStrategy):
    """One target forward per step: each request feeds its last token and samples one.

    On graphs, the decode graph also takes each row's greedy token (``greedy_tokens``,
    NaN/Inf mark included) into ``greedy_out``: a greedy step then launches nothing
    after the replay but its one read, and a sampled step reuses it.

    ``after_forward(batch, out)``, where given, runs on every step's forward output, inside
    the decode graph where one replays (device ops only): a drafter taking plain steps
    writes its next seeds there, with no launch of its own.

    Where the attention backend runs long rows on a schedule of their own
    (``AttentionBackend.long_row_keys``), batches whose longest row reaches it take decode
    graphs of their own (``long_runner``), captured when a batch first needs them: an
    engine that never sees long rows never captures them, and short batches never pay
    for the long rows' schedule (on CUDA a second attention launch a layer).
    """

    name = "plain"

    def __init__(self, after_forward: Callable[[ForwardBatch, RunnerOutput], None] | None = None):
        self.after_forward = after_forward
        self.greedy_out: torch.Tensor | None = None  # (rows,) the graphs' greedy tokens
        self.long_runner: GraphRunner | None = None  # batches with a long row (see above)
        self.long_row_keys: int | None = None
        self._long_deferred = False  # the long runner waits for captures_before

    def setup(self, ctx: StepContext) -> Sequence[GraphRunner]:
        self.ctx = ctx
        keys = ctx.attn_backend.long_row_keys(ctx.loaded.model.kv_layer_specs())
        ops = model_ops(ctx.loaded.model)
        if ops is not None and ops.width_invariant:
            keys = None  # --batch-invariant: one block size for every row (verify reuses it)
        self.long_row_keys = keys if keys is not None and keys < ctx.max_context_len else None
        if ctx.graph_backend is None:
            return ()
        rows = max(ctx.ledger.req_pool.max_requests, ctx.graph_config.max_bs)
        greedy = self.greedy_out = torch.empty(rows, dtype=torch.int64, device=ctx.device)
        user = self.after_forward

        def after(batch: ForwardBatch, out: RunnerOutput) -> None:
            # Closes over the buffer, not the strategy: the runner must not hold its owner.
            greedy[: out.logits.shape[0]] = greedy_tokens(out.logits, ops)
            if user is not None:
                user(batch, out)

        def runner(shape: GraphShape) -> GraphRunner:
            return GraphRunner(
                ctx.loaded.model,
                ctx.attn_backend,
                ctx.graph_backend,
                ctx.graph_config,
                ctx.device,
                shape,
                after_forward=after,
            )

        self.graph_runner = runner(DECODE_SHAPE)
        if self.long_row_keys is not None:
            self.long_runner, self._long_deferred = runner(LONG_DECODE_SHAPE), True
        return (self.graph_runner,)

    def captures_before(self, reqs: list[Request]) -> Sequence[GraphRunner]:
        if self._long_deferred and self._has_long_row(r.kv_len + 1 for r in reqs):
            self._long_deferred = False
            return (self.long_runner,)
        return ()

    def deferred_captures(self) -> Sequence[GraphRunner]:
        if not self._long_deferred:
            return ()
        self._long_deferred = False
        return (self.long_runner,)

    def refuse_capture(self, runner: GraphRunner) -> None:
        # Long batches stay on the plain graphs, which serve long rows too (slower).
        assert runner is self.long_runner, runner
        self.long_runner, self._long_deferred = None, False

    def _has_long_row(self, lengths: Iterable[int]) -> bool:
        return self.long_row_keys is not None and max(lengths, default=0) >= self.long_row_keys

    def plain_runner_for(self, batch: ForwardBatch) -> GraphRunner | None:
        """The runner of ``batch`` (its sequence lengths after the step, or bounds on them):
        with a long row, the long rows' where they serve it. Such a batch is flagged
        ``long_rows`` whatever runs it, so an eager forward of it (an eager engine's, or a
        size no graph serves) takes the schedule their graphs do."""
        if not self._has_long_row(batch.seq_lens_cpu):
            return self.graph_runner
        batch.long_rows = True
        long = self.long_runner
        # (Not captured yet or refused, or a bucket whose capture failed: the plain graphs.)
        return long if long is not None and long.serves(batch.batch_size) else self.graph_runner

    def decode(self, reqs: list[Request]) -> StepOutcome:
        return self.launch(reqs).finish()

    def launch(
        self,
        reqs: list[Request],
        last_tokens: torch.Tensor | None = None,
        kv_lens: torch.Tensor | None = None,
        in_flight: int = 0,
    ) -> LaunchedStep | None:
        """``DecodeStrategy.launch``; behind a round not read yet (``kv_lens``: a drafter's
        plain step) only on a graph that reads device lengths alone, where the context has
        room for all that round may emit: the host knows no position. Not behind a step
        where the batch reaches the long rows' graphs before their capture: the engine
        captures them before its next step (``captures_before``); a step not behind one
        (``decode``, or the engine's just after ``captures_before``) runs on the graphs
        captured, the plain ones serving long rows too."""
        behind = last_tokens is not None
        if (
            behind
            and self._long_deferred
            and self._has_long_row(r.kv_len + 1 + in_flight for r in reqs)
        ):
            return None
        lagging = None
        if kv_lens is not None:
            if not self._launches_behind_a_round(reqs, in_flight):
                return None
            lagging = LaggingLengths(kv_lens, self.ctx.ledger.hold_host(len(reqs)), in_flight)
        batch = self.ctx.decode_batch(reqs, last_tokens, lagging)
        # Views of the graph's outputs: sampled (or copied out) before the next replay.
        out, on_graph = self.ctx.forward(batch, self.plain_runner_for(batch), clone=False)
        if not on_graph and self.after_forward is not None:
            self.after_forward(batch, out)  # the graph ran it already
        greedy = self.greedy_out[: len(reqs)] if on_graph else None
        # The read is queued now, before any step launched behind this one replays over
        # the graph's outputs (greedy tokens are a view of its greedy_out).
        tokens = draw_tokens(reqs, out.logits, greedy)
        # Lagging, each request's slot is kept once the round before is settled, and the
        # step behind this one takes its lengths from the device too. (The slots are the
        # ledger's host ids: no device read.)
        kept = None if lagging is None else [[slot] for slot in lagging.slots.tolist()]
        lengths = None if lagging is None else batch.seq_lens

        def settle(values: list) -> StepOutcome:
            return StepOutcome(
                tokens=[[t] for t in values],
                kept=kept,
                graph_forwards=int(on_graph),
                eager_forwards=int(not on_graph),
            )

        return LaunchedStep(
            reqs=reqs,
            read=HostRead(tokens),
            settle=settle,
            feed=lambda: (tokens, lengths),
            uncounted=0 if lagging is None else 1,
        )

    def _launches_behind_a_round(self, reqs: list[Request], in_flight: int) -> bool:
        """Can a step of ``reqs`` go behind a round not read yet: a captured graph serves
        the batch (``serves``: what ``can_run_graph`` asks of a decode batch, asked before
        the ledger is touched), it takes device lengths only (the host's are bounds), and
        the furthest position the round may leave fits the context."""
        ctx, runner = self.ctx, self.graph_runner
        return (
            runner is not None
            and ctx.graphs_read_device_lengths
            and runner.serves(len(reqs))
            and ctx.room_behind(reqs, in_flight, 1)
        )

    def cleanup(self) -> None:
        for runner in (self.graph_runner, self.long_runner):
            if runner is not None:
                runner.cleanup()
