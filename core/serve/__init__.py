"""Serving: text in and out over the engine (``LLM``), and ``graphrt serve`` (to come).

A composition root like the CLI: it builds engines, drafters included, from names."""

from graphrt.core.serve.llm import LLM, Completion, TextParams

__all__ = ["LLM", "Completion", "TextParams"]
