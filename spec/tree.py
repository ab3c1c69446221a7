"""Draft trees: expanding top-k branches step by step, organising what was
drafted into ``(parent_list, top_scores_index, draft_tokens)``, and building
the verify tree (mask, positions, retrieve indices) the target scores.

Node numbering follows upstream (EAGLE / frozen-KV MTP): the draft loop's
scores are flattened per request as ``[step 0: topk] + [step i>=1: topk*topk]``;
a node's flat index identifies it. ``parent_list`` holds, per request, the
flat index of each frontier node that was expanded: ``-1`` (the root) and the
``topk`` step-0 nodes first, then ``topk`` more per later step except the last.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def expand_step(
    step: int,
    topk_p: torch.Tensor,  # (rows, topk) probabilities of each row's top-k tokens
    topk_index: torch.Tensor,  # (rows, topk) their token ids
    hidden: torch.Tensor,  # (rows, H) the rows' drafter hiddens
    scores: torch.Tensor | None,  # (B, topk) cumulative scores of the frontier (None at step 0)
    topk: int,
):
    """One tree expansion: picks the next frontier (``topk`` nodes per request).

    Returns (input_ids (B*topk,), hidden (B*topk, H), scores (B, topk),
    (step_scores, step_tokens, step_parents)) where the last three are this
    step's entries of the score / token / parent lists.
    """
    if step == 0:
        batch = topk_p.shape[0]  # rows == requests at the seed step
        parents = torch.arange(-1, topk, device=topk_p.device).expand(batch, topk + 1)
        return (
            topk_index.flatten(),
            hidden.repeat_interleave(topk, dim=0),
            topk_p,
            (topk_p.unsqueeze(1), topk_index, parents),  # (B, 1, k), (B, k), (B, k + 1)
        )
    batch = scores.shape[0]
    expand = scores.unsqueeze(2) * topk_p.view(batch, topk, topk)  # (B, k, k): parent x child
    best_p, best = expand.flatten(1).topk(topk, dim=-1)  # (B, k) over k*k candidates
    tokens = topk_index.view(batch, topk * topk)
    rows = best // topk + torch.arange(0, batch * topk, topk, device=best.device).unsqueeze(1)
    parents = best + topk * topk * (step - 1) + topk  # flat indices of the chosen nodes
    return (
        tokens.gather(1, best).flatten(),
        hidden[rows.flatten()],
        best_p,
        (expand, tokens, parents),  # (B, k, k), (B, k*k), (B, k)
    )


def organize_draft_results(
    score_list: list[torch.Tensor],
    token_list: list[torch.Tensor],
    parents_list: list[torch.Tensor],
    num_draft_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (parent_list (B, P), top_scores_index (B, n-1), draft_tokens (B, n-1)).

    The ``n - 1`` best-scored nodes of the whole draft, in flat-index order
    (so a parent always comes before its children).
    """
    scores = torch.cat([s.flatten(1) for s in score_list], dim=1)  # (B, N)
    tokens = torch.cat(token_list, dim=1)  # (B, N)
    top_scores_index = scores.topk(num_draft_tokens - 1, dim=-1).indices.sort(dim=-1).values
    draft_tokens = tokens.gather(1, top_scores_index)
    if len(parents_list) > 1:
        parent_list = torch.cat(parents_list[:-1], dim=1)
    else:
        parent_list = torch.empty(scores.shape[0], 0, dtype=torch.long, device=scores.device)
    return parent_list, top_scores_index, draft_tokens


@dataclass
class VerifyTree:
    """One request per row; node 0 is the root (the last accepted token)."""

    tokens: torch.Tensor  # (B, n) node tokens, root first
    parents: torch.Tensor  # (B, n) parent node (-1 for the root and for dropped nodes)
    depth: torch.Tensor  # (B, n) root = 0
    mask: torch.Tensor  # (B, n, n) bool: mask[b, i, j] = node j is i or an ancestor of i
    valid: torch.Tensor  # (B, n) bool: False for nodes whose ancestors were not all selected

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The fields in order (``VerifyTree(*tree.tensors())`` rebuilds it): what a graph returns."""
        return self.tokens, self.parents, self.depth, self.mask, self.valid

    def positions(self, root_positions: torch.Tensor) -> torch.Tensor:
        """(B, n) sequence positions: the root's plus the node's depth."""
        return root_positions.unsqueeze(1) + self.depth


def ancestors(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask, depth) of a forest given each node's parent ((B, n) int64, -1 at a root):
    mask[b, i, j] = node j is i or one of its ancestors (B, n, n), depth[b, i] = how many
    ancestors i has (B, n) int64.

    Pointer jumping: each pass adds the rows of the ancestors ``up`` points at and doubles
    its reach, so a depth of n - 1 takes ceil(log2(n - 1)) passes of three launches (a
    level at a time took n - 1 passes of nine). The passes are counted on the host: no
    sync, capture-safe."""
    batch, n = parents.shape
    nodes = torch.arange(n, device=parents.device)
    up = torch.where(parents >= 0, parents, nodes)  # (B, n): the parent; a root its own
    mask = (up.unsqueeze(-1) == nodes) | (nodes.unsqueeze(-1) == nodes)  # it and its parent
    reach = 1  # mask rows hold every ancestor up to this far; up, the one this far up
    while reach < n - 1:
        mask = mask | mask.gather(1, up.unsqueeze(-1).expand(batch, n, n))
        up = up.gather(1, up)
        reach *= 2
    return mask, mask.sum(-1) - 1


def every_ancestor(mask: torch.Tensor, flags: torch.Tensor) -> torch.Tensor:
    """(B, n) bool: each node's ``flags`` (B, n) hold for it and for every ancestor its row
    of ``mask`` (B, n, n, as ``ancestors``) holds: one and, one any, whatever the depth."""
    return ~(mask & ~flags.unsqueeze(1)).any(dim=-1)


def build_verify_tree(
    root_tokens: torch.Tensor,  # (B,)
    parent_list: torch.Tensor,  # (B, P)
    top_scores_index: torch.Tensor,  # (B, n-1), sorted
    draft_tokens: torch.Tensor,  # (B, n-1)
    topk: int,
) -> VerifyTree:
    batch, n_draft = top_scores_index.shape
    n = n_draft + 1
    dev = root_tokens.device
    # Flat index of each selected node's parent (-1: the root), per the numbering above:
    # parent_list[(flat - topk) // topk + 1], which is -1 for the step-0 nodes.
    if parent_list.shape[1] == 0:  # one draft step: every node hangs off the root
        parent_flat = torch.full_like(top_scores_index, -1)
    else:
        parent_pos = torch.div(top_scores_index - topk, topk, rounding_mode="floor") + 1
        parent_flat = parent_list.long().gather(1, parent_pos.clamp(0, parent_list.shape[1] - 1))
        parent_flat = torch.where(
            top_scores_index < topk, torch.full_like(parent_flat, -1), parent_flat
        )
    # Map parent flat indices to node numbers (1..n-1), or the root.
    match = parent_flat.unsqueeze(2) == top_scores_index.unsqueeze(1)  # (B, n-1, n-1)
    found = match.any(-1)
    parent_node = torch.where(found, match.float().argmax(-1) + 1, torch.zeros_like(parent_flat))
    is_root_child = parent_flat < 0
    valid_draft = is_root_child | found  # a node whose parent was not selected is dropped
    parents = torch.cat([torch.full((batch, 1), -1, device=dev, dtype=torch.long), parent_node], 1)
    valid = torch.cat([torch.ones(batch, 1, dtype=torch.bool, device=dev), valid_draft], 1)
    mask, depth = ancestors(parents)
    # An invalid node's descendants are invalid too; keep their rows to themselves.
    valid = every_ancestor(mask, valid)
    mask = torch.where(valid.unsqueeze(-1), mask, torch.eye(n, dtype=torch.bool, device=dev))
    parents = torch.where(valid, parents, torch.full_like(parents, -1))
    tokens = torch.cat([root_tokens.view(batch, 1).long(), draft_tokens.long()], 1)
    return VerifyTree(tokens=tokens, parents=parents, depth=depth, mask=mask, valid=valid)
