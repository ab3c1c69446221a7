"""Frozen-KV MTP decoding: every decode step of the engine becomes a speculative round.

A round, device work end to end (gpt-fast's ``speculative_decode``, on graphs). Steps
1 to 4 are one captured graph per request batch size, draft length and kind (greedy or
sampled) where attention is capture-safe (``SpecConfig.one_graph``, the default:
spec.round_graph); otherwise, and with ``one_graph=False``, two: the draft loop's, then
verify's with the tail:

1. draft: the drafter's whole loop and the verify tree built from it;
2. verify: the target scores every tree node in one TARGET_VERIFY forward, and then:
3. accept: the target's token at every node (argmax, or a draw from the request's
   stream), then the accepted path, as tensor operations over the fixed-size tree;
4. commit: the path's KV slots written into each request's token table and
   the next seed hidden gathered (spec.verify);
5. one host read per round: accepted lengths, path nodes and tokens, in one
   pinned copy waited on through an event. The round returns the path's slots to
   keep and the rejected nodes' slots to free (their ids are known on the host,
   which held them through the ledger); the engine settles both.

With ``--spec-steps auto`` (``SpecConfig.adaptive``) each step runs rounds of the draft
length ``spec.adaptive`` picks, 0 meaning a plain decode step: each length has its own
graphs, the longest captured at start-up and the others just before the first step that
chooses them (capturing every length up front would multiply start-up time; the engine
reports those captures apart from decoding time). A request
that opted out (``SamplingParams.speculate``) accepts no draft in a round: it emits the
target's token, as a plain step would.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from graphrt.core.batch import ForwardBatch
from graphrt.core.engine.ledger import HeldSlots
from graphrt.core.engine.request import Request
from graphrt.core.engine.sampling import request_rows
from graphrt.core.engine.strategy import (
    DecodeStrategy,
    LaunchedStep,
    PlainDecode,
    RoundLog,
    StepContext,
    StepOutcome,
)
from graphrt.core.errors import UsageError
from graphrt.core.host import HostRead, read_host, to_device
from graphrt.core.models.loader import LoadedModel
from graphrt.core.models.ops import model_ops
from graphrt.core.runners import EagerRunner, GraphRunner, RunnerOutput
from graphrt.core.runners.buckets import pad_to_bucket
from graphrt.spec.accept import accept
from graphrt.spec.adaptive import DraftChooser
from graphrt.spec.config import SpecConfig
from graphrt.spec.draft import (
    DraftRule,
    captured_draft_loop,
    draft_batch,
    draft_shape,
    draft_verify_tree,
    is_full_chain,
)
from graphrt.spec.round_graph import NEXT_LEN, NEXT_TOKEN, captured_round, round_batch, round_shape
from graphrt.spec.tree import VerifyTree
from graphrt.spec.verify import (
    AcceptRule,
    RoundTables,
    round_tail,
    verify_batch,
    verify_round,
    verify_shape,
)

_SPECULATES = operator.attrgetter("params.speculate")  # scanned every step: map, no generator


@dataclass
class RoundInputs:
    """What a round starts from, per request (device tensors unless ``_cpu``)."""

    reqs: list[Request]
    root: torch.Tensor  # (B,) last emitted token, not cached yet
    seed_hidden: torch.Tensor  # (B, H) the target hidden that produced it
    req_slots: torch.Tensor  # (B,)
    kv_lens: torch.Tensor  # (B,) int32: cached tokens = the root's position
    kv_lens_cpu: list[int]
    held: HeldSlots | None = None  # (B * nodes,) the tree's KV slots, node-major


@dataclass
class RoundGraphs:
    """The graphs of rounds with one draft length (all None: rounds run eagerly)."""

    cfg: SpecConfig
    draft: GraphRunner | None = None  # the draft loop and its tree
    verify: GraphRunner | None = None  # verify and the round's tail: greedy rounds
    sampled_verify: GraphRunner | None = None  # the same with a sampled request
    # One-graph rounds (spec.round_graph): draft, verify and tail in one graph.
    round: GraphRunner | None = None
    sampled_round: GraphRunner | None = None

    def runners(self) -> tuple[GraphRunner, ...]:
        """(Lengths whose trees have one width share their verify runners.)"""
        every = (self.round, self.sampled_round, self.verify, self.sampled_verify, self.draft)
        return tuple(r for r in every if r is not None)


class MTPDecoding(DecodeStrategy):
    name = "speculative"
    keeps_logits = False  # a round's tokens come from verify's rows, none kept

    def __init__(
        self,
        drafter: LoadedModel,
        config: SpecConfig | None = None,
        accept_rule: AcceptRule = accept,
        draft_rule: DraftRule | None = None,
    ):
        self.drafter = drafter
        self.cfg = config or SpecConfig()
        self.accept_rule = accept_rule  # spec.accept.accept; an oracle in benchmarks
        self.draft_rule = draft_rule  # None; an oracle's drafts in benchmarks and tests
        lengths = range(1, self.cfg.num_steps + 1) if self.cfg.adaptive else (self.cfg.num_steps,)
        self.variants = {k: RoundGraphs(self.cfg.for_steps(k)) for k in lengths}
        self.chooser = DraftChooser(self.cfg.num_steps) if self.cfg.adaptive else None
        self.plain: PlainDecode | None = None  # plain steps (auto's, or an opted-out batch's)
        # Runners built but not captured at start-up; the engine captures each before the
        # first step that needs it (``captures_before``): the sampled rounds' or verify
        # graphs (their sampling intermediates make them several times the greedy graphs'
        # memory: 6.1 GB with both for gemma4-e2b up to batch 64), the shorter lengths'
        # graphs, and fixed-length rounds' plain decode graphs (used only when a whole
        # batch opted out).
        self._later: list[GraphRunner] = []
        self._planned: tuple[list[Request], int] | None = None  # (reqs, draft steps) next
        self._refused: list[GraphRunner] = []  # left uncaptured by the graph memory cap
        self._forced: int | None = None  # the engine's start-up timing: this many steps
        # What the last step recorded for the chooser, waiting for its time (step_done).
        self._unrecorded: tuple[int, int, list, bool, bool] | None = None

    @property
    def longest(self) -> RoundGraphs:
        return self.variants[self.cfg.num_steps]

    @property
    def draft_graph(self) -> GraphRunner | None:
        return self.longest.draft

    @property
    def verify_graph(self) -> GraphRunner | None:
        return self.longest.verify

    def extra_kv_slots(self) -> int:
        return self.cfg.num_draft_tokens  # a round holds a whole verify tree's slots briefly

    def setup(self, ctx: StepContext) -> Sequence[GraphRunner]:
        self.ctx = ctx
        if self.chooser is not None:  # a look pays back only within the context
            self.chooser.context_len = ctx.max_context_len
            # Ranks agree on every step's length (TPGroup.agree): no step skips choosing.
            self.chooser.streaks = ctx.loaded.model.tp.is_single
        target, drafter = ctx.loaded.model, self.drafter.model
        if not hasattr(drafter, "bind_target"):
            raise UsageError(
                f"the drafter {self.drafter.source} is a {type(drafter).__name__}, not a "
                "frozen-KV MTP assistant (such as a Gemma 4 assistant checkpoint)"
            )
        if self.cfg.topk > drafter.vocab_size:
            raise UsageError(
                f"--spec-topk {self.cfg.topk} is larger than the drafter's vocabulary "
                f"({drafter.vocab_size} tokens)"
            )
        drafter.bind_target(target)
        self.draft_eager = EagerRunner(drafter, ctx.attn_backend)
        # (max requests + 1, H) each request slot's next seed: the target hidden that
        # produced its last token. Rounds read and write it on the device, by slot, so
        # no per-request tensor crosses the host; row 0 is the padding rows'.
        dtype = next(target.parameters()).dtype
        rows = ctx.ledger.req_pool.max_requests + 1
        self.seed_table = seeds = torch.zeros(
            rows, target.config.hidden_size, dtype=dtype, device=ctx.device
        )

        def write_seeds(batch, out: RunnerOutput) -> None:
            # A plain step's hiddens seed the next rounds, inside its decode graph. (Closes
            # over the table, not the strategy: the runner must not hold its owner.)
            seeds[batch.req_pool_indices] = out.hidden.to(seeds.dtype)

        self.plain = PlainDecode(after_forward=write_seeds)
        plain_runners = tuple(self.plain.setup(ctx))
        if ctx.graph_backend is None:
            return ()
        args = (ctx.graph_backend, ctx.graph_config, ctx.device)
        # One graph a round needs device lengths in every op (capture-safe attention) and a
        # backend that rebinds no single host length list into all of them.
        if self.cfg.one_graph and ctx.graphs_read_device_lengths:
            return self._setup_one_graph(ctx, args, plain_runners)
        verify = verify_round(
            target, ctx.attn_backend, self.tables(), ctx.max_context_len, self.accept_rule
        )
        # Verify is the same arithmetic at one width (and tree kind), whatever the length.
        by_width: dict[tuple[int, bool], tuple[GraphRunner, GraphRunner]] = {}
        for variant in self.variants.values():
            n, chain = variant.cfg.num_draft_tokens, is_full_chain(variant.cfg)
            if (n, chain) not in by_width:
                by_width[n, chain] = tuple(
                    GraphRunner(
                        target, ctx.attn_backend, *args, verify_shape(n, s, chain), forward=verify
                    )
                    for s in (False, True)
                )
            variant.verify, variant.sampled_verify = by_width[n, chain]
            # The loop's steps derive their rows inside the graph, so their attention
            # metadata must be the capture-safe kind; attention that needs host lengths per
            # step (a breakable backend's) drafts eagerly and verifies on graphs.
            if ctx.attn_backend.capture_safe:
                steps = variant.cfg.num_steps
                loop = captured_draft_loop(drafter, ctx.attn_backend, variant.cfg, self.draft_rule)
                shape = draft_shape(target.config.hidden_size, dtype, steps)
                variant.draft = GraphRunner(drafter, ctx.attn_backend, *args, shape, forward=loop)
        # The longest rounds' verify graphs (the larger) first, the draft loops last.
        draft = (self.longest.draft,) if self.longest.draft is not None else ()
        return self._captured_now((self.longest.verify,), plain_runners, draft)

    def _captured_now(self, first, plain_runners, last=()) -> tuple[GraphRunner, ...]:
        """The runners start-up captures, in order (one backend, one pool: the largest
        first), ``first``, plain decode's where steps may be plain, ``last``; every other
        runner waits in ``_later`` (once: lengths of one width share verify runners)."""
        now = tuple(first) + (tuple(plain_runners) if self.chooser is not None else ()) + last
        every = [r for v in self.variants.values() for r in v.runners()] + list(plain_runners)
        self._later = [r for i, r in enumerate(every) if r not in now and r not in every[:i]]
        return now

    def _setup_one_graph(self, ctx: StepContext, args, plain_runners) -> Sequence[GraphRunner]:
        """One graph per length, batch bucket and kind (greedy, sampled) for whole rounds:
        the longest greedy rounds' (and plain steps', with auto lengths) at start-up."""
        target, drafter = ctx.loaded.model, self.drafter.model
        for variant in self.variants.values():
            cfg = variant.cfg
            forward = captured_round(
                target,
                drafter,
                ctx.attn_backend,
                cfg,
                self.tables(),
                ctx.max_context_len,
                self.accept_rule,
                self.draft_rule,
            )
            variant.round, variant.sampled_round = (
                GraphRunner(
                    target,
                    ctx.attn_backend,
                    *args,
                    round_shape(cfg.num_draft_tokens, cfg.num_steps, sampled),
                    forward=forward,
                )
                for sampled in (False, True)
            )
        return self._captured_now((self.longest.round,), plain_runners)

    def after_prefill(self, reqs: list[Request], out: RunnerOutput) -> None:
        # The hidden that produced each first token: the first seed (one scatter).
        slots = to_device([r.req_slot for r in reqs], self.ctx.device)
        self.seed_table[slots] = out.hidden[: len(reqs)].to(self.seed_table.dtype)

    @property
    def plain_graph(self) -> GraphRunner | None:
        """The decode graphs of plain steps (None: eager)."""
        return self.plain.graph_runner if self.plain is not None else None

    def cleanup(self) -> None:
        for runner in {id(r): r for v in self.variants.values() for r in v.runners()}.values():
            runner.cleanup()
        if self.plain is not None:
            self.plain.cleanup()

    @contextlib.contextmanager
    def bench_pieces(self, reqs: list[Request]) -> Iterator[dict[str, Callable[[bool], bool]]]:
        """The longest round's draft loop and verify forward over ``reqs``, to time apart.
        Verify writes its nodes' KV into slots held for the bench and freed after it.
        No pieces (``{}``) where rounds run on one graph each: the bench's whole round is
        that graph (``--round-graphs two`` times the pieces)."""
        if self.longest.round is not None:
            yield {}
            return
        inputs = self.round_inputs(reqs)
        tree, _ = self.draft(inputs)
        held = self.ctx.ledger.hold(len(reqs) * tree.num_nodes, self.ctx.device)
        # Verify commits its path into the token table past each request's tokens, where
        # the next real round writes again, writes the next seeds and moves the streams
        # on: put those two back.
        draws, seeds = [r.draws for r in reqs], self.seed_table.clone()
        try:
            yield {
                "draft": lambda graphs: self.draft(inputs, graphs)[1],
                "verify": lambda graphs: self.verify(inputs, tree, held.device, graphs)[1],
            }
        finally:
            self.ctx.ledger.free(held.host)
            for req, n in zip(reqs, draws):
                req.draws = n
            self.seed_table.copy_(seeds)

    # ---- one step ----------------------------------------------------------------

    def step_timing(self) -> tuple[Sequence[int], Sequence[int]]:
        """With auto lengths: the longest rounds, every other length whose graphs start-up
        captured (all of them where graphs are captured up front: `graphrt serve`;
        eagerly, rounds of one draft step), and a plain step, three times each in a row
        (the chooser leaves each kind's first step out, first touches and the change of
        kind, and keeps the faster of the other two: a stall only adds time; in a row, as
        a winner runs. The longest rounds run once more last: their change of kind only.
        HAZARD: the embedded pair's host-bound steps drift by a third between H200 starts
        and within a process: start-up's figures ran 0.7-1.5x the same steps in use, in a
        row or interleaved; BENCHMARKS.md, stop 43), at every batch bucket whose graphs
        start-up captured, or at batch 1 when eager. Each length timed keeps its figure
        until it runs: round times are not linear in the length (on the H200, rounds of 1
        at batch 8 cost 3.6 ms where the line through 2 to 5 said 4.5), and
        bench/chooser_sim.py put auto at 0.98 of the best fixed length with every length
        timed against 0.97 with the ends alone. Lengths left out are modelled on the line
        ``a + b k`` through those timed, or between the longest and a plain step, until
        they run. A few steps a length and bucket: about 20 ms at batch 1 for
        random:gemma4-e2b on an H200."""
        if self.chooser is None:
            return (), ()
        if self.plain_graph is None:  # eager: each round costs its full time, on any host
            lengths = (self.cfg.num_steps, 1) if self.cfg.num_steps > 1 else (1,)
        else:
            later = set(self._later)  # timing runs greedy rounds: their graphs alone count
            lengths = tuple(
                k
                for k in sorted(self.variants, reverse=True)
                if k == self.cfg.num_steps or not later & set(self._needs(k, greedy=True))
            )
        # Then the longest rounds once more, behind a plain step: both changes of kind
        # have run before any real step (a path's first calls cost its first step in use
        # up to 1 ms more: see ``Engine._time_step``).
        kinds = (*(k for k in (*lengths, 0) for _ in range(3)), lengths[0])
        if self.plain_graph is None:
            return (1,), kinds
        graphs = [self.plain_graph, self.longest.verify, self.longest.draft, self.longest.round]
        sizes = set.intersection(*(set(g.captured_sizes) for g in graphs if g is not None))
        return sorted(sizes), kinds

    def force_step(self, kind: int | None) -> None:
        self._forced = kind

    def plan(self, reqs: list[Request]) -> int:
        """The draft steps of the next step of ``reqs`` (0: a plain step)."""
        if self._forced is not None:
            return self._forced
        if self.chooser is not None and self.chooser.stays_plain(reqs):
            return 0  # a plain winner's ranking, reused: nothing to weigh (O(1))
        if not any(map(_SPECULATES, reqs)):
            return 0  # nothing to draft for
        if self.chooser is None:
            return self.cfg.num_steps
        refused = set()
        if self._refused:  # the graph memory cap spoke: lengths whose graphs it left out
            refused |= self._lengths_needing(self._refused, reqs)
        if self._later and self.closed_batch and not self.chooser.pays_a_capture(reqs):
            # Too few tokens left to win a capture back: the lengths captured already, and
            # the longest (sampled rounds' graphs are all captured when first needed).
            refused |= self._lengths_needing(self._later, reqs) - {self.cfg.num_steps}
        steps = self.chooser.choose(self._bucket(len(reqs)), reqs, refused, self.closed_batch)
        # Under tensor parallelism each rank's chooser times its own steps: rank 0 decides.
        return self.ctx.loaded.model.tp.agree(steps)

    def _lengths_needing(self, runners: Sequence[GraphRunner], reqs: list[Request]) -> set[int]:
        """The draft lengths whose rounds of ``reqs`` (greedy or sampled) run on any of
        ``runners``."""
        greedy, runners = all(r.params.greedy for r in reqs), set(runners)
        return {k for k in self.variants if runners.intersection(self._needs(k, greedy))}

    def _needs(self, steps: int, greedy: bool) -> tuple[GraphRunner | None, ...]:
        """The graphs a step of ``steps`` draft steps runs on (greedy or sampled)."""
        if steps == 0:
            return (self.plain_graph,)
        variant = self.variants[steps]
        if variant.round is not None:
            return (variant.round if greedy else variant.sampled_round,)
        return (variant.verify if greedy else variant.sampled_verify, variant.draft)

    def captures_before(self, reqs: list[Request]) -> Sequence[GraphRunner]:
        steps = self._planned_steps(reqs)
        self._planned = (reqs, steps)
        # A plain step of a batch with a long row: the plain steps' own graphs for them.
        plain = list(self.plain.captures_before(reqs)) if steps == 0 and self.plain else []
        if not self._later:  # everything captured: the usual step (an O(batch) scan less)
            return plain
        needs = self._needs(steps, steps == 0 or all(r.params.greedy for r in reqs))
        now = [r for r in needs if r in self._later]
        self._later = [r for r in self._later if r not in now]
        return now + plain

    def plain_runner_for(self, batch: ForwardBatch) -> GraphRunner | None:
        return self.plain.plain_runner_for(batch) if self.plain else None

    def deferred_captures(self) -> Sequence[GraphRunner]:
        later, self._later = self._later, []
        return later + list(self.plain.deferred_captures() if self.plain else ())

    def refuse_capture(self, runner: GraphRunner) -> None:
        if self.plain is not None and runner is self.plain.long_runner:
            self.plain.refuse_capture(runner)  # its long batches stay on the plain graphs
            return
        # With auto lengths, the lengths needing it are not chosen again (for that kind of
        # batch); a fixed length's round, or a plain step, runs that piece eagerly.
        self._refused.append(runner)
        self._planned = None

    def _planned_steps(self, reqs: list[Request]) -> int:
        """The length planned for ``reqs`` already (by ``captures_before`` or ``launch``;
        taken), else planned now: the chooser chooses once a step. A plan made by a launch
        behind a step not read yet stands for the requests that step left running."""
        planned, self._planned = self._planned, None
        if planned is not None and [r for r in planned[0] if not r.finished] == reqs:
            return planned[1]
        return self.plan(reqs)

    def launch(
        self,
        reqs: list[Request],
        last_tokens: torch.Tensor | None = None,
        kv_lens: torch.Tensor | None = None,
        in_flight: int = 0,
    ) -> LaunchedStep | None:
        """A plain step, or a round on its one graph, queued without its read; None where
        neither can go (the engine then calls ``decode``, on the same plan)."""
        steps = self._planned_steps(reqs)
        if steps:
            variant = self.variants[steps]
            step = self._launch_round(reqs, variant, last_tokens, kv_lens, in_flight)
        else:
            step = self._launch_plain(reqs, last_tokens, kv_lens, in_flight)
        if step is None:
            self._planned = (reqs, steps)  # for the engine's next step: not chosen again
        else:
            step.record = self._recorder(reqs, steps)
        return step

    def _launch_plain(self, reqs, last_tokens, kv_lens, in_flight) -> LaunchedStep | None:
        if self._later and self.plain_graph in self._later:
            return None
        step = self.plain.launch(reqs, last_tokens, kv_lens, in_flight)
        if step is not None:
            settle = step.settle

            def counted(values: list) -> StepOutcome:
                outcome = settle(values)
                outcome.plain_steps = 1
                return outcome

            step.settle = counted
        return step

    def _launch_round(
        self, reqs: list[Request], variant: RoundGraphs, last_tokens, kv_lens, in_flight=0
    ) -> LaunchedStep | None:
        """``one_graph_round``'s launch, its settling left for later; behind a step whose
        lengths only the device knows (``kv_lens``) only where the context has room for
        both steps' tokens."""
        graph = self._round_graph(reqs, variant)  # None where none is captured (yet)
        if graph is None:
            return None
        # Behind a step not read yet, the context must hold what that one may still add
        # (``in_flight``: its own length's worth, not this round's) and this round's tree.
        n = variant.cfg.num_draft_tokens
        if kv_lens is not None and not self.ctx.room_behind(reqs, in_flight, n):
            return None
        packed, held = self._queue_round(reqs, variant, graph, last_tokens, kv_lens, in_flight)
        num_steps = variant.cfg.num_steps

        def settle(values: list) -> StepOutcome:
            outcome = self.settle_rows(reqs, values, held, num_steps)
            outcome.graph_forwards, outcome.graph_rounds = 1, len(reqs)
            return outcome

        def feed() -> tuple[torch.Tensor, torch.Tensor]:
            # Views of the graph's own columns (round_graph.with_next_inputs): no device op.
            return packed[:, NEXT_TOKEN], packed[:, NEXT_LEN]  # (B,) each

        return LaunchedStep(
            reqs=reqs, read=HostRead(packed), settle=settle, feed=feed, uncounted=num_steps + 1
        )

    def _recorder(self, reqs: list[Request], steps: int):
        """A launched step's ``record``: what ``decode`` and ``step_done`` record."""
        if self.chooser is None:
            return None
        chooser, bucket, timing = self.chooser, self._bucket(len(reqs)), self._forced is not None
        closed = self.closed_batch  # as planned: the next step's plan comes before this read

        def record(seconds: float, outcome: StepOutcome) -> None:
            chooser.record(steps, bucket, seconds, _accepted(reqs, outcome), timing, closed)

        return record

    def decode(self, reqs: list[Request]) -> StepOutcome:
        self._unrecorded = None  # a step that raised after its decode is not recorded
        steps = self._planned_steps(reqs)
        outcome = self.round(reqs, steps) if steps else self.plain_step(reqs)
        if self.chooser is not None:  # recorded with the step's time (step_done)
            timing = self._forced is not None
            accepted = _accepted(reqs, outcome)
            self._unrecorded = (steps, self._bucket(len(reqs)), accepted, timing, self.closed_batch)
        return outcome

    def step_done(self, seconds: float) -> None:
        unrecorded, self._unrecorded = self._unrecorded, None
        if unrecorded is not None:
            steps, bucket, accepted, timing, closed = unrecorded
            self.chooser.record(steps, bucket, seconds, accepted, timing, closed)

    def _bucket(self, batch_size: int) -> int:
        """The batch bucket a step of ``batch_size`` requests runs at (its graphs' padded
        size; the size itself when eager): what the chooser times steps by."""
        runner = self.plain_graph
        if runner is None:
            return batch_size
        return pad_to_bucket(batch_size, runner.buckets, runner.config.padding) or batch_size

    def plain_step(self, reqs: list[Request]) -> StepOutcome:
        """A plain decode step; its forward writes the hidden that produced each token
        into the seed table, for the request's next round."""
        outcome = self.plain.decode(reqs)
        outcome.plain_steps = 1
        return outcome

    def round(self, reqs: list[Request], num_steps: int | None = None) -> StepOutcome:
        """One speculative round over ``reqs``, of ``num_steps`` draft steps (default: the
        configured length)."""
        variant = self.variants[num_steps or self.cfg.num_steps]
        if variant.round is not None:
            outcome = self.one_graph_round(reqs, variant)
            if outcome is not None:
                return outcome
        # The tree's node slots come with the inputs, in their one copy: the host settles
        # the rejected ones without reading back.
        inputs = self.round_inputs(reqs, nodes=variant.cfg.num_draft_tokens)
        held = inputs.held
        tree, drafted_on_graph = self.draft(inputs, variant=variant)
        assert tree.num_nodes * len(reqs) == held.host.numel(), "the tree's width is the config's"
        if not all(r.params.speculate for r in reqs):  # opted out: no draft can be accepted
            speculate = [[r.params.speculate] for r in reqs]
            # Out of place: a draft graph's outputs are inference tensors (captured under
            # inference mode), which an in-place update outside it refuses.
            tree.valid = tree.valid & to_device(speculate, self.ctx.device, torch.bool)  # (B, n)
        packed, verified_on_graph = self.verify(inputs, tree, held.device, variant=variant)
        outcome = self.settle(reqs, packed, held, variant.cfg.num_steps)
        outcome.graph_forwards = int(verified_on_graph)
        outcome.eager_forwards = int(not verified_on_graph)
        outcome.graph_rounds = len(reqs) if drafted_on_graph and verified_on_graph else 0
        return outcome

    def one_graph_round(self, reqs: list[Request], variant: RoundGraphs) -> StepOutcome | None:
        """The round on ``variant``'s one graph (spec.round_graph) where one serves this
        many requests, else None (the round runs on the two-graph path: eagerly, in a
        one-graph engine)."""
        step = self._launch_round(reqs, variant, None, None)  # None before any copy
        return None if step is None else step.finish()

    def _round_graph(self, reqs: list[Request], variant: RoundGraphs) -> GraphRunner | None:
        """``variant``'s one graph for a round of ``reqs`` (greedy or sampled), where it
        serves this many requests."""
        greedy = all(r.params.greedy for r in reqs)  # (as request_rows decides)
        graph = variant.round if greedy else variant.sampled_round
        return graph if graph is not None and graph.serves(len(reqs)) else None

    def _queue_round(
        self,
        reqs: list[Request],
        variant: RoundGraphs,
        graph: GraphRunner,
        last_tokens: torch.Tensor | None = None,
        kv_lens: torch.Tensor | None = None,
        in_flight: int = 0,
    ) -> tuple[torch.Tensor, HeldSlots]:
        """A one-graph round's inputs (one copy; fed behind a step not read yet: see
        ``round_batch``) and its replay; -> (its packed result, not read, with the next
        step's inputs in its last columns; its held slots)."""
        rows = request_rows(reqs, self.ctx.device)  # no copy for greedy rows
        n = variant.cfg.num_draft_tokens
        held_host = self.ctx.ledger.hold_host(len(reqs) * n)
        batch = round_batch(
            reqs, n, held_host, rows, self.ctx.max_context_len, self.ctx.device,
            last_tokens, kv_lens, in_flight,
        )  # fmt: skip
        for req in reqs:  # every node draws from its request's stream (see verify)
            req.draws += n
        # A view of the graph's output, as a plain step's (PlainDecode.launch): the host's
        # read is queued at once (HostRead), and what a step launched behind this one is
        # fed (``feed``) is consumed by ops queued before its replay, which may overwrite
        # it. A clone here was one more device op between two rounds.
        (packed,) = graph.execute(batch, clone=False)
        return packed, HeldSlots(held_host, batch.out_cache_loc)

    def round_inputs(self, reqs: list[Request], nodes: int = 0) -> RoundInputs:
        """Each request's root token, request slot and cached length on the device, and
        with ``nodes``, ``nodes`` held KV slots a request for its tree (node-major), all in
        one pinned copy."""
        bs, kv_lens_cpu = len(reqs), [r.kv_len for r in reqs]
        rows = [r.output_ids[-1] for r in reqs] + [r.req_slot for r in reqs] + kv_lens_cpu
        held_host = self.ctx.ledger.hold_host(bs * nodes) if nodes else None
        host = torch.tensor(rows, dtype=torch.int64)
        on_device = to_device(
            host if held_host is None else torch.cat([host, held_host]), self.ctx.device
        )
        root, req_slots, kv_lens = on_device[: 3 * bs].view(3, bs)  # three (B,) rows
        held = None if held_host is None else HeldSlots(held_host, on_device[3 * bs :])
        return RoundInputs(
            reqs=list(reqs),
            root=root,
            seed_hidden=self.seed_table[req_slots],
            req_slots=req_slots,
            kv_lens=kv_lens.to(torch.int32),
            kv_lens_cpu=kv_lens_cpu,
            held=held,
        )

    def draft(
        self, inputs: RoundInputs, graphs: bool = True, variant: RoundGraphs | None = None
    ) -> tuple[VerifyTree, bool]:
        """The draft tree of ``variant``'s length (default: the longest), from its draft-loop
        graph where one fits; -> (tree, graph used)."""
        variant = variant or self.longest
        args = (inputs.root, inputs.seed_hidden, inputs.req_slots, inputs.kv_lens)
        batch = draft_batch(*args, inputs.kv_lens_cpu)
        graph = variant.draft
        if graphs and graph is not None and graph.can_run_graph(batch):
            return VerifyTree(*graph.execute(batch)), True
        tree = draft_verify_tree(
            self.draft_eager.execute, variant.cfg, *args, inputs.kv_lens_cpu, rule=self.draft_rule
        )
        return tree, False

    def verify(
        self,
        inputs: RoundInputs,
        tree: VerifyTree,
        locs: torch.Tensor,
        graphs: bool = True,
        variant: RoundGraphs | None = None,
    ) -> tuple[torch.Tensor, bool]:
        """The target over every node, their KV into ``locs`` ((B * n,) device slots,
        node-major), then the round's tail (spec.verify): acceptance, the accepted path
        committed into the token table, the next seeds into the seed table. -> (packed,
        graph used)."""
        variant = variant or self.longest
        rows = request_rows(inputs.reqs, self.ctx.device)
        sampling = None if rows.greedy else rows  # greedy rounds: the argmax variant
        batch = verify_batch(
            tree,
            inputs.req_slots,
            inputs.kv_lens,
            inputs.kv_lens_cpu,
            locs,
            self.ctx.max_context_len - 1,
            sampling,
            chain=is_full_chain(variant.cfg),
        )
        # Every node draws from its request's stream: node i at draw ``draws + i``.
        for req in inputs.reqs:
            req.draws += tree.num_nodes
        graph = variant.sampled_verify if sampling is not None else variant.verify
        if graphs and graph is not None and graph.can_run_graph(batch):
            (packed,) = graph.execute(batch)
            return packed, True
        out = self.ctx.eager_runner.execute(batch)
        tables, max_context_len = self.tables(), self.ctx.max_context_len
        packed = round_tail(
            out.logits, out.hidden, batch, tables, max_context_len, self.accept_rule,
            model_ops(self.ctx.loaded.model),
        )  # fmt: skip
        return packed, False

    def tables(self) -> RoundTables:
        """The device tables a round's tail writes: the token table, the seed table."""
        return RoundTables(req_to_token=self.ctx.ledger.req_to_token, seeds=self.seed_table)

    def settle(
        self, reqs: list[Request], packed: torch.Tensor, held: HeldSlots, num_steps: int
    ) -> StepOutcome:
        """The round's one host read (``packed``), and what the engine settles from it
        (``settle_rows``)."""
        return self.settle_rows(reqs, read_host(packed), held, num_steps)

    def settle_rows(
        self, reqs: list[Request], rows: list, held: HeldSlots, num_steps: int
    ) -> StepOutcome:
        """What the engine settles from a round's read rows: each request's emitted tokens
        and kept slots, the rejected nodes' slots. Python lists, not tensor ops, per
        request: at batch 64 those were milliseconds."""
        bs = len(reqs)
        n = held.host.numel() // bs
        locs = held.host.view(bs, n).tolist()  # host ids: no device read
        outcome = StepOutcome(tokens=[], kept=[], rounds=[])
        released = []
        for row, node_locs in zip(rows, locs):
            accepted = row[0]
            path, tokens = row[1 : 2 + accepted], row[1 + n : 2 + n + accepted]
            outcome.kept.append([node_locs[i] for i in path])  # the root, accepted drafts
            on_path = set(path)
            released += [loc for i, loc in enumerate(node_locs) if i not in on_path]
            outcome.rounds.append(RoundLog(num_steps, row[2 + 2 * n : 1 + 3 * n], tokens[:-1]))
            outcome.tokens.append(tokens)
        outcome.released = torch.tensor(released, dtype=torch.int64)
        return outcome


def _accepted(reqs: list[Request], outcome: StepOutcome) -> list[tuple[Request, int]]:
    """The drafts each drafting request's round accepted: what the chooser records."""
    return [
        (r, len(log.accepted_tokens))
        for r, log in zip(reqs, outcome.rounds or ())
        if r.params.speculate
    ]
