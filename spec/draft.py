"""The frozen-KV MTP draft loop: a seed step plus ``num_steps - 1`` recurrent steps.

Every step runs the drafter on DRAFT rows that read the target's KV and write
none, at one fixed position per request (the position of the last accepted
token, which has no KV yet). Step 0 has one row per request (input: that
token and the target's hidden that produced it); later steps have ``topk``
rows per request (the frontier's tokens and the drafter's own projected
hiddens). All shapes depend only on the request count and ``topk``, so the
loop can be captured as one graph per request batch size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from graphrt.core.attention.base import AttentionBackend
from graphrt.core.batch import ForwardBatch, ForwardMode
from graphrt.core.runners import GraphShape, StaticField
from graphrt.core.runners.base import RunnerOutput, forward_model
from graphrt.spec.config import SpecConfig
from graphrt.spec.tree import VerifyTree, build_verify_tree, expand_step, organize_draft_results


@dataclass
class DraftInput:
    """``spec_info`` of a DRAFT batch: the hidden state fed with each row's token."""

    hidden: torch.Tensor  # (rows, backbone hidden)


def draft_tree(
    run_step: Callable[[ForwardBatch], RunnerOutput],
    cfg: SpecConfig,
    tokens: torch.Tensor,  # (B,) last accepted token of each request
    seed_hidden: torch.Tensor,  # (B, H) target hidden that produced it
    req_pool_indices: torch.Tensor,  # (B,)
    kv_lens: torch.Tensor,  # (B,) int32: KV entries per request = the token's position
    kv_lens_cpu: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (parent_list, top_scores_index, draft_tokens), see spec.tree.

    ``run_step`` runs the drafter on one DRAFT batch: an eager runner's
    ``execute``, or, inside a captured draft graph, the model with capture metadata.
    """
    rows_tokens, rows_hidden, scores = tokens, seed_hidden, None
    score_list, token_list, parents_list = [], [], []
    for step in range(cfg.num_steps):
        reps = 1 if step == 0 else cfg.topk
        batch = draft_batch(rows_tokens, rows_hidden, req_pool_indices, kv_lens, kv_lens_cpu, reps)
        out = run_step(batch)
        topk_p, topk_index = top_probs(out.logits, cfg.topk)  # (rows, topk) each
        rows_tokens, rows_hidden, scores, (s, t, p) = expand_step(
            step, topk_p, topk_index, out.hidden, scores, cfg.topk
        )
        score_list.append(s)
        token_list.append(t)
        parents_list.append(p)
    return organize_draft_results(score_list, token_list, parents_list, cfg.num_draft_tokens)


def top_probs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k likeliest tokens of each row and their softmax probabilities, (rows, k) each.

    softmax(x)[i] = exp(x[i] - logsumexp(x)): no (rows, V) probability table. A one-row
    softmax over a 262k vocabulary runs on one thread block (64 us on an H200), and
    topk's radix select is several launches; logsumexp and max split the row over the GPU.
    """
    if k == 1:
        top, index = logits.max(dim=-1, keepdim=True)
    else:
        top, index = logits.topk(k, dim=-1)
    return (top - logits.logsumexp(dim=-1, keepdim=True)).exp(), index


# What a round's drafted tokens become before verify: (tree, request slots (B,), each
# request's root position (B,)) -> the tree's tokens (B, n); its structure (parents, mask,
# depths) stays, which the captured shapes and chain verify rely on. Device ops only: it
# runs inside the captured draft loop or round, at capture and warm-up too (a stateful
# rule advances there). Padding rows come with request slot 0 and a placeholder position.
# None in the engine; benchmarks and tests pass an oracle that drafts the target's own
# continuation (bench/oracles.py), which may repeat a sibling's token: acceptance then
# still takes the deepest accepted node and its ancestors as the path.
DraftRule = Callable[[VerifyTree, torch.Tensor, torch.Tensor], torch.Tensor]


def draft_verify_tree(
    run_step,
    cfg: SpecConfig,
    tokens: torch.Tensor,  # (B,) last accepted token of each request
    seed_hidden: torch.Tensor,  # (B, H)
    req_pool_indices: torch.Tensor,  # (B,)
    kv_lens: torch.Tensor,  # (B,) int32: each root's position
    kv_lens_cpu: list[int],
    rule: DraftRule | None = None,
) -> VerifyTree:
    """The round's verify tree: ``draft_tree`` (same arguments) built into mask, depths
    and parents, with the last accepted tokens as roots, its tokens then ``rule``'s. A
    chain that verifies every drafted token (topk 1, the default tree width) takes
    ``draft_chain``: the same tree."""
    rows = (req_pool_indices, kv_lens, kv_lens_cpu)
    if is_full_chain(cfg):
        tree = draft_chain(run_step, cfg, tokens, seed_hidden, *rows)
    else:
        drafted = draft_tree(run_step, cfg, tokens, seed_hidden, *rows)
        tree = build_verify_tree(tokens, *drafted, cfg.topk)
    if rule is None:
        return tree
    return dataclasses.replace(tree, tokens=rule(tree, req_pool_indices, kv_lens))


def is_full_chain(cfg: SpecConfig) -> bool:
    return cfg.topk == 1 and cfg.num_draft_tokens == cfg.num_steps + 1


def draft_chain(
    run_step: Callable[[ForwardBatch], RunnerOutput],
    cfg: SpecConfig,
    tokens: torch.Tensor,  # (B,) last accepted token of each request
    seed_hidden: torch.Tensor,  # (B, H)
    req_pool_indices: torch.Tensor,  # (B,)
    kv_lens: torch.Tensor,  # (B,) int32
    kv_lens_cpu: list[int],
) -> VerifyTree:
    """``draft_tree`` + ``build_verify_tree`` for a chain: each step drafts its row's
    argmax, and the tree is the chain itself, whose parents, depths, mask and validity
    are the same every round. The general path spends about 30 launches a step on
    scores, top-k expansion and the tree build that a chain does not need (launches are
    what a captured draft loop pays for): here a step is the drafter's forward and its
    argmax tokens (``greedy_only``: the centroid head never builds a full row), and every
    step reuses one batch (its rows do not change along a chain)."""
    batch_size, n = tokens.shape[0], cfg.num_steps + 1
    step = draft_batch(tokens, seed_hidden, req_pool_indices, kv_lens, kv_lens_cpu)
    step = dataclasses.replace(step, greedy_only=True)  # argmax tokens, no logits
    drafted = [tokens.long()]
    for _ in range(cfg.num_steps):
        out = run_step(step)
        token = out.tokens  # (B,) the first maximum, as top_probs' max
        drafted.append(token)
        step = dataclasses.replace(step, input_ids=token, spec_info=DraftInput(hidden=out.hidden))
    dev = tokens.device
    # Whole tensors, not broadcast views: kernels (Triton verify) read them by their
    # contiguous layout.
    depth = torch.arange(n, device=dev).repeat(batch_size, 1)  # (B, n)
    return VerifyTree(
        tokens=torch.stack(drafted, dim=1),  # (B, n)
        parents=depth - 1,  # the root's is -1
        depth=depth,
        mask=depth.unsqueeze(1) <= depth.unsqueeze(2),  # (B, n, n): j <= i
        valid=torch.ones(batch_size, n, dtype=torch.bool, device=dev),
    )


def draft_batch(
    tokens, hidden, req_pool_indices, kv_lens, kv_lens_cpu, reps: int = 1
) -> ForwardBatch:
    """DRAFT rows: ``reps`` per request, all at the request's frozen position."""
    rows = tokens.shape[0]
    positions = kv_lens.long()  # frozen at the token's position
    if reps > 1:  # (one row a request, the round's first batch: no copies to launch)
        positions = positions.repeat_interleave(reps)
        req_pool_indices = req_pool_indices.repeat_interleave(reps)
        kv_lens = kv_lens.repeat_interleave(reps)
    return ForwardBatch(
        mode=ForwardMode.DRAFT,
        input_ids=tokens,
        positions=positions,
        req_pool_indices=req_pool_indices,
        seq_lens=kv_lens,  # attend to every KV entry the target has
        out_cache_loc=torch.zeros(rows, dtype=torch.long, device=tokens.device),  # writes none
        seq_lens_cpu=[n for n in kv_lens_cpu for _ in range(reps)],
        extend_lens_cpu=[1] * rows,
        spec_info=DraftInput(hidden=hidden),
    )


def draft_shape(seed_hidden_size: int, dtype: torch.dtype, num_steps: int) -> GraphShape:
    """What a draft-loop graph takes: one row per request (its last token, frozen
    position and KV length) and the seed hidden beside it. Loops of different lengths
    take the same rows: the variant tells their graphs apart."""
    hidden = StaticField("hidden", (seed_hidden_size,), dtype)
    return GraphShape(
        mode=ForwardMode.DRAFT,
        width=1,
        spec_info=DraftInput,
        fields=(hidden,),
        variant=f"mtp-draft-{num_steps}",
    )


def captured_draft_step(drafter, attn: AttentionBackend):
    """One draft step's forward inside a captured loop: the step's rows are derived inside
    the graph from the static buffers, so their metadata is the capture-safe kind (device
    tensors, fixed KV length)."""

    def run_step(step: ForwardBatch) -> RunnerOutput:
        attn.init_metadata_for_capture(step)
        return forward_model(drafter, attn, step)

    return run_step


def captured_draft_loop(
    drafter, attn: AttentionBackend, cfg: SpecConfig, rule: DraftRule | None = None
):
    """The function a draft-loop graph computes from its static request rows: the whole
    draft (every draft step, the top-k expansions, the organised results) and the verify
    tree built from it (``rule`` applied), so the verify graph can follow with no eager
    work between."""

    run_step = captured_draft_step(drafter, attn)

    def forward(static: ForwardBatch):
        return draft_verify_tree(
            run_step,
            cfg,
            static.input_ids,
            static.spec_info.hidden,
            static.req_pool_indices,
            static.seq_lens,
            static.seq_lens_cpu,
            rule=rule,
        ).tensors()

    return forward
