"""Train the byte-level BPE tokenizer of graphrt's small Gemma 4 target/assistant pair.

Trained on the train split of the stdlib corpus (scripts/corpus.py) only, so the
held-out files stay unseen by both tokenizer and models. Writes into --out:
tokenizer.json (read by `tokenizers` and graphrt), tokenizer_config.json (so
transformers' AutoTokenizer loads the folder) and corpus_manifest.json.

    python scripts/train_tokenizer.py --out /tmp/tok4096 [--vocab-size 4096] [--corpus-root DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from corpus import Corpus, collect
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

# Order fixes the ids: <pad> 0, <bos> 1, <eos> 2, <unk> 3 (the trainer adds them first).
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
MIN_FREQUENCY = 2


def train_tokenizer(corpus: Corpus, vocab_size: int) -> Tokenizer:
    # Byte-level: every byte is in the alphabet, so any text encodes without <unk> and
    # decodes back exactly. No prefix space: source files start at column 0 and a
    # leading space would change the first token of every prompt.
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=MIN_FREQUENCY,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Whole files, not lines: the pre-tokenizer's whitespace runs cross newlines
    # ("\n\n    def"), and training must see the pieces encoding will see.
    tokenizer.train_from_iterator(corpus.train_texts(), trainer, length=len(corpus.train))
    return tokenizer


CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['content'] }}"
    "{% if not loop.last or add_generation_prompt %}{{ '\\n' }}{% endif %}{% endfor %}"
)


def save(tokenizer: Tokenizer, out_dir: Path, corpus: Corpus) -> None:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    pad, bos, eos, unk = SPECIAL_TOKENS
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": pad,
        "unk_token": unk,
        # transformers would otherwise rewrite " ." to "." etc. on decode, breaking
        # the exact round trip of source code.
        "clean_up_tokenization_spaces": False,
        # A code model's chat: the messages' text, a line each; the answer goes on from
        # the next line (graphrt.LLM.chat and graphrt serve's /v1/chat/completions).
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    corpus.write_manifest(out_dir / "corpus_manifest.json")


def bytes_per_token(tokenizer: Tokenizer, texts: Iterable[str]) -> tuple[int, int]:
    """(UTF-8 bytes, tokens) over texts: how much a token carries on unseen code."""
    texts = list(texts)
    encodings = tokenizer.encode_batch(texts, add_special_tokens=False)
    return sum(len(t.encode("utf-8")) for t in texts), sum(len(e.ids) for e in encodings)


@contextmanager
def phase(name: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    print(f"[train_tokenizer] {name}: {time.perf_counter() - start:.2f} s", file=sys.stderr)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--corpus-root",
        type=Path,
        default=Path(sysconfig.get_paths()["stdlib"]),
        help="tree of *.py files; the default is this interpreter's stdlib",
    )
    parser.add_argument("--vocab-size", type=int, default=4096, help="including special tokens")
    # SUPPRESS: a required flag has no default to show in --help.
    parser.add_argument(
        "--out", type=Path, required=True, default=argparse.SUPPRESS, help="output folder"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with phase("collect"):
        corpus = collect(args.corpus_root)
    manifest = corpus.manifest()
    print(
        f"[train_tokenizer] corpus {corpus.root}: {manifest['total']['files']} files,"
        f" {manifest['total']['bytes'] / 1e6:.2f} MB; train {manifest['train']['files']},"
        f" held out {manifest['heldout']['files']}",
        file=sys.stderr,
    )
    with phase("train"):
        tokenizer = train_tokenizer(corpus, args.vocab_size)
    with phase("save"):
        save(tokenizer, args.out, corpus)
    with phase("evaluate held out"):
        n_bytes, n_tokens = bytes_per_token(tokenizer, corpus.heldout_texts())
    print(
        f"[train_tokenizer] vocab {tokenizer.get_vocab_size()}; held out {n_bytes} bytes"
        f" / {n_tokens} tokens = {n_bytes / max(n_tokens, 1):.3f} bytes/token",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
