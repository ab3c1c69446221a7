"""Serving: text in and out over the engine (``LLM``), one engine loop thread for many
callers (``EngineLoop``), and ``graphrt serve`` (``app``, ``server``, core/cli/serve.py).

A composition root like the CLI: it builds engines, drafters included, from names."""

from graphrt.core.serve.llm import LLM, Completion, TextParams
from graphrt.core.serve.loop import Draining, EngineLoop

__all__ = ["LLM", "Completion", "Draining", "EngineLoop", "TextParams"]
