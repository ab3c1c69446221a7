"""One speculative round for a batch of running requests: draft, verify, accept.

The worker owns no request state: it takes each request's last token, seed
hidden and KV length, and returns what each request emits plus its next seed.
It commits the KV of accepted tokens into the request's token table and frees
the rest; the engine appends tokens and finishes requests.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from graphrt.core.memory import ReqToTokenPool, TokenKVPool
from graphrt.core.runners.base import BaseRunner
from graphrt.core.runners.graph import GraphRunner
from graphrt.spec.accept import Acceptance, accept_greedy, accept_sampled
from graphrt.spec.config import SpecConfig
from graphrt.spec.draft import draft_batch, draft_tree
from graphrt.spec.tree import VerifyTree, build_verify_tree
from graphrt.spec.verify import verify_batch


@dataclass
class RoundResult:
    acceptance: Acceptance  # accepted draft nodes and the tokens to emit (drafts + bonus)
    draft_tokens: list[int]  # what was drafted (tree nodes, root excluded)
    seed_hidden: torch.Tensor  # (H,) target hidden at the last accepted node: the next seed


class MTPWorker:
    def __init__(
        self,
        cfg: SpecConfig,
        target_runner: BaseRunner,
        draft_runner: BaseRunner,
        kv_pool: TokenKVPool,
        req_pool: ReqToTokenPool,
    ):
        self.cfg = cfg
        self.target_runner = target_runner
        self.draft_runner = draft_runner
        self.kv_pool = kv_pool
        self.req_pool = req_pool
        self.draft_graph: GraphRunner | None = None  # MTPDraftGraphRunner, set by the engine
        self.graph_rounds = 0

    def _draft(self, root, seed_hidden, slots, kv_lens, kv_lens_cpu):
        """The draft tree: one captured graph per request batch size where there is one."""
        batch = draft_batch(root, seed_hidden, slots, kv_lens, kv_lens_cpu)
        graph = self.draft_graph
        if graph is not None and graph.can_run_graph(batch):
            self.graph_rounds += 1
            return graph.execute(batch)
        return draft_tree(
            self.draft_runner.execute, self.cfg, root, seed_hidden, slots, kv_lens, kv_lens_cpu
        )

    @torch.inference_mode()
    def round(
        self,
        tokens: Sequence[int],  # last accepted (not yet cached) token per request
        seed_hidden: torch.Tensor,  # (B, H)
        req_slots: Sequence[int],
        kv_lens: Sequence[int],  # KV entries per request = position of its last token
        max_keep: Sequence[int],  # most tokens each request may still cache this round
        samplers: Sequence[Callable[[torch.Tensor], torch.Tensor] | None],  # None = greedy
        generators: Sequence[torch.Generator | None],
    ) -> list[RoundResult]:
        dev = seed_hidden.device
        batch = len(tokens)
        root = torch.tensor(tokens, device=dev)
        slots_t = torch.tensor(req_slots, device=dev)
        kv_lens_t = torch.tensor(kv_lens, dtype=torch.int32, device=dev)
        kv_lens_cpu = list(kv_lens)

        parent_list, top_index, drafts = self._draft(
            root, seed_hidden, slots_t, kv_lens_t, kv_lens_cpu
        )
        tree = build_verify_tree(root, parent_list, top_index, drafts, self.cfg.topk)
        n = tree.num_nodes
        locs = self.kv_pool.alloc(batch * n)  # (B*n,) node-major per request
        out = self.target_runner.execute(verify_batch(tree, slots_t, kv_lens_t, kv_lens_cpu, locs))
        logits = out.logits.view(batch, n, -1)  # (B, n, V)

        greedy = [b for b in range(batch) if samplers[b] is None]
        accepted: dict[int, Acceptance] = {}
        if greedy:
            sub = _rows(tree, greedy)
            accepted.update(zip(greedy, accept_greedy(sub, logits[greedy])))
        sampled = [b for b in range(batch) if samplers[b] is not None]
        if sampled:
            probs = [(lambda node, b=b: samplers[b](logits[b, node])) for b in sampled]
            sub = _rows(tree, sampled)
            accepted.update(
                zip(sampled, accept_sampled(sub, probs, [generators[b] for b in sampled]))
            )

        results = []
        locs_bn = locs.view(batch, n)
        locs_host = locs_bn.cpu()  # one copy for the whole batch: frees need host slot ids
        drafted = tree.tokens[:, 1:].tolist()
        for b in range(batch):
            acc = accepted[b]
            path = [0, *acc.nodes][: max_keep[b]]  # the root and accepted drafts get cached
            keep = locs_bn[b, path]
            self.req_pool.req_to_token[req_slots[b], kv_lens[b] : kv_lens[b] + len(path)] = keep
            drop = torch.ones(n, dtype=torch.bool)
            drop[path] = False
            self.kv_pool.free(locs_host[b][drop])
            if len(path) < len(acc.nodes) + 1:  # truncated by the context: emit what is cached
                acc = Acceptance(
                    nodes=acc.nodes[: len(path) - 1],
                    tokens=acc.tokens[: len(path)],
                    last_node=path[-1],
                )
            results.append(
                RoundResult(
                    acceptance=acc,
                    draft_tokens=drafted[b],
                    seed_hidden=out.hidden[b * n + acc.last_node],
                )
            )
        return results


def _rows(tree, rows: list[int]):
    """The sub-tree of the given requests (same VerifyTree type)."""
    idx = torch.tensor(rows, device=tree.tokens.device)
    return VerifyTree(
        tokens=tree.tokens[idx],
        parents=tree.parents[idx],
        depth=tree.depth[idx],
        mask=tree.mask[idx],
        valid=tree.valid[idx],
    )
