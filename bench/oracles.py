"""Oracle drafters for the speculative benchmarks (issue 20): acceptance at a set rate per
draft position, on a real target and its real assistant graphs, whose cost stays real.

- ``CoinAcceptance`` (the speed matrix's, an ``accept_rule``): node d of a chain counts as
  the target's own token where a coin at ``rate ** d`` passes, whatever was drafted. The
  emitted text is the drafts': it measures speed only.
- ``TokenOracle`` (a ``draft_rule``): the target's own greedy continuation, known from a
  plain run, drafted in place of the assistant's tokens where the coin passes; the real
  acceptance then compares them with what verify computes. Its text is the target's: with
  batch-invariant kernels a verify row is a decode row bit for bit, so every substituted
  token is accepted and the output equals plain decoding's (bench/eval_pair.py
  --oracle-rate). On the default kernels bf16 rounds differently at verify widths.

Both draw one uniform ``u`` a row and round from ``RoundCoins`` and pass depth d where
``u < rate ** d``: a round reaches depth d with probability ``rate ** d``, as
independent coins per position would give.
"""

from __future__ import annotations

import torch

from graphrt.spec.tree import every_ancestor


class RoundCoins:
    """One uniform a batch row and round, from a stratified stream: each block of
    ``STRATA`` rounds takes one value from each 1/STRATA of [0, 1), in a random order, so a
    row's accept lengths match their expectation over a few blocks where coins drift by
    1/sqrt(rounds). With coins, one request's 128 tokens at rate 0.9 accepted 5.38 a round
    in rounds of 5 (expected 4.69) and auto's rounds 4.45, which read as auto at 0.87 of
    the best mode (H100, stop 53): a measure of luck, not of the chooser. Not a Weyl
    sequence (round x golden ratio, tried): its rounds alternate (at rate 0.5 a round after
    an accepting one accepted with probability 0.24), which misleads a chooser that
    follows recent acceptance; here neighbouring rounds correlate by -1/(STRATA - 1). Each
    row reads its own part of the stream. Device ops only: captured graphs draw on every
    replay."""

    STRATA = 32  # rounds a block; its u values are one per stratum of [0, 1)
    BLOCKS = 4096
    ROW_STRIDE = 97  # blocks between rows' starts (coprime to BLOCKS: every row apart)
    MAX_ROWS = 4096

    def __init__(self, device, seed: int = 0):
        self.rate = torch.zeros((), device=device)  # a device scalar: captured graphs read it
        generator = torch.Generator().manual_seed(seed)
        order = torch.rand(self.BLOCKS, self.STRATA, generator=generator).argsort(dim=1)
        jitter = torch.rand(self.BLOCKS, self.STRATA, generator=generator)
        self.stream = ((order + jitter) / self.STRATA).flatten().to(device)  # (BLOCKS*STRATA,)
        rows = torch.arange(self.MAX_ROWS, device=device)
        self.starts = rows * self.ROW_STRIDE * self.STRATA % self.stream.numel()
        # Each row's rounds so far: state the captured graphs advance on every replay.
        self.rounds = torch.zeros(self.MAX_ROWS, dtype=torch.long, device=device)

    def restart(self, block: int) -> None:
        """Every row reads its stream again from its ``block``-th block. The matrix restarts
        the coins before each mode's timed run of a repetition, so the modes compared in a
        cell meet the same coins round for round (common random numbers): a repetition's
        luck then moves every mode alike, and auto / best measures the chooser. In place:
        captured graphs keep reading ``rounds``."""
        self.rounds.fill_(block * self.STRATA)

    def passes(self, depth: torch.Tensor) -> torch.Tensor:
        """(B, n) node depths -> (B, n) bool: this round's coin passes each depth (depth 0
        always); advances every row of the batch by one round."""
        batch = depth.shape[0]
        at = (self.starts[:batch] + self.rounds[:batch]) % self.stream.numel()
        u = self.stream[at]  # (B,)
        self.rounds[:batch] += 1
        return u.unsqueeze(1) < self.rate**depth


class CoinAcceptance(RoundCoins):
    """The speed matrix's oracle, an ``MTPDecoding`` accept rule: the assistant's drafts
    stay as drafted, and node d of a chain counts as the target's own token where the coin
    passes depth d, after which the real acceptance walks the path, commits it and emits it.

    Comparing drafts with a greedy continuation computed beforehand (``TokenOracle``) does
    not work in bfloat16 on a random target with the default kernels: its top logits are
    within rounding of each other, so decode's and verify's roundings disagree on nearly
    every token (measured: accept length 1.0 at every rate). Costs a few small kernels a
    round inside the verify graph. Chains only (topk 1)."""

    def __init__(self, real_accept, device, seed: int = 0):
        super().__init__(device, seed)
        self.real_accept = real_accept

    def __call__(self, tree, target_tokens, max_accept):
        passed = self.passes(tree.depth)  # (B, n)
        # A chain's node j + 1 hangs off node j: where it passes, the target "emitted" it.
        forced = target_tokens.clone()
        forced[:, :-1] = torch.where(passed[:, 1:], tree.tokens[:, 1:], target_tokens[:, :-1])
        return self.real_accept(tree, forced, max_accept)


class TokenOracle(RoundCoins):
    """An ``MTPDecoding`` draft rule: along each tree's first-child path (a chain: the
    chain), the node at depth d drafts the target's own greedy token at its position
    where the coin passes depth d; every other node keeps the assistant's draft (a
    sibling may then hold the same token: acceptance takes the deepest accepted node).

    ``know(slot, ids)`` tells it a request's whole greedy sequence (prompt, then the plain
    run's output) by request slot, as ``Request.req_slot`` holds it once admitted; a
    position it does not know (-1), or a slot told about another request, drafts a token
    that verify rejects, which costs acceptance and never output. HAZARD: it needs a row
    for every slot the engine may use (``max_requests``: the engine's
    ``max_running_requests``, start-up's throwaway requests included); a slot past them
    indexes out of the table, a device assert on CUDA."""

    def __init__(self, max_requests: int, max_context_len: int, device, seed: int = 0):
        super().__init__(device, seed)
        # (slots + 1, context) each request slot's greedy sequence by position; -1 unknown.
        # Row 0 is the padding rows' slot, never told.
        self.known = torch.full(
            (max_requests + 1, max_context_len), -1, dtype=torch.long, device=device
        )

    def know(self, slot: int, ids: list[int] | torch.Tensor) -> None:
        """Slot ``slot``'s sequence from now on: ``ids`` as a list, or already on the
        device (``staged``), which copies with no wait on the device."""
        row = self.known[slot]
        row.fill_(-1)
        ids = ids[: row.numel()]
        row[: len(ids)].copy_(torch.as_tensor(ids, dtype=torch.long))

    def staged(self, ids: list[int]) -> torch.Tensor:
        """``ids`` on the oracle's device, for ``know`` inside a timed run: a list would be
        copied from pageable host memory, a wait on the device per request told."""
        return torch.tensor(ids, dtype=torch.long).to(self.known.device)

    def __call__(self, tree, req_slots, kv_lens) -> torch.Tensor:
        """-> the tree's tokens (B, n), the oracle's where it drafts."""
        n, context = tree.tokens.shape[1], self.known.shape[1]
        nodes = torch.arange(n, device=tree.tokens.device)
        parents = tree.parents  # (B, n): -1 at the root and at dropped nodes
        # [b, i, j]: node j is a sibling of node i with a lower index.
        earlier = (parents.unsqueeze(2) == parents.unsqueeze(1)) & (nodes.unsqueeze(1) > nodes)
        first_child = (parents >= 0) & ~earlier.any(dim=-1)  # (B, n)
        # On the path: the root, or a first child all of whose ancestors are (a dropped
        # node's mask row holds itself alone, and it is no first child).
        on_path = every_ancestor(tree.mask, first_child | (nodes == 0))  # (B, n)
        position = kv_lens.long().unsqueeze(1) + tree.depth  # (B, n): the root's is kv_lens
        want = self.known[req_slots.long().unsqueeze(1), position.clamp(max=context - 1)]
        write = on_path & (tree.depth > 0) & (position < context) & (want >= 0)
        return torch.where(write & self.passes(tree.depth), want, tree.tokens)
