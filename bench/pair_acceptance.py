"""The embedded pair's real acceptance, position by position, for bench/chooser_sim.py.

Under greedy decoding a round from a position accepts the assistant's drafts while they
equal the target's own greedy continuation, so one pass tells what a round of any length
would accept from every position: the target continues each prompt greedily
(transformers, float32, CPU), then the assistant drafts teacher-forced at every anchor of
that text (scripts/train_pair.py's ``draft_logits``, the way spec/ drafts: tested
against transformers' own one-query forward there), and a position's run is how many of
its drafts in a row equal the text. ``runs[r][i]``: the drafts a round accepts at most
when request r has emitted i + 1 tokens (its prefill's and i more).

Prompts: ``--prompt-len`` tokens from the start of each held-out file of this machine's
standard library (scripts/corpus.py's split, which the pair's training held out too; a
start as bench/eval_pair.py takes it) and further in, every ``--stride`` tokens, up to
``--per-file`` a file. Writes JSON: the runs, each prompt's file and offset, and the
mean accept length a round of each length would have had. Rounds replayed over the runs
give graphrt's engine's accepted-count histogram exactly (float32, the CPU; rounds of 3
and of 5: tests/test_pair_acceptance.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from corpus import collect  # noqa: E402
from train_pair import PAD_ID, draft_logits  # noqa: E402

from graphrt.core import pretrained  # noqa: E402

MAX_STEPS = 5  # the chooser's longest rounds (graphrt's default --spec-steps auto bound)
DEFAULT_OUT = ROOT / "bench" / "results" / "cpu-pair-acceptance-runs.json"


def prompts_from_heldout(
    tokenizer, files: int, prompt_len: int, per_file: int, stride: int
) -> list[tuple[str, list[int]]]:
    """(file@offset, ``prompt_len`` token ids from there) for the first ``files``
    held-out files: up to ``per_file`` prompts a file, ``stride`` tokens apart from its
    start, each with ``prompt_len`` + 8 tokens or more of the file from it."""
    corpus = collect()
    chosen = []
    for path in corpus.heldout[:files]:
        ids = tokenizer.encode(path.read_text(encoding="utf-8"), add_special_tokens=False)
        for at in range(0, per_file * stride, stride):
            if len(ids) - at >= prompt_len + 8:
                chosen.append((f"{corpus.relative(path)}@{at}", ids[at : at + prompt_len]))
    return chosen


def runs_of(target, assistant, prompt: list[int], tokens: int) -> list[int]:
    """[i] = the assistant's drafts in a row that equal the target's greedy text from the
    state where ``i + 1`` tokens were emitted (at most MAX_STEPS)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        seq = target.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=tokens + MAX_STEPS + 1,
            min_new_tokens=tokens + MAX_STEPS + 1,  # the text past <eos> is text all the same
            do_sample=False,
            pad_token_id=PAD_ID,
        )
    _, drafts = draft_logits(target, assistant, seq, MAX_STEPS)
    length = seq.shape[1]
    # Step j's logits at anchor t draft token t + j + 1 (anchor t: the target produced
    # token t + 1 from position t). With i + 1 tokens emitted the last is at
    # len(prompt) + i, so a round's first draft is token len(prompt) + i + 1: anchor
    # len(prompt) + i - 1.
    matches = []
    for j, logits in enumerate(drafts, start=1):
        got = logits[0, : length - j - 1].argmax(-1)  # anchors 0 .. length - j - 2
        matches.append((got == seq[0, j + 1 :]).tolist())
    runs = []
    for i in range(tokens):
        anchor = len(prompt) + i - 1
        n = 0
        while n < MAX_STEPS and matches[n][anchor]:
            n += 1
        runs.append(n)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=64, help="held-out files (there are 26)")
    parser.add_argument("--per-file", type=int, default=4, help="prompts a file, at most")
    parser.add_argument("--stride", type=int, default=1024, help="tokens between a file's prompts")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=160, help="emitted tokens a request")
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target_dir, draft_dir = pretrained.model_and_draft(None, None)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    assistant = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
    prompts = prompts_from_heldout(
        tokenizer, args.files, args.prompt_len, args.per_file, args.stride
    )
    start = time.perf_counter()
    runs = [runs_of(target, assistant, ids, args.tokens) for _, ids in prompts]
    # A round of k from a position accepts min(run, k): its mean accept length, bonus included.
    accept = {
        k: statistics.mean(1 + min(n, k) for row in runs for n in row)
        for k in range(1, MAX_STEPS + 1)
    }
    out = {
        "what": __doc__.splitlines()[0],
        "pair": [str(target_dir), str(draft_dir)],
        "prompt_len": args.prompt_len,
        "files": [name for name, _ in prompts],
        "accept_length_by_steps": accept,
        "runs": runs,
    }
    Path(args.out).write_text(json.dumps(out) + "\n")
    print(
        f"{len(runs)} prompts x {args.tokens} positions in {time.perf_counter() - start:.1f} s; "
        "accept length by steps: " + ", ".join(f"{k}: {a:.2f}" for k, a in accept.items())
    )


if __name__ == "__main__":
    main()
