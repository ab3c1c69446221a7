"""graphrt.spec: device-neutral speculative decoding (frozen-KV MTP drafting, verify trees, lossless acceptance)."""

from graphrt.spec.config import SpecConfig
from graphrt.spec.load import load_drafting
from graphrt.spec.strategy import MTPDecoding

__all__ = ["MTPDecoding", "SpecConfig", "load_drafting"]
