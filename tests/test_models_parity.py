"""Models (DESIGN.md layer 2) against transformers on the same checkpoint, float32 on CPU:
identical greedy tokens, logits within 1e-4 relative, prefill and decode."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import (
    CPU,
    MISTRAL_WINDOW,
    cpu_engine,
    hf_greedy,
    host_reads,
    random_prompts,
    rel_err,
)
from safetensors import safe_open

from graphrt.core.attention import TorchAttentionBackend
from graphrt.core.batch import ForwardBatch, ForwardMode
from graphrt.core.engine import SamplingParams
from graphrt.core.memory import ReqToTokenPool, TokenKVPool
from graphrt.core.models import load_model
from graphrt.core.runners import EagerRunner

RTOL = 1e-4
NEW_TOKENS = 32
ARCHS = ["llama_gqa_untied", "llama_tied", "qwen2", "qwen3", "mistral_swa"]
# Mistral's prompts all exceed its sliding window, so prefill itself slides.
PROMPT_LENS = {"mistral_swa": (13, 25, 9, 17)}
DEFAULT_LENS = (5, 13, 21, 9)


@pytest.fixture(params=ARCHS)
def arch(request):
    return request.param, request.getfixturevalue(request.param)


def _lens(name: str) -> tuple[int, ...]:
    lens = PROMPT_LENS.get(name, DEFAULT_LENS)
    if name == "mistral_swa":
        assert min(lens) > MISTRAL_WINDOW
    return lens


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()  # (T, vocab)


class ExtendHarness:
    """An EagerRunner over fresh pools, fed hand-built EXTEND batches."""

    def __init__(self, loaded, max_requests: int = 8, context: int = 128):
        model = loaded.model
        self.req_pool = ReqToTokenPool(max_requests, context, CPU)
        self.kv_pool = TokenKVPool(
            max_requests * context, model.kv_layer_specs(), torch.float32, CPU
        )
        self.runner = EagerRunner(model, TorchAttentionBackend(self.kv_pool, self.req_pool))

    def extend(self, chunks: list[tuple[int, list[int], int]]) -> torch.Tensor:
        """chunks: (request slot, new token ids, cached prefix length). Logits of every new token."""
        lens = [len(ids) for _, ids, _ in chunks]
        locs = self.kv_pool.alloc(sum(lens))
        start = 0
        for (slot, _, prefix), n in zip(chunks, lens):
            self.req_pool.req_to_token[slot, prefix : prefix + n] = locs[start : start + n]
            start += n
        seq_lens = [prefix + len(ids) for _, ids, prefix in chunks]
        batch = ForwardBatch(
            mode=ForwardMode.EXTEND,
            input_ids=torch.tensor([t for _, ids, _ in chunks for t in ids]),
            positions=torch.cat([torch.arange(p, p + len(ids)) for _, ids, p in chunks]),
            req_pool_indices=torch.tensor([slot for slot, _, _ in chunks]),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            out_cache_loc=locs,
            seq_lens_cpu=seq_lens,
            extend_lens_cpu=lens,
            logits_indices=None,  # every position
        )
        return self.runner.execute(batch).logits  # (T, vocab)


@pytest.mark.parametrize("name", [*ARCHS, "gemma4_tiny"])
def test_a_prefill_forward_reads_nothing_back_to_the_host(name, request):
    """A prefill step's forward (a chunk after its cached prefix beside a whole prompt)
    reads no tensor value to the host. On a GPU each read is a wait on the device: the
    reference's 0-dim token-table index waited once a layer (pytorch#105641; an 8k
    llama-1b prompt, 16 waits, on an H100 23.5 ms of host time in a 52 ms prefill)."""
    loaded = load_model(str(request.getfixturevalue(name).path), CPU, torch.float32)
    prompt, other = random_prompts([23, 7], seed=15)
    harness = ExtendHarness(loaded)
    harness.extend([(1, prompt[:10], 0)])  # the cached prefix
    assert host_reads(lambda: harness.extend([(1, prompt[10:], 10), (2, other, 0)])) == []


def test_prefill_logits_match_every_position(arch):
    name, ckpt = arch
    loaded = load_model(str(ckpt.path), CPU, torch.float32)
    prompts = random_prompts(_lens(name), seed=10)
    harness = ExtendHarness(loaded)
    # One EXTEND batch of mixed lengths: the varlen split must not mix requests.
    logits = harness.extend([(i + 1, p, 0) for i, p in enumerate(prompts)])
    assert logits.shape == (sum(map(len, prompts)), loaded.config.vocab_size)
    assert logits.dtype == torch.float32
    start = 0
    for prompt in prompts:
        expected = _hf_logits(ckpt.hf, prompt)
        for pos in range(len(prompt)):
            err = rel_err(logits[start + pos], expected[pos])
            assert err < RTOL, (
                f"{name}: prompt len {len(prompt)}, position {pos}: rel err {err:.2e}"
            )
        start += len(prompt)


def test_prefill_with_cached_prefix_matches(arch):
    """A prompt extended in two chunks (the second attends to the cached first) equals one forward."""
    name, ckpt = arch
    loaded = load_model(str(ckpt.path), CPU, torch.float32)
    (prompt,) = random_prompts([23], seed=11)
    split = 10  # > Mistral's window: the second chunk's window starts inside the prefix
    harness = ExtendHarness(loaded)
    harness.extend([(1, prompt[:split], 0)])
    logits = harness.extend([(1, prompt[split:], split)])
    expected = _hf_logits(ckpt.hf, prompt)[split:]
    for pos in range(len(prompt) - split):
        err = rel_err(logits[pos], expected[pos])
        assert err < RTOL, f"{name}: position {split + pos}: rel err {err:.2e}"


def test_batched_greedy_decode_matches_transformers(arch):
    name, ckpt = arch
    loaded = load_model(str(ckpt.path), CPU, torch.float32)
    prompts = random_prompts(_lens(name), seed=12)
    engine = cpu_engine(loaded, max_context_len=128)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, return_logits=True)
    reqs = engine.generate(prompts, params)
    for prompt, req in zip(prompts, reqs):
        hf_tokens, hf_logits = hf_greedy(ckpt.hf, prompt, NEW_TOKENS)
        assert len(hf_tokens) == NEW_TOKENS
        assert req.output_ids == hf_tokens, f"{name}: prompt len {len(prompt)}"
        assert len(req.output_logits) == NEW_TOKENS
        for step, (ours, theirs) in enumerate(zip(req.output_logits, hf_logits)):
            err = rel_err(ours, theirs)
            assert err < RTOL, f"{name}: prompt len {len(prompt)}, step {step}: rel err {err:.2e}"


def test_llama3_rope_scaling_is_read(llama_gqa_untied):
    loaded = load_model(str(llama_gqa_untied.path), CPU, torch.float32)
    assert loaded.config.rope_parameters["rope_type"] == "llama3"
    assert loaded.config.num_kv_heads == 2 and loaded.config.num_heads == 4


def test_sharded_checkpoint_loads_and_matches(llama_sharded):
    path = llama_sharded.path
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2 and not (path / "model.safetensors").exists()
    loaded = load_model(str(path), CPU, torch.float32)
    (prompt,) = random_prompts([17], seed=13)
    logits = ExtendHarness(loaded).extend([(1, prompt, 0)])
    expected = _hf_logits(llama_sharded.hf, prompt)
    assert rel_err(logits, expected) < RTOL


def test_tied_embeddings_load_without_lm_head(llama_tied):
    names = set()
    for file in llama_tied.path.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            names |= set(f.keys())
    assert "lm_head.weight" not in names
    loaded = load_model(str(llama_tied.path), CPU, torch.float32)
    assert loaded.config.tie_word_embeddings
    (prompt,) = random_prompts([11], seed=14)
    logits = ExtendHarness(loaded).extend([(1, prompt, 0)])
    assert rel_err(logits, _hf_logits(llama_tied.hf, prompt)) < RTOL


@pytest.mark.parametrize("name", ["llama_gqa_untied", "mistral_swa"])
def test_prompts_longer_than_a_prefill_step_prefill_in_chunks(name, request):
    """max_prefill_tokens 4: the 25-token prompt prefills over 7 steps (each chunk attends
    to the KV of those before: lower-right causal, and Mistral's window reaching back into
    them), the next prompt's first chunk fills a step's spare tokens; greedy tokens and
    logits are still transformers'."""
    ckpt = request.getfixturevalue(name)
    loaded = load_model(str(ckpt.path), CPU, torch.float32)
    prompts = random_prompts(_lens(name), seed=12)
    engine = cpu_engine(loaded, max_context_len=128, max_prefill_tokens=4)
    chunks = []  # (request id, tokens) of every prefill step
    real_batch = engine._prefill_batch

    def recorded_batch(step):
        chunks.append([(r.rid, n) for r, n in step])
        return real_batch(step)

    engine._prefill_batch = recorded_batch
    params = SamplingParams(max_new_tokens=8, ignore_eos=True, return_logits=True)
    reqs = engine.generate(prompts, params)
    assert all(sum(n for _, n in step) <= 4 for step in chunks)
    assert any(len(step) > 1 for step in chunks)  # a prompt's first chunk fills a step's rest
    for prompt, req in zip(prompts, reqs):
        assert sum(n for step in chunks for rid, n in step if rid == req.rid) == len(prompt)
        hf_tokens, hf_logits = hf_greedy(ckpt.hf, prompt, 8)
        assert req.output_ids == hf_tokens, f"{name}: prompt len {len(prompt)}"
        for step, (ours, theirs) in enumerate(zip(req.output_logits, hf_logits)):
            assert rel_err(ours, theirs) < RTOL, f"{name}: prompt len {len(prompt)}, step {step}"
    longest = max(reqs, key=lambda r: len(r.prompt_ids))
    assert sum(any(rid == longest.rid for rid, _ in step) for step in chunks) >= 6
    assert engine.kv_pool.available() == engine.kv_pool.num_slots


@pytest.mark.parametrize("name", ["llama_long", "mistral_long"])
@pytest.mark.parametrize("prefill_step", [8192, 512], ids=["one-step", "chunks-of-512"])
def test_a_2k_token_prompt_decodes_as_transformers(name, prefill_step, request):
    """A 2,048-token prompt (issue 21), prefilled in one step or in four chunks of 512
    (Mistral's 512-token window then reaches back across chunks): transformers' greedy
    tokens, and logits within 1e-4, for 8 steps."""
    ckpt = request.getfixturevalue(name)
    loaded = load_model(str(ckpt.path), CPU, torch.float32)
    (prompt,) = random_prompts([2048], seed=43)
    engine = cpu_engine(loaded, max_context_len=2100, max_prefill_tokens=prefill_step)
    steps = []
    real_batch = engine._prefill_batch
    engine._prefill_batch = lambda chunks: (steps.append(chunks), real_batch(chunks))[1]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True, return_logits=True)
    (req,) = engine.generate([prompt], params)
    hf_tokens, hf_logits = hf_greedy(ckpt.hf, prompt, 8)
    assert req.output_ids == hf_tokens
    for step, (ours, theirs) in enumerate(zip(req.output_logits, hf_logits)):
        assert rel_err(ours, theirs) < RTOL, f"step {step}"
    assert len(steps) == -(-2048 // prefill_step)
