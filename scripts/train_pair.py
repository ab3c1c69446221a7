"""Train graphrt's small Gemma 4 target and its frozen-KV MTP assistant.

Two steps, so the GPU machine needs neither the corpus nor `tokenizers`:

    # here: corpus -> token ids (train / held-out split of scripts/corpus.py)
    python scripts/train_pair.py tokenize --tokenizer DIR --out tokens.pt [--corpus-root DIR]
    # on the GPU: target, then assistant against the frozen target; HF checkpoints out
    python scripts/train_pair.py train --tokens tokens.pt --tokenizer DIR --out DIR

The target is a transformers ``Gemma4ForCausalLM`` small enough to ship (sliding and
full layers, per-layer inputs, KV sharing over its last two layers, double-wide MLP
there, logit softcapping): graphrt's whole Gemma 4 path. The assistant is a
transformers ``Gemma4AssistantForCausalLM`` trained the way spec/ drafts with it:

- anchor t (every position of a training window at once): the target has KV for
  tokens 0..t and produced token t+1 from its final hidden h_t; draft step 1 reads
  ``[embed(x[t+1]), h_t]`` at position t+1 over that KV (sliding layers: the window + 1
  newest entries, as transformers masks them) and should give the target's next-token distribution at t+1;
- step j > 1 reads ``[embed(x[t+j]), post_projection of step j-1]`` at the same
  frozen position over the same KV and should give the target's distribution at t+j.
  Inputs are the window's tokens: under greedy decoding an accepted draft is the
  target's own token, so this is the case acceptance depends on.

Loss: KL(target || assistant) per step, over anchors whose step-j target exists. The
masks are checked against transformers' own one-query assistant forward in
tests/test_train_pair.py. Seeds are fixed; each phase may stop early at its time
budget (the step count reached is recorded in the report).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

EOS_ID, BOS_ID, PAD_ID = 2, 1, 0  # scripts/train_tokenizer.py's special-token ids


@dataclass(frozen=True)
class TrainConfig:
    window: int = 512  # tokens per training sequence
    batch: int = 64
    target_steps: int = 1200
    assistant_steps: int = 1200
    draft_steps: int = 4  # draft steps unrolled per anchor while training the assistant
    lr: float = 2e-3
    warmup: int = 50
    weight_decay: float = 0.05
    budget_s: float = 120.0  # per phase: stops early past it
    seed: int = 0
    # Self-distillation: the target's own continuations of this many train prompts (the
    # text it drafts on at generation time) make up ``distill_share`` of the assistant's
    # batches, ``distill_greedy`` of them greedy, the rest sampled at temperature 1.
    # Under greedy decoding an accepted draft chain is the target's greedy text, so that
    # is what teacher forcing should feed. 0: corpus windows only.
    distill_sequences: int = 0
    distill_prompt: int = 32  # prompt tokens of each continuation
    distill_share: float = 0.5
    distill_greedy: float = 0.5


# The target's shapes the assistant must match (it reads the target's KV and hidden).
TARGET = dict(hidden=256, kv_heads=1, head_dim=64, global_head_dim=128, window=128, positions=4096)


def target_config(vocab: int):
    from transformers import Gemma4TextConfig

    s, f = "sliding_attention", "full_attention"
    return Gemma4TextConfig(
        vocab_size=vocab,
        hidden_size=TARGET["hidden"],
        intermediate_size=640,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=TARGET["kv_heads"],
        head_dim=TARGET["head_dim"],
        global_head_dim=TARGET["global_head_dim"],
        layer_types=[s, s, f, s, s, f],
        sliding_window=TARGET["window"],
        num_kv_shared_layers=2,  # layers 4, 5 read layers 3 (sliding) and 2 (full)
        hidden_size_per_layer_input=32,
        vocab_size_per_layer_input=vocab,
        use_double_wide_mlp=True,
        final_logit_softcapping=30.0,
        max_position_embeddings=TARGET["positions"],
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        tie_word_embeddings=True,
    )


def assistant_config(vocab: int):
    from transformers import Gemma4AssistantConfig

    text = dict(
        model_type="gemma4_text",
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=TARGET["kv_heads"],
        head_dim=TARGET["head_dim"],
        global_head_dim=TARGET["global_head_dim"],
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=TARGET["window"],
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0,
        max_position_embeddings=TARGET["positions"],
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    return Gemma4AssistantConfig(text_config=text, backbone_hidden_size=TARGET["hidden"])


# ---- tokenize ------------------------------------------------------------------------


def tokenize(tokenizer_dir: Path, corpus_root: Path | None) -> dict:
    """{"train", "heldout": int32 ids (each file's ids then <eos>), "heldout_bytes", manifest}."""
    sys.path.insert(0, str(Path(__file__).parent))
    from corpus import collect
    from tokenizers import Tokenizer

    corpus = collect(corpus_root)
    tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))

    def stream(texts) -> tuple[torch.Tensor, int]:
        ids, size = [], 0
        for text in texts:
            ids.extend(tok.encode(text).ids)
            ids.append(EOS_ID)
            size += len(text.encode())
        return torch.tensor(ids, dtype=torch.int32), size

    train, _ = stream(corpus.train_texts())
    heldout, heldout_bytes = stream(corpus.heldout_texts())
    return {
        "train": train,
        "heldout": heldout,
        "heldout_bytes": heldout_bytes,
        "manifest": corpus.manifest(),
    }


# ---- training ------------------------------------------------------------------------


def windows(ids: torch.Tensor, cfg: TrainConfig, gen: torch.Generator) -> torch.Tensor:
    """(batch, window + 1) random windows of the id stream (inputs and next-token labels)."""
    starts = torch.randint(0, ids.numel() - cfg.window - 1, (cfg.batch,), generator=gen)
    return torch.stack([ids[s : s + cfg.window + 1] for s in starts.tolist()]).long()


def lr_at(step: int, progress: float, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine to 10% over ``progress`` (0..1: steps or time budget,
    whichever runs out first, so a phase cut by its budget still ends annealed)."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def optimizer(model, cfg: TrainConfig):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and p.requires_grad]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2 and p.requires_grad]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": rest, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), fused=torch.cuda.is_available())


def train_loop(name: str, model, loss_fn, total: int, cfg: TrainConfig, log) -> int:
    """AdamW with warmup + cosine; stops at ``total`` steps or the time budget. -> steps run."""
    opt = optimizer(model, cfg)
    start, step = time.perf_counter(), 0
    while step < total and time.perf_counter() - start < cfg.budget_s:
        progress = max(step / total, (time.perf_counter() - start) / cfg.budget_s)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, progress, cfg)
        loss = loss_fn(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == total - 1:
            log(f"{name} step {step}/{total}: loss {loss.item():.4f}")
        step += 1
    return step


def autocast(device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def train_target(tokens: dict, cfg: TrainConfig, device: torch.device, log):
    from transformers import Gemma4ForCausalLM

    torch.manual_seed(cfg.seed)
    vocab = int(tokens["vocab_size"])
    model = Gemma4ForCausalLM(target_config(vocab)).to(device).train()
    train_ids = tokens["train"]
    gen = torch.Generator().manual_seed(cfg.seed)

    def loss_fn(step):
        seq = windows(train_ids, cfg, gen).to(device)
        with autocast(device):
            logits = model(input_ids=seq[:, :-1]).logits
        return F.cross_entropy(logits.float().flatten(0, 1), seq[:, 1:].flatten())

    steps = train_loop("target", model, loss_fn, cfg.target_steps, cfg, log)
    return model.eval(), steps


def heldout_bits_per_byte(model, tokens: dict, cfg: TrainConfig, device: torch.device) -> float:
    """Bits per byte of the held-out files: next-token NLL over the held-out stream in
    windows of ``cfg.window`` (each window's first token scored from its own start)."""
    ids = tokens["heldout"].long()
    nll, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, ids.numel() - 1, cfg.window):
            seq = ids[start : start + cfg.window + 1].to(device)[None]
            with autocast(device):
                logits = model(input_ids=seq[:, :-1]).logits
            nll += F.cross_entropy(logits.float()[0], seq[0, 1:], reduction="sum").item()
            count += seq.shape[1] - 1
    return nll / math.log(2) / tokens["heldout_bytes"]


def anchor_masks(length: int, window: int, device) -> dict[str, torch.Tensor]:
    """Boolean (1, 1, T, T) masks of what draft queries at anchors 0..T-1 may read of the
    target's KV: full layers every key 0..t, sliding layers the window + 1 newest (the
    inclusive window transformers gives the assistant's one-query forward)."""
    q = torch.arange(length, device=device)[:, None]
    k = torch.arange(length, device=device)[None, :]
    causal = k <= q
    return {
        "full_attention": causal[None, None],
        "sliding_attention": (causal & (k >= q - window))[None, None],
    }


def draft_logits(target, assistant, seq: torch.Tensor, steps: int):
    """Teacher-forced drafting at every anchor of ``seq`` (B, T): -> (target log-probs
    (B, T, V), [assistant logits (B, T, V) of step 1..steps]); step j's logits at anchor
    t are the draft for token t + j + 1, to be compared with the target's at t + j."""
    with torch.no_grad():
        out = target(input_ids=seq, output_hidden_states=True, return_shared_kv_states=True)
        target_logp = out.logits.float().log_softmax(-1)
        hidden = out.hidden_states[-1]  # (B, T, H): the hidden spec/ seeds drafts with
        shared_kv = out.shared_kv_states
        embed = target.get_input_embeddings()
    length = seq.shape[1]
    masks = anchor_masks(length, TARGET["window"], seq.device)
    positions = (torch.arange(length, device=seq.device) + 1).expand(seq.shape[0], -1)
    drafts = []
    for j in range(1, steps + 1):
        # token t + j at anchor t: shift the window left by j (the tail has no token: pad)
        tokens = torch.full_like(seq, PAD_ID)
        tokens[:, : length - j] = seq[:, j:]
        inputs = torch.cat([embed(tokens), hidden], dim=-1)
        drafted = assistant_step(assistant, inputs, positions, masks, shared_kv)
        drafts.append(drafted.logits.float())
        hidden = drafted.last_hidden_state  # post_projection: the next step's seed
    return target_logp, drafts


def assistant_step(assistant, inputs, positions, masks, shared_kv):
    """One draft step for every anchor at once: transformers' assistant forward with the
    anchors' masks in place of its one-query mask."""
    from transformers.models.gemma4_assistant.modeling_gemma4_assistant import (
        Gemma4AssistantOutput,
    )

    x = assistant.pre_projection(inputs)
    out = assistant.model(
        inputs_embeds=x,
        attention_mask=masks,
        position_ids=positions,
        shared_kv_states=shared_kv,
        use_cache=False,
        # Not an int: keeps transformers from slicing the queries for KV-shared layers
        # (every assistant layer is one), which fails on its absent per-layer inputs.
        logits_to_keep=None,
    )
    last = out.last_hidden_state
    return Gemma4AssistantOutput(
        last_hidden_state=assistant.post_projection(last), logits=assistant.lm_head(last)
    )


def draft_loss(target_logp, drafts) -> torch.Tensor:
    """Mean over steps of KL(target || draft) at the anchors where step j has a target."""
    total = 0.0
    length = target_logp.shape[1]
    for j, logits in enumerate(drafts, start=1):
        want = target_logp[:, j:length]  # target at t + j, anchors 0..T-1-j
        got = logits[:, : length - j].log_softmax(-1)
        total = total + F.kl_div(got, want, log_target=True, reduction="none").sum(-1).mean()
    return total / len(drafts)


def train_assistant(target, tokens: dict, cfg: TrainConfig, device: torch.device, log):
    from transformers import Gemma4AssistantForCausalLM

    torch.manual_seed(cfg.seed + 1)
    target.requires_grad_(False)
    vocab = int(tokens["vocab_size"])
    assistant = Gemma4AssistantForCausalLM(assistant_config(vocab)).to(device).train()
    train_ids = tokens["train"]
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    continuations = None
    if cfg.distill_sequences:
        continuations = target_continuations(target, train_ids, cfg, gen, device)
        log(f"assistant: {continuations.shape[0]} target continuations of {continuations.shape[1]}")

    def loss_fn(step):
        seq = windows(train_ids, cfg, gen)[:, :-1].to(device)
        # distill_share of the batches (evenly spread): the target's own text
        if continuations is not None and int((step + 1) * cfg.distill_share) > int(
            step * cfg.distill_share
        ):
            pick = torch.randint(0, continuations.shape[0], (cfg.batch,), generator=gen)
            seq = continuations[pick.to(continuations.device)]
        with autocast(device):
            target_logp, drafts = draft_logits(target, assistant, seq, cfg.draft_steps)
        return draft_loss(target_logp, drafts)

    steps = train_loop("assistant", assistant, loss_fn, cfg.assistant_steps, cfg, log)
    return assistant.eval(), steps


def target_continuations(target, ids: torch.Tensor, cfg: TrainConfig, gen, device):
    """(distill_sequences, window) token windows: a train prompt of ``distill_prompt``
    tokens, then the target's continuation (the first ``distill_greedy`` of them greedy,
    the rest sampled at temperature 1)."""
    starts = torch.randint(
        0, ids.numel() - cfg.distill_prompt, (cfg.distill_sequences,), generator=gen
    )
    prompts = torch.stack([ids[s : s + cfg.distill_prompt] for s in starts.tolist()]).long()
    new = cfg.window - cfg.distill_prompt
    greedy = round(cfg.distill_sequences * cfg.distill_greedy)
    chunks = [(c, False) for c in prompts[:greedy].split(512)]
    chunks += [(c, True) for c in prompts[greedy:].split(512)]
    out = []
    with torch.no_grad(), autocast(device):
        for chunk, sample in chunks:
            seqs = target.generate(
                chunk.to(device),
                attention_mask=torch.ones_like(chunk, device=device),
                max_new_tokens=new,
                min_new_tokens=new,  # fixed-length windows: <eos> is just another token
                do_sample=sample,
                temperature=1.0 if sample else None,
                top_k=0 if sample else None,
                top_p=1.0 if sample else None,
                pad_token_id=PAD_ID,
            )
            out.append(seqs[:, : cfg.window])
    return torch.cat(out)


def draft_accuracy(target, assistant, tokens: dict, cfg: TrainConfig, device) -> list[float]:
    """Per draft step, how often the assistant's argmax equals the target's on held-out
    windows (teacher-forced: an estimate of per-step acceptance under greedy decoding)."""
    ids = tokens["heldout"].long()
    hits = [0] * cfg.draft_steps
    counts = [0] * cfg.draft_steps
    with torch.no_grad():
        for start in range(0, ids.numel() - cfg.window, cfg.window):
            seq = ids[start : start + cfg.window].to(device)[None]
            with autocast(device):
                target_logp, drafts = draft_logits(target, assistant, seq, cfg.draft_steps)
            for j, logits in enumerate(drafts, start=1):
                want = target_logp[0, j:].argmax(-1)
                got = logits[0, : seq.shape[1] - j].argmax(-1)
                hits[j - 1] += (want == got).sum().item()
                counts[j - 1] += want.numel()
    return [h / max(1, c) for h, c in zip(hits, counts)]


def save(model, out_dir: Path, tokenizer_dir: Path) -> None:
    import shutil

    out_dir.mkdir(parents=True, exist_ok=True)
    model.generation_config.bos_token_id = BOS_ID
    model.generation_config.eos_token_id = EOS_ID
    model.generation_config.pad_token_id = PAD_ID
    model.to(torch.bfloat16).save_pretrained(out_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (Path(tokenizer_dir) / name).exists():
            shutil.copy(Path(tokenizer_dir) / name, out_dir / name)


# ---- CLI -----------------------------------------------------------------------------


@contextmanager
def phase(name: str):
    start = time.perf_counter()
    print(f"{name}...", file=sys.stderr, flush=True)
    yield
    print(f"{name}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    tok = sub.add_parser("tokenize", help="corpus -> token ids (train / held-out)")
    tok.add_argument("--tokenizer", type=Path, required=True, help="folder with tokenizer.json")
    tok.add_argument("--corpus-root", type=Path, help="default: this Python's stdlib")
    tok.add_argument("--out", type=Path, required=True, help="the .pt file to write")
    train = sub.add_parser("train", help="train the target, then the assistant")
    train.add_argument("--tokens", type=Path, required=True, help="from `tokenize`")
    train.add_argument("--tokenizer", type=Path, required=True, help="copied into both outputs")
    train.add_argument("--out", type=Path, required=True, help="writes target/, assistant/")
    train.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    train.add_argument(
        "--target-from",
        type=Path,
        help="a trained target checkpoint: train only the assistant against it",
    )
    for field, default in asdict(TrainConfig()).items():
        train.add_argument(
            f"--{field.replace('_', '-')}",
            type=type(default),
            default=default,
            help=f"(default: {default})",
        )
    args = parser.parse_args(argv)

    if args.command == "tokenize":
        from tokenizers import Tokenizer

        with phase("tokenize"):
            data = tokenize(args.tokenizer, args.corpus_root)
            vocab = Tokenizer.from_file(str(args.tokenizer / "tokenizer.json")).get_vocab_size()
            data["vocab_size"] = vocab
            args.out.parent.mkdir(parents=True, exist_ok=True)
            torch.save(data, args.out)
        print(
            f"train {data['train'].numel()} tokens, held-out {data['heldout'].numel()} "
            f"({data['heldout_bytes']} bytes), vocab {vocab}",
            file=sys.stderr,
        )
        return

    cfg = TrainConfig(**{f: getattr(args, f) for f in asdict(TrainConfig())})
    device = torch.device(args.device)
    tokens = torch.load(args.tokens)
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    report: dict = {"config": asdict(cfg), "device": str(device)}
    if args.target_from is not None:
        from transformers import Gemma4ForCausalLM

        with phase(f"target from {args.target_from}"):
            target = Gemma4ForCausalLM.from_pretrained(args.target_from, dtype=torch.float32)
            target = target.to(device).eval()
            report["target_from"] = str(args.target_from)
    else:
        with phase("target"):
            target, report["target_steps_run"] = train_target(tokens, cfg, device, log)
    with phase("held-out bits per byte"):
        report["heldout_bits_per_byte"] = heldout_bits_per_byte(target, tokens, cfg, device)
    with phase("assistant"):
        assistant, report["assistant_steps_run"] = train_assistant(target, tokens, cfg, device, log)
    with phase("held-out draft accuracy"):
        report["draft_step_accuracy"] = draft_accuracy(target, assistant, tokens, cfg, device)
    with phase("save"):
        save(target, args.out / "target", args.tokenizer)
        save(assistant, args.out / "assistant", args.tokenizer)
        manifest = tokens["manifest"]  # the file list itself stays in the tokens file
        report["corpus"] = {
            "python": manifest["python"],
            **{
                k: {"files": manifest[k]["files"], "bytes": manifest[k]["bytes"]}
                for k in ("train", "heldout")
            },
        }
        (args.out / "report.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
