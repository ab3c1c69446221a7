"""The command line's flags, and nothing else: subcommands map them onto configs.

Every flag's help says its default, as ``(default: %(default)s)`` or in words
where the default is decided at run time (tests/test_cli.py checks this).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from graphrt.core.cli.version import package_version

DTYPES = ["auto", "float32", "bfloat16", "float16"]


class OneLineParser(argparse.ArgumentParser):
    """Usage errors as one line naming the problem (exit 2), not the whole usage block."""

    def error(self, message: str):
        self.exit(2, f"graphrt: error: {message} (see {self.prog} --help)\n")


def _token_ids(text: str) -> list[int]:
    if not text.strip():
        return []  # the engine refuses the empty prompt, naming it
    try:
        ids = [int(t) for t in text.split(",")]  # "1,,2" is a typo, not [1, 2]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--prompt-ids wants comma-separated integers, got {text!r}"
        ) from None
    return ids


def _utf8_text(text: str) -> str:
    """Arguments that are not valid UTF-8 arrive with lone surrogates (surrogateescape):
    refused by name while parsing, before anything loads and before --tp starts a rank."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        byte = ord(text[e.start]) & 0xFF
        raise argparse.ArgumentTypeError(
            f"not valid UTF-8 text (byte 0x{byte:02x} at offset {e.start}); pass text, "
            "or token ids with --prompt-ids"
        ) from None
    return text


def _runner_list(text: str) -> tuple[str, ...]:
    runners = tuple(text.split(","))
    unknown = [r for r in runners if r not in ("eager", "graph", "hf")]
    if unknown:
        raise argparse.ArgumentTypeError(f"runners are eager, graph, hf; got {text!r}")
    return runners


class _AppendPrompt(argparse.Action):
    """--prompt and --prompt-ids share one list, so requests keep the order given."""

    def __call__(self, parser, namespace, values, option_string=None):
        prompts = list(getattr(namespace, self.dest) or [])
        kind = "ids" if option_string == "--prompt-ids" else "text"
        prompts.append((kind, values))
        setattr(namespace, self.dest, prompts)


def _positive_list(what: str):
    """An argparse type: a comma list of integers >= 1, named ``what`` in its errors."""

    def parse(text: str) -> tuple[int, ...]:
        try:
            values = tuple(int(t) for t in text.split(",") if t.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"wants comma-separated {what}, got {text!r}"
            ) from None
        if not values or min(values) < 1:
            raise argparse.ArgumentTypeError(f"{what} must be >= 1, got {text!r}")
        return values

    return parse


_size_list = _positive_list("batch sizes")


def _whole(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"wants a whole number, got {text!r}") from None


# Counts past this (tokens, requests, slots) are typos: tensors are sized by them.
MAX_COUNT = 2**31 - 1


def _count(text: str, minimum: int, note: str = "") -> int:
    value = _whole(text)
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be >= {minimum}{note}, got {value}")
    if value > MAX_COUNT:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_COUNT}, got {value}")
    return value


def _port(text: str) -> int:
    value = _whole(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port from 0 to 65535, got {value}")
    return value


def _positive(text: str) -> int:
    return _count(text, 1)


def _non_negative(text: str) -> int:
    return _count(text, 0, " (0: no cut)")


def _real(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"wants a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be finite, got {text!r}")
    return value


def _seconds(text: str) -> float:
    value = _real(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 seconds, got {text}")
    return value


def _temperature(text: str) -> float:
    from graphrt.core.engine.request import MIN_TEMPERATURE  # torch: only with the flag

    value = _real(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (0: greedy), got {value}")
    if 0 < value < MIN_TEMPERATURE:  # logits / temperature would overflow
        raise argparse.ArgumentTypeError(
            f"{value} is too small to sample with (>= {MIN_TEMPERATURE}); use 0 for greedy"
        )
    return value


def _top_p(text: str) -> float:
    value = _real(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1] (1: no cut), got {value}")
    return value


def _fraction(text: str) -> float:
    value = _real(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


# --spec-steps auto: each step a plain step or a round of 1 to this many draft steps,
# whichever pays. The embedded pair, held-out code, greedy: accept length 2.48 at 3 steps,
# 2.88 at 5 (topk 1); topk 3 accepts more (3.45 at 5) but verifies 12 tokens a round.
AUTO_SPEC_STEPS = 5


# Draft steps a round may take: past the assistant's useful depth (acceptance compounds
# per position; the embedded pair accepts 3.5 tokens at 5 steps), a longer round only
# costs. --spec-steps 100 ran at 0.2 tok/s.
MAX_SPEC_STEPS = 16


def spec_steps(text: str) -> int | str:
    """``--spec-steps``: a count from 1 to MAX_SPEC_STEPS, or "auto"."""
    if text == "auto":
        return "auto"
    value = _positive(text)
    if value > MAX_SPEC_STEPS:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_SPEC_STEPS}, got {value}")
    return value


def check_environment(device) -> None:
    """The GRAPHRT_* variables a run reads, checked before anything loads (exit 2):
    GRAPHRT_DEVICE by devices.current, GRAPHRT_CHECK_FINITE here, the device's own
    (GRAPHRT_ALL_REDUCE on CUDA) by the device. Then the device's start-up notice, if it
    has one (kernels to compile on a first run), as one status line."""
    from graphrt.core.models.loader import CHECK_FINITE_ENV, env_flag
    from graphrt.core.parallel.launch import is_output_rank

    env_flag(CHECK_FINITE_ENV)
    device.check_environment()
    notice = device.startup_notice()
    if notice is not None and is_output_rank():
        print(f"graphrt: {notice}", file=sys.stderr, flush=True)


def spec_config_args(args: argparse.Namespace) -> dict:
    """SpecConfig's keywords from the speculative flags (auto: adaptive rounds)."""
    auto = args.spec_steps == "auto"
    return dict(
        num_steps=AUTO_SPEC_STEPS if auto else args.spec_steps,
        topk=args.spec_topk,
        num_draft_tokens=args.spec_draft_tokens,
        adaptive=auto,
        one_graph=args.round_graphs == "one",
    )


def _add_model_flags(p: argparse.ArgumentParser, tp: bool = True) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="checkpoint directory or random:PRESET (e.g. random:llama-tiny) (default: the "
        "embedded gemma4-code pair, a small Gemma 4 trained on Python code, drafting with "
        "its assistant unless --no-draft)",
    )
    p.add_argument(
        "--device",
        default=None,
        # Not argparse choices: plugin devices (the graphrt.devices entry points) count too,
        # and an unknown name gets the list of known ones from the registry.
        help="auto, cpu, cuda, npu, xpu or a plugin device (default: GRAPHRT_DEVICE, else probe)",
    )
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default="auto",
        help="auto: the checkpoint's (float32 on cpu) (default: %(default)s)",
    )
    _add_check_weights(p)
    if tp:
        _add_tp_flag(p)


def _add_tp_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tp",
        type=_positive,
        default=None,
        help="tensor parallelism: split the model over N devices of this host, one process "
        "each (under torchrun: its process count) (default: 1, or torchrun's WORLD_SIZE)",
    )


def _add_check_weights(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--batch-invariant",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="matmuls whose every row's result does not depend on the batch (CUDA: "
        "tensor-core tiles only), so drafting keeps greedy output equal to --no-draft in "
        "bfloat16 and float16; 1.25-1.45x a batch-1 step from hidden size 512 up, see "
        "BENCHMARKS.md (default: on for models of hidden size 256 or less, such as the "
        "embedded pair, where it is free)",
    )
    p.add_argument(
        "--check-weights",
        action="store_true",
        default=None,
        help="refuse checkpoints whose weights hold NaN or Inf (10-25%% more load time; "
        "default: the GRAPHRT_CHECK_FINITE environment variable, else off)",
    )


def _add_spec_flags(p: argparse.ArgumentParser, no_draft: bool = False) -> None:
    p.add_argument(
        "--draft",
        default=None,
        help="MTP assistant (drafter): checkpoint directory or random:PRESET (default: none; "
        "generate and serve without --model: the embedded assistant)",
    )
    p.add_argument(
        "--spec-steps",
        type=spec_steps,
        default="auto",
        help=f"draft steps per round; auto: each step a plain decode step or a round of 1 to "
        f"{AUTO_SPEC_STEPS} steps, whichever emits the most tokens a second by the acceptance "
        f"and times measured as it runs (generate, serve; the round bench times {AUTO_SPEC_STEPS}-step "
        "rounds) (default: %(default)s)",
    )
    p.add_argument(
        "--spec-topk",
        type=_positive,
        default=1,
        help="branches per draft step (default: %(default)s)",
    )
    p.add_argument(
        "--spec-draft-tokens",
        type=_positive,
        default=None,
        help="tokens verified per round, the root included (default: steps + 1 for topk 1)",
    )
    p.add_argument(
        "--round-graphs",
        choices=["one", "two"],
        default="one",
        help="one: each round (draft loop, verify, acceptance) one captured graph; two: the "
        "draft loop's graph, then verify's (the round bench then times them apart); "
        "breakable graph backends always run two (default: %(default)s)",
    )
    if no_draft:  # generate and serve draft by default with the embedded model
        p.add_argument(
            "--no-draft",
            action="store_true",
            help="decode without speculative drafting, also with the embedded model",
        )


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    """How the engine runs: generate's and serve's."""
    p.add_argument(
        "--runner",
        choices=["eager", "graph"],
        default=None,
        help="default: graph where the device has a graph backend (cuda, npu, xpu), eager on "
        "cpu (compiling costs more than it saves there)",
    )
    p.add_argument(
        "--graph-backend",
        default=None,
        help="cuda: full | breakable; cpu: compile; npu, xpu: full "
        "(default: the device's first, e.g. full on cuda); implies --runner graph",
    )
    p.add_argument(
        "--graph-bs",
        type=_size_list,
        default=None,
        help="batch sizes to capture, e.g. 1,2,4,8 (default: 1,2,4,8,12,...,256 capped)",
    )
    p.add_argument(
        "--no-graph-padding",
        dest="graph_padding",
        action="store_false",
        help="run only exactly captured batch sizes as graphs; others run eager",
    )
    p.add_argument(
        "--overlap",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="launch each decode step (plain, or a speculative round on one graph) before "
        "the last one's result is read, so the host prepares a step while the device runs "
        "one (default: on for cuda, off on cpu; --no-overlap reads each step)",
    )
    p.add_argument(
        "--max-graph-memory",
        type=_positive,
        default=None,
        metavar="MIB",
        help="graphs first needed after start-up (other speculative lengths, sampled verify) "
        "are captured only while all graphs hold under this many MiB; a length left out "
        "is not drafted (default: no cap)",
    )
    p.add_argument(
        "--max-running-requests",
        type=_positive,
        default=32,
        help="requests decoded together in one batch; graphs are captured up to this "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--max-context-len",
        type=_positive,
        default=None,
        help="the longest request, prompt and output (default: the model's, bounded by the "
        "KV pool; at most 4096 on the CPU)",
    )
    p.add_argument(
        "--kv-pool-tokens",
        type=_positive,
        default=None,
        help="KV slots (default: what --kv-memory-fraction of free memory holds; 1 GiB worth "
        "on the CPU)",
    )
    p.add_argument(
        "--kv-memory-fraction",
        type=_fraction,
        default=None,
        help="the share of device memory free after loading the weights that the KV pool "
        "takes, the graphs' logits buffers included (default: 0.85 on CUDA; the CPU "
        "keeps 1 GiB)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="graphrt", description="Accelerator-agnostic LLM decoding runtime.")
    parser.add_argument("--version", action="version", version=f"graphrt {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate tokens for one or more prompts")
    _add_model_flags(gen)
    gen.add_argument(
        "--prompt",
        dest="prompts",
        action=_AppendPrompt,
        type=_utf8_text,
        help="prompt text (repeatable; needs tokenizer.json); "
        "give at least one --prompt or --prompt-ids",
    )
    gen.add_argument(
        "--prompt-ids",
        dest="prompts",
        action=_AppendPrompt,
        type=_token_ids,
        help="prompt token ids, e.g. 1,2,3 (repeatable)",
    )
    gen.add_argument(
        "--max-new-tokens",
        type=_positive,
        default=32,
        help="tokens generated per prompt, fewer if EOS comes first (default: %(default)s)",
    )
    gen.add_argument(
        "--temperature", type=_temperature, default=0.0, help="0 = greedy (default: %(default)s)"
    )
    gen.add_argument(
        "--top-p", type=_top_p, default=1.0, help="1 = no nucleus cut (default: %(default)s)"
    )
    gen.add_argument(
        "--top-k", type=_non_negative, default=0, help="0 = no top-k cut (default: %(default)s)"
    )
    gen.add_argument(
        "--seed",
        type=_whole,
        default=0,
        # engine.add_request: request i's stream is seeded with seed * 1000003 + i.
        help="sampling is seeded with 0 unless --seed is given; each request's random stream "
        "is derived from this seed and the request's position; greedy decoding "
        "(--temperature 0) draws nothing (default: %(default)s)",
    )
    gen.add_argument(
        "--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens"
    )
    _add_engine_flags(gen)
    _add_spec_flags(gen, no_draft=True)
    gen.add_argument("--json", action="store_true", help="print one JSON object on stdout")

    serve = sub.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions (SSE "
        "streaming), /v1/models, /health, /metrics",
    )
    _add_model_flags(serve, tp=False)
    serve.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: %(default)s)"
    )
    serve.add_argument(
        "--port", type=_port, default=8000, help="0: any free port (default: %(default)s)"
    )
    serve.add_argument(
        "--served-model-name",
        default=None,
        help="the model's name in the API (default: the checkpoint directory's name, "
        "gemma4-code for the embedded pair)",
    )
    serve.add_argument(
        "--drain-timeout",
        type=_seconds,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM or Ctrl-C: stop admitting, let requests in flight finish for this "
        "long, then abort the rest (default: %(default)s)",
    )
    serve.add_argument(
        "--seed",
        type=_whole,
        default=0,
        help="sampled requests without a `seed` of their own draw from streams derived from "
        "this (default: %(default)s)",
    )
    serve.add_argument(
        "--step-trace",
        type=Path,
        default=None,
        metavar="FILE",
        help="on exit, write one JSON record a pass of the engine loop (its timing, batch "
        "and step kind; bench/step_trace.py summarises it) to FILE (default: none)",
    )
    _add_engine_flags(serve)
    _add_spec_flags(serve, no_draft=True)
    serve.add_argument(
        "--log-level",
        choices=["critical", "error", "warning", "info", "debug"],
        default="warning",
        help="uvicorn's log level; info logs every HTTP request (default: %(default)s)",
    )

    bench = sub.add_parser(
        "bench", help="decode step latency per batch size: eager, graph, transformers"
    )
    bench.add_argument(
        "--model",
        default="random:llama-1b",
        help="checkpoint directory or random:PRESET (default: %(default)s)",
    )
    bench.add_argument(
        "--device",
        default=None,
        # Not argparse choices: plugin devices (the graphrt.devices entry points) count too,
        # and an unknown name gets the list of known ones from the registry.
        help="auto, cpu, cuda, npu, xpu or a plugin device (default: GRAPHRT_DEVICE, else probe)",
    )
    bench.add_argument(
        "--dtype",
        choices=DTYPES,
        default="auto",
        help="auto: bfloat16 on accelerators (default: %(default)s)",
    )
    _add_check_weights(bench)
    _add_tp_flag(bench)
    bench.add_argument(
        "--prompt-len",
        type=_positive_list("prompt lengths"),
        default=(512,),
        help="random prompt tokens prefilled per request before timing; a comma list times "
        "every batch size at each length and plots the step against the context, e.g. "
        "512,2048,8192,32768 (default: 512)",
    )
    bench.add_argument(
        "--long-row",
        type=_positive,
        default=None,
        help="prefill one request of each batch to this many tokens instead: a long row "
        "among short ones, as a server's batches hold, e.g. 32768 (default: every row alike)",
    )
    bench.add_argument(
        "--batch-sizes",
        type=_size_list,
        default=(1, 8, 32, 64),
        help="comma list of batch sizes to time (default: 1,8,32,64)",
    )
    bench.add_argument(
        "--runners",
        type=_runner_list,
        default=("eager", "graph"),
        help="comma list of eager, graph, hf (transformers static cache + torch.compile) "
        "(default: eager,graph)",
    )
    bench.add_argument(
        "--graph-backend", default=None, help="the device's graph backend (default: its first)"
    )
    bench.add_argument(
        "--steps",
        type=_positive,
        default=50,
        help="timed decode steps per runner (default: %(default)s)",
    )
    bench.add_argument(
        "--warmup",
        type=_positive,
        default=5,
        help="untimed decode steps before timing (default: %(default)s)",
    )
    bench.add_argument(
        "--max-running-requests",
        type=_positive,
        default=256,
        help="graphs captured up to this (default: %(default)s)",
    )
    bench.add_argument(
        "--max-context-len",
        type=_positive,
        default=None,
        help="the engine's context, at least what the timed requests need; decode "
        "attention's scratch and kernels are sized from it, as a server's are from its "
        "context (the model's by default), e.g. 131072; the CPU's graphs read the whole "
        "context every step (default: what the requests need)",
    )
    bench.add_argument(
        "--seed",
        type=_whole,
        default=0,
        help="seeds the random prompt tokens (default: %(default)s)",
    )
    bench.add_argument(
        "--out",
        default="bench-decode.json",
        help="JSON results (a PNG plot lands beside it) (default: %(default)s)",
    )
    bench.add_argument("--no-plot", dest="plot", action="store_false", help="write no PNG plot")
    bench.add_argument("--json", action="store_true", help="print the JSON result on stdout")
    _add_spec_flags(bench)  # with --draft: the speculative round's pieces, per batch size

    info = sub.add_parser(
        "info", help="the selected device, available backends and library versions"
    )
    info.add_argument(
        "--device",
        default=None,
        # Not argparse choices: plugin devices (the graphrt.devices entry points) count too,
        # and an unknown name gets the list of known ones from the registry.
        help="auto, cpu, cuda, npu, xpu or a plugin device (default: GRAPHRT_DEVICE, else probe)",
    )
    return parser
