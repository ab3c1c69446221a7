"""Incremental detokenisation (core/text.py): the deltas joined are the whole text, and no
delta ends inside a multi-byte character."""

from __future__ import annotations

import random

from tokenizers import Tokenizer

from graphrt.core import pretrained
from graphrt.core.text import REPLACEMENT, IncrementalDetokenizer

TOKENIZER = Tokenizer.from_file(str(pretrained.TARGET_DIR / "tokenizer.json"))


def _deltas(ids: list[int], chunk: int) -> list[str]:
    detokenizer = IncrementalDetokenizer(TOKENIZER)
    deltas = [detokenizer.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return [*deltas, detokenizer.flush()]


def test_text_with_multibyte_characters_streams_whole_characters():
    text = "def f():\n    return 'héllo wörld ✓ 日本語 😀'  # ünïcode\n"
    ids = TOKENIZER.encode(text).ids
    for chunk in (1, 2, 3):
        deltas = _deltas(ids, chunk)
        assert "".join(deltas) == TOKENIZER.decode(ids) == text
        assert not any(REPLACEMENT in d for d in deltas)


def test_random_ids_join_to_the_whole_decode():
    vocab = TOKENIZER.get_vocab_size()
    for seed in range(100):
        rng = random.Random(seed)
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 50))]
        whole = TOKENIZER.decode(ids, skip_special_tokens=True)
        assert "".join(_deltas(ids, 1 + seed % 3)) == whole, seed
