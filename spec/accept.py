"""Accepting drafted tokens: lossless for greedy and for sampled decoding.

Greedy: walk the verify tree from the root; at each node the target's argmax
token is emitted; if a (valid) child drafted that token, the walk moves on to
it, else the argmax is the bonus token and the round ends. The emitted tokens
are exactly what target-only greedy decoding emits.

Sampling (temperature > 0): the drafter proposes deterministic candidates
(its top-k), i.e. a draft distribution that is a point mass per candidate.
Rejection sampling against point masses reduces to: draw y from the target's
distribution at the node; if y is a valid child's token, accept that child
and continue; otherwise y is the (resampled) bonus token. Every emitted token
is therefore a draw from the target's own distribution given the tokens
before it: the output distribution is exactly the target's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from graphrt.spec.tree import VerifyTree


@dataclass
class Acceptance:
    """One request's round: the accepted draft nodes (in path order) and the bonus token."""

    nodes: list[int]  # node numbers of accepted drafts (root excluded)
    tokens: list[int]  # their tokens, then the bonus token: what the request emits
    last_node: int  # the node whose target output produced the bonus (next seed's hidden)


def _walk(
    tree_row: tuple[list[int], list[int], list[bool]], choose: Callable[[int], int]
) -> Acceptance:
    tokens, parents, valid = tree_row
    children: dict[int, dict[int, int]] = {}
    for node in range(1, len(tokens)):
        if valid[node] and parents[node] >= 0:
            children.setdefault(parents[node], {})[tokens[node]] = node
    cur, nodes, out = 0, [], []
    while True:
        token = choose(cur)  # the target's token at this node
        out.append(token)
        nxt = children.get(cur, {}).get(token)
        if nxt is None:
            return Acceptance(nodes=nodes, tokens=out, last_node=cur)
        nodes.append(nxt)
        cur = nxt


def _rows(tree: VerifyTree) -> list[tuple[list[int], list[int], list[bool]]]:
    tokens, parents, valid = tree.tokens.tolist(), tree.parents.tolist(), tree.valid.tolist()
    return list(zip(tokens, parents, valid))


def accept_greedy(tree: VerifyTree, target_logits: torch.Tensor) -> list[Acceptance]:
    """target_logits: (B, n, V), the target's logits at every tree node."""
    argmax = target_logits.argmax(-1).tolist()  # one host sync for the whole batch
    return [_walk(row, lambda node, a=a: a[node]) for row, a in zip(_rows(tree), argmax)]


def accept_sampled(
    tree: VerifyTree,
    target_probs: Sequence[Callable[[int], torch.Tensor]],
    generators: Sequence[torch.Generator | None],
) -> list[Acceptance]:
    """``target_probs[b](node)`` -> the target's (filtered) distribution at that node."""

    def draw(b: int, node: int) -> int:
        return int(torch.multinomial(target_probs[b](node), 1, generator=generators[b])[0])

    return [_walk(row, lambda node, b=b: draw(b, node)) for b, row in enumerate(_rows(tree))]
