"""The HTTP side of ``graphrt serve``: a FastAPI app over one ``EngineLoop``.

Endpoints: ``/v1/completions`` and ``/v1/chat/completions`` (whole, or streamed as
server-sent events ending in ``data: [DONE]``), ``/v1/models``, ``/health``,
``/metrics``.

Threads: the engine loop thread steps the engine and calls each request's callback;
the callback hands the event to the asyncio loop (``call_soon_threadsafe``), where the
request's handler waits on its queue. Anything that takes the engine's step lock
(submit, abort, a metrics scrape) runs in a worker thread, never on the event loop: a
step can take long on a CPU, and the event loop serves every other client meanwhile.

A client that leaves (a stream's connection closed, or a whole answer's) aborts its
requests: their KV is free before the engine's next step.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool

from graphrt.core.engine.request import Request as EngineRequest
from graphrt.core.errors import RequestError, UsageError
from graphrt.core.serve import openai_api as api
from graphrt.core.serve.llm import Completion
from graphrt.core.serve.loop import Draining, EngineLoop
from graphrt.core.serve.metrics import RequestTimer, ServerMetrics

# How often a handler waiting for a whole answer checks that its client is still there.
DISCONNECT_POLL_S = 0.5


def build_app(loop: EngineLoop, model_name: str, metrics: ServerMetrics) -> FastAPI:
    from graphrt.core.cli.version import package_version

    app = FastAPI(title="graphrt", version=package_version(), docs_url=None, redoc_url=None)
    llm = loop.llm
    started = int(time.time())

    def refuse(status: int, message: str, kind: str, param=None) -> JSONResponse:
        metrics.refused(status)
        return JSONResponse(api.error_body(message, kind, param), status_code=status)

    async def serve(request: Request, chat: bool) -> Response:
        arrived = time.perf_counter()
        try:
            body = json.loads(await request.body())
        except ValueError as e:
            return refuse(400, f"the request body is not JSON: {e}", "invalid_request_error")
        try:
            parsed = api.parse_request(body, chat, model_name, llm.render_chat)
            jobs = await run_in_threadpool(
                _submit, loop, parsed, asyncio.get_running_loop(), metrics, arrived
            )
        except (api.BadRequest, RequestError, UsageError) as e:
            return refuse(400, str(e), "invalid_request_error", getattr(e, "param", None))
        except Draining as e:
            return refuse(503, str(e), "service_unavailable")
        ids = api.ResponseIds(chat, model_name)
        if parsed.stream:
            return StreamingResponse(
                _sse(_stream(loop, jobs, ids, parsed)),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        return await _whole(loop, jobs, ids, request, parsed)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serve(request, chat=True)

    @app.get("/v1/models")
    async def models() -> dict:
        model = {
            "id": model_name,
            "object": "model",
            "created": started,
            "owned_by": "graphrt",
            "max_model_len": llm.engine.max_context_len,
        }
        return {"object": "list", "data": [model]}

    @app.get("/health")
    async def health() -> Response:
        if not loop.admitting:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    def prometheus() -> Response:  # a worker thread: the scrape takes the step lock
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    return app


class _Job:
    """One prompt's request: the engine loop's events for it, queued on the event loop."""

    def __init__(self, index: int, events: asyncio.Queue, aio, timer: RequestTimer):
        self.index, self.events, self.aio, self.timer = index, events, aio, timer
        self.req: EngineRequest | None = None

    def __call__(self, delta: str, new_ids: list[int], done: Completion | None) -> None:
        # On the engine loop thread. If the event loop has closed (the server is going
        # down), this raises and the engine loop aborts the request.
        self.timer.update(len(new_ids), done)
        event = (self.index, delta, new_ids, done)
        self.aio.call_soon_threadsafe(self.events.put_nowait, event)


def _submit(loop: EngineLoop, parsed: api.ParsedRequest, aio, metrics, arrived) -> list[_Job]:
    """Queue every prompt of the request (a worker thread: this takes the step lock).
    All are checked before any is queued, so a bad one costs the others nothing."""
    events: asyncio.Queue = asyncio.Queue()
    jobs = [_Job(i, events, aio, metrics.timer(arrived)) for i in range(len(parsed.prompts))]
    reqs = loop.submit_all(parsed.prompts, parsed.params, jobs)
    for job, req in zip(jobs, reqs):
        job.req = req
        job.timer.admitted(len(req.prompt_ids))
    return jobs


def _abort_unfinished(loop: EngineLoop, jobs: list[_Job]) -> None:
    """Free a departed client's requests: in a worker thread (abort takes the step lock),
    not awaited (this runs while the handler is being cancelled)."""
    left = [job.req for job in jobs if not job.req.finished]
    if left:
        asyncio.get_running_loop().run_in_executor(None, _abort_all, loop, left)


def _abort_all(loop: EngineLoop, reqs: list[EngineRequest]) -> None:
    for req in reqs:
        loop.abort(req)


async def _stream(
    loop: EngineLoop, jobs: list[_Job], ids: api.ResponseIds, parsed: api.ParsedRequest
) -> AsyncIterator[dict]:
    """The chunks of a streamed answer, as steps finish (with ``return_token_ids``, a
    chunk for every step that gave tokens, text or not)."""
    events = jobs[0].events
    done: dict[int, Completion] = {}
    try:
        if ids.chat:  # the first chunk names the role
            for job in jobs:
                yield api.chunk(ids, job.index, None)
        while len(done) < len(jobs):
            index, delta, new_ids, completion = await events.get()
            token_ids = new_ids if parsed.return_token_ids else None
            if delta or token_ids:
                yield api.chunk(ids, index, delta, token_ids=token_ids)
            if completion is not None:
                done[index] = completion
                if completion.error is not None:
                    yield api.error_body(completion.error, "internal_error")
                finish_ids = [] if parsed.return_token_ids else None
                yield api.chunk(ids, index, "", completion.finish_reason, finish_ids)
        if parsed.include_usage:
            yield api.usage_chunk(ids, [done[i] for i in range(len(jobs))])
    finally:  # the client left, or the stream ended: nothing may keep running
        _abort_unfinished(loop, jobs)


async def _sse(chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
    async for chunk in chunks:
        yield f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n"
    yield "data: [DONE]\n\n"


async def _whole(
    loop: EngineLoop,
    jobs: list[_Job],
    ids: api.ResponseIds,
    request: Request,
    parsed: api.ParsedRequest,
) -> Response:
    """A whole answer once every prompt has finished; a client that left meanwhile
    aborts its requests."""
    events = jobs[0].events
    done: dict[int, Completion] = {}
    clock = asyncio.get_running_loop().time
    check_at = clock() + DISCONNECT_POLL_S
    try:
        while len(done) < len(jobs):
            # Events come every step, so the client's check goes by the clock, not by a
            # quiet queue.
            try:
                index, _, _, completion = await asyncio.wait_for(
                    events.get(), max(0.0, check_at - clock())
                )
                if completion is not None:
                    done[index] = completion
            except asyncio.TimeoutError:  # not TimeoutError on Python 3.10
                pass
            if clock() >= check_at:
                if await request.is_disconnected():
                    return Response(status_code=499)  # nobody reads it
                check_at = clock() + DISCONNECT_POLL_S
    finally:
        _abort_unfinished(loop, jobs)
    completions = [done[i] for i in range(len(jobs))]
    failed = [c for c in completions if c.error is not None]
    if failed:
        body = api.error_body(f"generation failed: {failed[0].error}", "internal_error")
        return JSONResponse(body, status_code=500)
    return JSONResponse(api.whole_response(ids, completions, parsed.return_token_ids))
