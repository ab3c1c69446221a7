"""Engine state: the batched sampler, the ledger's slot bookkeeping, and an engine that holds no
reference cycle.

The sampler draws every row of a batch at once, each request on a counter-based stream
(seed, draw number): its draws must follow the filtered distribution of each row,
whatever the other rows ask for, and must depend on the stream alone.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from helpers import CPU, chi2_quantile, chi2_stat, cpu_engine, random_prompts, standin_device

from graphrt.core.engine import SamplingParams
from graphrt.core.engine.sampling import (
    exponential_noise,
    filtered_probs,
    repeat_rows,
    sample,
    sampling_rows,
)
from graphrt.core.memory import KVLayerSpec, TokenKVPool
from graphrt.core.models import load_model

VOCAB = 12
LOGITS = torch.tensor([2.0, 1.5, 1.2, 1.0, 0.7, 0.5, 0.2, 0.0, -0.5, -1.0, -2.0, -3.0])
# One batch, every kind of row: greedy, plain temperature, top-k, top-p, both.
MIXED = [
    SamplingParams(),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=3),
    SamplingParams(temperature=1.3, top_p=0.6),
    SamplingParams(temperature=1.0, top_k=5, top_p=0.8),
]


def test_every_row_of_a_mixed_batch_follows_its_own_distribution():
    """Many draws of each kind of row at once (one sample call per draw number, all rows
    side by side): each row's token counts fit that row's filtered distribution
    (chi-square, p = 0.001), and greedy rows always take the argmax."""
    draws, kinds = 4000, len(MIXED)
    params = MIXED * draws
    rows = sampling_rows(params, [i // kinds for i in range(len(params))], [7] * len(params), CPU)
    tokens = sample(LOGITS.expand(len(params), VOCAB), rows).view(draws, kinds)
    expected = filtered_probs(
        LOGITS.expand(kinds, VOCAB), sampling_rows(MIXED, [0] * kinds, [0] * kinds, CPU)
    )
    assert torch.equal(tokens[:, 0], torch.zeros(draws, dtype=torch.long))  # the argmax
    for kind in range(1, kinds):
        counts = torch.bincount(tokens[:, kind], minlength=VOCAB)
        assert not counts[expected[kind] == 0].any(), (kind, counts)  # filtered tokens never
        stat, cells = chi2_stat(counts, expected[kind])
        assert stat < chi2_quantile(cells - 1), (MIXED[kind], stat, counts)


def test_a_rows_draw_depends_on_its_stream_alone():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=1.0)] * 3
    alone = sample(logits[1:2], sampling_rows(params[:1], [11], [4], CPU))
    # The same stream in another batch, at another row.
    together = sample(logits, sampling_rows(params, [5, 11, 2**63 + 9], [0, 4, 4], CPU))
    assert together[1] == alone[0]
    # Each draw number is a fresh draw: over many, they differ.
    offsets = sampling_rows(params[:1] * 64, [11] * 64, list(range(64)), CPU)
    assert len(set(sample(logits[1:2].expand(64, 50), offsets).tolist())) > 10


def test_noise_is_exponential_and_a_function_of_seed_offset_and_token():
    seeds = torch.tensor([0, 1, -5, 2**40 + 3])
    offsets = torch.tensor([0, 0, 7, 2**33])
    noise = exponential_noise(seeds, offsets, 50_000)
    assert torch.equal(noise, exponential_noise(seeds, offsets, 50_000))
    assert torch.equal(noise[2, :100], exponential_noise(seeds[2:3], offsets[2:3], 100)[0])
    assert noise.min() > 0 and torch.isfinite(noise).all()
    # Exp(1): mean 1, P(E > 1) = e^-1; rows (different streams) are uncorrelated.
    assert abs(noise.mean().item() - 1.0) < 0.01
    assert abs((noise > 1).float().mean().item() - 0.3679) < 0.005
    assert abs(torch.corrcoef(noise)[0, 1:].abs().max().item()) < 0.02
    next_draw = exponential_noise(seeds[:1], offsets[:1] + 1, 50_000)
    assert abs(torch.corrcoef(torch.stack([noise[0], next_draw[0]]))[0, 1].item()) < 0.02


def test_tree_rows_draw_at_consecutive_offsets():
    rows = sampling_rows([SamplingParams(temperature=1.0)] * 2, [3, 4], [10, 20], CPU)
    nodes = repeat_rows(rows, 3)
    assert nodes.seed.tolist() == [3, 3, 3, 4, 4, 4]
    assert nodes.offset.tolist() == [10, 11, 12, 20, 21, 22]


def test_greedy_rows_and_extreme_temperatures_never_give_nan():
    logits = torch.tensor([[1e4, -1e4, 0.0], [0.0, 0.0, 0.0]])
    params = [SamplingParams(), SamplingParams(temperature=1e-5, top_p=0.5)]
    tokens = sample(logits, sampling_rows(params, [1, 2], [0, 0], CPU))
    assert tokens[0] == 0 and 0 <= tokens[1] < 3


# ---- the ledger's free list ------------------------------------------------------------


def test_token_slots_come_back_exactly_once_whatever_the_order():
    pool = TokenKVPool(50, [KVLayerSpec(1, 4, 0)], torch.float32, CPU)
    gen = torch.Generator().manual_seed(0)
    held = []
    for _ in range(200):
        if held and torch.rand(1, generator=gen) < 0.45:
            pool.free(held.pop(int(torch.randint(len(held), (1,), generator=gen))))
        else:
            n = int(torch.randint(1, 8, (1,), generator=gen))
            if n <= pool.available():
                held.append(pool.alloc_host(n))
        live = torch.cat(held).tolist() if held else []
        assert len(live) == len(set(live)) and 0 not in live  # no slot handed out twice
        assert pool.available() + len(live) == 50
    with pytest.raises(AssertionError, match="freed twice"):
        pool.free(torch.arange(1, 51))


# ---- no reference cycles ---------------------------------------------------------------


@pytest.mark.graphs
@pytest.mark.parametrize("strategy", ["plain", "speculative"])
def test_a_dropped_engine_and_its_graphs_are_freed_without_the_cycle_collector(
    strategy, gemma4_tiny, gemma4_assistant
):
    """The capture path no longer holds the collector off, so nothing an engine owns may
    wait for it: a collection in the middle of a capture would destroy a dropped engine's
    graphs while another graph captures."""
    from graphrt.spec import MTPDecoding, SpecConfig

    target = load_model(str(gemma4_tiny.path), CPU, torch.float32)
    spec = None
    if strategy == "speculative":
        drafter = load_model(str(gemma4_assistant.path), CPU, torch.float32)
        spec = MTPDecoding(drafter, SpecConfig(num_steps=2))
    gc.collect()
    gc.disable()
    try:
        engine = cpu_engine(
            target, spec, standin_device(), runner="graph", max_context_len=64, graph_buckets=(1, 2)
        )
        engine.generate(random_prompts((5, 7), vocab=target.model.vocab_size), SamplingParams())
        assert engine.stats.graph_steps > 0
        backend = weakref.ref(engine.graph_backend)
        owned = (engine.graph_runner,)
        if spec is not None:  # every runner it built, captured or not
            owned += (spec.plain_graph, *spec.longest.runners())
        runners = [weakref.ref(r) for r in owned if r is not None]
        # Plain steps', and the greedy and sampled rounds' (one graph a round).
        assert len(runners) == (1 if spec is None else 3)
        dropped = weakref.ref(engine)
        del engine, spec, owned
        assert dropped() is None and backend() is None
        assert all(r() is None for r in runners)
    finally:
        gc.enable()
