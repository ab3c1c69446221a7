"""`graphrt serve`: an OpenAI-compatible server over one engine (graphrt.core.serve.app).

Start-up: the listening socket first (a port in use costs no torch import), then the
model, the drafter and the engine's graphs, then one line on stderr with the address.
SIGTERM or Ctrl-C drains: the socket closes, new requests get 503, requests in flight
finish within --drain-timeout and are aborted after it, then the process exits 0. A
second Ctrl-C stops at once.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from pathlib import Path

from graphrt import devices
from graphrt.core.cli.args import check_environment, spec_config_args
from graphrt.core.errors import UsageError

EMBEDDED_NAME = "gemma4-code"  # the embedded pair's name in the API


def _server_modules():
    """fastapi, uvicorn and prometheus_client: the `serve` extra."""
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn
    except ImportError as e:
        raise UsageError(
            f"graphrt serve needs the serve extra ({e.name} is missing): "
            "pip install 'graphrt[serve]'"
        ) from None
    return uvicorn


def _listen(host: str, port: int) -> socket.socket:
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        return socket.create_server((host, port), family=family, backlog=2048)
    except OSError as e:
        raise UsageError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def _write_trace(path: Path, loop) -> None:
    from graphrt.core.serve.loop import PASS_FIELDS

    try:
        path.write_text(json.dumps({"fields": PASS_FIELDS, "passes": list(loop.trace)}))
    except OSError as e:
        print(f"graphrt: cannot write the step trace to {path}: {e}", file=sys.stderr)
    else:
        print(f"graphrt: step trace ({len(loop.trace)} passes) in {path}", file=sys.stderr)


def run_serve(args: argparse.Namespace) -> int:
    uvicorn = _server_modules()
    # The socket before torch is imported: a port in use costs a second, not a start-up.
    sock = _listen(args.host, args.port)
    from graphrt.core.cli import build
    from graphrt.core.models.config import parse_dtype
    from graphrt.core.parallel.group import SINGLE
    from graphrt.core.serve import LLM, EngineLoop
    from graphrt.core.serve.app import build_app
    from graphrt.core.serve.metrics import ServerMetrics
    from graphrt.core.serve.server import DrainingServer
    from graphrt.spec import SpecConfig

    model, draft = build.model_and_draft(args)
    name = args.served_model_name or (EMBEDDED_NAME if args.model is None else Path(model).name)
    device = devices.current(args.device)
    check_environment(device)
    runner = build.runner(args, device, SINGLE)
    start = time.perf_counter()
    llm = LLM(
        model,
        draft or False,
        device=device.name,
        dtype=None if args.dtype == "auto" else parse_dtype(args.dtype),
        spec=SpecConfig(**spec_config_args(args)) if draft else None,
        # Every graph at start-up: a capture while serving would stall every stream.
        config=build.engine_config(args, runner, graph_max_batch=None, capture_all=True),
        batch_invariant=args.batch_invariant,
        check_weights=args.check_weights,
    )
    plan = llm.engine.kv_plan
    loop = EngineLoop(llm, trace_steps=args.step_trace is not None)
    app = build_app(loop, name, ServerMetrics(llm, name))
    config = uvicorn.Config(
        app,
        log_level=args.log_level,
        access_log=args.log_level in ("info", "debug"),
        # A backstop: the drain aborts what is left at --drain-timeout, which ends its
        # streams; uvicorn then waits for their connections to close.
        timeout_graceful_shutdown=args.drain_timeout + 10,
    )
    server = DrainingServer(config, loop, args.drain_timeout)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    drafting = f", drafting with {Path(draft).name}" if draft else ""
    print(
        f"graphrt: serving {name} on {device.name}{drafting} at http://{shown}:{port} "
        f"(ready in {time.perf_counter() - start:.1f} s; KV pool {plan.slots} tokens, "
        f"context {plan.context}, runner {runner}); SIGTERM or Ctrl-C drains and stops",
        file=sys.stderr,
        flush=True,
    )
    try:
        server.run(sockets=[sock])
        drained = server.wait_drained()
    finally:
        loop.close()
        if args.step_trace is not None:
            _write_trace(args.step_trace, loop)
    if drained is not None:
        print(f"graphrt: {drained}", file=sys.stderr, flush=True)
    return 0
