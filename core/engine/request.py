"""Requests and their sampling parameters."""

from __future__ import annotations

import enum
import math
import numbers
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from graphrt.core.errors import RequestError

MIN_TEMPERATURE = 1e-6


def is_int(value) -> bool:
    # numpy and torch integer scalars are Integral too; a bool is not a token or a count.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _require_int(name: str, value) -> None:
    if not is_int(value):
        raise RequestError(f"{name} must be an integer, got {value!r}")


def _require_number(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise RequestError(f"{name} must be a number, got {value!r}")


def _require_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be True or False, got {value!r}")


def sampling_params(params) -> SamplingParams:
    """``params``, or the defaults for None; anything else is refused."""
    if params is None:
        return SamplingParams()
    if not isinstance(params, SamplingParams):
        raise RequestError(f"params must be a SamplingParams, got {type(params).__name__}")
    return params


def token_ids(prompt: Iterable) -> list[int]:
    """A prompt as a list of Python ints: integers (or a 1-D integer tensor) only. Never
    coerced: "5", 1.9 or True as a token id is a caller's bug, refused in one line."""
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() != 1 or prompt.is_floating_point() or prompt.dtype == torch.bool:
            raise RequestError(
                f"a prompt tensor must be 1-D and integer, got {prompt.dim()}-D {prompt.dtype}"
            )
        return prompt.tolist()
    if isinstance(prompt, (str, bytes)):
        raise RequestError(f"a prompt is a sequence of token ids, got the string {prompt!r}")
    try:
        ids = list(prompt)
    except TypeError:
        raise RequestError(f"a prompt is a sequence of token ids, got {prompt!r}") from None
    if set(map(type, ids)) <= {int}:  # plain ints (bool is a subclass, not int itself)
        return ids  # at C speed: the check below took 14 ms for an 8k-token prompt
    for i, t in enumerate(ids):
        if not is_int(t):
            raise RequestError(
                f"prompt token {i} is {t!r} ({type(t).__name__}): token ids must be integers"
            )
    return [int(t) for t in ids]


MAX_TOP_K = 2**31 - 1  # a device tensor holds it; any vocabulary is smaller


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k cut
    seed: int | None = None  # None: derived from the engine seed and the request id
    ignore_eos: bool = False
    return_logits: bool = False  # keep each step's logits on the request (tests, logprobs)
    # False: this request takes no drafted tokens (an engine with a drafter gives it one
    # token a step, the target's own, as a plain step would); True: drafts where they pay.
    speculate: bool = True

    def __post_init__(self):
        # Integers are integers: 1.5 tokens or top_k 2.5 is a caller's bug, not a rounding.
        for name in ("max_new_tokens", "top_k"):
            _require_int(name, getattr(self, name))
        for name in ("temperature", "top_p"):
            _require_number(name, getattr(self, name))
        for name in ("ignore_eos", "return_logits", "speculate"):
            _require_bool(name, getattr(self, name))
        if self.seed is not None:
            _require_int("seed", self.seed)
            if not -(2**63) <= self.seed < 2**64:
                raise RequestError(f"seed must fit in 64 bits, got {self.seed}")
        if self.max_new_tokens < 1:
            raise RequestError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise RequestError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            # logits / temperature overflows to inf and the softmax to NaN
            raise RequestError(
                f"temperature {self.temperature} is too small to sample with (>= "
                f"{MIN_TEMPERATURE}); use 0 for greedy"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.top_k <= MAX_TOP_K:  # above the vocabulary it cuts nothing
            raise RequestError(f"top_k must be in [0, {MAX_TOP_K}], got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class FinishReason(enum.Enum):
    STOP = "stop"  # sampled an end-of-sequence token
    LENGTH = "length"  # max_new_tokens or the context length reached
    ERROR = "error"  # a step it was in failed: ``Request.error`` says how
    INTERRUPTED = "interrupted"  # its generate() call was interrupted (SIGINT, SIGTERM)


@dataclass(eq=False)
class Request:
    rid: int
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None  # with FinishReason.ERROR: the failure, in one line
    output_logits: list[torch.Tensor] = field(default_factory=list, repr=False)
    # Engine-owned state while running.
    req_slot: int | None = field(default=None, repr=False)
    kv_len: int = 0  # tokens whose KV is in the cache
    kv_budget: int = 0  # token slots reserved for this request at admission
    # Its random stream (core.engine.sampling): the seed, and the draws taken so far.
    seed: int = field(default=0, repr=False)
    draws: int = field(default=0, repr=False)
    # Speculative decoding: a log of rounds.
    spec_rounds: list[dict] = field(default_factory=list, repr=False)
    # The call that runs it to completion with the rest of its requests (``Engine.await_all``:
    # ``run_until_finished``, ``LLM.generate``), if any: a batch of one call's requests, none
    # waiting to join, only shrinks, and a speculative chooser weighs when it finishes
    # (``DecodeStrategy.closed_batch``).
    awaited_by: int | None = field(default=None, repr=False)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids
