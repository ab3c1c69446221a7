"""The small trained Gemma 4 pair that ships inside graphrt: `graphrt generate` runs it
when no --model is given, with its assistant drafting (frozen-KV MTP).

- ``gemma4-code-target``: a 7M-parameter Gemma 4 text model (sliding and full layers,
  per-layer inputs, KV sharing, double-wide MLP, logit softcapping), trained on the
  Python standard library's source (corpus_manifest.json lists the files, with the
  held-out ones), byte-level BPE tokenizer of 4,096 tokens;
- ``gemma4-code-assistant``: its MTP assistant, trained against the frozen target.

Both are Hugging Face checkpoints (transformers' Gemma4ForCausalLM and
Gemma4AssistantForCausalLM load them too), made by scripts/train_tokenizer.py and
scripts/train_pair.py; training_report.json holds that run's settings and figures.
"""

from __future__ import annotations

from pathlib import Path

from graphrt.core.errors import UsageError

_HERE = Path(__file__).resolve().parent

TARGET_DIR = _HERE / "gemma4-code-target"
ASSISTANT_DIR = _HERE / "gemma4-code-assistant"


def model_and_draft(model, draft) -> tuple[str, str | None]:
    """What to load: ``model`` (None: the embedded target) and the assistant to draft
    with. ``draft``: a checkpoint; None or True: the embedded assistant where the model
    is the embedded target (None: no drafter for another model); False: no drafter."""
    if model is None:
        model = TARGET_DIR
        if draft is None or draft is True:
            draft = ASSISTANT_DIR
    elif draft is True:
        raise UsageError("draft=True means the embedded assistant, which drafts for the "
                         "embedded model only: name an assistant checkpoint")  # fmt: skip
    return str(model), str(draft) if draft else None
