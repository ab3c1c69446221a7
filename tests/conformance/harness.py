"""Conformance cases and the harness each one runs on.

A case names a graph backend, the attention backend it is paired with, and
what "graph equals eager" can mean for that pair. Stand-in cases (ids
containing ``standin``) run the real graphrt backends against
``StandInGraphModule``: they check graphrt's own logic, not a device. Real
device cases are listed only where their device is present.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
from standin import StandInGraphModule

from graphrt.core.attention import AttentionBackend, TorchAttentionBackend
from graphrt.core.batch import ForwardBatch, ForwardMode
from graphrt.core.memory import ReqToTokenPool, TokenKVPool
from graphrt.core.models import load_model
from graphrt.core.runners import EagerRunner, ExecutionBackend, GraphRunner, GraphRunnerConfig

CPU = torch.device("cpu")
MODEL = "random:llama-tiny"
CONTEXT = 64  # a capture-safe torch-reference graph gathers this many keys per row
MAX_REQUESTS = 40  # room for one batch above the largest bucket
KV_SLOTS = 4096
# torch.compile costs seconds per bucket on 2 cores (inductor: ~6 g++ runs of 4 s each):
# keep the CPU list short. 1: a batch of one (size-1 dimensions); 16: the padded sizes
# (3, 9, 12 in test_replay).
CPU_BUCKETS = (1, 16)
DEVICE_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32)
NPU_UPDATABLE_OPS = 2


@dataclass(frozen=True)
class GraphCase:
    id: str
    device: torch.device
    dtype: torch.dtype
    make_backend: Callable[[], ExecutionBackend]
    make_attention: Callable[[TokenKVPool, ReqToTokenPool], AttentionBackend]
    buckets: tuple[int, ...]
    # Replay re-runs the kernels eager ran (a device graph, or the stand-in's
    # recording): bitwise equal to an eager forward of the same static batch.
    # False for compiled code, which fuses and reorders arithmetic.
    replays_eager_kernels: bool
    # EagerRunner builds the same attention metadata as the graph does for an
    # unpadded batch, so graph and EagerRunner are bitwise equal. False for the
    # capture-safe torch reference: eager gathers max(seq_lens) keys, a graph
    # the whole context, so the softmax reductions differ in the last bits.
    eager_metadata_matches: bool
    breakable: bool = False  # a breakable backend: graph segments around graph breaks
    marks: tuple = field(default=())

    @property
    def is_standin(self) -> bool:
        return "standin" in self.id

    @property
    def rtol(self) -> float:
        # float32 everywhere except the real-device bfloat16 params.
        return 1e-5 if self.dtype == torch.float32 else 2e-2


def _torch_attention(capture_safe: bool = True):
    def make(kv_pool, req_pool):
        return TorchAttentionBackend(kv_pool, req_pool, capture_safe=capture_safe)

    return make


def _standin_cases() -> list[GraphCase]:
    from graphrt.devices.cpu.compile import CompiledGraphBackend
    from graphrt.devices.cuda.graph import CudaBreakableGraphBackend, CudaFullGraphBackend
    from graphrt.devices.npu.graph import NpuGraphBackend
    from graphrt.devices.xpu.graph import XpuGraphBackend

    f32 = torch.float32
    return [
        GraphCase(
            "cpu-compile", CPU, f32, CompiledGraphBackend, _torch_attention(), CPU_BUCKETS,
            replays_eager_kernels=False, eager_metadata_matches=False,
            marks=(pytest.mark.slow,),  # inductor: seconds to tens of seconds a graph
        ),
        GraphCase(
            "npu-standin", CPU, f32,
            lambda: NpuGraphBackend(StandInGraphModule(), updatable_ops=NPU_UPDATABLE_OPS),
            _torch_attention(), DEVICE_BUCKETS,
            replays_eager_kernels=True, eager_metadata_matches=False,
        ),
        GraphCase(
            "xpu-standin", CPU, f32, lambda: XpuGraphBackend(StandInGraphModule()),
            _torch_attention(), DEVICE_BUCKETS,
            replays_eager_kernels=True, eager_metadata_matches=False,
        ),
        GraphCase(
            "cuda-full-standin", CPU, f32, lambda: CudaFullGraphBackend(StandInGraphModule()),
            _torch_attention(), DEVICE_BUCKETS,
            replays_eager_kernels=True, eager_metadata_matches=False,
        ),
        GraphCase(
            "cuda-breakable-standin", CPU, f32,
            lambda: CudaBreakableGraphBackend(StandInGraphModule()),
            _torch_attention(capture_safe=False), DEVICE_BUCKETS,
            replays_eager_kernels=True, eager_metadata_matches=True, breakable=True,
        ),
    ]  # fmt: skip


def _cuda_cases() -> list[GraphCase]:
    from graphrt.devices.cuda import CudaDevice
    from graphrt.devices.cuda.graph import CudaBreakableGraphBackend, CudaFullGraphBackend

    cuda = torch.device("cuda")
    has_triton = importlib.util.find_spec("triton") is not None
    no_triton = pytest.mark.skipif(not has_triton, reason="triton is not installed")
    cases = []
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        mark = (pytest.mark.cuda,)
        cases += [
            GraphCase(
                f"cuda-full-triton-{name}", cuda, dtype, CudaFullGraphBackend,
                CudaDevice().create_attention_backend, DEVICE_BUCKETS,
                replays_eager_kernels=True, eager_metadata_matches=True, marks=(*mark, no_triton),
            ),
            GraphCase(
                f"cuda-breakable-torch-{name}", cuda, dtype, CudaBreakableGraphBackend,
                _torch_attention(capture_safe=False), DEVICE_BUCKETS,
                replays_eager_kernels=True, eager_metadata_matches=True, breakable=True,
                marks=mark,
            ),
            GraphCase(
                f"cuda-breakable-triton-{name}", cuda, dtype, CudaBreakableGraphBackend,
                CudaDevice().create_attention_backend, DEVICE_BUCKETS,
                replays_eager_kernels=True, eager_metadata_matches=True, marks=(*mark, no_triton),
            ),
        ]  # fmt: skip
    return cases


def _other_device_cases() -> list[GraphCase]:
    from graphrt.devices.npu import NpuDevice
    from graphrt.devices.xpu import XpuDevice

    cases = []
    for device_cls, mark in ((NpuDevice, pytest.mark.npu), (XpuDevice, pytest.mark.xpu)):
        device = device_cls()
        if not device.is_available():
            continue
        cases.append(
            GraphCase(
                device.name, device.torch_device(), torch.float32,
                device.create_graph_backend, device.create_attention_backend, DEVICE_BUCKETS,
                replays_eager_kernels=True, eager_metadata_matches=False, marks=(mark,),
            )
        )  # fmt: skip
    return cases


def all_cases() -> list[GraphCase]:
    cases = _standin_cases()
    if torch.cuda.is_available():
        cases += _cuda_cases()
    return cases + _other_device_cases()


CASES = all_cases()


# ---- the harness: pools, attention, eager and graph runners, no Engine -------------------


@dataclass(eq=False)
class LiveRequest:
    slot: int  # row in ReqToTokenPool
    kv_len: int
    last_token: int
    locs: list[torch.Tensor] = field(default_factory=list)  # KV slots it owns


class Harness:
    """One captured GraphRunner per case, with an EagerRunner over the same pools.

    Tests build real requests (prefilled eagerly), decode batches of them, and
    compare runners; ``release_all`` returns every slot after each test.
    """

    def __init__(self, case: GraphCase, loaded, buckets: tuple[int, ...] | None = None):
        self.case = case
        self.model = loaded.model
        self.device = case.device
        self.req_pool = ReqToTokenPool(MAX_REQUESTS, CONTEXT, case.device)
        self.kv_pool = TokenKVPool(KV_SLOTS, self.model.kv_layer_specs(), case.dtype, case.device)
        self.attn = case.make_attention(self.kv_pool, self.req_pool)
        # Eager and graph share one attention backend and one set of pools, as in the Engine.
        self.eager = EagerRunner(self.model, self.attn)
        self.backend = case.make_backend()
        self.capture_log: list = []
        _spy_capture(self.backend, self.capture_log)
        self.runner = self.new_runner(buckets or case.buckets, backend=self.backend)
        self.runner.capture()
        # A failed capture only warns (its sizes then run eagerly): here it is an error.
        assert not self.runner.dropped_buckets, self.runner.dropped_buckets
        self.live: list[LiveRequest] = []

    def new_runner(self, buckets, padding: bool = True, backend=None, forward=None) -> GraphRunner:
        """A runner over this harness's pools; its own attention backend keeps the graph
        state (static metadata buffers) of the main runner's graphs untouched."""
        return GraphRunner(
            self.model,
            self.case.make_attention(self.kv_pool, self.req_pool),
            backend or self.case.make_backend(),
            GraphRunnerConfig(max_bs=max(buckets), buckets=tuple(buckets), padding=padding),
            self.device,
            forward=forward,
        )

    # ---- requests -------------------------------------------------------------------

    def new_requests(self, prompt_lens, seed: int = 0) -> list[LiveRequest]:
        """Allocate and prefill (eagerly) requests with prompts of the given lengths."""
        gen = torch.Generator().manual_seed(seed)
        vocab = self.model.vocab_size
        prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in prompt_lens]
        reqs = []
        for n in prompt_lens:
            locs = self.kv_pool.alloc(n)
            req = LiveRequest(slot=self.req_pool.alloc(), kv_len=n, last_token=-1, locs=[locs])
            self.req_pool.req_to_token[req.slot, :n] = locs
            reqs.append(req)
            self.live.append(req)
        lens = list(prompt_lens)
        dev = self.device
        batch = ForwardBatch(
            mode=ForwardMode.EXTEND,
            input_ids=torch.tensor([t for p in prompts for t in p], device=dev),
            positions=torch.cat([torch.arange(n) for n in lens]).to(dev),
            req_pool_indices=torch.tensor([r.slot for r in reqs], device=dev),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            out_cache_loc=torch.cat([r.locs[0] for r in reqs]),
            seq_lens_cpu=lens,
            extend_lens_cpu=lens,
            logits_indices=torch.tensor(lens, device=dev).cumsum(0) - 1,
        )
        tokens = self.eager.execute(batch).logits.argmax(-1).tolist()
        for req, token in zip(reqs, tokens):
            req.last_token = token
        return reqs

    def decode_batch(self, reqs: list[LiveRequest]) -> ForwardBatch:
        """The next decode step of ``reqs``: one new KV slot each (as Engine._decode_batch)."""
        dev = self.device
        locs = self.kv_pool.alloc(len(reqs))
        positions = [r.kv_len for r in reqs]
        for req, loc in zip(reqs, locs):
            self.req_pool.req_to_token[req.slot, req.kv_len] = loc
            req.locs.append(loc.view(1))
            req.kv_len += 1
        seq_lens = [r.kv_len for r in reqs]
        return ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=torch.tensor([r.last_token for r in reqs], device=dev),
            positions=torch.tensor(positions, device=dev),
            req_pool_indices=torch.tensor([r.slot for r in reqs], device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            out_cache_loc=locs,
            seq_lens_cpu=seq_lens,
            extend_lens_cpu=[1] * len(reqs),
        )

    @staticmethod
    def advance(reqs: list[LiveRequest], logits: torch.Tensor) -> None:
        for req, token in zip(reqs, logits.argmax(-1).tolist()):
            req.last_token = token

    def release_all(self) -> None:
        for req in self.live:
            self.kv_pool.free(torch.cat(req.locs))
            self.req_pool.req_to_token[req.slot].zero_()
            self.req_pool.free(req.slot)
        self.live.clear()

    # ---- references -----------------------------------------------------------------

    def eager_same_metadata(self, runner: GraphRunner, batch: ForwardBatch) -> torch.Tensor:
        """Eager forward of the static batch ``runner`` just replayed, with the graph's own
        attention metadata: what the recorded kernels computed, run op by op."""
        _, static = runner._loaded
        with torch.inference_mode():
            return runner._forward(static).logits[: batch.batch_size].clone()


def _spy_capture(backend: ExecutionBackend, log: list) -> None:
    """Record capture_session entry/exit and the key order capture_one sees."""
    session, capture_one = backend.capture_session, backend.capture_one

    def spy_session(*args, **kwargs):
        inner = session(*args, **kwargs)

        class Spy:
            def __enter__(self):
                log.append("session-enter")
                return inner.__enter__()

            def __exit__(self, *exc):
                log.append("session-exit")
                return inner.__exit__(*exc)

        return Spy()

    def spy_capture_one(key, *args, **kwargs):
        log.append(key)
        return capture_one(key, *args, **kwargs)

    backend.capture_session = spy_session
    backend.capture_one = spy_capture_one


def case_device(case: GraphCase):
    """A graphrt Device that hands out the case's attention and graph backends, so that
    an Engine built from it runs exactly the case's pair."""
    from graphrt.devices.cpu import CpuDevice
    from graphrt.devices.cuda import CudaDevice

    base = CudaDevice if case.device.type == "cuda" else CpuDevice

    class CaseDevice(base):
        # A stand-in takes the defaults of the device it stands in for (steps launched
        # ahead on CUDA), so the CPU lane runs what the CUDA lane runs.
        overlap_by_default = (CudaDevice if "cuda" in case.id else base).overlap_by_default

        def create_attention_backend(self, kv_pool, req_to_token_pool):
            return case.make_attention(kv_pool, req_to_token_pool)

        def _graph_backend_factories(self):
            return {case.id: case.make_backend}

        def default_dtype(self):
            return case.dtype

    return CaseDevice()


ENGINE_BUCKETS = (1, 4)  # case_engine's: batches of 5 and more run eagerly, 2 and 3 padded


def case_engine(case: GraphCase, loaded, graphs: bool, **overrides):
    """An Engine over the case's backends, the harness's pool and context sizes, graphs
    (at ENGINE_BUCKETS) or eager; ``overrides``: other EngineConfig fields or sizes."""
    from graphrt.core.engine import Engine, EngineConfig

    sizes = {"max_running_requests": MAX_REQUESTS, "max_context_len": CONTEXT,
             "kv_pool_tokens": KV_SLOTS, "graph_buckets": ENGINE_BUCKETS}  # fmt: skip
    config = EngineConfig(runner="graph" if graphs else "eager", **{**sizes, **overrides})
    return Engine(loaded, config, case_device(case))


def loaded_model(case: GraphCase, cache: dict):
    key = ("model", case.device, case.dtype)
    if key not in cache:
        cache[key] = load_model(MODEL, case.device, case.dtype)
    return cache[key]


# Nine runners, one bucket each, sizes no other test captures: more graphs than dynamo's
# default recompile_limit (8) lets one code object hold.
MANY_RUNNER_SIZES = (3, 5, 6, 7, 9, 10, 11, 13, 14)


def check_many_runners(h: Harness) -> int:
    """Capture a runner per size, then replay each one and compare it with eager; -> the
    graphs the runners replayed."""
    from helpers import rel_err

    reqs = h.new_requests([4 + i for i in range(max(MANY_RUNNER_SIZES))], seed=14)
    runners = []
    for size in MANY_RUNNER_SIZES:
        runners.append(h.new_runner((size,)))
        runners[-1].capture()
        assert not runners[-1].dropped_buckets, runners[-1].dropped_buckets  # as in Harness
    for runner, size in zip(runners, MANY_RUNNER_SIZES):
        batch = h.decode_batch(reqs[:size])
        graph = runner.execute(batch)
        eager = h.eager.execute(batch)
        assert rel_err(graph.logits, eager.logits) <= h.case.rtol, f"runner of size {size}"
        assert torch.equal(graph.logits.argmax(-1), eager.logits.argmax(-1))
        h.advance(reqs[:size], eager.logits)
    replays = sum(sum(runner.replays_per_size().values()) for runner in runners)
    for runner in runners:
        runner.cleanup()
    h.release_all()
    return replays


def without_inductor(compile_, backend: str = "eager"):
    """``compile_`` (torch.compile) with one of dynamo's debug backends instead of inductor:
    the CPU compile backend's captures, cache and cleanup as ever, without inductor's
    seconds of C++ codegen a graph. "eager" runs dynamo's captured graph as it is;
    "aot_eager" also functionalises it as inductor does first (in-place writes to inputs
    become copies at the graph's end), so what graphrt's code relies on there still
    shows. For tests of graphrt's runner logic; inductor's code is checked against eager
    by test_replay's every-bucket test."""
    return lambda fn, **kw: compile_(fn, **kw, backend=backend)


def check_many_runners_alone(case_id: str) -> None:
    """``check_many_runners`` in a fresh process (tests/conformance/test_capture.py); its
    last line on stdout: the graphs replayed."""
    case = next(c for c in CASES if c.id == case_id)
    if case_id == "cpu-compile":
        # What this exercises is dynamo's cache of compiled code: see without_inductor.
        torch.compile = without_inductor(torch.compile)
    print(check_many_runners(Harness(case, loaded_model(case, {}), buckets=(1,))))
