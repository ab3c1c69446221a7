"""Attention backends: the interface, the torch reference, and lookup by name."""

from graphrt.core.attention.base import AttentionBackend, AttentionSpec
from graphrt.core.attention.torch_ref import TorchAttentionBackend

__all__ = ["AttentionBackend", "AttentionSpec", "TorchAttentionBackend"]
