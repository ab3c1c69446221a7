"""Engine: admits requests, builds each step's ForwardBatch, picks the runner,
samples, and frees a request's KV the moment it finishes.

Admission reserves a request's whole KV budget (prompt + max_new_tokens,
capped by the context), so a running request never runs out of slots;
requests that do not fit yet wait in FIFO order.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch

from graphrt.core.attention import AttentionBackend, TorchAttentionBackend
from graphrt.core.batch import ForwardBatch, ForwardMode
from graphrt.core.engine.request import FinishReason, Request, SamplingParams
from graphrt.core.engine.sampling import filtered_probs, sample
from graphrt.core.errors import RequestError
from graphrt.core.memory import ReqToTokenPool, TokenKVPool
from graphrt.core.models.loader import LoadedModel
from graphrt.core.runners import EagerRunner, ExecutionBackend, GraphRunner, GraphRunnerConfig
from graphrt.spec.config import SpecConfig
from graphrt.spec.graph_runner import MTPDraftGraphRunner
from graphrt.spec.worker import MTPWorker


@dataclass(frozen=True)
class EngineConfig:
    max_running_requests: int = 32
    max_context_len: int | None = None  # None: the model's, capped at 4096
    kv_pool_tokens: int | None = None  # None: as many as kv_cache_bytes holds
    kv_cache_bytes: int = 1 << 30
    max_prefill_tokens: int = 8192  # prompt tokens per prefill step
    seed: int = 0
    graph_buckets: tuple[int, ...] | None = None  # --graph-bs; None = the default list
    graph_padding: bool = True  # False (--no-graph-padding): exact captured sizes only


@dataclass
class EngineStats:
    eager_steps: int = 0
    graph_steps: int = 0
    generated_tokens: int = 0
    elapsed_s: float = 0.0
    capture_time_s: float = 0.0
    graph_memory_bytes: int = 0
    captured_sizes: list[int] = field(default_factory=list)
    # Speculative rounds, one per request per verify forward.
    spec_rounds: int = 0
    accept_histogram: list[int] = field(default_factory=list)  # [k] = rounds accepting k drafts

    def record_accept(self, accepted: int, num_steps: int) -> None:
        if not self.accept_histogram:
            self.accept_histogram = [0] * (num_steps + 1)
        self.accept_histogram[accepted] += 1
        self.spec_rounds += 1

    @property
    def accept_length_mean(self) -> float:
        """Tokens emitted per verify round: accepted drafts plus the target's bonus token."""
        total = sum((k + 1) * n for k, n in enumerate(self.accept_histogram))
        return total / self.spec_rounds if self.spec_rounds else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0


@dataclass
class Engine:
    loaded: LoadedModel
    device: torch.device
    config: EngineConfig = field(default_factory=EngineConfig)
    attention_factory: Callable[..., AttentionBackend] = TorchAttentionBackend
    # With a graph backend, decode batches run on captured graphs where
    # can_run_graph says so; eager serves prefill and everything else.
    graph_backend: ExecutionBackend | None = None
    # With a drafter (frozen-KV MTP assistant), decode steps become speculative
    # rounds: draft, one target verify forward, lossless acceptance.
    drafter: LoadedModel | None = None
    spec_config: SpecConfig | None = None

    def __post_init__(self):
        model, cfg = self.loaded.model, self.config
        self.max_context_len = min(model.max_context_len, cfg.max_context_len or 4096)
        kv_specs = model.kv_layer_specs()
        dtype = next(model.parameters()).dtype
        self.req_pool = ReqToTokenPool(cfg.max_running_requests, self.max_context_len, self.device)
        slots = cfg.kv_pool_tokens or self._slots_for_bytes(kv_specs, dtype)
        self.kv_pool = TokenKVPool(slots, kv_specs, dtype, self.device)
        self.attn_backend = self.attention_factory(self.kv_pool, self.req_pool)
        self.eager_runner = EagerRunner(model, self.attn_backend)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.reserved_tokens = 0
        self.stats = EngineStats()
        self._next_rid = 0
        self.spec_worker = self._make_spec_worker() if self.drafter is not None else None
        # Graphs serve decode steps, or, with a drafter, the draft loop (rounds have no
        # plain decode step; the verify forward runs eager).
        self.graph_runner = None
        if self.graph_backend is not None:
            captured = self._capture_graphs()
            if self.spec_worker is not None:
                self.spec_worker.draft_graph = captured
            else:
                self.graph_runner = captured

    def _make_spec_worker(self) -> MTPWorker:
        cfg = self.spec_config or SpecConfig()
        self.spec_config = cfg
        self.drafter.model.bind_target(self.loaded.model)
        draft_runner = EagerRunner(self.drafter.model, self.attn_backend)
        return MTPWorker(cfg, self.eager_runner, draft_runner, self.kv_pool, self.req_pool)

    def _capture_graphs(self) -> GraphRunner:
        cfg = self.config
        runner_config = GraphRunnerConfig(
            # No batch can exceed the running-request cap or the KV slots.
            max_bs=min(cfg.max_running_requests, self.kv_pool.num_slots),
            buckets=cfg.graph_buckets,
            padding=cfg.graph_padding,
        )
        if self.spec_worker is None:
            runner = GraphRunner(
                self.loaded.model, self.attn_backend, self.graph_backend, runner_config, self.device
            )
        else:
            target = self.loaded.model
            runner = MTPDraftGraphRunner(
                self.drafter.model,
                self.attn_backend,
                self.graph_backend,
                runner_config,
                self.device,
                self.spec_config,
                seed_hidden_size=target.config.hidden_size,
                dtype=next(target.parameters()).dtype,
            )
        runner.capture()
        self.stats.capture_time_s = runner.capture_time_s
        self.stats.graph_memory_bytes = self.graph_backend.memory_bytes()
        self.stats.captured_sizes = runner.captured_sizes
        return runner

    def _slots_for_bytes(self, kv_specs, dtype) -> int:
        per_token = sum(
            2 * s.num_kv_heads * s.head_dim for s in kv_specs if s.cache_index is not None
        )
        per_token *= torch.empty((), dtype=dtype).element_size()
        by_bytes = self.config.kv_cache_bytes // per_token
        return max(1, min(by_bytes, self.config.max_running_requests * self.max_context_len))

    # ---- requests -------------------------------------------------------------

    def add_request(
        self, prompt_ids: Sequence[int], params: SamplingParams | None = None
    ) -> Request:
        params = params or SamplingParams()
        prompt_ids = [int(t) for t in prompt_ids]
        self.validate_request(prompt_ids, params)
        req = Request(rid=self._next_rid, prompt_ids=prompt_ids, params=params)
        req.kv_budget = min(len(prompt_ids) + params.max_new_tokens, self.max_context_len)
        if self.spec_config is not None:  # a round holds a whole verify tree's slots briefly
            req.kv_budget += self.spec_config.num_draft_tokens
        seed = params.seed if params.seed is not None else self.config.seed * 1_000_003 + req.rid
        if not params.greedy:
            req.generator = torch.Generator(device=self.device).manual_seed(seed)
        self._next_rid += 1
        self.waiting.append(req)
        return req

    def validate_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        vocab = self.loaded.model.vocab_size
        if not prompt_ids:
            raise RequestError("empty prompt: a request needs at least one token")
        bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"token id {bad} is outside the vocabulary (size {vocab})")
        if len(prompt_ids) > self.max_context_len:
            raise RequestError(
                f"prompt of {len(prompt_ids)} tokens is longer than the context ({self.max_context_len})"
            )
        need = min(len(prompt_ids) + params.max_new_tokens, self.max_context_len)
        if need > self.kv_pool.num_slots:
            raise RequestError(
                f"request needs {need} KV slots but the KV pool holds only {self.kv_pool.num_slots}"
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
        """Run the given prompts to completion; returns requests in input order."""
        reqs = [self.add_request(p, params) for p in prompts]
        start = time.perf_counter()
        while self.has_work:
            stepped = self.step()
            if on_step is not None:
                on_step(stepped)
        self.stats.elapsed_s += time.perf_counter() - start
        return reqs

    # ---- one step -------------------------------------------------------------

    def step(self) -> list[Request]:
        """One forward: a prefill of newly admitted requests, else a decode of all running.

        Returns the requests that received a token.
        """
        admitted = self._admit()
        reqs = admitted if admitted else list(self.running)
        if not reqs:
            return []
        if not admitted and self.spec_worker is not None:
            self._spec_round(reqs)
            return reqs
        batch = self._prefill_batch(reqs) if admitted else self.build_decode_batch(reqs)
        runner = self.eager_runner
        if self.graph_runner is not None and self.graph_runner.can_run_graph(batch):
            runner = self.graph_runner
            self.stats.graph_steps += 1
        else:
            self.stats.eager_steps += 1
        out = runner.execute(batch)
        tokens = sample(out.logits, [r.params for r in reqs], [r.generator for r in reqs]).tolist()
        for i, (req, token) in enumerate(zip(reqs, tokens)):
            if req.params.return_logits:
                req.output_logits.append(out.logits[i].to("cpu", copy=True))
            if self.spec_worker is not None:
                req.spec_seed = out.hidden[
                    i
                ]  # the hidden that produced the token: next draft's seed
            self._append_token(req, token)
        return reqs

    def _spec_round(self, reqs: list[Request]) -> None:
        results = self.spec_worker.round(
            tokens=[r.output_ids[-1] for r in reqs],
            seed_hidden=torch.stack([r.spec_seed for r in reqs]),
            req_slots=[r.req_slot for r in reqs],
            kv_lens=[r.kv_len for r in reqs],
            max_keep=[self.max_context_len - r.kv_len for r in reqs],
            samplers=[
                None if r.params.greedy else partial(filtered_probs, p=r.params) for r in reqs
            ],
            generators=[r.generator for r in reqs],
        )
        self.stats.eager_steps += 1  # the verify forward
        self.stats.graph_steps = self.spec_worker.graph_rounds  # captured draft loops
        for req, res in zip(reqs, results):
            acc = res.acceptance
            req.kv_len += len(acc.tokens)  # the root and the accepted drafts are cached now
            req.spec_seed = res.seed_hidden
            req.spec_rounds.append(
                {"draft_tokens": res.draft_tokens, "accepted_tokens": acc.tokens[:-1]}
            )
            self.stats.record_accept(len(acc.nodes), self.spec_config.num_steps)
            for token in acc.tokens:
                self._append_token(req, token, check_context=False)
                if req.finished:
                    break
            if not req.finished and req.kv_len >= self.max_context_len:
                req.finish_reason = FinishReason.LENGTH
                self._release(req)

    def _admit(self) -> list[Request]:
        admitted, tokens = [], 0
        while self.waiting and len(self.running) < self.config.max_running_requests:
            req = self.waiting[0]
            if self.reserved_tokens + req.kv_budget > self.kv_pool.num_slots:
                break  # FIFO: later requests wait behind this one
            if admitted and tokens + len(req.prompt_ids) > self.config.max_prefill_tokens:
                break
            self.waiting.popleft()
            req.req_slot = self.req_pool.alloc()
            self.reserved_tokens += req.kv_budget
            tokens += len(req.prompt_ids)
            self.running.append(req)
            admitted.append(req)
        return admitted

    def _prefill_batch(self, reqs: list[Request]) -> ForwardBatch:
        lens = [len(r.prompt_ids) for r in reqs]
        locs = self.kv_pool.alloc(sum(lens))
        table = self.req_pool.req_to_token
        start = 0
        for req, n in zip(reqs, lens):
            table[req.req_slot, :n] = locs[start : start + n]
            req.kv_len = n
            start += n
        dev = self.device
        return ForwardBatch(
            mode=ForwardMode.EXTEND,
            input_ids=torch.tensor([t for r in reqs for t in r.prompt_ids], device=dev),
            positions=torch.cat([torch.arange(n) for n in lens]).to(dev),
            req_pool_indices=torch.tensor([r.req_slot for r in reqs], device=dev),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            out_cache_loc=locs,
            seq_lens_cpu=lens,
            extend_lens_cpu=lens,
            logits_indices=torch.tensor(lens, device=dev).cumsum(0) - 1,  # last token of each
        )

    def build_decode_batch(self, reqs: list[Request]) -> ForwardBatch:
        """The next decode batch for ``reqs`` (running requests); allocates one KV slot each."""
        dev = self.device
        locs = self.kv_pool.alloc(len(reqs))
        slots = torch.tensor([r.req_slot for r in reqs], device=dev)
        positions = torch.tensor([r.kv_len for r in reqs], device=dev)
        self.req_pool.req_to_token[slots, positions] = locs
        for r in reqs:
            r.kv_len += 1
        seq_lens_cpu = [r.kv_len for r in reqs]
        return ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=torch.tensor([r.output_ids[-1] for r in reqs], device=dev),
            positions=positions,
            req_pool_indices=slots,
            seq_lens=torch.tensor(seq_lens_cpu, dtype=torch.int32, device=dev),
            out_cache_loc=locs,
            seq_lens_cpu=seq_lens_cpu,
            extend_lens_cpu=[1] * len(reqs),
        )

    def _append_token(self, req: Request, token: int, check_context: bool = True) -> None:
        req.output_ids.append(token)
        self.stats.generated_tokens += 1
        full = check_context and req.kv_len >= self.max_context_len
        if not req.params.ignore_eos and token in self.loaded.eos_token_ids:
            req.finish_reason = FinishReason.STOP
        elif len(req.output_ids) >= req.params.max_new_tokens or full:
            req.finish_reason = FinishReason.LENGTH
        if req.finished:
            self._release(req)

    def abort(self, req: Request) -> None:
        """Stop a request now (finish reason LENGTH) and free its KV; waiting ones just leave."""
        if req in self.waiting:
            self.waiting.remove(req)
        elif req in self.running:
            self._release(req)
        if req.finish_reason is None:
            req.finish_reason = FinishReason.LENGTH

    def _release(self, req: Request) -> None:
        self.kv_pool.free(self.req_pool.req_to_token[req.req_slot, : req.kv_len])
        self.req_pool.free(req.req_slot)
        self.reserved_tokens -= req.kv_budget
        self.running.remove(req)
        req.req_slot = None
