"""``LLM``: text in, text out, over one engine (DESIGN.md, layer 10).

Prompts are tokenised with the checkpoint's ``tokenizer.json``; chat messages are first
rendered with its chat template (jinja2, sandboxed, as transformers renders them). The
engine's tokens come back as text while steps finish (``IncrementalDetokenizer``: never
half a character). A stop string or stop token id ends its request where it appears: the
text ends before the stop string, as in OpenAI's API, and the request's KV is freed at
once (``Engine.abort``), in the middle of a speculative round's tokens too.

    llm = LLM()  # the embedded pair, drafting where it pays
    llm.generate(["def fibonacci(n):"], TextParams(max_tokens=32))[0].text
    for delta in llm.stream("def fibonacci(n):"):
        print(delta, end="")
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from graphrt import devices
from graphrt.core.engine import Engine, EngineConfig, SamplingParams
from graphrt.core.engine.request import FinishReason, Request
from graphrt.core.errors import RequestError, UsageError
from graphrt.core.text import IncrementalDetokenizer, load_tokenizer


@dataclass(frozen=True)
class TextParams:
    """How one completion is sampled and where it stops (OpenAI's names)."""

    max_tokens: int = 16
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: no cut
    seed: int | None = None
    stop: tuple[str, ...] = ()  # the text ends before the first of these it would contain
    stop_token_ids: tuple[int, ...] = ()  # end after one of these tokens (it is kept)
    ignore_eos: bool = False

    def __post_init__(self):
        if isinstance(self.stop, str):  # one stop string, as OpenAI's API allows
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise RequestError(f"stop strings must be non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise RequestError(f"stop_token_ids must be token ids (ints >= 0), got {t!r}")
        self.sampling()  # the engine's checks of the rest, now rather than at the first step

    def sampling(self) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            ignore_eos=self.ignore_eos,
        )


@dataclass
class Completion:
    """One prompt's result: its text and tokens, and why it ended ("stop", "length",
    "error" with ``error`` set, or "interrupted")."""

    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    error: str | None = None


@dataclass
class TextStream:
    """A request on its way to text: its detokeniser (None for a model without a
    tokenizer: tokens only, no text) and the stop checks."""

    req: Request
    params: TextParams
    detok: IncrementalDetokenizer | None
    text: str = ""  # everything handed out so far
    held: str = ""  # text that may be the start of a stop string: not handed out yet
    seen: int = 0  # output tokens turned into text
    stopped: bool = False
    deltas: list[str] = field(default_factory=list)

    def advance(self, engine: Engine) -> None:
        """Turn the request's new tokens into text; at a stop, end it (KV freed now)."""
        new = self.req.output_ids[self.seen :]
        stop_token = False
        for i, token in enumerate(new):
            if self.detok is not None:
                self._add(self.detok.push([token]))
            stop_token = token in self.params.stop_token_ids
            if self.stopped or stop_token:
                # Tokens after a stop are dropped: a round may emit several at once.
                del self.req.output_ids[self.seen + i + 1 :]
                break
        self.seen = len(self.req.output_ids)
        if self.req.finished or stop_token:
            # The end without a stop string: what the detokeniser and the stop-string
            # check held back is text (a stop token's own text included).
            if self.detok is not None:
                self._add(self.detok.flush())
            if not self.stopped:
                self._release_held()
        if self.stopped or stop_token:
            self.stopped = True
            if not self.req.finished:
                engine.abort(self.req, FinishReason.STOP)
            self.req.finish_reason = FinishReason.STOP

    def _add(self, piece: str) -> None:
        if self.stopped or not piece:
            return
        pending = self.held + piece
        cut = min((i for i in (pending.find(s) for s in self.params.stop) if i >= 0), default=-1)
        if cut >= 0:  # a stop string: the text ends before it
            self._emit(pending[:cut])
            self.held, self.stopped = "", True
            return
        # Hold back the longest tail that could still grow into a stop string.
        keep = max((_overlap(pending, s) for s in self.params.stop), default=0)
        self._emit(pending[: len(pending) - keep])
        self.held = pending[len(pending) - keep :]

    def _release_held(self) -> None:
        self._emit(self.held)
        self.held = ""

    def _emit(self, text: str) -> None:
        if text:
            self.text += text
            self.deltas.append(text)

    def completion(self) -> Completion:
        reason = self.req.finish_reason
        return Completion(
            text=self.text,
            token_ids=list(self.req.output_ids),
            finish_reason=reason.value if reason is not None else "length",
            prompt_tokens=len(self.req.prompt_ids),
            error=self.req.error,
        )


def _overlap(text: str, stop: str) -> int:
    """The length of the longest end of ``text`` that begins ``stop`` (shorter than it)."""
    for n in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0


class LLM:
    """An engine with its tokenizer: ``generate`` prompts, ``stream`` one, ``chat``.

    ``model``: a checkpoint directory (with ``tokenizer.json``) or None for the embedded
    pair; ``draft``: an assistant checkpoint to draft with (the embedded pair drafts with
    its own unless ``draft=False``); ``spec``: its ``SpecConfig`` (default: auto draft
    lengths); ``device``: a device name (default: the best one here); ``config``: the
    ``EngineConfig``; ``batch_invariant`` and ``check_weights``: the CLI's flags of those
    names. Safe to use from several threads: their requests share steps."""

    def __init__(
        self,
        model: str | Path | None = None,
        draft: str | Path | bool | None = None,
        *,
        device: str | None = None,
        dtype=None,
        spec=None,
        config: EngineConfig | None = None,
        batch_invariant: bool | None = None,
        check_weights: bool | None = None,
    ) -> None:
        from graphrt.core import pretrained
        from graphrt.core.cli.args import AUTO_SPEC_STEPS  # the CLI's auto, the same rounds
        from graphrt.core.models import load_model
        from graphrt.spec import SpecConfig, load_drafting

        model, draft = pretrained.model_and_draft(model, draft)
        self.device = devices.current(device)
        self.loaded = load_model(
            str(model), self.device, dtype, check_finite=check_weights,
            batch_invariant=batch_invariant,
        )  # fmt: skip
        strategy = None
        if draft:
            spec = spec or SpecConfig(num_steps=AUTO_SPEC_STEPS, adaptive=True)
            strategy = load_drafting(draft, self.loaded, self.device, spec, check_weights)
        # None for a checkpoint without tokenizer.json (the random presets): prompts are
        # then token ids, and completions carry tokens and no text.
        self.tokenizer = load_tokenizer(self.loaded.tokenizer_path)
        self.chat_template = _chat_template(self.loaded.tokenizer_path)
        self.engine = Engine(self.loaded, config or EngineConfig(), self.device, strategy)
        # Held while stepping the engine or touching a request's tokens: one thread steps
        # at a time, and every request in the engine shares that step (EngineLoop too).
        self.step_lock = FairLock()

    # ---- text ------------------------------------------------------------------------

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of a text prompt (token ids pass through)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this model has no tokenizer.json: prompts must be token ids")
            return self.tokenizer.encode(prompt).ids
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise RequestError(f"a prompt is text or a list of token ids, got {prompt!r:.60}")
        return list(prompt)

    def render_chat(self, messages: Sequence[dict]) -> str:
        """``messages`` ([{"role": ..., "content": ...}]) through the chat template,
        ending where the assistant's answer starts."""
        if self.chat_template is None:
            raise UsageError("this checkpoint has no chat template (tokenizer_config.json)")
        for m in messages:
            if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), str)):  # fmt: skip
                raise RequestError(
                    f"a chat message is {{'role': str, 'content': str}}, got {m!r:.80}"
                )
        return self.chat_template.render(messages=list(messages), add_generation_prompt=True)

    # ---- generation ------------------------------------------------------------------

    def generate(
        self, prompts: str | Iterable[str | Sequence[int]], params: TextParams | None = None
    ) -> list[Completion]:
        """Every prompt to completion, batched; -> completions in prompt order."""
        if isinstance(prompts, str):
            prompts = [prompts]
        streams = self.start(list(prompts), params or TextParams())
        self.engine.await_all([s.req for s in streams])  # together: the batch only shrinks
        self._run(streams)
        return [s.completion() for s in streams]

    def stream(
        self, prompt: str | Sequence[int], params: TextParams | None = None
    ) -> Iterator[str]:
        """The text of one completion, delta by delta as steps finish. Closing the
        iterator early (``break``) aborts the request and frees its KV."""
        (s,) = self.start([prompt], params or TextParams())
        try:
            while True:
                self._run([s], steps=1)
                yield from s.deltas
                s.deltas.clear()
                if s.req.finished:
                    return
        finally:
            if not s.req.finished:
                self.engine.abort(s.req, FinishReason.INTERRUPTED)

    def chat(self, messages: Sequence[dict], params: TextParams | None = None) -> Completion:
        """One assistant answer to ``messages``."""
        return self.generate([self.render_chat(messages)], params)[0]

    def start(self, prompts: list, params: TextParams) -> list[TextStream]:
        """Queue ``prompts`` (all checked first: a bad one queues nothing); -> their
        streams, which ``TextStream.advance`` turns into text after each step."""
        if not isinstance(params, TextParams):
            raise UsageError(f"params must be a TextParams, got {type(params).__name__}")
        if params.stop and self.tokenizer is None:
            raise RequestError("stop strings need text: this model has no tokenizer.json")
        ids = [self.encode(p) for p in prompts]
        reqs = self.engine.add_requests(ids, params.sampling())  # all checked, then queued
        return [TextStream(r, params, self._detokenizer()) for r in reqs]

    def _detokenizer(self) -> IncrementalDetokenizer | None:
        return None if self.tokenizer is None else IncrementalDetokenizer(self.tokenizer)

    def _run(self, streams: list[TextStream], steps: int | None = None) -> None:
        """Step the engine until ``streams`` finish (or ``steps`` steps), their text and
        stop checks after each step; an interruption aborts the unfinished ones (KV
        freed). Requests touched only under the lock: another thread may be stepping."""
        try:
            done = 0
            while True:
                with self.step_lock:
                    for s in streams:
                        s.advance(self.engine)
                    if all(s.req.finished for s in streams) or done == steps:
                        return
                    self.engine.step()
                done += 1
        except BaseException:
            for s in streams:
                if not s.req.finished:
                    self.engine.abort(s.req, FinishReason.INTERRUPTED)
            raise


class FairLock:
    """A lock taken in the order it was asked for.

    HAZARD: with ``threading.Lock`` a thread that steps the engine back to back (the
    engine loop) takes the lock again before a waiting thread wakes: an abort or a new
    request waited seconds behind a busy loop (measured: 4-10 s on the CPU). Here each
    ``with`` draws a ticket, and the lock goes to tickets in order. Not re-entrant."""

    def __init__(self) -> None:
        self._turn = threading.Condition()
        self._next = 0  # the next ticket to hand out
        self._serving = 0  # the ticket that holds the lock
        self._abandoned: set[int] = set()  # tickets whose threads stopped waiting

    def __enter__(self) -> None:
        with self._turn:
            ticket, self._next = self._next, self._next + 1
            try:
                while ticket != self._serving:
                    self._turn.wait()
            except BaseException:  # a Ctrl-C while waiting: the ticket must not block the rest
                if ticket == self._serving:
                    self._pass_on()
                else:
                    self._abandoned.add(ticket)
                raise

    def __exit__(self, *exc) -> None:
        with self._turn:
            self._pass_on()

    def _pass_on(self) -> None:
        """To the next ticket still waiting (under ``_turn``)."""
        self._serving += 1
        while self._serving in self._abandoned:
            self._abandoned.remove(self._serving)
            self._serving += 1
        self._turn.notify_all()


def _chat_template(tokenizer_path: Path | None):
    """The checkpoint's chat template (tokenizer_config.json's ``chat_template``, or
    ``chat_template.jinja`` beside it), compiled as transformers compiles it; None if it
    has none."""
    if tokenizer_path is None:
        return None
    folder = tokenizer_path.parent
    source = None
    if (folder / "chat_template.jinja").is_file():
        source = (folder / "chat_template.jinja").read_text()
    elif (folder / "tokenizer_config.json").is_file():
        source = json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template")
    if not isinstance(source, str):
        return None
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, indent=indent)
    return env.from_string(source)
