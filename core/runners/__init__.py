"""Runners: the shared surface (can_run_graph, load_batch, execute)."""

from graphrt.core.runners.base import BaseRunner, RunnerOutput
from graphrt.core.runners.eager import EagerRunner

__all__ = ["BaseRunner", "EagerRunner", "RunnerOutput"]
