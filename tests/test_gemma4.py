"""Gemma 4 text (models layer) against transformers on the same checkpoint, float32 on CPU:
identical greedy tokens, logits within 1e-4 relative; its KV layout; its errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import (
    CPU,
    GEMMA4_WINDOW,
    cpu_engine,
    hf_greedy,
    make_checkpoint,
    needs_gpu,
    random_prompts,
    rel_err,
)
from safetensors.torch import load_file, save_file
from test_models_parity import ExtendHarness

from graphrt.core.batch import ForwardBatch, ForwardMode
from graphrt.core.engine import SamplingParams
from graphrt.core.errors import CheckpointError, UnsupportedModelError
from graphrt.core.memory import TokenKVPool
from graphrt.core.models import load_model
from graphrt.core.models.gemma4 import Gemma4ForCausalLM
from graphrt.core.models.gemma4_config import gemma4_config_from_hf
from graphrt.core.models.loader import checkpoint_targets
from graphrt.core.models.presets import preset_hf_config

RTOL = 1e-4
NEW_TOKENS = 24
PROMPT_LENS = (9, 14, 20)  # all longer than the sliding window
CHECKPOINTS = ["gemma4_tiny", "gemma4_multimodal"]


@pytest.fixture(params=CHECKPOINTS)
def ckpt(request):
    return request.param, request.getfixturevalue(request.param)


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()  # (T, vocab)


def _load(ckpt) -> Gemma4ForCausalLM:
    return load_model(str(ckpt.path), CPU, torch.float32).model


# ---- parity ---------------------------------------------------------------------


def test_prefill_logits_match_every_position(ckpt):
    name, ckpt = ckpt
    loaded = load_model(str(ckpt.path), CPU, torch.float32)
    assert min(PROMPT_LENS) > GEMMA4_WINDOW
    prompts = random_prompts(PROMPT_LENS, seed=30)
    logits = ExtendHarness(loaded).extend([(i + 1, p, 0) for i, p in enumerate(prompts)])
    assert logits.shape == (sum(PROMPT_LENS), 300) and logits.dtype == torch.float32
    start = 0
    for prompt in prompts:
        expected = _hf_logits(ckpt.hf, prompt)
        for pos in range(len(prompt)):
            err = rel_err(logits[start + pos], expected[pos])
            assert err < RTOL, f"{name}: len {len(prompt)}, position {pos}: rel err {err:.2e}"
        start += len(prompt)


def test_prefill_with_cached_prefix_matches(gemma4_tiny):
    """The second chunk's sharing layers read the first chunk's KV from their producer's buffer."""
    loaded = load_model(str(gemma4_tiny.path), CPU, torch.float32)
    (prompt,) = random_prompts([20], seed=31)
    split = 8  # > the window: the second chunk's window starts inside the prefix
    harness = ExtendHarness(loaded)
    harness.extend([(1, prompt[:split], 0)])
    logits = harness.extend([(1, prompt[split:], split)])
    expected = _hf_logits(gemma4_tiny.hf, prompt)[split:]
    assert rel_err(logits, expected) < RTOL


# 4: every prompt prefills in chunks, each attending to the KV of those before (sliding
# windows reaching back into them, KV-sharing layers reading their producer's).
@pytest.mark.parametrize("prefill_step", [8192, 4])
def test_batched_greedy_decode_matches_transformers(ckpt, prefill_step):
    name, ckpt = ckpt
    loaded = load_model(str(ckpt.path), CPU, torch.float32)
    prompts = random_prompts(PROMPT_LENS, seed=32)
    engine = cpu_engine(loaded, max_context_len=64, max_prefill_tokens=prefill_step)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, return_logits=True)
    reqs = engine.generate(prompts, params)
    for prompt, req in zip(prompts, reqs):
        hf_tokens, hf_logits = hf_greedy(ckpt.hf, prompt, NEW_TOKENS)
        assert req.output_ids == hf_tokens, f"{name}: {len(prompt)}"
        for step, (ours, theirs) in enumerate(zip(req.output_logits, hf_logits, strict=True)):
            err = rel_err(ours, theirs)
            assert err < RTOL, f"{name}: len {len(prompt)}, step {step}: rel err {err:.2e}"


def test_greedy_tokens_follow_the_softcap_where_logits_reach_it(tmp_path):
    """Softcapping is monotone, so greedy tokens feel it only where logits reach the cap:
    tanh saturates to exactly the cap in float32 and the lowest-id saturated token wins the
    argmax, not the largest raw logit. Here (cap 2.0, final norm scaled 48x: raw logits
    up to ~30) that happens at many steps, and graphrt's tokens are transformers'."""
    from transformers import Gemma4TextConfig

    s, f = "sliding_attention", "full_attention"
    cfg = Gemma4TextConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        layer_types=[s, s, f],
        sliding_window=GEMMA4_WINDOW,
        num_kv_shared_layers=0,
        hidden_size_per_layer_input=8,
        final_logit_softcapping=2.0,
        max_position_embeddings=256,
    )
    hf = make_checkpoint(tmp_path, cfg, seed=0).hf
    with torch.no_grad():
        hf.model.norm.weight.mul_(48.0)  # the head's input, so the raw logits, 48x
    hf.save_pretrained(tmp_path)
    prompts = random_prompts(PROMPT_LENS, seed=34)
    engine = cpu_engine(load_model(str(tmp_path), CPU, torch.float32), max_context_len=64)
    reqs = engine.generate(prompts, SamplingParams(max_new_tokens=16, ignore_eos=True))
    for prompt, req in zip(prompts, reqs):
        expected, logits = hf_greedy(hf, prompt, 16)
        assert req.output_ids == expected, len(prompt)
        assert sum((step == 2.0).sum() > 1 for step in logits) > 1  # ties at the cap
    hf.config.final_logit_softcapping = None  # the test's premise: uncapped, other tokens
    assert all(r.output_ids != hf_greedy(hf, p, 16)[0] for p, r in zip(prompts, reqs))


def test_hidden_and_embedding_are_what_the_assistant_reads(gemma4_tiny):
    """RunnerOutput.hidden is transformers' ``hidden_states[-1]`` (after the final norm),
    the h_t assisted generation feeds the assistant; embed_tokens_scaled is the target's
    input embedding (scaled by sqrt(hidden)) with that hidden beside it."""
    loaded = load_model(str(gemma4_tiny.path), CPU, torch.float32)
    (prompt,) = random_prompts([12], seed=33)
    hidden = _extend_hidden(ExtendHarness(loaded), prompt)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = gemma4_tiny.hf(ids, output_hidden_states=True)
        hf_embed = gemma4_tiny.hf.get_input_embeddings()(ids)[0]
    assert rel_err(hidden, out.hidden_states[-1][0]) < RTOL
    model = loaded.model
    assert torch.equal(model.embed_tokens_scaled(ids[0], hidden), torch.cat([hf_embed, hidden], -1))
    assert model.lm_head_weight is model.model.embed_tokens.weight  # tied


def _extend_hidden(harness: ExtendHarness, prompt: list[int]) -> torch.Tensor:
    locs = harness.kv_pool.alloc(len(prompt))
    harness.req_pool.req_to_token[1, : len(prompt)] = locs
    batch = ForwardBatch(
        mode=ForwardMode.EXTEND,
        input_ids=torch.tensor(prompt),
        positions=torch.arange(len(prompt)),
        req_pool_indices=torch.tensor([1]),
        seq_lens=torch.tensor([len(prompt)], dtype=torch.int32),
        out_cache_loc=locs,
        seq_lens_cpu=[len(prompt)],
        extend_lens_cpu=[len(prompt)],
    )
    return harness.runner.execute(batch).hidden  # (T, hidden)


# ---- KV layout ------------------------------------------------------------------


def test_kv_sharing_layout(gemma4_tiny):
    model = _load(gemma4_tiny)
    hf_modes = gemma4_tiny.hf.config.kv_sharing_modes  # None / "store" / "reuse"
    specs = model.kv_layer_specs()
    # Layers [s, f, s, s, f, s, f], the last 3 share: 4 (full) and 6 (full) read layer 1,
    # 5 (sliding) reads layer 3. Layer 1 stores although layer 2 follows it.
    assert [s.cache_index for s in specs] == [0, 1, 2, 3, None, None, None]
    assert [m == "reuse" for m in hf_modes] == [s.cache_index is None for s in specs]
    attn = [layer.self_attn.spec for layer in model.model.layers]
    assert [a.cache_index for a in attn] == [0, 1, 2, 3, 1, 3, 1]
    assert [a.writes_kv for a in attn] == [True] * 4 + [False] * 3
    assert [a.head_dim for a in attn] == [16, 32, 16, 16, 32, 16, 32]
    assert [a.sliding_window for a in attn] == [GEMMA4_WINDOW, None, 6, 6, None, 6, None]
    assert all(a.scaling == 1.0 for a in attn)
    # Sharing layers own no projections for K/V (nor do transformers' layers).
    assert not hasattr(model.model.layers[4].self_attn, "qkv_proj")
    pool = TokenKVPool(8, specs, torch.float32, CPU)
    assert len(pool.k_buffers) == 4
    assert [tuple(k.shape[1:]) for k in pool.k_buffers] == [(2, 16), (2, 32), (2, 16), (2, 16)]
    # The assistant reads the "store" layers' KV.
    shared = model.shared_kv_layers()
    stores = {
        gemma4_tiny.hf.config.layer_types[i]: i for i, m in enumerate(hf_modes) if m == "store"
    }
    assert stores == {"sliding_attention": 3, "full_attention": 1}
    assert shared["full_attention"] == attn[1] and shared["sliding_attention"] == attn[3]


def test_k_eq_v_and_global_kv_heads(gemma4_multimodal):
    model = _load(gemma4_multimodal)
    specs = model.kv_layer_specs()
    assert [(s.num_kv_heads, s.head_dim, s.cache_index) for s in specs] == [
        (2, 16, 0), (1, 32, 1), (2, 16, 2), (2, 16, 3), (1, 32, 4),
    ]  # fmt: skip
    full = model.model.layers[1].self_attn
    assert set(full.qkv_proj.shard_offsets) == {"q_proj", "k_proj"}  # no v_proj: V = K


# ---- config ---------------------------------------------------------------------


def test_global_head_dim_and_per_layer_config_agree(gemma4_tiny):
    """transformers 5.24 writes per_layer_config; older writers global_head_dim."""
    cfg = json.loads((gemma4_tiny.path / "config.json").read_text())
    assert "per_layer_config" in cfg and "global_head_dim" not in cfg
    new = gemma4_config_from_hf(cfg, "Gemma4ForCausalLM")
    old_cfg = {k: v for k, v in cfg.items() if k != "per_layer_config"}
    old = gemma4_config_from_hf({**old_cfg, "global_head_dim": 32}, "Gemma4ForCausalLM")
    assert new.head_dims == old.head_dims == (16, 32, 16, 16, 32, 16, 32)
    assert new.kv_heads == old.kv_heads == (2,) * 7


def test_map_checkpoint_name(gemma4_multimodal, gemma4_tiny):
    mm = _load(gemma4_multimodal)
    assert mm.map_checkpoint_name("model.language_model.norm.weight") == "model.norm.weight"
    assert mm.map_checkpoint_name("lm_head.weight") == "lm_head.weight"
    assert mm.map_checkpoint_name("model.vision_tower.encoder.layers.0.mlp.w") is None
    assert mm.map_checkpoint_name("model.embed_audio.embedding_projection.weight") is None
    assert mm.map_checkpoint_name("model.norm.weight") != "model.norm.weight"  # not text's
    text = _load(gemma4_tiny)
    assert text.map_checkpoint_name("model.layers.0.layer_scalar") == "model.layers.0.layer_scalar"
    # Writers may keep K/V weights on sharing layers; transformers ignores them, so do we.
    assert text.map_checkpoint_name("model.layers.5.self_attn.k_proj.weight") is None
    assert text.map_checkpoint_name("model.layers.3.self_attn.k_proj.weight") is not None


def test_e2b_preset_shape():
    """Config and meta-device builds only: 4.6 B parameters have no place in a unit test."""
    from transformers import Gemma4ForCausalLM as HFGemma4
    from transformers import Gemma4TextConfig

    hf = preset_hf_config("gemma4-e2b")
    c = gemma4_config_from_hf(hf, "Gemma4ForCausalLM")
    assert (c.num_layers, c.hidden_size, c.vocab_size) == (35, 1536, 262144)
    assert c.head_dims == tuple(512 if i % 5 == 4 else 256 for i in range(35))
    assert c.kv_heads == (1,) * 35 and c.num_heads == 8
    assert c.kv_producers == {"sliding_attention": 13, "full_attention": 14}
    assert c.first_kv_shared_layer == 15 and c.dtype == torch.bfloat16
    assert c.final_logit_softcapping == 30.0 and c.hidden_size_per_layer_input == 256
    with torch.device("meta"):
        model = Gemma4ForCausalLM(c)
        ref = HFGemma4(Gemma4TextConfig(**{k: v for k, v in hf.items() if k != "architectures"}))
    assert sum(s.cache_index is not None for s in model.kv_layer_specs()) == 15
    assert model.model.layers[15].mlp.down_proj.in_features == 2 * 6144  # double-wide
    # Same tensors as transformers' model of this config (its layer_scalars are buffers).
    ref_names = set(ref.state_dict()) - {"lm_head.weight"}  # tied
    assert set(checkpoint_targets(model)) == ref_names
    ours = sum(p.numel() for p in model.parameters())
    assert (
        ours == sum(p.numel() for p in ref.parameters()) + 35
    )  # parameters() dedups the tied head


# ---- errors ---------------------------------------------------------------------


def _copy(ckpt, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(ckpt.path, dst)
    return dst


def test_moe_is_unsupported(gemma4_tiny, tmp_path):
    path = _copy(gemma4_tiny, tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="MoE"):
        load_model(str(path), CPU, torch.float32)


def test_missing_tensor_is_a_checkpoint_error(gemma4_tiny, tmp_path):
    path = _copy(gemma4_tiny, tmp_path)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.2.layer_scalar"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.layer_scalar"):
        load_model(str(path), CPU, torch.float32)


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_kernels_match_the_torch_reference(dtype, ckpt):
    """On the GPU with the CUDA device's fused Triton ops (Gemma's norms among them) and
    attention, the same tokens and logits as the torch reference ops on the same GPU."""
    from graphrt.core.engine import Engine, EngineConfig
    from graphrt.devices.cuda import CudaDevice

    name, ckpt = ckpt
    device = CudaDevice()
    prompts = random_prompts(PROMPT_LENS, seed=34)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True, return_logits=True)
    runs = []
    for ops in ("device", "torch"):
        loaded = load_model(
            str(ckpt.path), device if ops == "device" else torch.device("cuda"), dtype
        )
        engine = Engine(loaded, EngineConfig(max_context_len=64), device)
        runs.append(engine.generate(prompts, params))
    assert runs[0][0].output_logits[0].device.type == "cpu"
    limit = 1e-5 if dtype == torch.float32 else 3e-2
    # bf16: the first token and its logits; later steps may fork on a near-tie.
    steps = 8 if dtype == torch.float32 else 1
    for fused, reference in zip(*runs):
        assert fused.output_ids[:steps] == reference.output_ids[:steps], name
        for ours, theirs in zip(fused.output_logits[:steps], reference.output_logits[:steps]):
            assert rel_err(ours, theirs) < limit, name
