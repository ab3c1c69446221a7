"""Text from tokens as they arrive: incremental detokenisation.

Decoding each new token alone breaks text two ways: a multi-byte character split over
two byte-level tokens decodes as U+FFFD halves, and tokenizers that drop or add a
space at a token's start (SentencePiece's metaspace) decode a suffix differently from
the whole. So, as vLLM and transformers' TextStreamer do, each delta is the text of a
short window of tokens ending at the newest, minus the text of the same window without
the new tokens; a delta that ends in U+FFFD waits for the next token. The deltas joined
are the whole sequence's text (``flush`` gives what is held back at the end).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from graphrt.core.errors import CheckpointError, first_line

REPLACEMENT = "\ufffd"  # what a decoder emits for an incomplete UTF-8 sequence


class IncrementalDetokenizer:
    """``push(ids)`` -> the text those tokens add; ``flush()`` -> what is still held back.

    ``tokenizer``: anything with ``decode(ids, skip_special_tokens=...)`` (a
    ``tokenizers.Tokenizer``, a transformers tokenizer)."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # window start: tokens before it are settled text
        self._read = 0  # tokens whose text has been handed out

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=self._skip)

    def push(self, ids: Sequence[int]) -> str:
        self._ids.extend(ids)
        before = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        if len(text) <= len(before) or text.endswith(REPLACEMENT):
            return ""  # nothing new yet, or a character still incomplete
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(before) :]

    def flush(self) -> str:
        """The text of tokens held back (an incomplete character stays U+FFFD)."""
        before = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return text[len(before) :]


def load_tokenizer(path: Path | None):
    """A checkpoint's ``tokenizer.json`` as a ``tokenizers.Tokenizer``; None without one.
    Raises ``CheckpointError`` (one line) for a file it cannot read."""
    if path is None:
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises plain Exceptions on malformed files
        raise CheckpointError(f"cannot read {path}: {first_line(e)}") from None
