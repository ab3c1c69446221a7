"""The peers a user would pick instead, on the same weights as graphrt's model:
transformers with its static cache under ``torch.compile(mode="reduce-overhead")``
(inductor kernels + CUDA graphs) for a decode step, and transformers' assisted
generation (``generate(..., assistant_model=...)``) for speculative decoding."""

from __future__ import annotations

import inspect
import re
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from graphrt.core.bench.timing import attention_specs, median_ms
from graphrt.core.errors import GraphrtError
from graphrt.core.models.layers import MergedLinear
from graphrt.core.models.loader import LoadedModel, read_hf_config
from graphrt.core.models.presets import preset_hf_config


def hf_config(source: str) -> dict:
    """The Hugging Face config.json of a ``--model`` source (a directory or random:PRESET)."""
    if source.startswith("random:"):
        return preset_hf_config(source.removeprefix("random:"))
    return read_hf_config(Path(source))


def hf_peer_problem(model: nn.Module) -> str | None:
    """Why the compiled transformers peer cannot time ``model``'s decode step, or None."""
    if any(spec.sliding_window is not None for spec in attention_specs(model)):
        # StaticSlidingWindowLayer.cumulative_length_int (transformers 5.x): dynamo guards
        # on it, so the peer's column would time a recompile per step, not decoding.
        return (
            "its sliding-window layers keep their StaticCache length in a Python int that "
            "torch.compile guards on, so every decode step would recompile"
        )
    return None


def hf_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """graphrt's parameters under transformers' names (fused projections split back)."""
    merged = {name: m for name, m in model.named_modules() if isinstance(m, MergedLinear)}
    out = {}
    for name, param in model.named_parameters():
        module_name, _, leaf = name.rpartition(".")
        if module_name in merged:
            parent = module_name.rpartition(".")[0]
            for shard, (offset, size) in merged[module_name].shard_offsets.items():
                out[f"{parent}.{shard}.{leaf}"] = param[offset : offset + size]
        else:
            out[name] = param
    return out


def build_hf_model(hf_config: dict, model: nn.Module, device: torch.device, dtype: torch.dtype):
    """transformers' model of ``hf_config``'s architecture carrying graphrt ``model``'s
    weights -> (model in eval mode, its config). Tensors transformers has that graphrt
    never loads (the K/V projections an MTP assistant keeps unused) may stay missing."""
    try:
        import transformers
        from transformers import AutoConfig
    except ImportError:
        raise GraphrtError(
            "the transformers peer needs transformers: pip install 'graphrt[bench]'"
        ) from None
    cfg = {k: v for k, v in hf_config.items() if k not in ("architectures", "dtype", "torch_dtype")}
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    model_class = getattr(transformers, hf_config["architectures"][0])
    with torch.device(device):
        hf = model_class(config).to(dtype)
    missing, unexpected = hf.load_state_dict(hf_state_dict(model), strict=False)
    # A tied head has no tensor of its own; anything else missing is a bug.
    tied = getattr(config, "tie_word_embeddings", False)
    missing = [
        m for m in missing if not (tied and m == "lm_head.weight") and not _UNUSED_KV.search(m)
    ]
    if missing or unexpected:
        raise GraphrtError(
            f"transformers peer: weights do not map (missing {missing}, unexpected {unexpected})"
        )
    return hf.eval(), config


# K/V weights of KV-sharing layers: graphrt has none (they read another layer's KV).
_UNUSED_KV = re.compile(r"self_attn\.(k_proj|v_proj|k_norm|v_norm)\.")


class HFPeer:
    """transformers' own recipe for compiled static-cache decoding: an eager
    prefill fills a ``StaticCache``, then single-token steps run through
    ``torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)``.

    The static cache keeps its own write cursor (a device tensor per layer,
    advanced in place by every update; neither 5.17 nor 5.24 reads a
    ``cache_position``), so each timed call decodes the *next* position, as
    ``generate`` does, and the cache is sized for the prefill plus every call.
    (Repeating one position would run the cursor off the cache's end.)
    """

    def __init__(self, hf_config: dict, model: nn.Module, device: torch.device, dtype: torch.dtype):
        hf, config = build_hf_model(hf_config, model, device, dtype)
        self.model = hf.eval()
        self.config = config
        self.device = device
        # transformers renamed forward's cache argument (``past_key_values`` in 5.17,
        # ``cache`` in 5.24, where the old name is only a deprecated alias).
        params = inspect.signature(self.model.forward).parameters
        self.cache_kwarg = "cache" if "cache" in params else "past_key_values"
        # Compiled once; dynamo specialises (and, on CUDA, records a graph) per
        # batch size. dynamic=False: every batch size gets static-shape kernels,
        # so allow a recompile per batch size of a long sweep rather than letting
        # dynamo fall back to eager (and this column time eager) past its default 8.
        for knob in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, knob):
                setattr(torch._dynamo.config, knob, max(getattr(torch._dynamo.config, knob), 64))
                break
        self.step = torch.compile(
            self.model.forward, mode="reduce-overhead", fullgraph=True, dynamic=False
        )

    def new_cache(self, max_cache_len: int):
        from transformers import StaticCache

        return StaticCache(config=self.config, max_cache_len=max_cache_len)

    def prefill(self, ids: torch.Tensor, cache) -> torch.Tensor:
        """Eager prefill (never compiled, as transformers advises); it also allocates
        the cache tensors and marks them static addresses for dynamo/CUDA graphs."""
        return self.model(input_ids=ids, **{self.cache_kwarg: cache}).logits

    def decode(self, token: torch.Tensor, cache, compiled: bool = True) -> torch.Tensor:
        """One decode step at the cache's cursor (positions derived from it in-graph)."""
        fn = self.step if compiled else self.model.forward
        return fn(input_ids=token, **{self.cache_kwarg: cache}).logits

    @torch.no_grad()
    def decode_step_ms(
        self, batch_size: int, prompt_len: int, steps: int, warmup: int, sync: Callable[[], None]
    ) -> float:
        warmup = max(warmup, 3)  # compilation and CUDA-graph recording happen here
        calls = warmup + steps
        cache = self.new_cache(prompt_len + calls)
        ids = torch.randint(0, self.config.vocab_size, (batch_size, prompt_len), device=self.device)
        self.prefill(ids, cache)
        # Contiguous strides, so every batch size's token looks alike to dynamo's guards.
        token = ids[:, -1:].clone(memory_format=torch.contiguous_format)
        done = 0

        def run():
            nonlocal done
            if done == calls:  # the cache would overflow (an out-of-bounds index_copy_)
                raise GraphrtError("transformers peer: more decode steps than its cache holds")
            done += 1
            return self.decode(token, cache)

        return median_ms(run, sync, steps=steps, warmup=warmup)


def hf_assisted_tokens_per_s(
    target_cfg: dict, target: LoadedModel, draft_cfg: dict, drafter: LoadedModel,
    draft_tokens: int, prompt_len: int, new_tokens: int, device: torch.device, sync,
) -> float:  # fmt: skip
    """transformers' assisted generation (batch 1, greedy, ``draft_tokens`` drafts a round)
    on graphrt's weights: tokens/s."""
    dtype = next(target.model.parameters()).dtype
    hf_target, _ = build_hf_model(target_cfg, target.model, device, dtype)
    hf_draft, _ = build_hf_model(draft_cfg, drafter.model, device, dtype)
    hf_draft.generation_config.num_assistant_tokens = draft_tokens
    hf_draft.generation_config.num_assistant_tokens_schedule = "constant"
    ids = torch.randint(0, target.model.vocab_size, (1, prompt_len), device=device)
    kwargs = dict(
        assistant_model=hf_draft,
        do_sample=False,
        min_new_tokens=new_tokens,
        attention_mask=torch.ones_like(ids),
        pad_token_id=0,
    )
    with torch.no_grad():
        hf_target.generate(ids, max_new_tokens=4, **{**kwargs, "min_new_tokens": 4})  # warm-up
        sync()
        start = time.perf_counter()
        out = hf_target.generate(ids, max_new_tokens=new_tokens, **kwargs)
        sync()
    return (out.shape[1] - prompt_len) / (time.perf_counter() - start)
