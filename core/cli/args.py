"""The command line's flags, and nothing else: subcommands map them onto configs."""

from __future__ import annotations

import argparse

DEVICES = ["auto", "cpu", "cuda", "npu", "xpu"]
DTYPES = ["auto", "float32", "bfloat16", "float16"]


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--prompt-ids wants comma-separated integers, got {text!r}"
        ) from None
    return ids


class _AppendPrompt(argparse.Action):
    """--prompt and --prompt-ids share one list, so requests keep the order given."""

    def __call__(self, parser, namespace, values, option_string=None):
        prompts = list(getattr(namespace, self.dest) or [])
        kind = "ids" if option_string == "--prompt-ids" else "text"
        prompts.append((kind, values))
        setattr(namespace, self.dest, prompts)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        required=True,
        help="checkpoint directory or random:PRESET (e.g. random:llama-tiny)",
    )
    p.add_argument(
        "--device", choices=DEVICES, default=None, help="default: GRAPHRT_DEVICE, else probe"
    )
    p.add_argument(
        "--dtype", choices=DTYPES, default="auto", help="auto: the checkpoint's (float32 on cpu)"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="graphrt", description="Accelerator-agnostic LLM decoding runtime."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate tokens for one or more prompts")
    _add_model_flags(gen)
    gen.add_argument(
        "--prompt",
        dest="prompts",
        action=_AppendPrompt,
        help="prompt text (repeatable; needs tokenizer.json)",
    )
    gen.add_argument(
        "--prompt-ids",
        dest="prompts",
        action=_AppendPrompt,
        type=_token_ids,
        help="prompt token ids, e.g. 1,2,3 (repeatable)",
    )
    gen.add_argument("--max-new-tokens", type=_positive, default=32)
    gen.add_argument("--runner", choices=["eager", "graph"], default="eager")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0, help="0 = no top-k cut")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument(
        "--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens"
    )
    gen.add_argument("--max-running-requests", type=_positive, default=32)
    gen.add_argument(
        "--max-context-len", type=_positive, default=None, help="default: the model's, at most 4096"
    )
    gen.add_argument(
        "--kv-pool-tokens", type=_positive, default=None, help="KV slots (default: 1 GiB worth)"
    )
    gen.add_argument("--json", action="store_true", help="print one JSON object on stdout")

    info = sub.add_parser(
        "info", help="the selected device, available backends and library versions"
    )
    info.add_argument("--device", choices=DEVICES, default=None)
    return parser
