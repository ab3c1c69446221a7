"""Prefill attention through torch SDPA, one layer: which backend serves graphrt's calls, and
what the others would cost (issue 21, prefill at 8k and 32k against transformers).

graphrt sends a chunk of 4,096 tokens or more to SDPA (devices/cuda/attention.py,
``SDPA_MIN_CHUNK``) through ``torch_ref._causal``: a whole prompt as ``is_causal`` with
``enable_gqa`` (K/V left at their own heads), a chunk after cached tokens as torch's
lower-right ``CausalBias`` on K/V expanded to every query head. transformers expands K/V
itself and ran cuDNN's flash kernel (stop 38's profile: 10.1 ms of 16 layers at 8k against
graphrt's 22.5 in the extend kernel then). Variants, each checked against float32 math
first (max abs error), then timed (median of CUDA events, us a layer):

- ``graphrt``: the reference's ``_causal``, SDPA choosing its backend (CUDA serves a chunk
  after cached keys as ``split-cudnn`` below since stop 54, a whole prompt as this);
- ``expanded``: K/V expanded to every query head first (timed with the copy), then
  ``is_causal`` for a whole prompt, ``CausalBias`` for a chunk;
- ``split``: a chunk as two calls merged by their log-sum-exps (its cached keys, all
  visible; its own keys, ``is_causal``), each on a kernel that returns the log-sum-exp
  (flash, cuDNN), so a chunk never needs the lower-right mask;
- and each of these with one backend forced (``sdpa_kernel``): flash, cuDNN, efficient
  ("-" where the backend refuses the call).

    python bench/sdpa_prefill.py [--shape llama-1b|gemma-global] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math

import torch
import torch.nn.functional as F
from extend_blocks import timed_us
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from graphrt.core.attention.torch_ref import _causal, expand_kv_heads
from graphrt.devices.cuda.attention import cudnn_with_lse, merge_by_lse

SHAPES = {"llama-1b": (32, 8, 64), "gemma-global": (8, 1, 512)}  # heads, KV heads, head_dim
CASES = {  # name: (cached tokens, new tokens)
    "prompt 512": (0, 512),
    "prompt 8192": (0, 8192),
    "chunk 8192 after 8192": (8192, 8192),
    "chunk 8192 after 24576": (24576, 8192),
}
BACKENDS = {
    "auto": None,
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}


def expanded(q, key, value, scale):
    """K/V expanded, then SDPA: ``is_causal`` for a whole prompt, lower-right otherwise."""
    n, length = q.shape[2], key.shape[2]
    key, value = expand_kv_heads(key, value, q.shape[1])
    mask = None if n == length else causal_lower_right(n, length)
    return F.scaled_dot_product_attention(
        q, key, value, attn_mask=mask, is_causal=n == length, scale=scale
    )


def with_lse(q, key, value, causal: bool, scale: float, kernel: str):
    """SDPA's output and log-sum-exp, (1, H, n, D) and (1, H, n, 1) float32, from ``kernel``
    (flash as aten returns them, or cuDNN as graphrt calls it; math on the CPU, the check)."""
    if not q.is_cuda:
        scores = (q.float() @ key.float().transpose(-1, -2)) * scale
        if causal:
            n = q.shape[2]
            scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -math.inf)
        lse = torch.logsumexp(scores, -1, keepdim=True)
        return (torch.softmax(scores, -1) @ value.float()).to(q.dtype), lse
    if kernel == "cudnn":
        return cudnn_with_lse(q, key, value, causal, scale)
    out = torch.ops.aten._scaled_dot_product_flash_attention(
        q, key, value, 0.0, causal, False, scale=scale
    )
    return out[0], out[1].float().reshape(*q.shape[:3], 1)


def split(q, key, value, scale, kernel: str):
    """A chunk after cached keys as two calls merged by their log-sum-exps (a whole prompt:
    one ``is_causal`` call)."""
    n, length = q.shape[2], key.shape[2]
    key, value = expand_kv_heads(key, value, q.shape[1])
    if n == length:
        return with_lse(q, key, value, True, scale, kernel)[0]
    cached = length - n
    return merge_by_lse(
        *with_lse(q, key[:, :, :cached], value[:, :, :cached], False, scale, kernel),
        *with_lse(q, key[:, :, cached:], value[:, :, cached:], True, scale, kernel),
    )


def reference(q, key, value, scale):
    """float32 math, one query head at a time: all heads' scores at once would take 34 GB
    (x3 with the mask and softmax) for a chunk of 8,192 after 24,576 on llama-1b's 32."""
    n, length = q.shape[2], key.shape[2]
    group = q.shape[1] // key.shape[1]
    visible = torch.ones(n, length, dtype=torch.bool, device=q.device).tril(length - n)
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)  # (1, H, n, D)
    for h in range(q.shape[1]):
        k, v = key[0, h // group].float(), value[0, h // group].float()  # (L, D)
        scores = (q[0, h].float() @ k.T) * scale  # (n, L)
        out[0, h] = torch.softmax(scores.masked_fill_(~visible, -math.inf), -1) @ v
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=SHAPES, default="llama-1b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--cases", default=",".join(CASES), help="of: " + ", ".join(CASES))
    parser.add_argument("--scale-down", type=int, default=1, help="divide lengths (CPU check)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    heads, kv_heads, head_dim = SHAPES[args.shape]
    scale = head_dim**-0.5
    variants = {
        "graphrt": lambda q, k, v: _causal(q, k, v, scale, heads != kv_heads),
        "expanded": lambda q, k, v: expanded(q, k, v, scale),
        "split-flash": lambda q, k, v: split(q, k, v, scale, "flash"),
        "split-cudnn": lambda q, k, v: split(q, k, v, scale, "cudnn"),
    }
    print(f"# {args.shape} ({heads} heads, {kv_heads} KV heads, head_dim {head_dim}), {dtype}, "
          f"{device}, torch {torch.__version__}; us a layer (max abs error vs float32 math)")  # fmt: skip
    for name in args.cases.split(","):
        cached, new = (x // args.scale_down for x in CASES[name])
        gen = torch.Generator(device).manual_seed(0)
        q = torch.randn(1, heads, new, head_dim, device=device, generator=gen).to(dtype)
        key, value = (
            torch.randn(1, kv_heads, cached + new, head_dim, device=device, generator=gen).to(dtype)
            for _ in range(2)
        )
        want = reference(q, key, value, scale)
        print(f"== {name} (cached {cached}, new {new})")
        for variant, fn in variants.items():
            if variant == "split-cudnn" and device.type != "cuda":
                continue  # (on the CPU both are the math check of the merge)
            cells = []
            for backend, which in BACKENDS.items():
                if variant.startswith("split") and backend != "auto":
                    continue  # its kernel is named: nothing to force
                try:
                    call = functools.partial(fn, q, key, value)
                    with sdpa_kernel(which) if which is not None else contextlib.nullcontext():
                        err = (call().float() - want).abs().max().item()
                        us = timed_us(call) if device.type == "cuda" else 0.0
                    cells.append(f"{backend} {us:8.1f} ({err:.1e})")
                except RuntimeError as e:  # the backend refused these inputs
                    cells.append(f"{backend} - ({str(e).splitlines()[0][:40]})")
            print(f"  {variant:<12} " + " | ".join(cells))


if __name__ == "__main__":
    main()
