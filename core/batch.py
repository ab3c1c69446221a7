"""ForwardBatch: what one model forward computes, in flat token order.

Tokens of all requests are concatenated: request i owns tokens
``[token_start[i], token_start[i] + extend_lens[i])``. In DECODE every request
contributes exactly one token, so tokens and requests coincide.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill: new prompt tokens, causal over cached prefix + new tokens
    DECODE = "decode"  # one new token per request
    TARGET_VERIFY = "target_verify"  # target scores a verify tree of draft tokens
    DRAFT = "draft"  # drafter step reading the target's frozen KV

    @property
    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE


@dataclass
class ForwardBatch:
    """Inputs of one forward. Device tensors unless the name ends in ``_cpu``.

    Host copies (``*_cpu``) are taken once by the scheduler, so attention
    backends never sync the device to learn shapes.
    """

    mode: ForwardMode
    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64, position of each token in its sequence
    req_pool_indices: torch.Tensor  # (B,) int64, row in ReqToTokenPool
    seq_lens: torch.Tensor  # (B,) int32, sequence length after this forward
    out_cache_loc: torch.Tensor  # (T,) int64, KV slot each token writes
    seq_lens_cpu: list[int]
    extend_lens_cpu: list[int]  # new tokens per request (all 1 in DECODE)
    # Rows of the flat token dimension whose logits are wanted; None = every token.
    logits_indices: torch.Tensor | None = None
    spec_info: Any = None
    # Rows want only their argmax token (``RunnerOutput.tokens``), no logits: a greedy
    # draft chain. A model with a cheaper greedy head (``greedy_tokens``: the centroid-
    # masked head scores ~4k of 262k tokens) then never builds the (N, vocab) logits.
    greedy_only: bool = False
    # (4, B) int64 device rows out_cache_loc, req_pool_indices, positions, input_ids of a
    # one-token-a-request batch whose four fields are views of them (they came in one
    # copy: Ledger.append_one), or None: a graph loads them with one copy, not four.
    packed_rows: torch.Tensor | None = None
    # (3, B, W) int64 device rows input_ids, positions, out_cache_loc of a batch of W
    # tokens a request (a round's verify tree) whose three fields are views of them (one
    # copy: spec.round_graph.round_batch), or None: a graph loads them with one copy.
    packed_nodes: torch.Tensor | None = None
    # Some row may hold the attention backend's long-row count of visible keys or more
    # (``AttentionBackend.long_row_keys``): a backend with a schedule of their own uses it
    # (a graph captured with it set keeps it). Every row is served right either way.
    long_rows: bool = False
    # Attention-backend metadata for this forward (set by init_forward_metadata).
    attn_metadata: Any = field(default=None, repr=False)

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def prefix_lens_cpu(self) -> list[int]:
        return [s - e for s, e in zip(self.seq_lens_cpu, self.extend_lens_cpu)]
