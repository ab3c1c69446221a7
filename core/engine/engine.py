"""Engine: admits requests, prefills them, hands decode steps to its decode
strategy, and frees a request's KV the moment it finishes.

The engine is built from a graphrt device (the current one by default): its
attention kernels, graph backend and pools, exactly as the CLI gets them.
Admission reserves a request's whole KV budget (prompt + max_new_tokens,
capped by the context, plus what the strategy holds during a step), so a
running request never runs out of slots; requests that do not fit yet wait
in FIFO order, and one that could never fit is refused when it is added.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import operator
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence

import torch

from graphrt import devices
from graphrt.core.batch import ForwardBatch
from graphrt.core.engine.config import EngineConfig
from graphrt.core.engine.heap import freeze_startup_heap
from graphrt.core.engine.kv_plan import plan_kv
from graphrt.core.engine.ledger import Ledger
from graphrt.core.engine.prefill import Chunk, dry_prefills, prefill_batch, prefill_chunks
from graphrt.core.engine.request import (
    FinishReason,
    Request,
    SamplingParams,
    sampling_params,
    token_ids,
)
from graphrt.core.engine.sampling import BAD_LOGITS, sample_requests
from graphrt.core.engine.stats import EngineStats
from graphrt.core.engine.strategy import (
    DecodeStrategy,
    LaunchedStep,
    PlainDecode,
    StepContext,
    StepOutcome,
)
from graphrt.core.errors import (
    OutOfMemoryError,
    RequestError,
    UsageError,
    out_of_memory,
)
from graphrt.core.host import to_device
from graphrt.core.memory import ReqToTokenPool, TokenKVPool
from graphrt.core.models.loader import LoadedModel
from graphrt.core.runners import EagerRunner, GraphRunner, GraphRunnerConfig
from graphrt.devices.base import Device

log = logging.getLogger(__name__)
_AWAITED_BY = operator.attrgetter("awaited_by")  # scanned every decode step: map


def _require_type(name: str, value, kind: type, what: str, optional: bool = False) -> None:
    if (value is None and optional) or isinstance(value, kind):
        return
    raise UsageError(f"{name} must be {what}, got {value!r}"[:300])


class Engine:
    def __init__(
        self,
        loaded: LoadedModel,
        config: EngineConfig | None = None,
        device: Device | None = None,
        strategy: DecodeStrategy | None = None,
    ):
        _require_type("loaded", loaded, LoadedModel, "a LoadedModel from load_model()")
        _require_type("config", config, EngineConfig, "an EngineConfig", optional=True)
        _require_type("device", device, Device, "a graphrt Device (devices.current())", True)
        _require_type("strategy", strategy, DecodeStrategy, "a DecodeStrategy", optional=True)
        self.loaded = loaded
        self.device = device or devices.current()
        cfg = config or EngineConfig()
        self.strategy = strategy or PlainDecode()
        if cfg.overlap is None:  # the defaults', settled here: config says what ran
            overlap = self.device.overlap_by_default and self.strategy.overlap_by_default
            cfg = dataclasses.replace(cfg, overlap=overlap)
        self.config = cfg
        self.torch_device = self.device.torch_device()
        model = loaded.model
        param = next(model.parameters())
        if param.device.type != self.torch_device.type:
            raise UsageError(
                f"the model is on {param.device.type} but the engine's device is "
                f"{self.device.name}: load it with load_model(..., device)"
            )
        kv_specs = model.kv_layer_specs()
        if not any(s.cache_index is not None for s in kv_specs):
            raise UsageError(
                f"{loaded.source} keeps no KV cache of its own: it is a drafter (a frozen-KV "
                "MTP assistant) and runs beside its target; pass it as --draft, the target "
                "as --model"
            )
        runner = cfg.runner or self.device.default_runner()
        # No batch can exceed the running-request cap or the KV slots, nor the workload
        # the caller announced (graph_max_batch; an explicit bucket list wins over it).
        graph_max_bs = cfg.max_running_requests
        if cfg.graph_max_batch is not None and cfg.graph_buckets is None:
            graph_max_bs = min(graph_max_bs, cfg.graph_max_batch)
        # The graphs' logits buffers (the decode graphs' shared one, a round's verify rows):
        # a floor on graph memory, most of it for large vocabularies.
        graph_floor = 0
        if runner == "graph":
            rows = graph_max_bs * (1 + self.strategy.extra_kv_slots())
            graph_floor = rows * model.vocab_size * 4
        free = self.device.free_memory_bytes()
        kv_per_token = self._kv_bytes_per_token(kv_specs, param.dtype)
        plan = plan_kv(
            model_context=model.max_context_len,
            bytes_per_token=kv_per_token,
            max_running_requests=cfg.max_running_requests,
            max_context_len=cfg.max_context_len,
            kv_pool_tokens=cfg.kv_pool_tokens,
            kv_cache_bytes=cfg.kv_cache_bytes,
            memory_fraction=cfg.kv_memory_fraction,
            device_fraction=self.device.kv_memory_fraction,
            free_bytes=free,
            reserved_bytes=graph_floor,
        )
        self.kv_plan = plan
        self.max_context_len, slots = plan.context, plan.slots
        graph_max_bs = min(graph_max_bs, slots)
        too_big = OutOfMemoryError(
            f"the KV pool ({slots} tokens), request table ({cfg.max_running_requests} "
            f"requests x {self.max_context_len} tokens)"
            + (f" and graphs (at least {graph_floor / 2**30:.2f} GiB)" if graph_floor else "")
            + f" do not fit in {self.device.name} memory: lower --kv-pool-tokens, "
            "--max-running-requests or --max-context-len"
            + (", or run eagerly (--runner eager)" if graph_floor else "")
        )
        # Checked before allocating: a host allocation too large may not fail but be
        # killed later by the kernel's OOM killer.
        need = slots * kv_per_token
        need += cfg.max_running_requests * self.max_context_len * 8  # int64 token table
        need += graph_floor
        if free is not None and need > free:
            raise OutOfMemoryError(
                f"{too_big} (needs {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free)"
            )
        try:
            req_pool = ReqToTokenPool(
                cfg.max_running_requests, self.max_context_len, self.torch_device
            )
            kv_pool = TokenKVPool(slots, kv_specs, param.dtype, self.torch_device)
        except (MemoryError, RuntimeError) as e:
            if not out_of_memory(e):
                raise
            raise too_big from None
        self.ledger = Ledger(req_pool, kv_pool)
        self.attn_backend = self.device.create_attention_backend(kv_pool, req_pool)
        self.eager_runner = EagerRunner(model, self.attn_backend)
        self.runner_kind = runner
        self.graph_backend = (
            self.device.create_graph_backend(cfg.graph_backend) if runner == "graph" else None
        )
        # HAZARD (threads): every change to requests, pools and stats happens under this
        # lock; generate() callers on several threads take turns stepping the whole engine,
        # so their requests share batches. Re-entrant: generate() holds it around step().
        self._lock = threading.RLock()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Admitted requests whose prompt is not all in the KV cache yet (a prompt longer
        # than max_prefill_tokens prefills in chunks, one a step); also in ``running``.
        self.prefilling: list[Request] = []
        self.stats = EngineStats()
        self._next_rid = 0
        self._calls = itertools.count()  # await_all's call ids
        self._largest_capture = 0  # bytes the largest capture so far added (the cap's guess)
        self._warned_cap = False
        # A step launched ahead (config.overlap), its result not read yet: the next step
        # settles it before anything else runs.
        self._pending: LaunchedStep | None = None
        self._graphs_dropped = False  # cleanup() ran: no capture after it
        self.ctx = StepContext(
            loaded=loaded,
            ledger=self.ledger,
            attn_backend=self.attn_backend,
            eager_runner=self.eager_runner,
            graph_backend=self.graph_backend,
            graph_config=GraphRunnerConfig(
                max_bs=graph_max_bs,
                buckets=cfg.graph_buckets,
                padding=cfg.graph_padding,
            ),
            device=self.torch_device,
            max_context_len=self.max_context_len,
        )
        runners = self.strategy.setup(self.ctx)
        self._compile_ahead(runners, prefills=True)
        for graphs in runners:
            self._capture(graphs)
        if cfg.capture_all_graphs:
            deferred = self.strategy.deferred_captures()
            self._compile_ahead(deferred)
            for graphs in deferred:
                self._capture_within_cap([graphs])
        if self.config.freeze_gc:  # before timing: no full collection stalls a timed step
            freeze_startup_heap()
        self._time_steps()

    def _time_steps(self) -> None:
        """Run the kinds of step the strategy weighs by their cost (``step_timing``: auto
        draft lengths' plain steps and longest rounds) at each batch size it names, on
        throwaway one-token requests, so that its first real steps know what each costs.
        What they emit is dropped, the slot pools are left as fresh ones, and the stats as
        they were but for ``step_timing_s``."""
        sizes, kinds = self.strategy.step_timing()
        if not kinds:
            return
        start = time.perf_counter()
        stats, self.stats = self.stats, EngineStats()
        # Enough tokens that none finishes: a round emits at most its steps + 1 (twice over
        # with overlap: each run of a kind ends with one more step launched ahead).
        tokens = sum(k + 1 for k in kinds) * (2 if self.config.overlap else 1)
        params = SamplingParams(max_new_tokens=1 + tokens, ignore_eos=True)
        try:
            for size in sizes:
                reqs = [Request(rid=-1 - i, prompt_ids=[0], params=params) for i in range(size)]
                for req in reqs:
                    req.kv_budget = self.kv_budget(1, params)
                if not self.ledger.fits(size * reqs[0].kv_budget):
                    continue
                for req in reqs:
                    self.ledger.admit(req)
                    self.running.append(req)
                    self.prefilling.append(req)
                try:
                    while self.prefilling:
                        self._step(self._prefill_chunks())
                    for i, kind in enumerate(kinds):
                        self.strategy.force_step(kind)
                        self._time_step(last=i + 1 == len(kinds))
                finally:
                    self.strategy.force_step(None)
                    self._pending = None  # (a step that raised): its requests go below
                    for req in reqs:
                        if req in self.running:
                            self._release(req)
        finally:
            # Fresh free lists, so that the first requests get the slots they would have
            # got without timing (engines that time differently still allocate alike).
            self.ledger.recover(self.running)
            stats.step_timing_s = time.perf_counter() - start
            self.stats = stats

    def _time_step(self, last: bool) -> None:
        """One start-up step of the kind forced. With overlap, steps run as they will in
        use, each launched behind the one before, the next kind's first behind the last
        of the one before (the chooser leaves a step after a change of kind out): timed
        one at a time, the embedded pair's plain step on the H200 cost 0.31-0.52 ms where
        it ran at 0.21 launched ahead, and auto drafted at 0.79x. So a change of kind
        runs here first: the first plain step launched behind a round in use cost 1.1-1.5
        ms, against 0.5 for later ones (an H100 and an H200: first calls of its path),
        and was the only plain step auto ever timed in use (stop 69)."""
        step, self._pending = self._pending, None
        if step is None:
            self._step([])
        else:
            self._settle(step)
        if last and self._pending is not None:  # nothing behind the last
            step, self._pending = self._pending, None
            self._settle(step, launch_next=False)

    @property
    def req_pool(self) -> ReqToTokenPool:
        return self.ledger.req_pool

    @property
    def kv_pool(self) -> TokenKVPool:
        return self.ledger.kv_pool

    @property
    def graph_runner(self) -> GraphRunner | None:
        """The graph runner of plain decode steps (None with a speculative strategy)."""
        return self.strategy.graph_runner

    def _compile_ahead(self, runners: Sequence[GraphRunner], prefills: bool = False) -> None:
        """Let the backend compile the kernels of every bucket of ``runners`` at once before
        the first capture (CUDA: Triton's, in parallel, devices/cuda/compile_ahead.py);
        ``prefills``: a first prompt's too (``dry_prefills``: on a fresh H200 the first
        prefill of the README's command took 1.43 s from an empty Triton cache, 0.01 s
        warm)."""
        todo = [runner for runner in runners if not runner.compiled_ahead]
        if not (todo or prefills) or self.graph_backend is None:
            return
        runs = itertools.chain.from_iterable(r.dry_runs() for r in todo)
        if prefills:  # last: a dry run that raises ends the ones after it
            forward = self.eager_runner.execute
            runs = itertools.chain(
                runs, dry_prefills(self.ledger, forward, self.torch_device, self.max_context_len)
            )
        self.graph_backend.compile_ahead(runs)
        if prefills:
            self.ledger.recover(self.running)  # fresh free lists (nothing runs yet)

    def _capture(self, runner: GraphRunner) -> None:
        """Capture ``runner``'s graphs into the engine's backend (one pool for all)."""
        before = self.stats.graph_memory_bytes
        runner.capture()
        self.stats.capture_time_s += runner.capture_time_s
        self.stats.graph_memory_bytes = self.graph_backend.memory_bytes()
        self.stats.captured_sizes = runner.captured_sizes
        self._largest_capture = max(self._largest_capture, self.stats.graph_memory_bytes - before)

    def _capture_needed(self, reqs: list[Request]) -> None:
        """Capture the graphs the next step of ``reqs`` needs and start-up left out, while
        the graphs' memory stays under ``max_graph_memory_bytes``. Over it, the strategy is
        told (``refuse_capture``) and plans the step again without those graphs."""
        needed = self.strategy.captures_before(reqs)
        while needed:
            start = time.perf_counter()
            if self._capture_within_cap(needed):
                self.stats.lazy_capture_s += time.perf_counter() - start
                return
            needed = self.strategy.captures_before(reqs)  # each refusal is final: this ends

    def _capture_within_cap(self, runners: Sequence[GraphRunner]) -> bool:
        """Capture ``runners``, unless the graphs' memory would pass
        ``max_graph_memory_bytes``: then the strategy is told (``refuse_capture``) of each
        and plans without them, as they are once ``cleanup`` dropped the graphs. -> whether
        they were captured."""
        if self._graphs_dropped or self._over_graph_cap():
            for runner in runners:
                self.strategy.refuse_capture(runner)
            self.stats.refused_captures += len(runners)
            return False
        self._compile_ahead(runners)
        for runner in runners:
            self._capture(runner)
        return True

    def _over_graph_cap(self) -> bool:
        """Would the next capture pass ``max_graph_memory_bytes``? It is taken to add what
        the largest capture so far added. Warns once."""
        cap = self.config.max_graph_memory_bytes
        if cap is None or self.stats.graph_memory_bytes + self._largest_capture <= cap:
            return False
        if not self._warned_cap:
            self._warned_cap = True
            log.warning(
                "graphs hold %.0f MiB of max_graph_memory_bytes (%.0f MiB): graphs first "
                "needed from now on are not captured",
                self.stats.graph_memory_bytes / 2**20, cap / 2**20,
            )  # fmt: skip
        return True

    def build_decode_batch(self, reqs: list[Request]) -> ForwardBatch:
        """The next decode batch for ``reqs`` (running requests); one new KV slot each."""
        return self.ctx.decode_batch(reqs)

    def decode_graph_runner(self, reqs: list[Request], batch: ForwardBatch) -> GraphRunner | None:
        """The graph runner a plain decode step of ``batch`` (of ``reqs``) runs on, as the
        strategy picks it (a batch with a long row: ``PlainDecode.long_runner``), its graphs
        captured first if start-up left them out: what a benchmark of such steps times."""
        self._capture_needed(reqs)
        return self.strategy.plain_runner_for(batch)

    @staticmethod
    def _kv_bytes_per_token(kv_specs, dtype) -> int:
        per_token = sum(
            2 * s.num_kv_heads * s.head_dim for s in kv_specs if s.cache_index is not None
        )
        return per_token * dtype.itemsize

    # ---- requests -------------------------------------------------------------

    def add_request(
        self, prompt_ids: Sequence[int], params: SamplingParams | None = None
    ) -> Request:
        params = sampling_params(params)
        prompt_ids = token_ids(prompt_ids)
        self.validate_request(prompt_ids, params)
        with self._lock:
            return self._queue(prompt_ids, params)

    def add_requests(
        self, prompts: Iterable[Sequence[int]], params: SamplingParams | None = None
    ) -> list[Request]:
        """Queue every prompt, in order, after validating them all: a bad one queues none."""
        params = sampling_params(params)
        if isinstance(prompts, (str, bytes, torch.Tensor)) or not isinstance(prompts, Iterable):
            raise UsageError(
                f"prompts must be a list of prompts (each a list of token ids), got {prompts!r}"
            )
        prompts = [token_ids(p) for p in prompts]
        for prompt in prompts:
            self.validate_request(prompt, params)
        with self._lock:  # queued together: another thread's requests do not interleave
            return [self._queue(p, params) for p in prompts]

    def _queue(self, prompt_ids: list[int], params: SamplingParams) -> Request:
        """A validated prompt into the waiting queue (under the lock)."""
        req = Request(rid=self._next_rid, prompt_ids=prompt_ids, params=params)
        req.kv_budget = self.kv_budget(len(prompt_ids), params)
        seed = params.seed
        if seed is None:  # modulo 2^64: any integer --seed is a valid stream
            seed = (self.config.seed * 1_000_003 + req.rid) % 2**64
        req.seed = seed
        self._next_rid += 1
        self.waiting.append(req)
        return req

    def kv_budget(self, prompt_len: int, params: SamplingParams) -> int:
        """Token slots a request holds while running: what admission reserves."""
        tokens = min(prompt_len + params.max_new_tokens, self.max_context_len)
        return tokens + self._held_slots()

    def _held_slots(self) -> int:
        """Slots a request's steps hold beyond its tokens: the strategy's a step, twice
        over where a step may be launched behind one not settled (overlap)."""
        return self.strategy.extra_kv_slots() * (2 if self.config.overlap else 1)

    def validate_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        vocab = self.loaded.model.vocab_size
        if not prompt_ids:
            raise RequestError("empty prompt: a request needs at least one token")
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:  # C speed; then which one
            bad = next(t for t in prompt_ids if not 0 <= t < vocab)
            raise RequestError(f"token id {bad} is outside the vocabulary (size {vocab})")
        if len(prompt_ids) > self.max_context_len:
            model_max = self.loaded.model.max_context_len
            fix = (
                f"--max-context-len (max_context_len) raises it, up to the model's {model_max}"
                if model_max > self.max_context_len
                else "that is the model's own limit"
            )
            raise RequestError(
                f"prompt of {len(prompt_ids)} tokens is longer than the context "
                f"({self.max_context_len}): {fix}"
            )
        if params.return_logits and not self.strategy.keeps_logits:
            raise RequestError(
                f"return_logits keeps each token's logits, which {self.strategy.name} "
                "steps do not: run the request on an engine without a drafter"
            )
        # The budget admission reserves: a request above it could never be admitted.
        need = self.kv_budget(len(prompt_ids), params)
        if need > self.kv_pool.num_slots:
            held = self._held_slots()
            extra = f" ({held} of them for {self.strategy.name} steps)" if held else ""
            raise RequestError(
                f"request needs {need} KV slots{extra} but the KV pool holds only "
                f"{self.kv_pool.num_slots}"
            )

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def generate(
        self,
        prompts: Iterable[Sequence[int]],
        params: SamplingParams | None = None,
        on_step: Callable[[list[Request]], None] | None = None,
    ) -> list[Request]:
        """Run the given prompts to completion; returns their requests in input order. Every
        prompt is validated before any is queued (a bad one queues nothing); a request
        whose step failed comes back finished with ``FinishReason.ERROR``. Safe to call
        from several threads at once: see ``run_until_finished``."""
        return self.run_until_finished(self.add_requests(prompts, params), on_step)

    def await_all(self, reqs: Sequence[Request]) -> None:
        """``reqs`` are one call's, run to completion together: while they are all the
        engine runs and none waits to join, their batch only shrinks, and a speculative
        strategy weighs when it finishes (``DecodeStrategy.closed_batch``). Another call's
        requests in the batch open it again: one caller's slow request must not set the
        draft length of another's."""
        with self._lock:
            call = next(self._calls)
            for req in reqs:
                req.awaited_by = call

    def run_until_finished(
        self, reqs: list[Request], on_step: Callable[[list[Request]], None] | None = None
    ) -> list[Request]:
        """Step the engine until every one of ``reqs`` has finished; returns ``reqs``.

        Callers on several threads take turns: each step (under the engine's lock) serves
        every running request, so concurrent calls share batches. ``on_step`` gets those
        of ``reqs`` a step gave tokens to (or failed). If the call is interrupted
        (KeyboardInterrupt, SIGTERM's, or an exception out of ``on_step``), its unfinished
        requests finish as ``INTERRUPTED`` with their KV freed, keeping what they
        generated, and the exception goes on: nothing is left for the next call."""
        self.await_all(reqs)
        pending = set(reqs)
        start = time.perf_counter()
        try:
            while pending:
                with self._lock:
                    stepped = self.step() if any(not r.finished for r in pending) else []
                mine = [r for r in stepped if r in pending]
                pending = {r for r in pending if not r.finished}
                if on_step is not None and mine:
                    on_step(mine)
        except BaseException:
            with self._lock:
                for req in reqs:
                    if not req.finished:
                        self.abort(req, FinishReason.INTERRUPTED)
            raise
        finally:
            with self._lock:
                self.stats.elapsed_s += time.perf_counter() - start
                if self.graph_backend is not None:
                    self.stats.compile_time_s = self.graph_backend.lazy_compile_s()
        return reqs

    # ---- one step -------------------------------------------------------------

    @property
    def prefill_pending(self) -> bool:
        """Requests wait for admission or still prefill their prompt (in chunks): steps
        prefill before any decodes them all."""
        return bool(self.waiting or self.prefilling)

    def step(self) -> list[Request]:
        """One step: a prefill (of admitted prompts, a chunk of max_prefill_tokens at most;
        a prompt emits its first token when its last chunk is in), else a decode step (or
        speculative round) of all running ones. Returns the requests that received tokens,
        or that failed: if the step raises, its requests finish with ``FinishReason.ERROR``
        (the error in ``Request.error``, logged), their slots come back, and the engine
        goes on serving the others."""
        with self._lock:
            return self._step_locked()

    def _step_locked(self) -> list[Request]:
        self._admit()
        if self._pending is not None:  # settled before anything else runs (a prefill)
            step, self._pending = self._pending, None
            try:
                return self._settle(step)
            except BaseException as e:  # noqa: BLE001 (as below)
                # Its own requests only: those just admitted have not run yet.
                failed = [req for req in step.reqs if req in self.running]
                self._fail(failed, e)
                if not isinstance(e, Exception):
                    raise  # an interrupt goes on, the slots back
                return failed
        chunks = self._prefill_chunks()
        stepping = [req for req, _ in chunks] or list(self.running)
        start = time.perf_counter()
        try:
            return self._step(chunks)
        except BaseException as e:  # noqa: BLE001 (any failure: the requests must not leak)
            self._fail(stepping, e)
            if not isinstance(e, Exception):
                raise  # an interrupt goes on, the slots back
            return stepping
        finally:
            if chunks:
                self.stats.prefill_s += time.perf_counter() - start

    def _fail(self, reqs: list[Request], error: BaseException) -> None:
        """Finish ``reqs`` with an error and rebuild the pools' free lists from the requests
        still running: a step that failed midway may hold slots nothing else tracks (a
        round's tree, a step launched ahead and not yet pending). An interrupt
        (KeyboardInterrupt, SIGTERM's: no ``Exception``) finishes them as INTERRUPTED, and
        the caller raises it on once the slots are back. Requests the step finished
        already keep their reason: it failed after their last token."""
        message = f"{type(error).__name__}: {error}".splitlines()[0]
        interrupted = not isinstance(error, Exception)
        if not interrupted:
            log.warning(
                "a step of %d requests failed (%s); they finish with 'error'", len(reqs), message
            )
        for req in reqs:
            if req.finish_reason is None:
                req.finish_reason = FinishReason.INTERRUPTED if interrupted else FinishReason.ERROR
                req.error = None if interrupted else message
            if req in self.running:
                self.running.remove(req)
            if req in self.prefilling:
                self.prefilling.remove(req)
            req.req_slot = None
        self.ledger.recover(self.running)

    def _step(self, chunks: list[Chunk]) -> list[Request]:
        if not chunks:
            return self._decode_step()
        batch = self._prefill_batch(chunks)
        out, _ = self.ctx.forward(batch, None)
        self.stats.eager_steps += 1
        # Requests whose whole prompt is in now emit their first token; the others' next
        # chunk comes in the next step.
        reqs = [req for req in self.prefilling if req.kv_len == len(req.prompt_ids)]
        self.prefilling = [req for req in self.prefilling if req not in reqs]
        if not reqs:
            return []
        tokens = sample_requests(reqs, out.logits)
        self.strategy.after_prefill(reqs, out)
        self._emit(reqs, [[t] for t in tokens])
        # The prompts' first tokens: decoding tok/s leaves them out.
        self.stats.prefill_tokens += sum(len(req.output_ids) > 0 for req in reqs)
        return reqs

    def _decode_step(self) -> list[Request]:
        """A decode step (or speculative round) of every running request; its whole time,
        settling included, goes to the strategy (``step_done``)."""
        reqs = list(self.running)
        if not reqs:
            return []
        self.strategy.closed_batch = self._closed(reqs)
        self._capture_needed(reqs)
        start = time.perf_counter()  # after any capture: what the step itself costs
        step = self.strategy.launch(reqs) if self.config.overlap else None
        if step is not None:
            step.start = start
            return self._settle(step)
        self._emit(reqs, self._apply(reqs, self.strategy.decode(reqs)))
        self.strategy.step_done(time.perf_counter() - start)
        return reqs

    def _settle(self, step: LaunchedStep, launch_next: bool = True) -> list[Request]:
        """Launch the next step behind ``step`` where one can go (``_launch_ahead``; not
        with ``launch_next`` False), then wait for ``step``'s result and emit its tokens. A
        step's seconds run from the end of the one before it was settled (its host work
        overlapped that one's device time), less the launch of the step behind it, plus its
        own launch (made in the interval before, behind the step before it): each kind of
        step is charged its own host work. Charged the next step's launch instead, a plain
        step before a round paid for the round's launch and a round behind a plain step hid
        its own: on the H200 auto weighed the pair's plain steps at 0.52 ms and rounds of 4
        at 0.53, ran rounds, and decoded at 0.79x reading each step (BENCHMARKS.md,
        stop 50)."""
        launching = time.perf_counter()
        ahead = self._launch_ahead(step) if launch_next else None
        launch_s = time.perf_counter() - launching if ahead is not None else 0.0
        outcome = step.finish()
        self._emit(step.reqs, self._apply(step.reqs, outcome))
        now = time.perf_counter()
        if step.record is not None:
            step.record(now - step.start - launch_s + step.launch_s, outcome)
        if ahead is not None:
            ahead.start, ahead.launch_s = now, launch_s
        self._pending = ahead
        self._drop_idle_pending()  # every request it served stopped with ``step``
        return step.reqs

    def _drop_idle_pending(self) -> None:
        """Settle the step launched ahead, untimed and launching none, once none of its
        requests runs (they stopped, or were aborted): nothing is left to emit, but its
        slots must come back now. Left pending, it would be settled only by the next
        request's first step, idle time counted as its own in the chooser's figures."""
        step = self._pending
        if step is not None and not any(r in self.running for r in step.reqs):
            self._pending = None
            try:
                self._apply(step.reqs, step.finish())  # its forward ran: counted as a step
            except BaseException:
                # Its slots are in no running request's table (``abort``'s callers get the
                # error; a step's own failure recovers the same way in ``_fail``).
                self.ledger.recover(self.running)
                raise

    def _launch_ahead(self, step: LaunchedStep) -> LaunchedStep | None:
        """The next step of ``step``'s requests, queued behind it and fed its result on the
        device (``LaunchedStep.feed``), where nothing else must run first (a prefill) and
        the strategy can launch it (``DecodeStrategy.launch``); requests whose ``step``
        token is surely their last are left out. One that stops on a token of ``step`` (end
        of sequence, its length, broken logits) gets a step too many, dropped when that
        step is settled."""
        if self.prefilling:
            return None
        keep = [
            i
            for i, r in enumerate(step.reqs)
            if not r.finished
            and len(r.output_ids) + 1 < r.params.max_new_tokens
            and r.kv_len < self.max_context_len
            and not r.params.return_logits  # each token's logits are read as it is sampled
        ]
        if not keep:
            return None
        reqs = [step.reqs[i] for i in keep]
        tokens, kv_lens = step.feed()
        if len(keep) < len(step.reqs):
            index = to_device(keep, tokens.device)
            tokens = tokens.index_select(0, index)
            kv_lens = None if kv_lens is None else kv_lens.index_select(0, index)
        self.strategy.closed_batch = self._closed(reqs)
        ahead = self.strategy.launch(reqs, tokens, kv_lens, step.uncounted)
        self.stats.launched_ahead += ahead is not None
        return ahead

    def _closed(self, reqs: list[Request]) -> bool:
        """Does the batch ``reqs`` only shrink from here: all one call's requests, run to
        completion together (``await_all``), and none waiting to join? (A serving loop's
        requests are awaited by no call: finished ones are replaced.)"""
        if self.waiting:
            return False
        calls = set(map(_AWAITED_BY, reqs))
        return len(calls) == 1 and None not in calls

    def _emit(self, reqs: list[Request], emitted: list[list[int]]) -> None:
        """Append each request's tokens, finishing those that stop, reach their length or
        fill the context. A request finished already (it stopped, or was aborted, while a
        step launched ahead ran) takes none."""
        for req, tokens in zip(reqs, emitted):
            if req.finished:
                continue
            for token in tokens:
                if token == BAD_LOGITS:  # the target's logits held NaN or +Inf
                    self._fail_bad_logits(req)
                    break
                self._append_token(req, token)
                if req.finished:
                    break
            # A request whose KV filled the context can take no further token: its last
            # token's KV would go at position prompt + output - 1. (Not ``kv_len``: a
            # step launched ahead already holds that slot.)
            filled = len(req.prompt_ids) + len(req.output_ids) > self.max_context_len
            if not req.finished and filled:
                self._finish(req, FinishReason.LENGTH)

    def _apply(self, reqs: list[Request], outcome: StepOutcome) -> list[list[int]]:
        """Settle a decode step's slots and counts through the ledger and stats; -> the
        tokens each request emits. A request finished already (while a step launched
        behind one ran: its slots are back in the pool) keeps none: they are freed."""
        if outcome.kept is not None:
            keeping, kept = reqs, outcome.kept
            if any(req.finished for req in reqs):
                gone = [slot for r, k in zip(reqs, kept) if r.finished for slot in k]
                self.ledger.free(torch.tensor(gone, dtype=torch.int64))
                live = [(r, k) for r, k in zip(reqs, kept) if not r.finished]
                keeping, kept = [r for r, _ in live], [k for _, k in live]
            self.ledger.keep(keeping, kept)
        if outcome.released is not None:
            self.ledger.free(outcome.released)
        rounds = list(zip(reqs, outcome.rounds or ()))
        if any(req.finished for req, _ in rounds):
            # Rounds of requests that stopped before this step settled (a step launched past
            # their end): dropped, so no acceptance figure counts them.
            rounds = [(req, log) for req, log in rounds if not req.finished]
            graph_rounds = len(rounds) if outcome.graph_rounds else 0
            live = [log for _, log in rounds]
            outcome = dataclasses.replace(outcome, rounds=live, graph_rounds=graph_rounds)
        for req, log in rounds:
            req.spec_rounds.append(
                {"draft_tokens": log.draft_tokens, "accepted_tokens": log.accepted_tokens}
            )
        self.stats.record_step(outcome)
        return outcome.tokens

    def _admit(self) -> None:
        """Admit waiting requests (FIFO) while their KV fits and this step's prefill has
        tokens to spare (a prompt that does not fit whole starts with a chunk)."""
        pending = sum(len(r.prompt_ids) - r.kv_len for r in self.prefilling)
        while self.waiting and len(self.running) < self.config.max_running_requests:
            req = self.waiting[0]
            if not self.ledger.fits(req.kv_budget):
                break  # FIFO: later requests wait behind this one
            if pending >= self.config.max_prefill_tokens:
                break
            self.waiting.popleft()
            self.ledger.admit(req)
            pending += len(req.prompt_ids)
            self.running.append(req)
            self.prefilling.append(req)

    def _prefill_chunks(self) -> list[Chunk]:
        return prefill_chunks(self.prefilling, self.config.max_prefill_tokens)

    def _prefill_batch(self, chunks: list[Chunk]) -> ForwardBatch:
        return prefill_batch(self.ledger, chunks, self.torch_device)

    def _append_token(self, req: Request, token: int) -> None:
        req.output_ids.append(token)
        self.stats.generated_tokens += 1
        if not req.params.ignore_eos and token in self.loaded.eos_token_ids:
            self._finish(req, FinishReason.STOP)
        elif len(req.output_ids) >= req.params.max_new_tokens:
            self._finish(req, FinishReason.LENGTH)

    def _fail_bad_logits(self, req: Request) -> None:
        req.error = (
            f"the model's logits held NaN or Inf at token {len(req.output_ids)} of this "
            "request: broken weights or an overflow (--check-weights tests the weights)"
        )
        log.warning("request %d: %s; it finishes with 'error'", req.rid, req.error)
        self._finish(req, FinishReason.ERROR)

    def _finish(self, req: Request, reason: FinishReason) -> None:
        req.finish_reason = reason
        self._release(req)

    def abort(self, req: Request, reason: FinishReason = FinishReason.LENGTH) -> None:
        """Stop a request now (with ``reason``) and free its KV; waiting ones just leave."""
        _require_type("req", req, Request, "a Request from add_request()")
        with self._lock:
            if req in self.waiting:
                self.waiting.remove(req)
            if req.finish_reason is None:  # first: a step in flight settled below keeps
                req.finish_reason = reason  # nothing for it (its slot is gone)
            if req in self.running:
                self._release(req)
                self._drop_idle_pending()

    def _release(self, req: Request) -> None:
        self.ledger.release(req)
        self.running.remove(req)
        if req in self.prefilling:
            self.prefilling.remove(req)

    def cleanup(self) -> None:
        """Drop every captured graph (the engine can no longer run graphs: what start-up
        left to capture later is refused, as over the graph memory cap)."""
        self._graphs_dropped = True
        if self._pending is not None:  # never free graphs under a replay in flight
            # Settled, not dropped: requests still running keep its tokens (their KV
            # lengths have moved on with it) and go on eagerly.
            step, self._pending = self._pending, None
            self._emit(step.reqs, self._apply(step.reqs, step.finish()))
        self.strategy.cleanup()
