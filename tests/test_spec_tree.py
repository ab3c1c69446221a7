"""spec.tree and spec.accept: draft-tree bookkeeping and lossless acceptance, on their own."""

from __future__ import annotations

import pytest
import torch
from helpers import CPU, chi2_quantile, chi2_stat

from graphrt.core.engine import SamplingParams
from graphrt.core.engine.sampling import repeat_rows, sample, sampling_rows
from graphrt.core.errors import GraphrtError, UsageError
from graphrt.spec.accept import accept
from graphrt.spec.config import SpecConfig
from graphrt.spec.tree import ancestors, build_verify_tree, expand_step, organize_draft_results

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


@pytest.mark.parametrize("n", [1, 2, 3, 5, 6, 9, 16, 17])
def test_ancestors_equal_walking_up_each_node(n):
    """Random forests (a node's parent any earlier node, or none: a root), the deepest a
    chain of n: mask rows hold exactly the node and its ancestors, depth their count."""
    gen = torch.Generator().manual_seed(n)
    batch = 6
    parents = torch.full((batch, n), -1, dtype=torch.long)
    for b in range(batch):
        for i in range(1, n):
            if b == 0:  # a chain, as deep as n nodes go
                parents[b, i] = i - 1
            elif torch.rand((), generator=gen) < 0.9:
                parents[b, i] = int(torch.randint(i, (), generator=gen))
    mask, depth = ancestors(parents)
    assert mask.dtype == torch.bool and depth.dtype == torch.long
    for b in range(batch):
        for i in range(n):
            chain, node = {i}, int(parents[b, i])
            while node >= 0:
                chain.add(node)
                node = int(parents[b, node])
            assert set(mask[b, i].nonzero().flatten().tolist()) == chain, (b, i)
            assert int(depth[b, i]) == len(chain) - 1


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


def greedy(tree, logits, max_accept=None):
    """Device acceptance of the target's argmax tokens; -> (accepted, path, tokens, last)."""
    bs, n = tree.tokens.shape
    cap = torch.full((bs,), n) if max_accept is None else torch.tensor(max_accept)
    acc = accept(tree, logits.argmax(-1), cap)
    rows = []
    for b in range(bs):
        k = int(acc.accept_len[b])
        rows.append(
            (
                k,
                acc.path[b, : k + 1].tolist(),
                acc.tokens[b, : k + 1].tolist(),
                int(acc.last_node[b]),
            )
        )
    return rows


def test_greedy_accepts_the_longest_matching_path():
    tree = chain_tree([5, 11, 12, 13, 14])
    logits = torch.full((1, 5, VOCAB), -1.0)
    # Target argmax per node: root->11 (match), 11->12 (match), 12->40 (mismatch).
    for node, tok in enumerate([11, 12, 40, 14, 15]):
        logits[0, node, tok] = 1.0
    # Accepted drafts 1, 2; emitted: the accepted drafts, then the target's bonus token.
    assert greedy(tree, logits) == [(2, [0, 1, 2], [11, 12, 40], 2)]
    # The context's end caps the path: one draft at most, its bonus is the target's 12.
    assert greedy(tree, logits, max_accept=[1]) == [(1, [0, 1], [11, 12], 1)]
    assert greedy(tree, logits, max_accept=[0]) == [(0, [0], [11], 0)]
    # All drafts match: every draft plus the bonus from the last node.
    for node, tok in enumerate([11, 12, 13, 14, 33]):
        logits[0, node] = -1.0
        logits[0, node, tok] = 1.0
    assert greedy(tree, logits) == [(4, [0, 1, 2, 3, 4], [11, 12, 13, 14, 33], 4)]


def test_greedy_follows_a_side_branch_per_request():
    # Root 7 with children 20 (node 1) and 21 (node 2); node 3 (token 30) hangs off node 2.
    tree = build_verify_tree(
        torch.tensor([7, 7]),
        torch.tensor([[-1, 0, 1], [-1, 0, 1]]),  # parents of the flat-indexed nodes
        torch.tensor([[0, 1, 4], [0, 1, 4]]),  # topk 2: step-0 flat 0, 1; flat 4 under flat 1
        torch.tensor([[20, 21, 30], [20, 21, 30]]),
        2,
    )
    assert tree.parents.tolist() == [[-1, 0, 0, 2]] * 2
    logits = torch.full((2, 4, VOCAB), -1.0)
    # Request 0: the target picks 21 at the root (the side branch), then 30, then 9.
    for node, tok in enumerate([21, 1, 30, 9]):
        logits[0, node, tok] = 1.0
    # Request 1: the target picks 20 at the root, then 4 (nothing drafted under node 1).
    for node, tok in enumerate([20, 4, 2, 3]):
        logits[1, node, tok] = 1.0
    assert greedy(tree, logits) == [(2, [0, 2, 3], [21, 30, 9], 3), (1, [0, 1], [20, 4], 1)]


def walk_accept(tree, target_tokens, max_accept, b):
    """One request's acceptance the slow, obvious way: from the root, step to the valid
    child that drafted the current node's target token while the cap allows; -> (accepted,
    path, emitted tokens, last node)."""
    node, path = 0, [0]
    while True:
        wanted = int(target_tokens[b, node])
        children = [
            c for c in range(tree.tokens.shape[1])
            if tree.valid[b, c] and int(tree.parents[b, c]) == node and c != 0
        ]  # fmt: skip
        nxt = [c for c in children if int(tree.tokens[b, c]) == wanted]
        if not nxt or int(tree.depth[b, nxt[0]]) > int(max_accept[b]):
            break
        node = nxt[0]
        path.append(node)
    return len(path) - 1, path, [int(target_tokens[b, i]) for i in path], node


@pytest.mark.parametrize(
    ("steps", "topk", "n"), [(1, 1, 2), (4, 1, 5), (5, 1, 6), (3, 2, 6), (3, 3, 9), (2, 4, 12)]
)
def test_accept_equals_walking_the_tree(steps, topk, n):
    """``accept`` on random trees (dropped nodes included) and random target tokens, most
    of them a child's draft so that paths run deep, against walking each request's tree."""
    batch, trials = 4, 40
    gen = torch.Generator().manual_seed(100 + steps * 10 + topk)
    tables = torch.rand(steps, batch, topk, VOCAB, generator=gen).softmax(-1)

    def step_probs(step, rows_hidden):
        reps = 1 if step == 0 else topk
        return tables[step][:, :reps].reshape(batch * reps, VOCAB)

    lists = run_loop(step_probs, batch, steps, topk)
    tree = build_verify_tree(torch.tensor([7, 8, 9, 10]), *organize_draft_results(*lists, n), topk)
    # The last request is a graph's padding (verify_shape's pads): every mask entry True,
    # no parent, no valid node. It accepts nothing, its root alone on the path.
    tree.mask[-1], tree.parents[-1], tree.depth[-1], tree.valid[-1] = True, -1, 0, False
    depths = set()
    for _ in range(trials):
        target = torch.randint(VOCAB, (batch, n), generator=gen)
        for b in range(batch):  # a child's token at each node, 3 times in 4
            for i in range(n):
                kids = [c for c in range(1, n) if tree.valid[b, c] and tree.parents[b, c] == i]
                if kids and torch.rand((), generator=gen) < 0.75:
                    pick = int(torch.randint(len(kids), (), generator=gen))
                    target[b, i] = tree.tokens[b, kids[pick]]
        cap = torch.randint(n, (batch,), generator=gen)  # the context's end, now and then
        cap = torch.where(torch.rand(batch, generator=gen) < 0.7, n, cap)
        acc = accept(tree, target, cap)
        for b in range(batch):
            k, path, tokens, last = walk_accept(tree, target, cap, b)
            got = acc.path[b, : k + 1].tolist(), acc.tokens[b, : k + 1].tolist()
            assert (int(acc.accept_len[b]), *got, int(acc.last_node[b])) == (k, path, tokens, last)
            depths.add(k)
    assert max(depths) == int(tree.depth[tree.valid].max())  # some reached the deepest node


# Far from uniform, so that a biased draw shows (a near-uniform target hides one).
P_ROOT = torch.tensor([0.05, 0.55, 0.25, 0.1, 0.03, 0.02, 0.0, 0.0])
P_CHILD = torch.tensor([0.04, 0.06, 0.6, 0.2, 0.1, 0.0, 0.0, 0.0])


def sampled_rounds(trials: int, temperature_below_root: float = 1.0, seed: int = 0):
    """``trials`` requests of one tree: root 3, then drafted 1 (node 1), then 2 (node 2). The
    target's distributions: P_ROOT at the root, P_CHILD below it. Draws go through the
    engine's sampler, each request on its own stream; ``temperature_below_root`` < 1 sharpens the draws at the nodes only
    an accepted draft reaches (0.5: p^2), the bias the test must catch. -> emitted (B, n)
    and accepted lengths."""
    n = 3
    tree = build_verify_tree(
        torch.tensor([3] * trials),
        torch.tensor([[-1, 0]] * trials),
        torch.tensor([[0, 1]] * trials),
        torch.tensor([[1, 2]] * trials),
        1,
    )
    logits = torch.stack([P_ROOT, P_CHILD, P_CHILD]).log().expand(trials, n, 8)
    seeds = [seed * trials + i for i in range(trials)]
    tokens = torch.empty(trials, n, dtype=torch.long)
    root = sampling_rows([SamplingParams(temperature=1.0)] * trials, seeds, [0] * trials, CPU)
    tokens[:, 0] = sample(logits[:, 0], root)
    below = SamplingParams(temperature=temperature_below_root)
    nodes = repeat_rows(sampling_rows([below] * trials, seeds, [1] * trials, CPU), n - 1)
    tokens[:, 1:] = sample(logits[:, 1:].reshape(-1, 8), nodes).view(trials, n - 1)
    acc = accept(tree, tokens, torch.full((trials,), n))
    return acc.tokens, acc.accept_len


def sampled_acceptance_stats(**kwargs) -> list[tuple[float, int]]:
    """Chi-square of (a) the first emitted token against P_ROOT, (b) the draw at the
    accepted node 1 (the second token, where the first accepted the draft) against P_CHILD."""
    tokens, accepted = sampled_rounds(40000, **kwargs)
    firsts = torch.bincount(tokens[:, 0], minlength=8).double()
    at_child = tokens[accepted >= 1, 1]  # draws at node 1, reached by accepting token 1
    assert bool((tokens[accepted >= 1, 0] == 1).all()) and bool(
        (tokens[accepted == 0, 0] != 1).all()
    )
    seconds = torch.bincount(at_child, minlength=8).double()
    return [chi2_stat(firsts, P_ROOT), chi2_stat(seconds, P_CHILD)]


def test_sampled_acceptance_emits_the_target_distribution():
    for stat, cells in sampled_acceptance_stats():
        assert stat < chi2_quantile(cells - 1), (stat, cells)


def test_sampled_acceptance_test_catches_sharpened_draws():
    """The statistic above must be able to fail: with the draws at accepted nodes sharpened
    to p^2 (temperature 0.5) it rejects them by far."""
    (root_stat, root_cells), (child_stat, child_cells) = sampled_acceptance_stats(
        temperature_below_root=0.5
    )
    assert root_stat < chi2_quantile(root_cells - 1)  # the root's draws were left alone
    assert child_stat > 10 * chi2_quantile(child_cells - 1), child_stat


def test_spec_config_defaults_and_errors():
    assert SpecConfig(num_steps=4, topk=1).num_draft_tokens == 5
    assert SpecConfig(num_steps=5, topk=3).max_draft_tokens == 1 + 3 + 4 * 9
    with pytest.raises(GraphrtError, match="spec-draft-tokens"):
        SpecConfig(num_steps=2, topk=1, num_draft_tokens=4)
    with pytest.raises(GraphrtError, match="spec-steps"):
        SpecConfig(num_steps=0)
    for bad in ({"num_steps": 2.5}, {"topk": True}, {"num_draft_tokens": "4"}):
        with pytest.raises(UsageError, match="must be an integer"):
            SpecConfig(**bad)
