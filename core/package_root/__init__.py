"""graphrt: an accelerator-agnostic model execution runtime for LLM decoding.

This file is installed as ``graphrt/__init__.py`` (pyproject's package-dir maps the
``graphrt`` package here; core/, devices/ and spec/ install as its subpackages). It
imports nothing at import time: ``import graphrt.core.cli.main`` must stay light (the
CLI's start-up), so the names below load on first use.

    import graphrt

    llm = graphrt.LLM()  # the embedded pair, drafting where it pays
    print(llm.generate("def fibonacci(n):", graphrt.TextParams(max_tokens=32))[0].text)
"""

from __future__ import annotations

# name -> the module that defines it
_EXPORTS = {
    "LLM": "graphrt.core.serve.llm",
    "TextParams": "graphrt.core.serve.llm",
    "Completion": "graphrt.core.serve.llm",
    "Engine": "graphrt.core.engine",
    "EngineConfig": "graphrt.core.engine",
    "SamplingParams": "graphrt.core.engine",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'graphrt' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
