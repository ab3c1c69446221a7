"""A whole speculative round as one captured graph (``SpecConfig.one_graph``, the default).

The two-graph round (spec.draft's loop, then spec.verify's forward and tail) launches two
graphs and runs host work between them: the draft graph's outputs cloned, the held slots
copied, the verify batch built and loaded (on the H200 the embedded pair's round of 4 spent
473 us of host work before verify's launch, against 165 us of kernels in a plain step).
Here one graph per batch bucket and draft length runs the draft loop, builds the verify
tree's batch on the device and runs verify with the round's tail: the host loads one
batch (its rows in one pinned copy: ``round_batch``) and launches once.

Only for capture-safe attention: its metadata is a per-batch host object over the batch's
own tensors, so the draft steps inside the graph leave verify's alone, and verify's
kernels derive their schedule on the device. The static batch is the verify batch
(TARGET_VERIFY, ``n`` tokens a request): each request's root token at all ``n`` places
(the first is read), its cached length as ``seq_lens - n``, its tree's held KV slots, and
per request whether it drafts and, in the sampled variant, its sampling state. The seed
hidden comes from the seed table by request slot, inside the graph.

Not on a backend that pushes one host length list into every captured attention op
(``ExecutionBackend.one_length_list``: an NPU graph with updatable ops,
devices/npu/graph.py): here the draft's ops need the cached lengths and verify's those
plus ``n``. Rounds there keep two graphs (``MTPDecoding.setup``); per-op lengths would
lift that (not verified on hardware).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from graphrt.core.attention.base import AttentionBackend
from graphrt.core.batch import ForwardBatch, ForwardMode
from graphrt.core.engine.request import Request
from graphrt.core.engine.sampling import SamplingRows
from graphrt.core.host import to_device
from graphrt.core.models.ops import model_ops
from graphrt.core.runners import GraphShape, StaticField
from graphrt.core.runners.base import forward_model
from graphrt.spec.config import SpecConfig
from graphrt.spec.draft import DraftRule, captured_draft_step, draft_verify_tree, is_full_chain
from graphrt.spec.verify import (
    SAMPLING_FIELDS,
    SAMPLING_NAMES,
    AcceptRule,
    RoundTables,
    VerifyInput,
    round_tail,
)


@dataclass
class RoundInput:
    """``spec_info`` of a one-graph round's batch: per request, whether it drafts (an
    opted-out request accepts no draft), and a sampled round's sampling state."""

    speculate: torch.Tensor  # (B,) bool
    temperature: torch.Tensor | None = None  # (B,) float32 (see VerifyInput)
    top_k: torch.Tensor | None = None
    top_p: torch.Tensor | None = None
    seed: torch.Tensor | None = None
    offset: torch.Tensor | None = None  # (B,) int64: the root node's draw


def round_shape(num_nodes: int, num_steps: int, sampled: bool) -> GraphShape:
    """What a one-graph round takes (see the module docstring); padding rows draft
    nothing (``speculate`` pads False) and accept nothing."""
    speculate = StaticField("speculate", (), torch.bool, pad=False)
    kind = "sampled" if sampled else "greedy"
    return GraphShape(
        mode=ForwardMode.TARGET_VERIFY,
        width=num_nodes,
        spec_info=RoundInput,
        fields=(speculate,) + (SAMPLING_FIELDS if sampled else ()),
        variant=f"round-{num_steps}-{kind}",
    )


def round_batch(
    reqs: list[Request],
    num_nodes: int,
    held_host: torch.Tensor,
    sampling: SamplingRows,
    max_context_len: int,
    device: torch.device,
    last_tokens: torch.Tensor | None = None,
    cached_lens: torch.Tensor | None = None,
    in_flight: int = 0,
) -> ForwardBatch:
    """A one-graph round's batch for ``reqs``, built on the host (numpy) and sent in one
    pinned copy, so no device op comes before the launch: per node the request's root
    token (the graph reads the first), a chain's positions (placeholders: the graph derives
    them from the tree's depths) and the held KV slots ``held_host`` ((B * n,) host ids,
    request by request, as ``settle`` reads them); per request its slot, its length with
    all n nodes cached (acceptance sets the length after the round), whether it drafts;
    the sampling state of a sampled round (``sampling``).

    Behind a step not read yet (``DecodeStrategy.launch``): ``last_tokens`` (B,) are the
    roots and ``cached_lens`` (B,), where given, the cached lengths, on the device, written
    over the host's (a few device ops after the copy); the host lengths, there only as
    placeholders, are then bounds: ``in_flight`` is the most the step not read yet may
    add to a request's cache (``LaunchedStep.uncounted``)."""
    bs, n = len(reqs), num_nodes
    ahead = in_flight if cached_lens is not None else 0
    with_all_nodes = [r.kv_len + ahead + n for r in reqs]  # each length, all n nodes cached
    kv_lens = np.array(with_all_nodes, dtype=np.int64) - n
    host = np.empty(3 * bs * n + 3 * bs, dtype=np.int64)
    per_node = host[: 3 * bs * n].reshape(3, bs, n)  # tokens, positions, slots
    per_node[0] = np.array([r.output_ids[-1] for r in reqs])[:, None]
    per_node[1] = np.minimum(kv_lens[:, None] + np.arange(n), max_context_len - 1)
    per_node[2] = held_host.numpy().reshape(bs, n)
    per_request = host[3 * bs * n :].reshape(3, bs)
    per_request[0] = [r.req_slot for r in reqs]
    per_request[1] = kv_lens + n  # (the static buffer is int32: its copy casts)
    per_request[2] = [r.params.speculate for r in reqs]
    on_device = to_device(torch.from_numpy(host), device)
    nodes = on_device[: 3 * bs * n].view(3, bs, n)  # a graph loads these in one copy
    tokens, positions, slots = nodes.view(3, bs * n)
    req_slots, seq_lens, speculate = on_device[3 * bs * n :].view(3, bs)
    if last_tokens is not None:  # BAD_LOGITS (-1) becomes a valid token: dropped later
        torch.clamp(last_tokens.unsqueeze(1).expand(bs, n), min=0, out=tokens.view(bs, n))
    if cached_lens is not None:
        torch.add(cached_lens, n, out=seq_lens)
    state = {} if sampling.greedy else {name: getattr(sampling, name) for name in SAMPLING_NAMES}
    return ForwardBatch(
        mode=ForwardMode.TARGET_VERIFY,
        input_ids=tokens,
        positions=positions,
        req_pool_indices=req_slots,
        seq_lens=seq_lens,
        out_cache_loc=slots,
        seq_lens_cpu=with_all_nodes,
        extend_lens_cpu=[n] * bs,
        spec_info=RoundInput(speculate=speculate, **state),
        packed_nodes=nodes,
    )


def captured_round(
    target,
    drafter,
    attn: AttentionBackend,
    cfg: SpecConfig,
    tables: RoundTables,
    max_context_len: int,
    accept_rule: AcceptRule,
    draft_rule: DraftRule | None = None,
):
    """The function a one-graph round computes from its static batch: the draft loop
    (as spec.draft's captured loop, ``draft_rule`` applied), the verify batch of its
    tree, verify and the tail (as spec.verify's round); -> (packed,), what the host
    reads."""

    run_step = captured_draft_step(drafter, attn)

    def forward(static: ForwardBatch) -> tuple[torch.Tensor]:
        info: RoundInput = static.spec_info
        bs, n = static.req_pool_indices.shape[0], cfg.num_draft_tokens
        kv_lens = static.seq_lens - n  # (B,) int32: the root's position
        root = static.input_ids.view(bs, n)[:, 0]
        seed_hidden = tables.seeds[static.req_pool_indices]  # (B, H)
        # Padding rows have no cached token (kv_len 0): the draft reads one, slot 0's. The
        # draft steps' host lengths are placeholders: capture-safe attention reads the
        # device's, and compiled code (CPU) would specialise on host values computed here,
        # recompiling every round until its limit.
        tree = draft_verify_tree(
            run_step,
            cfg,
            root,
            seed_hidden,
            static.req_pool_indices,
            kv_lens.clamp(min=1),
            [1] * len(static.seq_lens_cpu),
            rule=draft_rule,
        )
        # The verify batch as spec.verify.verify_batch builds it, on the static batch's own
        # lengths: verify_batch would derive host lengths from the static batch's values,
        # on which compiled code (CPU) specialises.
        positions = tree.positions(kv_lens.long()).clamp(max=max_context_len - 1)  # (B, n)
        sampling = {name: getattr(info, name) for name in SAMPLING_NAMES}  # None: greedy
        verify_info = VerifyInput(
            tree_mask=tree.mask,
            parents=tree.parents,
            depth=tree.depth,
            valid=tree.valid & info.speculate.unsqueeze(1),
            chain=is_full_chain(cfg),
            **sampling,
        )
        batch = dataclasses.replace(
            static,
            input_ids=tree.tokens.flatten(),
            positions=positions.flatten(),
            spec_info=verify_info,
        )
        attn.init_metadata_for_capture(batch)
        out = forward_model(target, attn, batch)
        packed = round_tail(
            out.logits, out.hidden, batch, tables, max_context_len, accept_rule, model_ops(target)
        )  # (B, 1 + 3n): accepted drafts, path nodes, emitted tokens, drafted tokens
        return (with_next_inputs(packed, static.seq_lens, n),)

    return forward


def with_next_inputs(packed: torch.Tensor, seq_lens: torch.Tensor, n: int) -> torch.Tensor:
    """``packed`` (B, 1 + 3n) with two more columns, computed on the device: the last
    token each row emitted and its cached length after the round, the inputs of a step
    launched behind this round before its read (``NEXT_TOKEN``, ``NEXT_LEN``). In the
    graph they cost no host work: as tensor ops beside the launch they were six device
    ops' dispatch a round (stop 70's host profile: 0.12 ms of a round's 0.78 under cProfile).
    ``seq_lens`` (B,): each row's length with all n nodes."""
    accepted = packed[:, :1]  # (B, 1)
    # Emitted tokens start at column 1 + n. HAZARD: compiling ahead runs this graph's
    # forward on unset inputs, whose accepted counts are anything: an index out of the
    # row is a device assert (stop 71), so it is clamped to the emitted columns.
    last = packed.gather(1, (accepted + 1 + n).clamp(1 + n, 1 + 2 * n))
    after = seq_lens.unsqueeze(1).long() - n + accepted + 1
    return torch.cat([packed, last, after], 1)  # (B, 3 + 3n)


# ``with_next_inputs``' columns, counted from the end of a round's packed row.
NEXT_TOKEN, NEXT_LEN = -2, -1
