"""scripts/train_pair.py: its all-anchors drafting against transformers' own one-query
assistant forward (both sides of the sliding window's edge), its draft loss, and a tiny
end-to-end CPU run whose bfloat16 checkpoints transformers and graphrt both load and
decode with speculatively."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from helpers import hf_greedy, rel_err

# scripts/ is not a package: its files import each other by plain module name.
_SCRIPTS_DIR = str(Path(__file__).resolve().parents[1] / "scripts")
if _SCRIPTS_DIR not in sys.path:
    sys.path.insert(0, _SCRIPTS_DIR)

import train_pair as tp  # noqa: E402

VOCAB = 300
WINDOW = tp.TARGET["window"]  # the target's (and assistant's) sliding window: 128
LENGTH = WINDOW + 12  # a sequence that runs past the window by a few tokens
# Anchors below, at and past the window's edge; LENGTH - 3 is the last with a step-2 token.
ANCHORS = (0, 5, WINDOW - 1, WINDOW, WINDOW + 1, WINDOW + 4, LENGTH - 3)
# float32 throughout. The all-anchors forward reduces over LENGTH masked keys and batches
# LENGTH queries into one matmul, the one-query forward over the anchor's keys alone: the
# same sums in another order, so they agree to rounding, not bit for bit. Measured: up to
# ~3e-5 of the logits' largest magnitude (step 2 carries step 1's rounding; the 4x weights
# below sharpen it) over every anchor and 4 seeds. 1e-4 of that scale is graphrt's parity
# bar (helpers.rel_err); the window one key narrower misses by 1e-2 to 1 past the window.
TOLERANCE = 1e-4


# ---- all-anchors drafting vs transformers' one-query forward -------------------------


@pytest.fixture(scope="module")
def random_pair():
    """The real configs at a small vocabulary, random weights, two random sequences."""
    from transformers import Gemma4AssistantForCausalLM, Gemma4ForCausalLM

    torch.manual_seed(0)
    target = Gemma4ForCausalLM(tp.target_config(VOCAB)).eval()
    assistant = Gemma4AssistantForCausalLM(tp.assistant_config(VOCAB)).eval()
    with torch.no_grad():
        # At initialisation (std 0.02) attention is near uniform over the keys, so reading
        # one key more or less barely moves the output; 4x weights make it peaked, so a
        # wrong mask shows (and the logits reach a scale of ~4).
        for param in assistant.parameters():
            if param.dim() == 2:
                param.mul_(4)
    seq = torch.randint(3, VOCAB, (2, LENGTH))
    return target, assistant, seq


@pytest.fixture(scope="module")
def one_query_reference(random_pair):
    """{(row, anchor): [step 1 logits (V,), step 2 logits (V,)]} from transformers'
    assistant forward, called the way SinglePositionMultiTokenCandidateGenerator calls it:
    one query at position anchor + 1 over the target's KV 0..anchor, its own mask."""
    target, assistant, seq = random_pair
    reference = {}
    with torch.no_grad():
        out = target(input_ids=seq, output_hidden_states=True, return_shared_kv_states=True)
        hidden = out.hidden_states[-1]  # (B, T, H)
        embed = target.get_input_embeddings()
        for row in range(seq.shape[0]):
            for t in ANCHORS:
                kv = {
                    kind: (k[row : row + 1, :, : t + 1], v[row : row + 1, :, : t + 1])
                    for kind, (k, v) in out.shared_kv_states.items()
                }
                position = torch.tensor([[t + 1]])
                seed = hidden[row : row + 1, t : t + 1]  # (1, 1, H)
                logits = []
                for j in (1, 2):  # step j reads token t + j and the previous step's projection
                    inputs = torch.cat([embed(seq[row : row + 1, t + j : t + j + 1]), seed], -1)
                    step = assistant(
                        inputs_embeds=inputs,
                        position_ids=position,
                        shared_kv_states=kv,
                        attention_mask=None,
                    )
                    logits.append(step.logits[0, 0])
                    seed = step.last_hidden_state
                reference[row, t] = logits
    return reference


def anchor_errors(drafts, reference) -> dict[tuple[int, int, int], float]:
    """{(row, anchor, step): rel_err of the all-anchors draft against the reference}."""
    return {
        (row, t, j): rel_err(drafts[j - 1][row, t], logits[j - 1])
        for (row, t), logits in reference.items()
        for j in (1, 2)
    }


def test_anchor_masks_give_sliding_layers_the_window_plus_one_newest_keys():
    masks = tp.anchor_masks(LENGTH, WINDOW, torch.device("cpu"))
    full, sliding = masks["full_attention"][0, 0], masks["sliding_attention"][0, 0]
    for t in ANCHORS:
        assert full[t].nonzero().flatten().tolist() == list(range(t + 1))
        assert sliding[t].nonzero().flatten().tolist() == list(range(max(0, t - WINDOW), t + 1))


def test_all_anchors_drafting_equals_transformers_one_query_forward(
    random_pair, one_query_reference
):
    target, assistant, seq = random_pair
    with torch.no_grad():
        _, drafts = tp.draft_logits(target, assistant, seq, steps=2)
    errors = anchor_errors(drafts, one_query_reference)
    assert max(errors.values()) < TOLERANCE, errors
    scale = max(logits[1].abs().max().item() for logits in one_query_reference.values())
    assert scale > 1.0  # the logits are not all near zero (which would make any mask pass)


def test_a_window_one_key_narrower_is_caught_past_the_window_only(
    monkeypatch, random_pair, one_query_reference
):
    """The same comparison with the off-by-one mask (k >= q - window + 1) fails clearly at
    the anchors past the window, and only there: the tolerance above is tight enough."""
    target, assistant, seq = random_pair

    anchor_masks = tp.anchor_masks

    def narrow_masks(length, window, device):  # the full layers' mask does not use window
        return anchor_masks(length, window - 1, device)

    narrow = narrow_masks(LENGTH, WINDOW, torch.device("cpu"))["sliding_attention"]
    q, k = torch.arange(LENGTH)[:, None], torch.arange(LENGTH)[None, :]
    assert torch.equal(narrow[0, 0], (k <= q) & (k >= q - WINDOW + 1))  # the variant meant
    monkeypatch.setattr(tp, "anchor_masks", narrow_masks)
    with torch.no_grad():
        _, drafts = tp.draft_logits(target, assistant, seq, steps=2)
    errors = anchor_errors(drafts, one_query_reference)
    before = [e for (_, t, _), e in errors.items() if t < WINDOW]
    past = [e for (_, t, _), e in errors.items() if t >= WINDOW]
    assert max(before) < TOLERANCE, errors  # one key fewer only matters once t >= window
    assert max(past) > 10 * TOLERANCE, errors


# ---- draft loss ----------------------------------------------------------------------


def hand_made_drafts(target_logp: torch.Tensor, steps: int, shift: int = 0) -> list:
    """Step j's logits at anchor t = the target's log-probs at t + j + shift (shift 0: a
    perfect drafter), plus a per-anchor constant (logits, not log-probs), and garbage at
    the anchors with no such target."""
    gen = torch.Generator().manual_seed(1)
    length = target_logp.shape[1]
    drafts = []
    for j in range(1, steps + 1):
        offset = j + shift
        logits = torch.randn(target_logp.shape, generator=gen) * 5
        logits[:, : length - offset] = target_logp[:, offset:] + torch.randn(
            target_logp.shape[0], length - offset, 1, generator=gen
        )
        drafts.append(logits)
    return drafts


@pytest.fixture
def target_logp():
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(2, 10, 7, generator=gen) * 3).log_softmax(-1)  # (B, T, V)


def test_draft_loss_is_zero_for_the_targets_own_distributions(target_logp):
    loss = tp.draft_loss(target_logp, hand_made_drafts(target_logp, steps=3))
    assert abs(loss.item()) < 1e-6


def test_draft_loss_is_positive_for_other_distributions(target_logp):
    drafts = hand_made_drafts(target_logp, steps=3)
    drafts[1][1, 4, 2] += 1.0  # one anchor of one step off
    assert tp.draft_loss(target_logp, drafts).item() > 1e-4
    # Aligned one token early (t + j - 1) or late (t + j + 1): the off-by-ones.
    for shift in (-1, 1):
        assert tp.draft_loss(target_logp, hand_made_drafts(target_logp, 3, shift)).item() > 0.1


def test_draft_loss_ignores_the_anchors_without_a_step_target(target_logp):
    drafts = hand_made_drafts(target_logp, steps=3)
    loss = tp.draft_loss(target_logp, drafts)
    length = target_logp.shape[1]
    for j, logits in enumerate(drafts, start=1):
        logits[:, length - j :] = torch.randn_like(logits[:, length - j :]) * 100
    assert torch.equal(tp.draft_loss(target_logp, drafts), loss)
    drafts[2][:, length - 4] += torch.arange(7.0)  # the last anchor step 3 has a target for
    assert tp.draft_loss(target_logp, drafts).item() > loss.item() + 1e-4


# ---- end to end: train, report, checkpoints ------------------------------------------

HELDOUT, HELDOUT_BYTES = 600, 2000
MANIFEST = {"python": "x", "train": {"files": 1, "bytes": 1}, "heldout": {"files": 1, "bytes": 1}}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """`train_pair.py train` on CPU at tiny settings; -> its --out directory."""
    root = tmp_path_factory.mktemp("train_pair")
    gen = torch.Generator().manual_seed(0)
    tokens = {
        "train": torch.randint(3, VOCAB, (5000,), generator=gen, dtype=torch.int32),
        "heldout": torch.randint(3, VOCAB, (HELDOUT,), generator=gen, dtype=torch.int32),
        "heldout_bytes": HELDOUT_BYTES,
        "vocab_size": VOCAB,
        "manifest": MANIFEST,
    }
    torch.save(tokens, root / "tokens.pt")
    (root / "tokenizer").mkdir()  # empty: save() copies the tokenizer files only if present
    argv = ["train", "--tokens", str(root / "tokens.pt"), "--tokenizer", str(root / "tokenizer")]
    argv += ["--out", str(root / "out"), "--window", "32", "--batch", "2", "--target-steps", "2"]
    argv += ["--assistant-steps", "2", "--draft-steps", "2", "--device", "cpu", "--budget-s", "30"]
    argv += ["--distill-sequences", "3", "--distill-prompt", "8"]  # the target's own text too
    tp.main(argv)
    return root / "out"


def test_train_writes_the_report(trained):
    report = json.loads((trained / "report.json").read_text())
    assert set(report) == {
        "config",
        "device",
        "target_steps_run",
        "heldout_bits_per_byte",
        "assistant_steps_run",
        "draft_step_accuracy",
        "corpus",
    }
    assert report["config"]["window"] == 32 and report["config"]["draft_steps"] == 2
    assert report["device"] == "cpu"
    assert report["target_steps_run"] == 2 and report["assistant_steps_run"] == 2
    assert report["corpus"] == MANIFEST
    accuracy = report["draft_step_accuracy"]
    assert len(accuracy) == 2 and all(0.0 <= a <= 1.0 for a in accuracy)
    # Two steps leave the target near uniform over the vocabulary: every held-out token but
    # the first scored once at ~log2(VOCAB) bits, over the held-out bytes.
    uniform = (HELDOUT - 1) * math.log2(VOCAB) / HELDOUT_BYTES
    assert abs(report["heldout_bits_per_byte"] / uniform - 1) < 0.05, report


def test_checkpoints_are_bfloat16_safetensors(trained):
    from safetensors import safe_open

    for name in ("target", "assistant"):
        files = {p.name for p in (trained / name).iterdir()}
        assert {"config.json", "model.safetensors"} <= files, files
        # no pickled weights, and no tokenizer copied from the empty tokenizer folder
        assert not any(f.endswith(".bin") or f.startswith("tokenizer") for f in files), files
        with safe_open(trained / name / "model.safetensors", "pt") as f:
            dtypes = {f.get_slice(key).get_dtype() for key in f.keys()}
        assert dtypes == {"BF16"}, (name, dtypes)


def test_checkpoints_load_with_transformers(trained):
    from transformers import Gemma4AssistantForCausalLM, Gemma4ForCausalLM

    target, info = Gemma4ForCausalLM.from_pretrained(trained / "target", output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensors
    assistant, info = Gemma4AssistantForCausalLM.from_pretrained(
        trained / "assistant", output_loading_info=True
    )
    assert not any(info.values()), info
    assert target.dtype == assistant.dtype == torch.bfloat16
    assert (target.generation_config.eos_token_id, assistant.config.backbone_hidden_size) == (
        tp.EOS_ID,
        target.config.hidden_size,
    )


def test_checkpoints_load_with_graphrt_and_bind(trained):
    from graphrt.core.models import load_model

    cpu = torch.device("cpu")  # a plain torch device: the checkpoint's own dtype
    target = load_model(str(trained / "target"), cpu)
    drafter = load_model(str(trained / "assistant"), cpu)
    assert next(target.model.parameters()).dtype == torch.bfloat16
    assert next(drafter.model.parameters()).dtype == torch.bfloat16
    assert target.eos_token_ids == (tp.EOS_ID,)
    drafter.model.bind_target(target.model)  # raises when the pair does not fit


def test_cli_speculative_generate_on_the_pair_equals_transformers_greedy(capsys, trained):
    """How a user runs the pair: `graphrt generate --model target --draft assistant`. The
    CLI loads both (float32 on the CPU), binds the drafter and must decode losslessly."""
    from transformers import Gemma4ForCausalLM

    from graphrt.core.cli.main import main

    prompt, new_tokens = list(range(3, 3 + 2 * 7, 2)), 12
    hf = Gemma4ForCausalLM.from_pretrained(trained / "target", dtype=torch.float32).eval()
    expected, _ = hf_greedy(hf, prompt, new_tokens)
    argv = ["generate", "--model", str(trained / "target"), "--draft", str(trained / "assistant")]
    argv += ["--device", "cpu", "--runner", "eager", "--spec-steps", "2", "--ignore-eos"]
    argv += ["--max-new-tokens", str(new_tokens), "--prompt-ids", ",".join(map(str, prompt))]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["requests"][0]["output_ids"] == expected
    assert out["stats"]["spec"]["rounds"] > 0


def test_target_continuations_are_train_prompts_continued_by_the_target():
    from transformers import Gemma4ForCausalLM

    torch.manual_seed(0)
    target = Gemma4ForCausalLM(tp.target_config(300)).eval()
    ids = torch.randint(3, 300, (500,), dtype=torch.int32)
    cfg = tp.TrainConfig(window=24, distill_sequences=3, distill_prompt=8)
    seqs = tp.target_continuations(
        target, ids, cfg, torch.Generator().manual_seed(0), torch.device("cpu")
    )
    assert seqs.shape == (3, 24) and seqs.dtype == torch.long
    windows = ids.long().unfold(0, 8, 1)  # every 8-token window of the stream
    for row in seqs:
        assert (windows == row[:8]).all(-1).any(), "the prompt is not a window of the train ids"
    # distill_greedy (0.5) of 3, rounded: the first 2 are greedy, their first new token the
    # target's argmax after the prompt.
    with torch.no_grad():
        first = target(input_ids=seqs[:2, :8]).logits[:, -1].argmax(-1)
    assert torch.equal(first, seqs[:2, 8])


def test_train_from_a_trained_target_trains_the_assistant_only(trained, tmp_path):
    from safetensors.torch import load_file

    argv = ["train", "--tokens", str(trained.parent / "tokens.pt"), "--target-from"]
    argv += [str(trained / "target"), "--tokenizer", str(trained.parent / "tokenizer")]
    argv += ["--out", str(tmp_path), "--window", "32", "--batch", "2", "--assistant-steps", "2"]
    argv += ["--draft-steps", "2", "--device", "cpu", "--budget-s", "30"]
    tp.main(argv)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["target_from"] == str(trained / "target") and "target_steps_run" not in report
    assert report["assistant_steps_run"] == 2
    given = load_file(trained / "target" / "model.safetensors")
    written = load_file(tmp_path / "target" / "model.safetensors")
    assert given.keys() == written.keys()
    assert all(torch.equal(given[k], written[k]) for k in given)  # bf16 -> f32 -> bf16: exact
