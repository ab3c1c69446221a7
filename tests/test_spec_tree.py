"""spec.tree and spec.accept: draft-tree bookkeeping and lossless acceptance, on their own."""

from __future__ import annotations

import pytest
import torch

from graphrt.core.errors import GraphrtError
from graphrt.spec.accept import accept_greedy, accept_sampled
from graphrt.spec.config import SpecConfig
from graphrt.spec.tree import build_verify_tree, expand_step, organize_draft_results

VOCAB = 50


def run_loop(step_probs, batch: int, steps: int, topk: int, hidden_dim: int = 3):
    """Drive expand_step with given per-step probability tables; returns its lists and,
    for a brute-force check, every node as (flat index, token, parent flat index, score)."""
    rows_hidden = torch.arange(batch, dtype=torch.float32).unsqueeze(1).repeat(1, hidden_dim)
    scores = None
    score_list, token_list, parents_list = [], [], []
    for step in range(steps):
        probs = step_probs(step, rows_hidden)  # (rows, V)
        topk_p, topk_index = probs.topk(topk, dim=-1)
        # The drafter's next hidden: encode each row's chosen token so rows stay traceable.
        out_hidden = rows_hidden * 0 + topk_index[:, :1].float()
        _, rows_hidden, scores, (s, t, p) = expand_step(
            step, topk_p, topk_index, out_hidden, scores, topk
        )
        score_list.append(s)
        token_list.append(t)
        parents_list.append(p)
    return score_list, token_list, parents_list


def brute_force_nodes(step_probs_rows, batch, steps, topk):
    """Reference expansion written the slow, obvious way: per request, a list of nodes."""
    all_nodes = []
    for b in range(batch):
        nodes = []  # (flat, token, parent_flat, score)
        frontier = [(-1, 1.0)]  # (flat index, score); the root
        flat = 0
        for step in range(steps):
            children = []
            for f_i, (f_flat, f_score) in enumerate(frontier):
                probs = step_probs_rows(step, b, f_i)
                p, tok = probs.topk(topk)
                for pk, tk in zip(p.tolist(), tok.tolist()):
                    children.append((flat, tk, f_flat, f_score * pk))
                    flat += 1
            nodes += children
            best = sorted(children, key=lambda c: -c[3])[:topk]
            frontier = [(c[0], c[3]) for c in best]
        all_nodes.append(nodes)
    return all_nodes


@pytest.mark.parametrize(
    ("steps", "topk", "n"), [(1, 1, 2), (4, 1, 5), (3, 2, 6), (3, 3, 9), (2, 4, 12)]
)
def test_tree_matches_brute_force(steps, topk, n):
    batch = 2
    gen = torch.Generator().manual_seed(steps * 10 + topk)
    # A distinct random distribution for every (step, request, frontier row): no score ties.
    tables = torch.rand(steps, batch, topk, VOCAB, generator=gen).softmax(-1)

    def step_probs(step, rows_hidden):
        reps = 1 if step == 0 else topk
        return tables[step][:, :reps].reshape(batch * reps, VOCAB)

    score_list, token_list, parents_list = run_loop(step_probs, batch, steps, topk)
    parent_list, top_index, drafts = organize_draft_results(score_list, token_list, parents_list, n)
    root = torch.tensor([7, 8])
    tree = build_verify_tree(root, parent_list, top_index, drafts, topk)

    ref = brute_force_nodes(lambda s, b, f: tables[s, b, f if s else 0], batch, steps, topk)
    for b in range(batch):
        nodes = {flat: (tok, parent, score) for flat, tok, parent, score in ref[b]}
        chosen = sorted(sorted(nodes, key=lambda f: -nodes[f][2])[: n - 1])
        assert top_index[b].tolist() == chosen
        assert tree.tokens[b].tolist() == [int(root[b])] + [nodes[f][0] for f in chosen]
        node_of = {f: i + 1 for i, f in enumerate(chosen)}
        for i, f in enumerate(chosen, start=1):
            parent_flat = nodes[f][1]
            expect_parent = 0 if parent_flat == -1 else node_of.get(parent_flat, -1)
            if tree.valid[b, i]:
                assert tree.parents[b, i] == expect_parent
                # The mask row holds exactly the node and its ancestors; depth is their count - 1.
                anc, cur = {i}, expect_parent
                while cur != -1:
                    anc.add(cur)
                    cur = int(tree.parents[b, cur]) if cur else -1
                assert set(tree.mask[b, i].nonzero().flatten().tolist()) == anc
                assert tree.depth[b, i] == len(anc) - 1
            else:
                assert expect_parent == -1  # only nodes whose parent was not chosen are dropped
        assert tree.mask[b, 0].tolist() == [True] + [False] * (n - 1)


def test_chain_is_a_chain():
    steps, n = 4, 5
    tables = torch.rand(steps, 1, 1, VOCAB, generator=torch.Generator().manual_seed(0)).softmax(-1)
    lists = run_loop(lambda s, h: tables[s, :, 0], 1, steps, 1)
    tree = build_verify_tree(torch.tensor([3]), *organize_draft_results(*lists, n), 1)
    assert tree.parents[0].tolist() == [-1, 0, 1, 2, 3]
    assert tree.depth[0].tolist() == [0, 1, 2, 3, 4]
    assert torch.equal(tree.mask[0], torch.ones(n, n, dtype=torch.bool).tril())
    assert tree.tokens[0, 1:].tolist() == [int(tables[s, 0, 0].argmax()) for s in range(steps)]


def chain_tree(tokens):
    n = len(tokens)
    return build_verify_tree(
        torch.tensor([tokens[0]]),
        torch.tensor([[-1, 0] + list(range(1, n - 2))]),
        torch.arange(n - 1).unsqueeze(0),
        torch.tensor([tokens[1:]]),
        1,
    )


def test_greedy_accepts_the_longest_matching_path():
    tree = chain_tree([5, 11, 12, 13, 14])
    logits = torch.full((1, 5, VOCAB), -1.0)
    # Target argmax per node: root->11 (match), 11->12 (match), 12->40 (mismatch).
    for node, tok in enumerate([11, 12, 40, 14, 15]):
        logits[0, node, tok] = 1.0
    (acc,) = accept_greedy(tree, logits)
    assert acc.nodes == [1, 2]
    assert acc.tokens == [11, 12, 40]  # accepted drafts, then the target's bonus token
    assert acc.last_node == 2
    # All drafts match: every draft plus the bonus from the last node.
    for node, tok in enumerate([11, 12, 13, 14, 33]):
        logits[0, node] = -1.0
        logits[0, node, tok] = 1.0
    (acc,) = accept_greedy(tree, logits)
    assert acc.tokens == [11, 12, 13, 14, 33] and acc.last_node == 4


def test_sampled_acceptance_emits_the_target_distribution():
    # Target distribution at the root; the draft chain proposes token 1 (likely) then 2.
    p_root = torch.tensor([0.1, 0.6, 0.3, 0.0])
    p_child = torch.tensor([0.25, 0.25, 0.25, 0.25])
    tree = build_verify_tree(
        torch.tensor([3]),
        torch.tensor([[-1, 0]]),
        torch.tensor([[0, 1]]),
        torch.tensor([[1, 2]]),
        1,
    )
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(4, 4)
    trials = 20000
    for _ in range(trials):
        (acc,) = accept_sampled(tree, [lambda node: p_root if node == 0 else p_child], [gen])
        first = acc.tokens[0]
        second = acc.tokens[1] if len(acc.tokens) > 1 else None
        if second is not None:
            counts[first, second] += 1
    # First token: exactly p_root; given first == 1 (accepted), the second is drawn from p_child.
    firsts = torch.zeros(4)
    gen = torch.Generator().manual_seed(1)
    for _ in range(trials):
        (acc,) = accept_sampled(tree, [lambda node: p_root if node == 0 else p_child], [gen])
        firsts[acc.tokens[0]] += 1
    freq = firsts / trials
    assert torch.allclose(freq, p_root, atol=0.015), freq
    second = counts[1] / counts[1].sum()
    assert torch.allclose(second, p_child, atol=0.02), second
    assert counts[0].sum() == 0 and counts[2].sum() == 0  # rejected at the root: nothing more


def test_spec_config_defaults_and_errors():
    assert SpecConfig(num_steps=4, topk=1).num_draft_tokens == 5
    assert SpecConfig(num_steps=5, topk=3).max_draft_tokens == 1 + 3 + 4 * 9
    with pytest.raises(GraphrtError, match="spec-draft-tokens"):
        SpecConfig(num_steps=2, topk=1, num_draft_tokens=4)
    with pytest.raises(GraphrtError, match="spec-steps"):
        SpecConfig(num_steps=0)
