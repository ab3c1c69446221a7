"""Engine: admission, batching, sampling, and the step loop over a runner."""

from graphrt.core.engine.engine import Engine, EngineConfig, EngineStats
from graphrt.core.engine.request import FinishReason, Request, SamplingParams

__all__ = ["Engine", "EngineConfig", "EngineStats", "FinishReason", "Request", "SamplingParams"]
