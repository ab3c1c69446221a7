"""A speculative round's tail in one launch: acceptance, the commit of the path's KV
slots, the next seed and the packed row the host reads (``ModelOps.round_tail``).

``spec.verify.round_tail`` runs the same as tensor operations: ``spec.accept.accept``
(every ancestor's check, the deepest accepted node, the path sorted by depth), then
``commit_kv``, the seed's gather and a concatenation, about 45 launches of a few
microseconds each at the end of every verify graph, none of them on the GEMV's PDL
chain. Here one program a request does all of it: its tree is at most a few dozen
nodes, so a node's ancestor check is one (n, n) tile and the path's order one
comparison of every pair.

The result equals the tensor ops' bit for bit, the packed row's tail included: the path
lists the accepted chain root first, then every other node by depth, ties by node index
(the stable order ``accept`` sorts by).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# The most tree nodes a program serves: its (n, n) tiles at 64 take 215 registers a thread
# for sm_90 and spill nothing, at 128 they spill (tests/test_round_tail.py compiles it).
# Larger trees (a wide top-k drafted deep) keep spec's tensor ops.
MAX_NODES = 64


@triton.jit
def _round_tail_kernel(
    TreeTokens,  # (B, n) int64: each node's drafted token (the root's: the last emitted)
    Parents,  # (B, n) int64: -1 for the root and dropped nodes
    Depth,  # (B, n) int64
    Valid,  # (B, n) uint8
    Mask,  # (B, n, n) uint8: node j is node i or one of its ancestors
    Target,  # (B, n) int64: the target's token after each node
    SeqLens,  # (B,) int32: KV entries after the round's nodes
    ReqSlots,  # (B,) int64
    NodeLocs,  # (B, n) int64: each node's KV slot
    Hidden,  # (B * n, H): the target's hidden at each node
    ReqToToken,  # (R + 1, context) int64, written: the path's slots
    Seeds,  # (R + 1, H), written: the deepest accepted node's hidden
    Packed,  # (B, 1 + 3n) int64, written
    n,
    hidden_size,
    max_context_len,
    table_cols,
    stride_hidden,
    stride_table,
    stride_seed,
    BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    node = tl.arange(0, BLOCK_N)
    live = node < n
    at = b * n + node
    tokens = tl.load(TreeTokens + at, mask=live, other=0)
    parents = tl.load(Parents + at, mask=live, other=-1)
    depth = tl.load(Depth + at, mask=live, other=0)
    valid = tl.load(Valid + at, mask=live, other=0) != 0
    target = tl.load(Target + at, mask=live, other=0)
    kv_len = tl.load(SeqLens + b).to(tl.int64) - n  # the root's position
    # A node drafted its parent's target token, within the context's end (accept).
    parent_target = tl.load(Target + b * n + tl.maximum(parents, 0), mask=live, other=-1)
    drafted = valid & (parents >= 0) & (tokens == parent_target)
    drafted = drafted & (depth <= (max_context_len - 1) - kv_len)
    ok = drafted | (node == 0)
    # On the path: every ancestor (a row of the mask) drafted right. HAZARD: a padding
    # request's mask is all True; the root is on the path by fiat, as in accept.
    pair = live[:, None] & live[None, :]
    rows = tl.load(Mask + b * n * n + node[:, None] * n + node[None, :], mask=pair, other=0)
    wrong_ancestor = (rows != 0) & (ok == 0)[None, :]
    on_path = ((tl.max(wrong_ancestor.to(tl.int32), axis=1) == 0) | (node == 0)) & live
    # Siblings drafted distinct tokens, so the accepted nodes form one chain: its deepest.
    # A draft rule may repeat one (spec.draft.DraftRule): then the deepest accepted node
    # of lowest index and its ancestors are the path, as accept's max(dim=1) picks.
    accept_len = tl.max(tl.where(on_path, depth, -1), axis=0)
    last = tl.min(tl.where(on_path & (depth == accept_len), node, BLOCK_N), axis=0)
    # The path: the last node's ancestors by depth, then the rest by depth, ties by index.
    chain = tl.load(Mask + b * n * n + last * n + node, mask=live, other=0) != 0
    key = tl.where(chain, depth, n + depth)
    key = tl.where(live, key, 3 * BLOCK_N)
    before = (key[None, :] < key[:, None]) | (
        (key[None, :] == key[:, None]) & (node[None, :] < node[:, None])
    )
    rank = tl.sum(before.to(tl.int32), axis=1)  # (BLOCK_N,): each node's place on the path
    out = Packed + b * (1 + 3 * n)
    tl.store(out, accept_len)
    tl.store(out + 1 + rank, node.to(tl.int64), mask=live)
    tl.store(out + 1 + n + rank, target, mask=live)
    tl.store(out + 1 + 2 * n + node, tokens, mask=live)
    # The commit: path position k's slot at the request's position kv_len + k.
    slot = tl.load(ReqSlots + b)
    locs = tl.load(NodeLocs + at, mask=live, other=0)
    column = kv_len + rank
    keep = live & (rank <= accept_len) & (column >= 0) & (column < table_cols)
    tl.store(ReqToToken + slot * stride_table + column, locs, mask=keep)
    # The next round's seed: the deepest accepted node's hidden, in the table's dtype (the
    # target's own, as the hidden's: the cast is a no-op; where not, the GPU rounds to
    # nearest as torch does, while Triton's interpreter truncates).
    source = Hidden + (b * n + last) * stride_hidden
    for start in range(0, hidden_size, BLOCK_H):
        cols = start + tl.arange(0, BLOCK_H)
        inside = cols < hidden_size
        values = tl.load(source + cols, mask=inside)
        tl.store(Seeds + slot * stride_seed + cols, values.to(Seeds.dtype.element_ty), mask=inside)


def block_nodes(n: int) -> int:
    """The kernel's BLOCK_N for a tree of ``n`` nodes."""
    return max(16, triton.next_power_of_2(n))


def round_tail(
    tokens: torch.Tensor,  # (B, n) int64
    parents: torch.Tensor,  # (B, n) int64
    depth: torch.Tensor,  # (B, n) int64
    valid: torch.Tensor,  # (B, n) bool
    mask: torch.Tensor,  # (B, n, n) bool
    target_tokens: torch.Tensor,  # (B, n) int64
    seq_lens: torch.Tensor,  # (B,) int32
    req_slots: torch.Tensor,  # (B,) int64
    node_locs: torch.Tensor,  # (B, n) int64
    hidden: torch.Tensor,  # (B * n, H)
    req_to_token: torch.Tensor,  # (R + 1, context) int64
    seeds: torch.Tensor,  # (R + 1, H)
    max_context_len: int,
) -> torch.Tensor | None:
    """``ModelOps.round_tail``; -> packed (B, 1 + 3n) int64, or None for a tree of more
    than MAX_NODES nodes (nothing launched: the caller runs the tensor ops)."""
    bs, n = tokens.shape
    if n > MAX_NODES:
        return None
    # The kernel reads each (B, n) row at b * n and the mask at (b * n + i) * n: whole
    # tensors by construction (the graph's static fields, draft_chain's), so these are
    # no-ops; a broadcast view would be copied here, never read wrong.
    tokens, parents, depth, target_tokens, node_locs, seq_lens, req_slots = (
        t.contiguous()
        for t in (tokens, parents, depth, target_tokens, node_locs, seq_lens, req_slots)
    )
    valid, mask = valid.contiguous().view(torch.uint8), mask.contiguous().view(torch.uint8)
    hidden = hidden if hidden.stride(1) == 1 else hidden.contiguous()
    assert req_to_token.dtype == torch.int64 and req_to_token.stride(1) == 1
    assert seeds.stride(1) == 1
    packed = torch.empty(bs, 1 + 3 * n, dtype=torch.int64, device=tokens.device)
    _round_tail_kernel[(bs,)](
        tokens, parents, depth, valid, mask,
        target_tokens, seq_lens, req_slots, node_locs, hidden, req_to_token, seeds, packed,
        n, hidden.shape[1], max_context_len, req_to_token.shape[1],
        hidden.stride(0), req_to_token.stride(0), seeds.stride(0),
        BLOCK_N=block_nodes(n), BLOCK_H=1024, num_warps=4,
    )  # fmt: skip
    return packed
