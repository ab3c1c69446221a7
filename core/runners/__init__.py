"""Runners: the shared surface (can_run_graph, load_batch, execute)."""

from graphrt.core.runners.backend import ExecutionBackend, ShapeKey
from graphrt.core.runners.base import BaseRunner, RunnerOutput
from graphrt.core.runners.buffers import GraphShape, StaticField
from graphrt.core.runners.eager import EagerRunner
from graphrt.core.runners.graph import GraphRunner, GraphRunnerConfig

__all__ = [
    "BaseRunner",
    "EagerRunner",
    "ExecutionBackend",
    "GraphRunner",
    "GraphRunnerConfig",
    "GraphShape",
    "RunnerOutput",
    "ShapeKey",
    "StaticField",
]
