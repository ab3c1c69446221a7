"""The Triton backend in the speculative modes against the torch reference backend:
TARGET_VERIFY (store the tree nodes' K/V, then tree-masked attention over prefix plus
ancestors) and DRAFT (query-only rows over the target's KV, live prefix only, no store).

CPU lane: under TRITON_INTERPRET=1 in a subprocess (see tests/test_triton_attention.py).
CUDA lane: the same comparisons on the GPU, float32 and bfloat16.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import OLD_INTERPRETER, needs_gpu, needs_triton, rel_err, run_under_triton_interpreter
from test_triton_verify import make_inputs

from graphrt.core.attention import AttentionSpec, TorchAttentionBackend
from graphrt.core.batch import ForwardBatch, ForwardMode
from graphrt.core.memory import KVLayerSpec, ReqToTokenPool, TokenKVPool
from graphrt.spec.draft import DraftInput
from graphrt.spec.verify import VerifyInput


def _pools(inp, device):
    """Pools over a verify input's buffers (a copy each: the backends write K/V)."""
    context = inp.req_to_token.shape[1]
    req_pool = ReqToTokenPool(inp.req_to_token.shape[0] - 1, context, device)
    req_pool.req_to_token.copy_(inp.req_to_token)
    num_slots, kv_heads, head_dim = inp.k_buffer.shape
    layer = KVLayerSpec(kv_heads, head_dim, 0)
    kv_pool = TokenKVPool(num_slots - 1, [layer], inp.k_buffer.dtype, device)
    kv_pool.k_buffers[0].copy_(inp.k_buffer)
    kv_pool.v_buffers[0].copy_(inp.v_buffer)
    return kv_pool, req_pool


def _verify_batch(inp, chain: bool = False) -> ForwardBatch:
    n = inp.num_nodes
    return ForwardBatch(
        mode=ForwardMode.TARGET_VERIFY,
        input_ids=torch.zeros_like(inp.positions),
        positions=inp.positions,
        req_pool_indices=inp.req_pool_indices,
        seq_lens=inp.seq_lens,
        out_cache_loc=inp.out_cache_loc,
        seq_lens_cpu=[p + n for p in inp.prefix_lens],
        extend_lens_cpu=[n] * len(inp.prefix_lens),
        # Attention reads the mask alone; the round's tail, which reads the rest, is not run.
        spec_info=VerifyInput(
            tree_mask=inp.tree_mask, parents=None, depth=None, valid=None, chain=chain
        ),
    )


def _draft_batch(inp, reps: int) -> ForwardBatch:
    """``reps`` query-only rows per request at the position after its prefix."""
    prefix = torch.tensor(inp.prefix_lens, device=inp.positions.device)
    rows = len(inp.prefix_lens) * reps
    return ForwardBatch(
        mode=ForwardMode.DRAFT,
        input_ids=torch.zeros(rows, dtype=torch.int64, device=prefix.device),
        positions=prefix.repeat_interleave(reps),
        req_pool_indices=inp.req_pool_indices.repeat_interleave(reps),
        seq_lens=prefix.to(torch.int32).repeat_interleave(reps),
        out_cache_loc=torch.zeros(rows, dtype=torch.int64, device=prefix.device),
        seq_lens_cpu=[p for p in inp.prefix_lens for _ in range(reps)],
        extend_lens_cpu=[1] * rows,
        spec_info=DraftInput(hidden=torch.zeros(rows, 1, device=prefix.device)),
    )


def compare(
    prefix_lens, n, heads, kv_heads, head_dim, window, dtype, device, seed, splits=None,
    width_invariant=False, chain=False,
) -> dict:  # fmt: skip
    """Triton vs the torch reference: verify outputs and stored K/V, draft outputs.
    ``splits``: the Triton backend's KV splits (None: its default); ``width_invariant``:
    the layers' (verify on decode's schedule, else in one pass a request); ``chain``:
    every tree a chain, and the batch says so (small batches then verify on decode's
    kernel)."""
    from graphrt.devices.cuda.attention import TritonAttentionBackend

    inp = make_inputs(
        prefix_lens,
        n,
        heads,
        kv_heads,
        head_dim,
        dtype,
        device,
        seed=seed,
        window=window,
        chain=chain,
    )
    gen = torch.Generator().manual_seed(seed + 100)
    k, v = (
        torch.randn(inp.q.shape[0], kv_heads * head_dim, generator=gen).to(device, dtype)
        for _ in range(2)
    )
    results = {}
    for mode, writes in (("verify", True), ("draft", False)):
        spec = AttentionSpec(
            heads, kv_heads, head_dim, inp.sm_scale, 0, window, writes, width_invariant
        )
        batch = _verify_batch(inp, chain) if mode == "verify" else _draft_batch(inp, reps=3)
        q = inp.q
        if mode == "draft":  # one set of queries for both backends
            q = torch.randn(batch.num_tokens, heads, head_dim, generator=gen).to(device, dtype)
        outs, pools = [], []
        for backend_cls in (TritonAttentionBackend, TorchAttentionBackend):
            kv_pool, req_pool = _pools(inp, device)
            if backend_cls is TritonAttentionBackend and splits is not None:
                backend = backend_cls(kv_pool, req_pool, num_kv_splits=splits)
            else:
                backend = backend_cls(kv_pool, req_pool)
            backend.init_forward_metadata(batch)
            kv = (k, v) if writes else (None, None)
            outs.append(backend.forward(q.flatten(1), *kv, spec, batch).float())
            pools.append(kv_pool)
        results[f"{mode}/out"] = rel_err(outs[0], outs[1])
        if writes:
            stored = [p.k_buffers[0][inp.out_cache_loc].float() for p in pools]
            results[f"{mode}/stored_k"] = rel_err(stored[0], stored[1])
    return results


CPU_CASES = [  # (prefix lens, n, heads, kv heads, head dim, window)
    ([3, 21, 40], 4, 4, 2, 16, None),
    ([1, 9, 40], 5, 8, 1, 24, 6),  # as chains: 3 (request, KV head) pairs, on decode's kernel
]


def interpreter_results() -> dict:
    errors = {}
    for i, case in enumerate(CPU_CASES):
        # 4 KV splits: a quarter of the interpreted programs (prefixes of 40 keys fill
        # at most 3 blocks); the 16-split schedule is test_triton_verify's. Verify both
        # ways: one pass a request (the default), decode's schedule (width-invariant); each
        # for trees and for chains (on decode's kernel where the batch is small enough).
        for invariant in (False, True):
            for chain in (False, True):
                results = compare(
                    *case, torch.float32, "cpu", seed=i, splits=4, width_invariant=invariant,
                    chain=chain,
                )  # fmt: skip
                for name, err in results.items():
                    errors[f"{i}/invariant{invariant}/chain{chain}/{name}"] = err
    return errors


@needs_triton
@pytest.mark.skipif(OLD_INTERPRETER, reason="triton < 3.7: its interpreter mishandles loop bounds")
def test_triton_backend_matches_reference_in_speculative_modes_under_interpreter():
    errors = run_under_triton_interpreter(__file__)
    assert len(errors) == 2 * 2 * 3 * len(CPU_CASES)
    too_far = {name: err for name, err in errors.items() if not err <= 1e-5}
    assert not too_far, too_far


@needs_triton
def test_the_layers_width_invariance_picks_the_verify_kernel(monkeypatch):
    """TARGET_VERIFY runs the one-pass kernel, or decode's schedule (triton_verify) for
    layers whose model asks width invariance (``--batch-invariant``); chains go to
    decode's own kernel (with the chain's slots and width) in small batches, and in
    width-invariant models at any size."""
    from graphrt.devices.cuda import attention

    called, chains, current = [], [], {}
    for name in ("tree_verify_attention", "onepass_verify_attention", "decode_attention"):

        def record(*args, name=name, **kwargs):
            called.append(name)
            if name == "decode_attention":  # the chain's slots are the batch's, its width 2
                slots, width = kwargs["chain"]
                chains.append((slots is current["batch"].out_cache_loc, width))

        monkeypatch.setattr(attention, name, record)
    for requests, chain in ((2, False), (2, True), (5, True)):
        inp = make_inputs([3] * requests, 2, 2, 1, 16, torch.float32, "cpu", seed=0, chain=chain)
        batch = current["batch"] = _verify_batch(inp, chain)
        for invariant in (False, True):
            backend = attention.TritonAttentionBackend(*_pools(inp, "cpu"), num_kv_splits=4)
            backend.init_forward_metadata(batch)
            spec = AttentionSpec(2, 1, 16, 1.0, 0, None, False, invariant)  # reads, no store
            backend.forward(inp.q.flatten(1), None, None, spec, batch)
    assert called == [
        "onepass_verify_attention", "tree_verify_attention",  # trees
        "decode_attention", "decode_attention",  # a chain of 2 requests x 1 KV head
        "onepass_verify_attention", "decode_attention",  # 5 requests: past the limit
    ]  # fmt: skip
    assert chains == [(True, 2)] * 3


@pytest.mark.cuda
@needs_gpu
@needs_triton
@pytest.mark.parametrize("chain", [False, True], ids=["trees", "chains"])
@pytest.mark.parametrize("invariant", [False, True], ids=["onepass", "width-invariant"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize(
    ("head_dim", "heads", "kv_heads", "window"),
    [(512, 8, 1, None), (256, 8, 1, 512), (64, 8, 2, 5)],
)
def test_cuda_triton_backend_matches_reference_in_speculative_modes(
    dtype, head_dim, heads, kv_heads, window, invariant, chain
):
    errors = compare(
        [7, 300, 700], 5, heads, kv_heads, head_dim, window, dtype, "cuda", seed=1,
        width_invariant=invariant, chain=chain,
    )  # fmt: skip
    limit = 2e-5 if dtype == torch.float32 else 2e-2
    too_far = {name: err for name, err in errors.items() if not err <= limit}
    assert not too_far, too_far


if __name__ == "__main__":
    print(json.dumps(interpreter_results()))
