"""The verify forward and the round's tail: the target scores every node of every
request's tree, then, in the same graph, picks its token at every node, accepts the
longest drafted path, commits the path's KV slots into the token table, gathers the
next round's seed hiddens and packs what the host reads.

One function (``verify_round``) runs in the captured graph and eagerly, so a graph
round and an eager round are the same arithmetic. Greedy batches and batches with a
sampled request are two variants (two graphs per batch size): drawing costs a noise
value per vocabulary entry and node, which greedy rounds should not pay.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from graphrt.core.attention.base import AttentionBackend
from graphrt.core.batch import ForwardBatch, ForwardMode
from graphrt.core.engine.sampling import SamplingRows, greedy_tokens, repeat_rows, sample
from graphrt.core.models.ops import ModelOps, model_ops
from graphrt.core.runners import GraphShape, StaticField
from graphrt.core.runners.base import forward_model
from graphrt.spec.accept import Acceptance, accept, commit_kv
from graphrt.spec.tree import VerifyTree

# The per-request sampling state a sampled round's graph reads, and what padding holds.
SAMPLING_FIELDS = (
    StaticField("temperature", (), torch.float32, pad=0.0),  # padding rows are greedy
    StaticField("top_k", (), torch.int64, pad=0),
    StaticField("top_p", (), torch.float32, pad=1.0),
    StaticField("seed", (), torch.int64, pad=0),
    StaticField("offset", (), torch.int64, pad=0),
)
SAMPLING_NAMES = tuple(f.name for f in SAMPLING_FIELDS)  # a sampled round's state, by name


@dataclass
class VerifyInput:
    """``spec_info`` of a TARGET_VERIFY batch: the tree beside its tokens, and for a
    sampled round each request's sampling state (None in a greedy round)."""

    tree_mask: torch.Tensor  # (B, n, n) bool: node j is node i or one of its ancestors
    parents: torch.Tensor  # (B, n) int64, -1 for the root and dropped nodes
    depth: torch.Tensor  # (B, n) int64
    valid: torch.Tensor  # (B, n) bool
    temperature: torch.Tensor | None = None  # (B,) float32
    top_k: torch.Tensor | None = None  # (B,) int64
    top_p: torch.Tensor | None = None  # (B,) float32
    seed: torch.Tensor | None = None  # (B,) int64
    offset: torch.Tensor | None = None  # (B,) int64: the root node's draw; node i draws at +i
    # Host: every request's tree is the n-node chain (``draft_chain``'s: node i at depth i,
    # seeing nodes 0 .. i), which attention may run as n decode rows.
    chain: bool = False

    @property
    def sampled(self) -> bool:
        return self.temperature is not None


def verify_shape(num_nodes: int, sampled: bool, chain: bool = False) -> GraphShape:
    """What a round's verify graph takes: ``num_nodes`` tokens per request and the tree,
    plus the sampling state in the sampled variant; ``chain``: every tree is the chain
    (``VerifyInput.chain``). Padding requests see every padding node (all slot 0), so
    their softmax stays finite, and accept nothing."""
    n = (num_nodes,)
    tree = (
        StaticField("tree_mask", (num_nodes, num_nodes), torch.bool, pad=True),
        StaticField("parents", n, torch.int64, pad=-1),
        StaticField("depth", n, torch.int64, pad=0),
        StaticField("valid", n, torch.bool, pad=False),
    )
    return GraphShape(
        mode=ForwardMode.TARGET_VERIFY,
        width=num_nodes,
        spec_info=functools.partial(VerifyInput, chain=chain),
        fields=tree + (SAMPLING_FIELDS if sampled else ()),
        variant=("round-sampled" if sampled else "round-greedy") + ("-chain" if chain else ""),
    )


def verify_batch(
    tree: VerifyTree,
    req_pool_indices: torch.Tensor,  # (B,)
    kv_lens: torch.Tensor,  # (B,) KV entries before the round = the root's position
    kv_lens_cpu: list[int],
    out_cache_loc: torch.Tensor,  # (B * n,) fresh KV slots, node-major per request
    max_position: int,
    sampling: SamplingRows | None,  # (B,) rows at each request's root draw; None: greedy
    chain: bool = False,  # the tree is draft_chain's (VerifyInput.chain)
) -> ForwardBatch:
    n = tree.num_nodes
    # Near the end of the context, deep nodes would sit past the rope table: they are
    # clamped to the last position and never accepted (acceptance stops at the context).
    positions = tree.positions(kv_lens.long()).clamp(max=max_position)  # (B, n)
    info = VerifyInput(
        tree_mask=tree.mask, parents=tree.parents, depth=tree.depth, valid=tree.valid, chain=chain
    )
    if sampling is not None:
        for name in SAMPLING_NAMES:
            setattr(info, name, getattr(sampling, name))
    return ForwardBatch(
        mode=ForwardMode.TARGET_VERIFY,
        input_ids=tree.tokens.flatten(),
        positions=positions.flatten(),
        req_pool_indices=req_pool_indices,
        seq_lens=(kv_lens + n).to(torch.int32),
        out_cache_loc=out_cache_loc,
        seq_lens_cpu=[k + n for k in kv_lens_cpu],
        extend_lens_cpu=[n] * len(kv_lens_cpu),
        spec_info=info,
    )


@dataclass(frozen=True)
class RoundTables:
    """The device tables a round's tail writes, rows by request slot (row 0: padding)."""

    req_to_token: torch.Tensor  # (R + 1, context) the token table: the path's KV slots
    seeds: torch.Tensor  # (R + 1, H) each request's next seed hidden


# The rule that turns the target's token at every node into the accepted path: ``accept``
# (spec.accept); benchmarks pass an oracle (bench/oracles.py). Device ops only: it runs
# inside the verify graph.
AcceptRule = Callable[[VerifyTree, torch.Tensor, torch.Tensor], Acceptance]


def round_tail(
    logits: torch.Tensor,  # (B * n, V) float32, the target's at every node
    hidden: torch.Tensor,  # (B * n, H) its hidden states
    batch: ForwardBatch,  # the verify batch that produced them
    tables: RoundTables,
    max_context_len: int,
    accept_rule: AcceptRule = accept,
    ops: ModelOps | None = None,  # the target's: its greedy sampler, its fused tail
) -> torch.Tensor:
    """Acceptance, commit and the next seeds on the device; -> packed (B, 1 + 3n) int64:
    accepted drafts, path nodes, emitted tokens, drafted tokens (the host's one read)."""
    info: VerifyInput = batch.spec_info
    bs = batch.req_pool_indices.shape[0]
    n = batch.input_ids.shape[0] // bs
    tree = VerifyTree(
        tokens=batch.input_ids.view(bs, n),
        parents=info.parents,
        depth=info.depth,
        mask=info.tree_mask,
        valid=info.valid,
    )
    greedy = greedy_tokens(logits, ops)  # (B * n,): sampled rounds' greedy rows take these
    if info.sampled:
        rows = SamplingRows(
            info.temperature, info.top_k, info.top_p, info.seed, info.offset,
            greedy=False, filtered=True,
        )  # fmt: skip
        target_tokens = sample(logits, repeat_rows(rows, n), greedy).view(bs, n)
    else:
        target_tokens = greedy.view(bs, n)  # (B, n)
    slots = batch.req_pool_indices
    fused = ops.round_tail if ops is not None and accept_rule is accept else None
    if fused is not None:  # the same, one kernel (ModelOps.round_tail), where it serves
        packed = fused(
            tree.tokens, tree.parents, tree.depth, tree.valid, tree.mask, target_tokens,
            batch.seq_lens, slots, batch.out_cache_loc.view(bs, n), hidden,
            tables.req_to_token, tables.seeds, max_context_len,
        )  # fmt: skip
        if packed is not None:
            return packed
    kv_lens = batch.seq_lens.long() - n  # the root's position
    acc = accept_rule(tree, target_tokens, (max_context_len - 1) - kv_lens)
    commit_kv(tables.req_to_token, slots, kv_lens, batch.out_cache_loc.view(bs, n), acc)
    rows = torch.arange(bs, device=hidden.device)
    # Padding rows write the padding row: never read as a live request's seed.
    tables.seeds[slots] = hidden.view(bs, n, -1)[rows, acc.last_node].to(tables.seeds.dtype)
    return torch.cat([acc.accept_len.unsqueeze(1), acc.path, acc.tokens, tree.tokens], 1)


def verify_round(
    target,
    attn: AttentionBackend,
    tables: RoundTables,
    max_context_len: int,
    accept_rule: AcceptRule = accept,
) -> Callable[[ForwardBatch], tuple[torch.Tensor]]:
    """What a round's verify graph computes from its static batch: the target forward and
    the round's tail, -> (packed,); eager rounds call the same two."""

    def forward(batch: ForwardBatch) -> tuple[torch.Tensor]:
        out = forward_model(target, attn, batch)
        packed = round_tail(
            out.logits, out.hidden, batch, tables, max_context_len, accept_rule, model_ops(target)
        )
        return (packed,)

    return forward
