"""Engine (DESIGN.md layer 8): independent finishing, freeing, waiting, limits, seeded
sampling, request validation."""

from __future__ import annotations

import dataclasses
import re
import time

import pytest
import torch
from helpers import CPU, cpu_engine, host_reads, random_prompts

from graphrt.core.engine import Engine, FinishReason, SamplingParams
from graphrt.core.engine.sampling import filtered_probs, sample, sampling_rows
from graphrt.core.errors import RequestError
from graphrt.core.models import load_model

LENS = (5, 13, 21, 9)
GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)
SAMPLED = SamplingParams(
    max_new_tokens=12, temperature=0.9, top_p=0.9, top_k=40, seed=1234, ignore_eos=True
)


@pytest.fixture(scope="module")
def loaded(llama_gqa_untied):
    return load_model(str(llama_gqa_untied.path), CPU, torch.float32)


def _engine(loaded, **config) -> Engine:
    return cpu_engine(loaded, **{"max_context_len": 64, **config})


def _run(engine: Engine, prompts, params):
    """Step to completion, checking after every step that KV in use is exactly the running KV."""
    reqs = [engine.add_request(p, params) for p in prompts]
    while engine.has_work:
        engine.step()
        in_use = engine.kv_pool.num_slots - engine.kv_pool.available()
        assert in_use == sum(r.kv_len for r in engine.running)
        assert all(r.req_slot is None for r in reqs if r.finished)  # freed at once
    return reqs


def _assert_idle(engine: Engine) -> None:
    assert not engine.running and not engine.waiting
    assert engine.kv_pool.available() == engine.kv_pool.num_slots
    assert engine.req_pool.available() == engine.config.max_running_requests
    assert engine.ledger.reserved_tokens == 0


def _alone(loaded, prompts, params, **config) -> list[list[int]]:
    return [_engine(loaded, **config).generate([p], params)[0].output_ids for p in prompts]


def test_requests_finish_independently(loaded):
    prompts = random_prompts(LENS, seed=20)
    reference = _engine(loaded).generate(prompts, GREEDY)
    engine = _engine(loaded)
    limits = [3, 12, 1, 7]
    reqs = [
        engine.add_request(p, dataclasses.replace(GREEDY, max_new_tokens=n))
        for p, n in zip(prompts, limits)
    ]
    finished_at: dict[int, int] = {}
    step = 0
    while engine.has_work:
        engine.step()
        step += 1
        in_use = engine.kv_pool.num_slots - engine.kv_pool.available()
        assert in_use == sum(r.kv_len for r in engine.running)  # finished KV freed at once
        for req in reqs:
            if req.finished:
                finished_at.setdefault(req.rid, step)
    # One prefill step, then one token per decode step: a request stops at its own limit.
    assert [finished_at[r.rid] for r in reqs] == limits
    for req, ref, n in zip(reqs, reference, limits):
        assert req.finish_reason is FinishReason.LENGTH
        assert req.output_ids == ref.output_ids[:n]
    _assert_idle(engine)


def test_eos_stops_one_request_while_others_continue(loaded):
    prompts = random_prompts(LENS, seed=21)
    reference = [r.output_ids for r in _engine(loaded).generate(prompts, GREEDY)]
    # An eos id that request `target` emits first as its 3rd token, and some other never emits.
    target, eos = next(
        (i, out[2])
        for i, out in enumerate(reference)
        if out[2] not in out[:2] and any(out[2] not in other for other in reference)
    )
    eos_loaded = dataclasses.replace(loaded, eos_token_ids=(eos,))
    params = dataclasses.replace(GREEDY, ignore_eos=False)
    engine = _engine(eos_loaded)
    reqs = _run(engine, prompts, params)
    assert reqs[target].output_ids == reference[target][:3]
    assert reqs[target].finish_reason is FinishReason.STOP
    for req, ref in zip(reqs, reference):
        if eos in ref:
            cut = ref.index(eos) + 1
            assert req.output_ids == ref[:cut] and req.finish_reason is FinishReason.STOP
        else:
            assert req.output_ids == ref and req.finish_reason is FinishReason.LENGTH
    _assert_idle(engine)


def test_ignore_eos_runs_to_length(loaded):
    prompts = random_prompts(LENS, seed=21)
    reference = [r.output_ids for r in _engine(loaded).generate(prompts, GREEDY)]
    eos = reference[0][0]
    reqs = _engine(dataclasses.replace(loaded, eos_token_ids=(eos,))).generate(prompts, GREEDY)
    assert [r.output_ids for r in reqs] == reference
    assert all(r.finish_reason is FinishReason.LENGTH for r in reqs)


def test_requests_wait_for_kv_and_match_running_alone(loaded):
    prompts = random_prompts(LENS, seed=22)
    params = dataclasses.replace(GREEDY, return_logits=True)
    # Budgets are prompt + 12 = 17, 25, 33, 21 slots; 40 slots hold at most two at once.
    engine = _engine(loaded, kv_pool_tokens=40)
    assert engine.kv_pool.num_slots == 40
    queued = []

    def on_step(stepped):
        assert engine.ledger.reserved_tokens <= engine.kv_pool.num_slots
        queued.append(len(engine.waiting))

    reqs = engine.generate(prompts, params, on_step=on_step)
    assert max(queued) > 0  # some requests really waited
    _assert_idle(engine)
    for prompt, req in zip(prompts, reqs):
        alone = _engine(loaded).generate([prompt], params)[0]
        assert req.output_ids == alone.output_ids
        assert req.finish_reason is FinishReason.LENGTH
        for ours, theirs in zip(req.output_logits, alone.output_logits):
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_max_running_requests_respected(loaded):
    prompts = random_prompts((4, 7, 3, 9, 6), seed=23)
    engine = _engine(loaded, max_running_requests=2)
    running = []

    def on_step(stepped):
        assert len(stepped) <= 2
        running.append(len(engine.running))

    reqs = engine.generate(prompts, GREEDY, on_step=on_step)
    assert max(running) == 2
    assert all(len(r.output_ids) == GREEDY.max_new_tokens for r in reqs)
    _assert_idle(engine)
    assert [r.output_ids for r in reqs] == _alone(loaded, prompts, GREEDY)


def test_context_limit_finishes_request(loaded):
    engine = _engine(loaded, max_context_len=16)
    full, near = random_prompts((16, 12), seed=24)
    reqs = _run(engine, [full, near], dataclasses.replace(GREEDY, max_new_tokens=30))
    # The last token never needs KV: a prompt of 16 in a 16-token context still gets one token.
    assert len(reqs[0].output_ids) == 1 and reqs[0].finish_reason is FinishReason.LENGTH
    assert len(reqs[1].output_ids) == 16 - 12 + 1 and reqs[1].finish_reason is FinishReason.LENGTH
    _assert_idle(engine)


# ---- sampling -------------------------------------------------------------------------


def test_seeded_sampling_is_reproducible_and_batch_independent(loaded):
    prompts = random_prompts(LENS, seed=25)
    first = [r.output_ids for r in _engine(loaded).generate(prompts, SAMPLED)]
    again = [r.output_ids for r in _engine(loaded).generate(prompts, SAMPLED)]
    assert first == again
    # Other batch compositions and orders: each request keeps its own tokens.
    assert _alone(loaded, prompts[1:2], SAMPLED) == first[1:2]
    reordered = _engine(loaded).generate([prompts[3], prompts[0]], SAMPLED)
    assert [r.output_ids for r in reordered] == [first[3], first[0]]
    greedy = [r.output_ids for r in _engine(loaded).generate(prompts, GREEDY)]
    assert first != greedy
    other_seed = dataclasses.replace(SAMPLED, seed=99)
    assert [r.output_ids for r in _engine(loaded).generate(prompts, other_seed)] != first


def test_unseeded_sampling_follows_engine_seed(loaded):
    params = dataclasses.replace(SAMPLED, seed=None)
    prompts = random_prompts(LENS, seed=26)

    def run(seed):
        return [r.output_ids for r in _engine(loaded, seed=seed).generate(prompts, params)]

    assert run(0) == run(0)
    assert run(0) != run(1)


def _probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One row's distribution, through the batched sampler's filter."""
    return filtered_probs(logits.unsqueeze(0), sampling_rows([params], [0], [0], CPU))[0]


def test_filtered_probs_top_k_keeps_exactly_k():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=0.7, top_k=5)
    probs = _probs(logits, params)
    kept = probs.nonzero().flatten()
    assert set(kept.tolist()) == set(logits.topk(5).indices.tolist())
    expected = torch.softmax(logits[kept] / 0.7, dim=0)
    torch.testing.assert_close(probs[kept], expected)
    assert probs.sum().item() == pytest.approx(1.0)


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.999])
def test_filtered_probs_top_p_keeps_the_nucleus(top_p):
    logits = torch.randn(50, generator=torch.Generator().manual_seed(1)) * 2
    full = torch.softmax(logits, dim=0)
    probs = _probs(logits, SamplingParams(temperature=1.0, top_p=top_p))
    order = full.argsort(descending=True)
    # The nucleus: the smallest most-likely prefix whose mass reaches top_p.
    size = int((full[order].cumsum(0) < top_p).sum()) + 1
    assert set(probs.nonzero().flatten().tolist()) == set(order[:size].tolist())
    nucleus = order[:size]
    torch.testing.assert_close(probs[nucleus], full[nucleus] / full[nucleus].sum())


def test_filtered_probs_top_k_then_top_p():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0, -1.0])
    probs = _probs(logits, SamplingParams(temperature=1.0, top_k=4, top_p=0.8))
    within_k = torch.softmax(logits[:4], dim=0)  # top-p acts on the top-k distribution
    size = int((within_k.cumsum(0) < 0.8).sum()) + 1
    assert probs.nonzero().flatten().tolist() == list(range(size))


def test_sample_top_k_1_is_greedy():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=1.5, top_k=1)] * 3
    rows = sampling_rows(params, [0, 1, 2], [0, 0, 0], CPU)
    assert torch.equal(sample(logits, rows), logits.argmax(-1))


# ---- validation -----------------------------------------------------------------------


def test_request_larger_than_pool_rejected_at_add(loaded):
    engine = _engine(loaded, kv_pool_tokens=20)
    with pytest.raises(RequestError, match="20"):
        engine.add_request(list(range(3, 13)), dataclasses.replace(GREEDY, max_new_tokens=11))
    assert not engine.waiting
    engine.add_request(list(range(3, 13)), dataclasses.replace(GREEDY, max_new_tokens=10))


@pytest.mark.parametrize(
    ("prompt", "words"),
    [
        ([], "empty"),
        ([5, 300, 7], "300"),  # vocab is 300: ids 0..299
        ([5, -1], "-1"),
        (list(range(3, 3 + 65)), "65"),  # context is 64
    ],
    ids=["empty", "too-large-id", "negative-id", "longer-than-context"],
)
def test_bad_prompts_rejected(loaded, prompt, words):
    engine = _engine(loaded)
    with pytest.raises(RequestError) as info:
        engine.add_request(prompt, GREEDY)
    message = str(info.value)
    assert words in message and "\n" not in message
    assert not engine.waiting


@pytest.mark.parametrize(
    "kwargs",
    [{"max_new_tokens": 0}, {"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -1}],
)
def test_bad_sampling_params_rejected(kwargs):
    with pytest.raises(RequestError):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "fields, needle",
    [
        ({"top_k": 2.5}, "top_k must be an integer"),  # was: a sampling crash mid-step
        ({"max_new_tokens": 1.5}, "max_new_tokens must be an integer"),
        ({"max_new_tokens": True}, "max_new_tokens must be an integer"),
        ({"temperature": float("nan")}, "finite number"),
        ({"temperature": float("inf")}, "finite number"),
        ({"temperature": 1e-40}, "too small to sample with"),
        ({"seed": 2**64}, "seed must fit in 64 bits"),
        ({"seed": "7"}, "seed must be an integer"),
        ({"temperature": "0.5"}, "temperature must be a number"),  # was: TypeError
        ({"top_p": None}, "top_p must be a number"),
        ({"ignore_eos": "false"}, "ignore_eos must be True or False"),  # a truthy string
    ],
)
def test_sampling_params_refuse_what_would_fail_a_step(fields, needle):
    with pytest.raises(RequestError, match=needle):
        SamplingParams(**fields)


def test_decoding_speed_leaves_out_prefill_steps(loaded, monkeypatch):
    """tokens_per_s counts what decode steps emitted over their time: a prefill step that
    stalls (on a GPU the first one JIT-compiles eager kernels) must not count."""
    engine = _engine(loaded, max_running_requests=2)
    prefill = engine._prefill_batch

    def slow_prefill(admitted):
        time.sleep(0.3)
        return prefill(admitted)

    monkeypatch.setattr(engine, "_prefill_batch", slow_prefill)
    prompts = random_prompts((5, 9, 7), seed=3)  # 2 admitted at once, the third later
    reqs = engine.generate(prompts, GREEDY)
    stats = engine.stats
    assert stats.prefill_tokens == 3 and stats.generated_tokens == 3 * GREEDY.max_new_tokens
    assert stats.prefill_s >= 0.6  # two prefill steps, each stalled
    decode_s = stats.elapsed_s - stats.prefill_s - stats.compile_time_s
    assert 0 < decode_s < stats.elapsed_s - 0.6
    assert stats.tokens_per_s == pytest.approx((3 * GREEDY.max_new_tokens - 3) / decode_s)
    assert all(len(r.output_ids) == GREEDY.max_new_tokens for r in reqs)


@pytest.mark.parametrize(
    ("prompt", "needle"),
    [
        ([5, "6"], "prompt token 1 is '6' (str)"),
        ([5, 6.0], "prompt token 1 is 6.0 (float)"),  # was: silently int(6.0)
        ([5, 1.9], "prompt token 1 is 1.9 (float)"),  # was: silently 1
        ([True, 5], "prompt token 0 is True (bool)"),
        ("hello", "got the string 'hello'"),
        (7, "a prompt is a sequence of token ids, got 7"),
        (torch.tensor([1.0, 2.0]), "1-D and integer"),
    ],
    ids=["str", "float-whole", "float", "bool", "text", "int", "float-tensor"],
)
def test_token_ids_are_integers_never_coerced(loaded, prompt, needle):
    """The API refuses what is not a token id with the typed error, for add_request and
    for generate (before queueing anything)."""
    engine = _engine(loaded)
    with pytest.raises(RequestError, match=re.escape(needle)):
        engine.add_request(prompt, GREEDY)
    with pytest.raises(RequestError, match=re.escape(needle)):
        engine.generate([[5, 6], prompt], GREEDY)
    assert not engine.waiting and not engine.running


def test_integer_prompts_of_other_types_are_taken(loaded):
    import numpy as np

    engine = _engine(loaded)
    prompts = [np.array([5, 6, 7]).tolist(), [np.int64(5), 6, 7], torch.tensor([5, 6, 7])]
    outputs = [r.output_ids for r in engine.generate(prompts, GREEDY)]
    assert outputs[0] == outputs[1] == outputs[2]


def test_generate_refuses_params_of_another_type(loaded):
    engine = _engine(loaded)
    with pytest.raises(RequestError, match="params must be a SamplingParams, got dict"):
        engine.generate([[5, 6]], {"max_new_tokens": 4})
    assert not engine.waiting


def test_pools_too_large_to_allocate_are_one_typed_error(loaded):
    from graphrt.core.errors import OutOfMemoryError

    with pytest.raises(OutOfMemoryError, match="do not fit in cpu memory: lower --kv-pool"):
        _engine(loaded, kv_pool_tokens=10**13)


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"max_running_requests": "8"}, "max_running_requests must be an integer"),  # TypeError
        ({"kv_pool_tokens": 2.5}, "kv_pool_tokens must be an integer"),
        ({"max_context_len": True}, "max_context_len must be an integer"),
        ({"graph_buckets": (1, "2")}, "graph_buckets must be a list of integers"),
        ({"graph_padding": "no"}, "graph_padding must be True or False"),
        ({"overlap": "yes"}, "overlap must be True or False"),
        ({"max_prefill_tokens": 0}, "max_prefill_tokens must be >= 1"),
    ],
)
def test_engine_config_refuses_wrong_types_with_the_typed_error(fields, needle):
    from graphrt.core.engine import EngineConfig
    from graphrt.core.errors import UsageError

    with pytest.raises(UsageError, match=needle):
        EngineConfig(**fields)


def test_overlap_left_unset_takes_the_devices_default(loaded):
    """``EngineConfig(overlap=None)``: steps launched ahead where the device says they pay
    (``Device.overlap_by_default``: CUDA), read one by one on the CPU; the engine's config
    then says which ran, and an explicit choice wins either way."""
    from graphrt.devices.cpu import CpuDevice
    from graphrt.devices.cuda import CudaDevice

    class Overlapping(CpuDevice):
        overlap_by_default = True

    assert CudaDevice.overlap_by_default and not CpuDevice.overlap_by_default
    assert _engine(loaded).config.overlap is False
    engine = cpu_engine(loaded, device=Overlapping(), max_context_len=64)
    assert engine.config.overlap is True
    engine.generate(random_prompts((5, 9), seed=3), GREEDY)
    assert engine.stats.launched_ahead > 0
    assert cpu_engine(loaded, device=Overlapping(), overlap=False).config.overlap is False
    # Both strategies take the device's default (speculative decoding too, since stop
    # 53); one that does not reads each step unless asked.
    from graphrt.core.engine.strategy import PlainDecode
    from graphrt.spec import MTPDecoding

    class ReadEachStep(PlainDecode):
        overlap_by_default = False

    assert PlainDecode.overlap_by_default and MTPDecoding.overlap_by_default
    engine = cpu_engine(loaded, ReadEachStep(), Overlapping(), max_context_len=64)
    assert engine.config.overlap is False


def test_a_decode_step_reads_no_value_to_the_host_but_its_tokens(llama_gqa_untied):
    """A plain step over greedy and sampled rows reads no tensor value to the host beyond
    its tokens (tolist, none of HOST_READS): on CUDA a stray read is a wait on the device
    that also stops the next step being launched ahead."""
    engine = cpu_engine(load_model(str(llama_gqa_untied.path), CPU, torch.float32))
    engine.add_requests(random_prompts([5, 9], seed=1), SamplingParams(max_new_tokens=8))
    sampled = SamplingParams(max_new_tokens=8, temperature=0.8, top_k=20, top_p=0.9)
    engine.add_requests(random_prompts([7], seed=2), sampled)
    for _ in range(3):  # prefill, then plain steps
        engine.step()
    before = [len(r.output_ids) for r in engine.running]
    assert host_reads(engine.step) == []
    assert [len(r.output_ids) for r in engine.running] == [n + 1 for n in before]
