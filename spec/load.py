"""An MTP assistant loaded to draft for a loaded target: one place for the rule that
they share KV, so the assistant runs in the target's dtype whatever it was saved in."""

from __future__ import annotations

from pathlib import Path

from graphrt.core.models import load_model
from graphrt.core.models.loader import LoadedModel
from graphrt.core.parallel.group import SINGLE, TPGroup
from graphrt.spec.config import SpecConfig
from graphrt.spec.strategy import MTPDecoding


def load_drafting(
    draft: str | Path,
    target: LoadedModel,
    device,
    spec: SpecConfig,
    check_finite: bool | None = None,
    tp: TPGroup = SINGLE,
) -> MTPDecoding:
    """The decode strategy that drafts with the assistant checkpoint ``draft`` (a
    directory or random:PRESET) for ``target``, on ``device``, with ``spec``'s rounds."""
    drafter = load_model(str(draft), device, target.dtype, check_finite=check_finite, tp=tp)
    return MTPDecoding(drafter, spec)
