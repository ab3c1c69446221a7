"""bench/oracles.py's ``TokenOracle`` on a hand-built tree: which nodes it redrafts (the
first-child path only, each at its own position in its own request's sequence) and which
it leaves (siblings, dropped nodes, unknown positions, padding rows, failed coins)."""

from __future__ import annotations

import pytest
import torch

from graphrt.spec.tree import VerifyTree, ancestors


def tree_of(parents: list[int], rows: int) -> VerifyTree:
    """Every row the same tree: node i hangs off parents[i] (-1: the root, or dropped)."""
    parents_t = torch.tensor(parents).repeat(rows, 1)
    mask, depth = ancestors(parents_t)
    valid = (parents_t >= 0) | (torch.arange(len(parents)) == 0)
    tokens = torch.arange(100, 100 + len(parents)).repeat(rows, 1)
    return VerifyTree(tokens=tokens, parents=parents_t, depth=depth, mask=mask, valid=valid)


@pytest.mark.parametrize("rate", [1.0, 0.0])
def test_the_oracle_redrafts_the_first_child_path_at_each_nodes_position(oracles, rate):
    # 0 -> 1 -> 3 -> 5 is the first-child path; 2 and 4 are later siblings; 6 is dropped.
    tree = tree_of([-1, 0, 0, 1, 1, 3, -1], rows=3)
    oracle = oracles.TokenOracle(max_requests=3, max_context_len=16, device="cpu")
    oracle.rate.fill_(rate)
    oracle.know(1, list(range(1000, 1013)))  # positions 0 .. 12 of slot 1's sequence
    oracle.know(2, list(range(2000, 2016)))
    req_slots = torch.tensor([1, 2, 0])  # the last row pads: slot 0, never told
    kv_lens = torch.tensor([10, 3, 1], dtype=torch.int32)  # each root's position
    got = oracle(tree, req_slots, kv_lens)
    drafted = tree.tokens
    if rate == 0.0:  # no coin passes a depth of 1 or more
        assert torch.equal(got, drafted)
        return
    # Slot 1, root at 10: nodes 1 and 3 (depths 1, 2) at positions 11, 12; node 5's 13
    # is past what the oracle knows, so it keeps its draft.
    assert got[0].tolist() == [100, 1011, 102, 1012, 104, 105, 106]
    assert got[1].tolist() == [100, 2004, 102, 2005, 104, 2006, 106]
    assert torch.equal(got[2], drafted[2])
    assert oracle.rounds[:3].tolist() == [1, 1, 1]  # each row drew one coin


def test_the_oracles_coin_passes_a_depth_with_its_rate(oracles):
    """At rate 0.5 over 64 rounds of a chain, depth d is redrafted about 0.5 ** d of the
    time, and never where a shallower depth was not (one coin a round)."""
    tree = tree_of([-1, 0, 1, 2], rows=1)
    oracle = oracles.TokenOracle(max_requests=1, max_context_len=8, device="cpu")
    oracle.rate.fill_(0.5)
    oracle.know(1, list(range(1000, 1008)))
    one, zero = torch.tensor([1]), torch.tensor([0], dtype=torch.int32)
    redrafted = torch.stack([oracle(tree, one, zero)[0] >= 1000 for _ in range(64)]).double()
    chains = redrafted[:, 1:]  # depths 1 .. 3
    assert torch.equal(chains, chains.cumprod(dim=1))  # a depth only behind the one above
    rates = chains.mean(dim=0)
    assert (rates - torch.tensor([0.5, 0.25, 0.125], dtype=torch.float64)).abs().max() < 0.08


def test_restarted_coins_repeat_round_for_round(oracles):
    """``restart(block)`` replays every row's stream from that block: the matrix's modes
    of one repetition meet the same coins, and another repetition meets others."""
    coins = oracles.RoundCoins("cpu")
    coins.rate.fill_(0.7)
    depth = torch.arange(6).repeat(4, 1)  # (rows, depths 0 .. 5)

    def draw(rounds):
        return torch.stack([coins.passes(depth) for _ in range(rounds)])

    coins.restart(1)
    first = draw(40)
    draw(7)  # a warm-up's rounds in between
    coins.restart(1)
    assert torch.equal(draw(40), first)
    coins.restart(2)
    assert not torch.equal(draw(40), first)
