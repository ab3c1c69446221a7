"""OpenAI's request and response shapes for ``graphrt serve`` (no web framework here).

Request bodies are read field by field into what the engine takes (``TextParams``, the
prompts): a field of the wrong type, a value out of range or a feature graphrt does not
have is a ``BadRequest`` naming the field, which the server answers with 400 and
OpenAI's error JSON. Responses and stream chunks are built here too, so the streamed and
the whole answer cannot drift apart.

Supported beside OpenAI's fields, as vLLM does: ``top_k``, ``ignore_eos``,
``stop_token_ids``, and ``return_token_ids`` (each choice and chunk carries its token
ids: the way to read a model without a tokenizer, whose prompts are token ids and whose
text is empty). Refused (400): ``n`` > 1, ``best_of`` > 1, ``echo``, ``logprobs``,
``suffix``, ``logit_bias``, nonzero penalties, tools.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from graphrt.core.errors import GraphrtError
from graphrt.core.serve.llm import Completion, TextParams

# graphrt's finish reasons in OpenAI's words ("abort": vLLM's, for a request the server
# ended: a drain past its timeout).
FINISH_REASONS = {"stop": "stop", "length": "length", "interrupted": "abort", "error": "error"}


class BadRequest(GraphrtError):
    """A request the server refuses with 400 (OpenAI's ``invalid_request_error``)."""

    exit_code = 1

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def error_body(message: str, kind: str = "invalid_request_error", param=None, code=None):
    """OpenAI's error JSON."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass(frozen=True)
class ParsedRequest:
    """A completions or chat request, read and checked."""

    chat: bool
    prompts: list  # texts or token-id lists, one choice each
    params: TextParams
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    return_token_ids: bool  # vLLM's: token ids in every choice and chunk


def parse_request(body, chat: bool, served_model: str, render_chat) -> ParsedRequest:
    """``body``: the request's JSON; ``render_chat``: messages -> prompt text."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != served_model:
        raise BadRequest(
            f"the model `{model}` does not exist: this server serves `{served_model}`", "model"
        )
    for name in ("n", "best_of"):
        if _get(body, name, int, 1) != 1:
            raise BadRequest(f"`{name}` must be 1: graphrt returns one choice a prompt", name)
    for name in ("echo", "logprobs", "top_logprobs", "suffix", "logit_bias", "tools"):
        if body.get(name) not in (None, False, 0, [], {}):
            raise BadRequest(f"`{name}` is not supported by graphrt", name)
    for name in ("presence_penalty", "frequency_penalty"):
        if _get(body, name, float, 0.0) != 0.0:
            raise BadRequest(f"`{name}` is not supported by graphrt (only 0)", name)
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("`messages` must be a non-empty list of messages", "messages")
        messages = [
            {**m, "content": _text_parts(m["content"])}
            if isinstance(m, dict) and isinstance(m.get("content"), list)
            else m
            for m in messages
        ]
        try:
            prompts = [render_chat(messages)]
        except GraphrtError as e:
            raise BadRequest(str(e), "messages") from None
    else:
        prompts = _prompts(body.get("prompt"))
    max_tokens = _get(body, "max_completion_tokens", int, None) if chat else None
    if max_tokens is None:
        max_tokens = _get(body, "max_tokens", int, 16)
    stop = body.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise BadRequest("`stop` must be a string or a list of strings", "stop")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list):
        raise BadRequest("`stop_token_ids` must be a list of token ids", "stop_token_ids")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise BadRequest("`stream_options` must be an object", "stream_options")
    try:
        params = TextParams(
            max_tokens=max_tokens,
            temperature=_get(body, "temperature", float, 1.0),  # OpenAI's default
            top_p=_get(body, "top_p", float, 1.0),
            top_k=_get(body, "top_k", int, 0),
            seed=_get(body, "seed", int, None),
            stop=tuple(stop),
            stop_token_ids=tuple(stop_ids),
            ignore_eos=_get(body, "ignore_eos", bool, False),
        )
    except GraphrtError as e:
        raise BadRequest(str(e)) from None
    return ParsedRequest(
        chat=chat,
        prompts=prompts,
        params=params,
        stream=_get(body, "stream", bool, False),
        include_usage=_get(options, "include_usage", bool, False),
        return_token_ids=_get(body, "return_token_ids", bool, False),
    )


def _get(body: dict, name: str, kind: type, default):
    """``body[name]`` if it is a ``kind`` (ints count as floats; bools are not ints)."""
    value = body.get(name)
    if value is None:
        return default
    ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        ok, value = True, float(value)
    if not ok:
        raise BadRequest(f"`{name}` must be {_KIND_NAMES[kind]}, got {value!r:.40}", name)
    return value


_KIND_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _prompts(prompt) -> list:
    """OpenAI's prompt forms: a text, a list of texts, token ids, lists of token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(_is_ids(p) for p in prompt):
            return list(prompt)
        if _is_ids(prompt):
            return [prompt]
    raise BadRequest(
        "`prompt` must be a string, a list of strings, a list of token ids or a list of "
        "such lists (non-empty)",
        "prompt",
    )


def _is_ids(value) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def _text_parts(parts: list) -> str:
    """A message's content as a list of parts: only text parts (images are refused)."""
    texts = []
    for part in parts:
        if not (isinstance(part, dict) and part.get("type") == "text"):
            raise BadRequest("only text content parts are supported", "messages")
        if not isinstance(part.get("text"), str):
            raise BadRequest("a text content part needs a string `text`", "messages")
        texts.append(part["text"])
    return "".join(texts)


# ---- responses -----------------------------------------------------------------------


class ResponseIds:
    """The id, creation time and model that every chunk of one response repeats."""

    def __init__(self, chat: bool, model: str):
        self.chat, self.model = chat, model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def head(self, chunk: bool) -> dict:
        if self.chat:
            kind = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            kind = "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}


def usage(completions: list[Completion]) -> dict:
    prompt = sum(c.prompt_tokens for c in completions)
    generated = sum(len(c.token_ids) for c in completions)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": generated,
        "total_tokens": prompt + generated,
    }


def whole_response(ids: ResponseIds, completions: list[Completion], token_ids: bool) -> dict:
    choices = []
    for i, c in enumerate(completions):
        choice = {"index": i, "logprobs": None, "finish_reason": FINISH_REASONS[c.finish_reason]}
        if ids.chat:
            choice["message"] = {"role": "assistant", "content": c.text}
        else:
            choice["text"] = c.text
        if token_ids:
            choice["token_ids"] = c.token_ids
        choices.append(choice)
    return {**ids.head(chunk=False), "choices": choices, "usage": usage(completions)}


def chunk(
    ids: ResponseIds,
    index: int,
    text: str | None,
    finish: str | None = None,
    token_ids: list[int] | None = None,
) -> dict:
    """One stream chunk for choice ``index``: its new text (and, asked for, its new token
    ids), or (chat, ``text`` None) the first chunk, which names the assistant's role;
    ``finish``: graphrt's finish reason."""
    choice: dict = {"index": index, "logprobs": None}
    if ids.chat:
        choice["delta"] = {"role": "assistant", "content": ""} if text is None else {}
        if text:
            choice["delta"]["content"] = text
    else:
        choice["text"] = text or ""
    if token_ids is not None:
        choice["token_ids"] = token_ids
    choice["finish_reason"] = FINISH_REASONS[finish] if finish is not None else None
    return {**ids.head(chunk=True), "choices": [choice]}


def usage_chunk(ids: ResponseIds, completions: list[Completion]) -> dict:
    return {**ids.head(chunk=True), "choices": [], "usage": usage(completions)}
