"""`graphrt generate`: load a model, run prompts through the Engine, print or emit JSON."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tqdm import tqdm

from graphrt import devices
from graphrt.core.cli import build
from graphrt.core.cli.args import check_environment, spec_config_args
from graphrt.core.engine import Engine, SamplingParams
from graphrt.core.errors import CheckpointError, GraphrtError, RequestError
from graphrt.core.models import load_model
from graphrt.core.models.config import parse_dtype
from graphrt.core.parallel.launch import is_output_rank, join
from graphrt.core.text import load_tokenizer
from graphrt.spec import SpecConfig, load_drafting


@contextmanager
def _phase(what: str) -> Iterator[list[str]]:
    """One status line on stderr per phase, with its time (stdout stays the result's);
    details the phase appends to the yielded list go in parentheses after its name."""
    start, details = time.perf_counter(), []
    yield details
    if is_output_rank():  # one job, one voice: rank 0's
        said = f" ({', '.join(details)})" if details else ""
        print(f"{what}{said}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)


def _output_tokenizer(path: Path | None, prompts):
    """The tokenizer, read only when text is needed: for --prompt, and for the output's
    text. A run of --prompt-ids alone survives a broken tokenizer.json (one warning line,
    ids instead of text); a --prompt needs it (exit 3)."""
    if any(kind == "text" for kind, _ in prompts):
        return load_tokenizer(path)
    try:
        return load_tokenizer(path)
    except CheckpointError as e:
        _warn(f"{e}; printing token ids without text")
        return None


def _warn(message: str) -> None:
    if is_output_rank():
        print(f"graphrt: warning: {message}", file=sys.stderr, flush=True)


def _encode_prompts(prompts, tokenizer) -> list[list[int]]:
    if not prompts:
        raise RequestError("no prompt given: pass --prompt TEXT or --prompt-ids 1,2,3")
    encoded = []
    for kind, value in prompts:
        if kind == "ids":
            encoded.append(value)
        elif tokenizer is None:
            raise RequestError(
                "--prompt needs the checkpoint's tokenizer.json, and this model has none; use --prompt-ids"
            )
        else:
            encoded.append(tokenizer.encode(value).ids)
    return encoded


def _request_json(req, decode, spec: bool) -> dict:
    out = {
        "prompt_ids": req.prompt_ids,
        "output_ids": req.output_ids,
        "text": decode(req.output_ids),
        "finish_reason": req.finish_reason.value,
    }
    if spec:
        out["spec_rounds"] = req.spec_rounds
    if req.error is not None:
        out["error"] = req.error
    return out


class _TextStream:
    """One request's text to stdout as its tokens arrive (core.text), flushed each step."""

    def __init__(self, tokenizer) -> None:
        from graphrt.core.text import IncrementalDetokenizer

        self._detokenizer = IncrementalDetokenizer(tokenizer)
        self._pushed = 0

    def write(self, text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    def push(self, output_ids: list[int]) -> None:
        new, self._pushed = output_ids[self._pushed :], len(output_ids)
        if new:
            self.write(self._detokenizer.push(new))

    def close(self) -> None:
        self.write(self._detokenizer.flush() + "\n")


def _warn_about_limits(args, engine: Engine, prompts: list[list[int]]) -> None:
    """Flags past the model's limits are clamped, never silently: one line each."""
    context = engine.max_context_len
    if args.max_context_len is not None and args.max_context_len > context:
        _warn(f"--max-context-len {args.max_context_len} is above what this engine allows; "
              f"using {context} (the model's limit, or the 4096 cap)")  # fmt: skip
    longest = max(len(p) for p in prompts)
    if longest + args.max_new_tokens > context:
        _warn(f"--max-new-tokens {args.max_new_tokens} does not fit the context ({context} "
              f"tokens, prompt included): generation stops at the context")  # fmt: skip


def _raise_failures(reqs, stopped: KeyboardInterrupt | None = None) -> None:
    """After every output is out: one error line (via main) if the run was interrupted or
    any request failed."""
    if stopped is not None:
        raise stopped
    failed = [i for i, r in enumerate(reqs) if r.error is not None]
    if failed:
        first = reqs[failed[0]]
        raise GraphrtError(
            f"{len(failed)} of {len(reqs)} requests failed (request {failed[0]}: {first.error})"
        )


def run_generate(args: argparse.Namespace) -> int:
    args.model, args.draft = build.model_and_draft(args)
    device = devices.current(args.device)
    check_environment(device)
    tp = join(args.tp, device)  # the group of one unless this is a rank of a --tp job
    spec_config = None
    if args.draft is not None:
        spec_config = SpecConfig(**spec_config_args(args))
    runner = build.runner(args, device, tp)
    # auto: the checkpoint's dtype on accelerators, float32 where the device prefers it (cpu).
    dtype = None if args.dtype == "auto" else parse_dtype(args.dtype)
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        ignore_eos=args.ignore_eos,
    )
    with _phase(f"loaded {args.model} on {device.name}") as said:
        loaded = load_model(
            args.model, device, dtype, check_finite=args.check_weights, tp=tp,
            batch_invariant=args.batch_invariant,
        )  # fmt: skip
        if loaded.batch_invariant:
            said.append("batch-invariant matmuls")
    strategy = None
    if args.draft is not None:
        with _phase(f"loaded drafter {args.draft}"):
            strategy = load_drafting(
                args.draft, loaded, device, spec_config, check_finite=args.check_weights, tp=tp
            )
    tokenizer = _output_tokenizer(loaded.tokenizer_path, args.prompts or [])
    prompts = _encode_prompts(args.prompts, tokenizer)
    # N prompts: no batch above N, no graph for one
    config = build.engine_config(args, runner, graph_max_batch=len(prompts))
    # With graphs this is the capture (a lazy backend compiles later, inside the steps: the
    # summary line reports that time apart).
    with _phase("set up the engine" + (" and its graphs" if runner == "graph" else "")) as said:
        engine = Engine(loaded, config, device, strategy)
        plan = engine.kv_plan
        said.append(f"KV pool {plan.slots} tokens, {plan.sized_by}; context {plan.context}")
        if engine.stats.step_timing_s:  # auto draft lengths timed each kind of step
            said.append(f"steps timed for auto draft lengths in {engine.stats.step_timing_s:.2f} s")
    # Validate every prompt before generating anything, so a bad one costs no work.
    for prompt in prompts:
        engine.validate_request(prompt, params)
    _warn_about_limits(args, engine, prompts)

    decode = (
        (lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
        if tokenizer
        else (lambda ids: None)
    )
    # One prompt with text: its continuation streams to stdout as it is decoded; otherwise
    # (several requests, --json, no tokenizer) everything prints at the end.
    stream = _TextStream(tokenizer) if len(prompts) == 1 and tokenizer and not args.json else None
    if stream is not None and is_output_rank():
        stream.write(decode(prompts[0]))
    reqs = engine.add_requests(prompts, params)
    stopped = None  # a SIGINT or SIGTERM: print what was produced, then its one line
    total = len(prompts) * args.max_new_tokens
    with tqdm(
        total=total,
        unit="tok",
        disable=args.json or stream is not None or not is_output_rank() or None,
        file=sys.stderr,
        leave=False,
    ) as bar:

        def on_step(stepped) -> None:
            bar.update(len(stepped))
            if stream is not None and is_output_rank():
                stream.push(reqs[0].output_ids)

        try:
            engine.run_until_finished(reqs, on_step=on_step)
        except KeyboardInterrupt as e:  # unfinished requests are now "interrupted"
            stopped = e
    if stream is not None and is_output_rank():
        stream.push(reqs[0].output_ids)
        stream.close()

    stats = {
        "device": device.name,
        "runner": runner,
        "overlap": engine.config.overlap,  # steps launched ahead of the read (--overlap)
        "launched_ahead": engine.stats.launched_ahead,  # steps that were
        "tp": tp.size,
        "batch_invariant": loaded.batch_invariant,  # --batch-invariant, or its default
        "graph_steps": engine.stats.graph_steps,
        "eager_steps": engine.stats.eager_steps,
        "captured_sizes": engine.stats.captured_sizes,
        "tokens_per_s": round(engine.stats.tokens_per_s, 3),
        "capture_time_s": round(engine.stats.capture_time_s, 3),  # start-up and later
        "lazy_capture_s": round(engine.stats.lazy_capture_s, 3),  # within generate, not counted
        "compile_time_s": round(engine.stats.compile_time_s, 3),
        "prefill_time_s": round(engine.stats.prefill_s, 3),
        "graph_memory_bytes": engine.stats.graph_memory_bytes,
    }
    if strategy is not None:
        stats["spec"] = {
            "rounds": engine.stats.spec_rounds,
            "graph_rounds": engine.stats.graph_rounds,
            "accept_length_mean": round(engine.stats.accept_length_mean, 4),
            "accept_histogram": engine.stats.accept_histogram,
            "accepted_per_position": engine.stats.accepted_per_position,
            "drafted_per_position": engine.stats.drafted_per_position,
            # request rounds by draft steps (--spec-steps auto picks them step by step)
            "rounds_by_steps": {str(k): n for k, n in sorted(engine.stats.rounds_by_steps.items())},
            "plain_steps": engine.stats.spec_plain_steps,  # --spec-steps auto's undrafted steps
        }
        chooser = engine.strategy.chooser
        if chooser is not None:  # --spec-steps auto: why it chose as it did
            stats["spec"]["auto"] = {
                "round_steps": chooser.rounds,  # steps run as rounds (of all running requests)
                "why": chooser.explain(),
            }
    if args.json:
        out = {
            "requests": [_request_json(r, decode, strategy is not None) for r in reqs],
            "stats": stats,
        }
        print(json.dumps(out))
        _raise_failures(reqs, stopped)
        return 0
    for i, r in enumerate(reqs):
        header = (
            f"[{i}] {len(r.prompt_ids)} prompt tokens, {len(r.output_ids)} generated, "
            f"finished: {r.finish_reason.value}"
        )
        if stream is not None:  # the text is out already: the header follows it
            print(header)
            continue
        print(header)
        text = decode(r.output_ids)
        if text is None:  # no tokenizer (random presets, --prompt-ids only checkpoints)
            print(f"    output_ids: {r.output_ids}")
        else:  # the prompt, then its continuation, as one text
            print(decode(r.prompt_ids) + text)
    not_counted = f"prefill {engine.stats.prefill_s:.2f} s"
    if engine.stats.compile_time_s:
        not_counted += f", compiling graphs {engine.stats.compile_time_s:.1f} s"
    if engine.stats.lazy_capture_s:
        not_counted += f", capturing graphs first needed {engine.stats.lazy_capture_s:.2f} s"
    summary = (
        f"{engine.stats.generated_tokens} tokens in {engine.stats.elapsed_s:.2f} s: "
        f"{stats['tokens_per_s']:.1f} tok/s decoding ({not_counted} not counted)"
        f" on {device.name}"
        + (f" x {tp.size} (tensor parallel)" if tp.size > 1 else "")
        + f", runner {runner}"
    )
    if strategy is not None:
        spec = stats["spec"]
        if spec["rounds"]:
            summary += (
                f"; speculative: accept length {spec['accept_length_mean']:.2f} tokens per "
                f"round over {spec['rounds']} rounds, drafts accepted per round "
                f"{spec['accept_histogram']}"
            )
        else:  # no accept length to speak of
            summary += "; speculative: no round ran"
        if "auto" in spec:  # --spec-steps auto: what it chose, and why
            summary += (
                f"; auto: {spec['auto']['round_steps']} rounds and {spec['plain_steps']} plain "
                f"steps ({spec['auto']['why']})"
            )
    print(summary)
    _raise_failures(reqs, stopped)
    return 0
