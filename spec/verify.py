"""The verify forward: the target scores every node of every request's tree at once."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphrt.core.batch import ForwardBatch, ForwardMode
from graphrt.core.runners import GraphShape, StaticField
from graphrt.spec.tree import VerifyTree


@dataclass
class VerifyInput:
    """``spec_info`` of a TARGET_VERIFY batch."""

    tree_mask: torch.Tensor  # (B, n, n) bool: node j is node i or one of its ancestors


def verify_shape(num_nodes: int) -> GraphShape:
    """What a verify graph takes: ``num_nodes`` tokens per request and the tree mask.
    Padding requests see every padding node (all slot 0), so their softmax stays finite."""
    mask = StaticField("tree_mask", (num_nodes, num_nodes), torch.bool, pad=True)
    return GraphShape(
        mode=ForwardMode.TARGET_VERIFY, width=num_nodes, spec_info=VerifyInput, fields=(mask,)
    )


def verify_batch(
    tree: VerifyTree,
    req_pool_indices: torch.Tensor,  # (B,)
    kv_lens: torch.Tensor,  # (B,) KV entries before the round = the root's position
    kv_lens_cpu: list[int],
    out_cache_loc: torch.Tensor,  # (B * n,) fresh KV slots, node-major per request
    max_position: int,
) -> ForwardBatch:
    n = tree.num_nodes
    # Near the end of the context, deep nodes would sit past the rope table: they are
    # clamped to the last position and never accepted (acceptance stops at the context).
    positions = tree.positions(kv_lens.long()).clamp(max=max_position)  # (B, n)
    return ForwardBatch(
        mode=ForwardMode.TARGET_VERIFY,
        input_ids=tree.tokens.flatten(),
        positions=positions.flatten(),
        req_pool_indices=req_pool_indices,
        seq_lens=(kv_lens + n).to(torch.int32),
        out_cache_loc=out_cache_loc,
        seq_lens_cpu=[k + n for k in kv_lens_cpu],
        extend_lens_cpu=[n] * len(kv_lens_cpu),
        spec_info=VerifyInput(tree_mask=tree.mask),
    )
