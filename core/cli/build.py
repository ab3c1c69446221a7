"""What `graphrt generate` and `graphrt serve` build alike from their flags: the model and
drafter to load, the runner, the engine's config."""

from __future__ import annotations

import argparse

from graphrt.core.engine import EngineConfig
from graphrt.core.errors import UsageError
from graphrt.core.parallel.launch import check_runner, default_runner


def model_and_draft(args: argparse.Namespace) -> tuple[str, str | None]:
    """--model and --draft as given, the embedded pair where --model is not."""
    from graphrt.core import pretrained

    if args.no_draft and args.draft is not None:
        raise UsageError("--draft and --no-draft contradict each other; pass one")
    return pretrained.model_and_draft(args.model, False if args.no_draft else args.draft)


def runner(args: argparse.Namespace, device, tp) -> str:
    """--runner, checked against the device; a bad --graph-backend fails here, before
    anything loads."""
    # --graph-backend asks for graphs: it implies --runner graph where the runner is unset.
    chosen = args.runner or ("graph" if args.graph_backend else default_runner(device, tp))
    check_runner(device, chosen, tp)
    if chosen == "graph":
        device.create_graph_backend(args.graph_backend)
    return chosen


def engine_config(
    args: argparse.Namespace, runner: str, graph_max_batch: int | None, capture_all: bool = False
) -> EngineConfig:
    return EngineConfig(
        capture_all_graphs=capture_all,
        max_running_requests=args.max_running_requests,
        max_context_len=args.max_context_len,
        kv_pool_tokens=args.kv_pool_tokens,
        kv_memory_fraction=args.kv_memory_fraction,
        seed=args.seed,
        runner=runner,
        graph_backend=args.graph_backend,
        graph_buckets=args.graph_bs,
        graph_padding=args.graph_padding,
        overlap=args.overlap,
        max_graph_memory_bytes=None
        if args.max_graph_memory is None
        else args.max_graph_memory << 20,
        graph_max_batch=graph_max_batch,
    )
