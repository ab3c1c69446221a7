"""A prefill step's work: which prompt tokens it takes, and the EXTEND batch for them."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from graphrt.core.batch import ForwardBatch, ForwardMode
from graphrt.core.engine.ledger import Ledger
from graphrt.core.engine.request import Request
from graphrt.core.host import to_device

Chunk = tuple[Request, int]  # a request and how many of its prompt tokens this step takes


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
