"""A prefill step's work: which prompt tokens it takes, and the EXTEND batch for them."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterator, Sequence

import torch

from graphrt.core.batch import ForwardBatch, ForwardMode
from graphrt.core.engine.ledger import Ledger
from graphrt.core.engine.request import Request, SamplingParams
from graphrt.core.host import to_device

Chunk = tuple[Request, int]  # a request and how many of its prompt tokens this step takes

# The prompts (token counts, one a request) of the prefills an engine hands its graph
# backend to compile ahead beside its graphs (``dry_prefills``). A device that compiles a
# kernel at its first launch compiles one for each specialisation: Triton's by each int
# argument that is 1 or a multiple of 16 (on CUDA the GEMV's rows, the extend kernel's
# requests; other kernels take rows in their grid alone), and the matmul path by rows
# (by default up to 16 the GEMV may serve, then cuBLAS). One request of 9 tokens and two
# of 9 + 8 cover a first prompt of either path alone or beside others; a prompt of 16
# tokens still compiles its own GEMV at its first prefill.
DRY_PREFILL_PROMPTS = ((9,), (9, 8))


def prefill_chunks(prefilling: Sequence[Request], budget: int) -> list[Chunk]:
    """This step's prefill: (request, tokens) in admission order, at most ``budget``
    tokens in all; a prompt longer than that prefills over several steps (its chunks
    attend to the KV of those before, through the token table)."""
    chunks = []
    for req in prefilling:
        n = min(len(req.prompt_ids) - req.kv_len, budget)
        if n == 0:
            break
        chunks.append((req, n))
        budget -= n
    return chunks


def prefill_batch(ledger: Ledger, chunks: list[Chunk], device: torch.device) -> ForwardBatch:
    """The EXTEND batch of ``chunks``, their slots placed in the token table (each
    request's ``kv_len`` moves on)."""
    reqs = [req for req, _ in chunks]
    starts = [req.kv_len for req in reqs]  # tokens already in the cache
    lens = [n for _, n in chunks]
    locs = ledger.place_prompts(reqs, lens, device)
    ends = [req.kv_len for req in reqs]  # (place_prompts moved kv_len on)
    # Logits only where a prompt ends: rows of the requests this chunk completes.
    last_rows = torch.tensor(lens).cumsum(0) - 1
    done = [end == len(req.prompt_ids) for req, end in zip(reqs, ends)]
    ids = list(itertools.chain.from_iterable(  # slices at C speed, not a loop a token
        req.prompt_ids[a:b] for req, a, b in zip(reqs, starts, ends)
    ))  # fmt: skip
    positions = torch.cat([torch.arange(a, b) for a, b in zip(starts, ends)])
    return ForwardBatch(
        mode=ForwardMode.EXTEND,
        input_ids=to_device(ids, device),
        positions=to_device(positions, device),
        req_pool_indices=to_device([r.req_slot for r in reqs], device),
        seq_lens=to_device(ends, device, torch.int32),
        out_cache_loc=locs,
        seq_lens_cpu=ends,
        extend_lens_cpu=lens,
        logits_indices=to_device(last_rows[torch.tensor(done)], device),
    )


def dry_prefills(
    ledger: Ledger,
    forward: Callable[[ForwardBatch], object],
    device: torch.device,
    max_context_len: int,
) -> Iterator[Callable[[], None]]:
    """The prefills of ``DRY_PREFILL_PROMPTS`` that the ledger has room for, each as a
    closure that runs ``forward`` on throwaway requests and gives their slots back: for a
    graph backend's ``compile_ahead``, which runs them dry (what they compute, KV
    included, is garbage in slots freed after). The caller makes the free lists fresh
    again afterwards (``Ledger.recover``): requests then get the slots they would have
    got without these."""
    for lens in DRY_PREFILL_PROMPTS:
        fits = ledger.fits(sum(lens)) and len(lens) <= ledger.req_pool.available()
        if fits and max(lens) < max_context_len:
            yield functools.partial(_dry_prefill, ledger, forward, device, lens)


def _dry_prefill(
    ledger: Ledger,
    forward: Callable[[ForwardBatch], object],
    device: torch.device,
    lens: Sequence[int],
) -> None:
    params = SamplingParams(max_new_tokens=1)
    reqs = [Request(rid=-1 - i, prompt_ids=[0] * n, params=params) for i, n in enumerate(lens)]
    admitted = []
    try:
        for req in reqs:
            req.kv_budget = len(req.prompt_ids)
            ledger.admit(req)
            admitted.append(req)
        forward(prefill_batch(ledger, list(zip(reqs, lens)), device))
    finally:
        for req in admitted:
            ledger.release(req)
