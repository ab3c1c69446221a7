"""The verify forward: the target scores every node of every request's tree at once."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphrt.core.batch import ForwardBatch, ForwardMode
from graphrt.spec.tree import VerifyTree


@dataclass
class VerifyInput:
    """``spec_info`` of a TARGET_VERIFY batch."""

    tree_mask: torch.Tensor  # (B, n, n) bool: node j is node i or one of its ancestors


def verify_batch(
    tree: VerifyTree,
    req_pool_indices: torch.Tensor,  # (B,)
    kv_lens: torch.Tensor,  # (B,) KV entries before the round = the root's position
    kv_lens_cpu: list[int],
    out_cache_loc: torch.Tensor,  # (B * n,) fresh KV slots, node-major per request
) -> ForwardBatch:
    n = tree.num_nodes
    positions = tree.positions(kv_lens.long())  # (B, n)
    seq_lens_cpu = [k + n for k in kv_lens_cpu]
    return ForwardBatch(
        mode=ForwardMode.TARGET_VERIFY,
        input_ids=tree.tokens.flatten(),
        positions=positions.flatten(),
        req_pool_indices=req_pool_indices,
        seq_lens=(kv_lens + n).to(torch.int32),
        out_cache_loc=out_cache_loc,
        seq_lens_cpu=seq_lens_cpu,
        extend_lens_cpu=[n] * len(kv_lens_cpu),
        spec_info=VerifyInput(tree_mask=tree.mask),
    )
