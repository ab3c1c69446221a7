"""Engine: admission, batching, sampling, and the step loop over a runner."""

from graphrt.core.engine.config import EngineConfig
from graphrt.core.engine.engine import Engine
from graphrt.core.engine.request import FinishReason, Request, SamplingParams
from graphrt.core.engine.stats import EngineStats

__all__ = ["Engine", "EngineConfig", "EngineStats", "FinishReason", "Request", "SamplingParams"]
