"""Accepting drafted tokens, as tensor operations over the fixed-size verify tree.

``target_tokens[b, i]`` is the token the target emits after node i: its argmax
(greedy), or a draw from its distribution there (sampling). A node is on the
accepted path when its parent is and it drafted exactly the parent's target
token; the request emits the target's token at every path node: the accepted
drafts, then the bonus token of the deepest one.

Greedy, this is target-only greedy decoding. Sampling is rejection sampling
against the drafter's deterministic candidates (point masses): the draw at a
node is accepted as the child that drafted it, else it is the resampled bonus
token. Drawing at every node up front changes nothing: the walk reads only the
draws at nodes it reaches, each an independent draw from the target's
distribution given the tokens before it, so every emitted token follows the
target's own distribution exactly.

No host reads: the shapes are the tree's, and no op depends on its depth.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphrt.spec.tree import VerifyTree, every_ancestor


@dataclass
class Acceptance:
    """One round, every tensor (B, ...) on the device."""

    accept_len: torch.Tensor  # (B,) accepted drafts (root excluded)
    path: torch.Tensor  # (B, n) path nodes by depth, root first; valid up to accept_len
    tokens: torch.Tensor  # (B, n) emitted tokens: target token at each path node
    last_node: torch.Tensor  # (B,) deepest accepted node: its hidden seeds the next round


def accept(
    tree: VerifyTree,
    target_tokens: torch.Tensor,  # (B, n) int64
    max_accept: torch.Tensor,  # (B,) int64: most drafts a request may still cache
) -> Acceptance:
    bs, n = target_tokens.shape
    parent = tree.parents.clamp(min=0)
    drafted_target = tree.valid & (tree.parents >= 0)
    drafted_target &= tree.tokens == target_tokens.gather(1, parent)  # (B, n)
    drafted_target &= tree.depth <= max_accept.unsqueeze(1)  # the context's end
    # A node is on the accepted path when it and each of its ancestors below the root
    # drafted its parent's target token (walking the path a level at a time took three
    # launches a level). Node 0 is the root; a dropped node's row holds itself alone.
    # HAZARD: a padding request's mask is all True (verify_shape): its root row would
    # hold every node, so the root is on the path by fiat, as it always is.
    root = torch.arange(n, device=target_tokens.device) == 0  # (n,)
    on_path = every_ancestor(tree.mask, drafted_target | root) | root  # (B, n)
    # Children of one node drafted distinct tokens, so the accepted nodes form one chain
    # (a draft rule may repeat one: then the deepest of them, and its ancestors, are the path).
    accept_len, last_node = torch.where(on_path, tree.depth, -1).max(dim=1)  # (B,), (B,)
    ancestors = tree.mask.gather(1, last_node.view(bs, 1, 1).expand(bs, 1, n)).squeeze(1)
    by_depth = torch.where(ancestors, tree.depth, n + tree.depth)  # path nodes first
    # (B, n): root, then deeper and deeper path nodes; the rest by depth, ties by index
    # (stable: CUDA's ModelOps.round_tail orders the packed row's tail the same way).
    path = by_depth.argsort(dim=1, stable=True)
    return Acceptance(
        accept_len=accept_len,
        path=path,
        tokens=target_tokens.gather(1, path),
        last_node=last_node,
    )


def commit_kv(
    req_to_token: torch.Tensor,  # (R + 1, context) written
    req_slots: torch.Tensor,  # (B,)
    kv_lens: torch.Tensor,  # (B,) KV entries before the round = the root's position
    node_locs: torch.Tensor,  # (B, n) KV slot of each tree node
    acc: Acceptance,
) -> None:
    """Write the path nodes' KV slots into each request's token table at their positions.

    Entries past a request's path go to the padding row's column 0 with value 0
    (the padding slot): a no-op, so the writes keep one fixed shape.
    """
    n = node_locs.shape[1]
    depth = torch.arange(n, device=node_locs.device)
    keep = depth.unsqueeze(0) <= acc.accept_len.unsqueeze(1)  # (B, n)
    rows = torch.where(keep, req_slots.unsqueeze(1), 0)
    cols = torch.where(keep, kv_lens.long().unsqueeze(1) + depth, 0)
    req_to_token[rows, cols] = torch.where(keep, node_locs.gather(1, acc.path), 0)
