"""Speculative decoding on the trained pair: accept length, decode speed, output equality.

Measures graphrt's frozen-KV MTP decoding with the small Gemma 4 target and its
assistant from scripts/train_pair.py on fixed held-out code prompts: the first
``--prompt-len`` tokens of each of the first ``--files`` held-out files (files are
split at the target's <eos>; files shorter than prompt-len + 8 tokens are skipped).
Every configuration decodes the same prompts greedily, ``--max-new-tokens`` each
(fewer where <eos> comes first): no draft, then ``--configs`` (default steps {3, 5} x
topk {1, 3}) with ``SpecConfig``'s default verify-tree size. Per configuration it reports

- accept length: tokens emitted per verify round (accepted drafts + the target's
  bonus token), ``EngineStats.accept_length_mean`` as ``graphrt generate`` prints it;
- decode tok/s: tokens emitted by decode steps / wall time of those steps, measured
  after an untimed warm-up (which compiles any lazily compiled graphs); model loading,
  graph capture, compilation and prefill steps are excluded;
- whether every request's output ids equal the no-draft run's (greedy: they must).

With ``--oracle-rate R`` the drafts are an oracle's (issue 20's, bench/oracles.py
``TokenOracle``): along each tree's first-child path the target's own greedy token, known
from the no-draft run, replaces the assistant's at depth d with probability R ** d, inside
the captured rounds; verify still decides. With ``--batch-invariant`` every replaced token
is accepted, so the accept length follows R and the output must equal the no-draft run's
in 16-bit too: the measure of width-invariant verify on a large random target, whose
own assistant (random) is never right. ``--tokens random`` takes ``--files`` prompts of
random ids instead of held-out files.

Run from the repository root (prints a markdown table; --out also writes JSON):

    python bench/eval_pair.py [--runner eager|graph] [--device cpu] [--out eval.json]
    python bench/eval_pair.py --device cuda --runner graph --target random:gemma4-e2b \
        --draft random:gemma4-e2b-assistant --tokens random --dtype bfloat16 \
        --batch-invariant --oracle-rate 0.7 --configs 4x1,3x3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict

import torch
from oracles import TokenOracle  # bench/oracles.py (bench/ is the script's directory)

from graphrt import devices
from graphrt.core import pretrained
from graphrt.core.engine import Engine, EngineConfig, EngineStats, SamplingParams
from graphrt.core.engine.request import Request
from graphrt.core.models import load_model
from graphrt.core.models.config import parse_dtype
from graphrt.spec import MTPDecoding, SpecConfig

DEFAULT_CONFIGS = "3x1,3x3,5x1,5x3"  # steps x topk


def parse_configs(text: str) -> list[SpecConfig]:
    """ "3x1,5x3,auto" -> [SpecConfig(3, 1), SpecConfig(5, 3), SpecConfig(5, adaptive=True)]
    (``auto``: the CLI's default, up to 5 draft steps chosen step by step)."""
    try:
        return [
            SpecConfig(5, adaptive=True)
            if item == "auto"
            else SpecConfig(*map(int, item.split("x")))
            for item in text.split(",")
        ]
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(
            f"expected STEPSxTOPK or auto[,...], got {text!r} ({e})"
        ) from e


def heldout_prompts(ids: torch.Tensor, eos_ids, files: int, prompt_len: int) -> list[list[int]]:
    """The first ``prompt_len`` ids of each of the first ``files`` held-out files
    (the stream is each file's ids then <eos>) that has at least prompt_len + 8 ids."""
    ends = torch.isin(ids, torch.tensor(eos_ids, dtype=ids.dtype)).nonzero().flatten().tolist()
    starts = [0] + [e + 1 for e in ends[:-1]]
    return [
        ids[s : s + prompt_len].tolist()
        for s, e in list(zip(starts, ends))[:files]
        if e - s >= prompt_len + 8
    ]


class StepClock:
    """``Engine.generate``'s on_step hook: splits its wall time into prefill and decode steps."""

    def __init__(self) -> None:
        self.prefill_s = self.decode_s = 0.0
        self.last = time.perf_counter()

    def __call__(self, stepped) -> None:
        now = time.perf_counter()
        # A prefill step steps freshly admitted requests, each holding just its first token;
        # a decode step (or speculative round) leaves every request it steps with two or more.
        if all(len(r.output_ids) == 1 for r in stepped):
            self.prefill_s += now - self.last
        else:
            self.decode_s += now - self.last
        self.last = now


class Teacher:
    """``Engine.generate``'s on_step hook with an oracle: tells it each request's greedy
    sequence (prompt, then the no-draft run's output) by request slot once admitted,
    between its prefill step and its first round (no round is launched ahead while a
    request prefills). Were a round to draft from a slot's stale row, verify would reject
    what differs: acceptance would pay, never output."""

    def __init__(self, oracle: TokenOracle, sequences: dict[tuple[int, ...], list[int]]):
        self.oracle = oracle
        # On the device before any timing: telling the oracle then waits on nothing.
        self.sequences = {prompt: oracle.staged(ids) for prompt, ids in sequences.items()}
        self.told: dict[int, Request] = {}  # slot -> the request told about

    def __call__(self, stepped: list[Request]) -> None:
        for req in stepped:
            if req.req_slot is not None and self.told.get(req.req_slot) is not req:
                self.told[req.req_slot] = req
                self.oracle.know(req.req_slot, self.sequences[tuple(req.prompt_ids)])


def run_config(
    target, drafter, spec: SpecConfig | None, prompts, args, device, sequences=None
) -> dict:
    """One configuration's timed generate (``sequences``: the no-draft run's greedy
    sequences by prompt, which ``--oracle-rate`` drafts from)."""
    # Room for the deepest verify tree past the last token: no round is cut short by the
    # context's end. Kept tight because graphs attend over the whole context.
    headroom = max(spec.num_draft_tokens for spec in args.configs)  # KV slots a round holds
    context = args.prompt_len + args.max_new_tokens + headroom
    config = EngineConfig(
        max_running_requests=args.batch_size,
        max_context_len=context,
        kv_pool_tokens=args.batch_size * (context + headroom),
        runner=args.runner,
        # One bucket, smaller batches padded up to it: the warm-up compiles every graph used.
        graph_buckets=(args.batch_size,),
    )
    oracle = teacher = None
    if spec is not None and args.oracle_rate is not None:
        oracle = TokenOracle(args.batch_size, context, device.torch_device())
        oracle.rate.fill_(args.oracle_rate)
        teacher = Teacher(oracle, sequences)
    strategy = MTPDecoding(drafter, spec, draft_rule=oracle) if spec is not None else None
    start = time.perf_counter()
    engine = Engine(target, config, device, strategy)  # captures graphs (cpu: lazily)
    capture_s = engine.stats.capture_time_s
    warmup = SamplingParams(max_new_tokens=16)
    engine.generate(prompts[: args.batch_size], warmup, on_step=teacher)  # warm-up
    warmup_s = time.perf_counter() - start
    engine.stats = EngineStats()  # count the timed run only

    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    clock = StepClock()

    def on_step(stepped) -> None:
        if teacher is not None:
            teacher(stepped)
        clock(stepped)

    reqs = engine.generate(prompts, params, on_step=on_step)
    engine.cleanup()
    decode_tokens = sum(len(r.output_ids) - 1 for r in reqs)  # each request's first is prefill's
    stats = engine.stats
    return {
        "spec": asdict(spec) if spec is not None else None,
        "accept_length_mean": stats.accept_length_mean if spec is not None else 1.0,
        "accept_histogram": stats.accept_histogram,
        "spec_rounds": stats.spec_rounds,
        "graph_rounds": stats.graph_rounds,
        "graph_steps": stats.graph_steps,
        "eager_steps": stats.eager_steps,
        "generated_tokens": stats.generated_tokens,
        "decode_tokens": decode_tokens,
        "decode_s": clock.decode_s,
        "prefill_s": clock.prefill_s,
        "decode_tokens_per_s": decode_tokens / clock.decode_s,
        "capture_time_s": capture_s,
        "setup_and_warmup_s": warmup_s,
        "output_ids": [r.output_ids for r in reqs],
    }


def first_differences(results: dict, prompts) -> list[tuple[int, int]]:
    """(request, index) of each request's first output id where some configuration's
    output differs from the no-draft run's."""
    base = results["no draft"]["output_ids"]
    found = set()
    for r in results.values():
        for i, (got, want) in enumerate(zip(r["output_ids"], base)):
            at = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), None)
            if at is not None:
                found.add((i, at))
    return sorted(found)


def explain_differences(target_dir: str, results: dict, prompts, device) -> list[dict]:
    """For each first difference: the target's top-2 logit gap there, from transformers
    in float32 on the same prefix (the plain run's text up to the difference). Gaps far
    below bfloat16's resolution of the logits say the difference is rounding (the verify
    forward multiplies several rows at once, a decode step one), not a wrong token."""
    from transformers import Gemma4ForCausalLM

    hf = Gemma4ForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    hf = hf.to(device.torch_device()).eval()
    base = results["no draft"]["output_ids"]
    out = []
    for i, at in first_differences(results, prompts):
        ids = torch.tensor([prompts[i] + base[i][:at]], device=device.torch_device())
        with torch.no_grad():
            logits = hf(input_ids=ids).logits[0, -1].float()
        top = logits.topk(2)
        spec_tokens = sorted(
            {r["output_ids"][i][at] for r in results.values() if len(r["output_ids"][i]) > at}
        )
        out.append(
            {
                "request": i,
                "index": at,
                "tokens": spec_tokens,
                "top2": top.indices.tolist(),
                "top2_gap": (top.values[0] - top.values[1]).item(),
                "logit": top.values[0].item(),
            }
        )
    return out


def config_name(spec: SpecConfig | None) -> str:
    if spec is None:
        return "no draft"
    if spec.adaptive:
        return f"auto, up to {spec.num_steps} steps, topk {spec.topk}"
    return f"steps {spec.num_steps}, topk {spec.topk} ({spec.num_draft_tokens} verified)"


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--target", default=str(pretrained.TARGET_DIR), help="target (default: the embedded one)"
    )
    p.add_argument(
        "--draft", default=str(pretrained.ASSISTANT_DIR), help="assistant (default: embedded)"
    )
    p.add_argument(
        "--tokens",
        default="build/pair/tokens.pt",
        help="scripts/train_pair.py tokenize output; random: --files prompts of random ids",
    )
    p.add_argument("--files", type=int, default=16, help="held-out files to take prompts from")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per file")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per prompt")
    p.add_argument("--batch-size", type=int, default=1, help="requests decoded together")
    p.add_argument(
        "--configs",
        type=parse_configs,
        default=DEFAULT_CONFIGS,
        help="speculative configurations, STEPSxTOPK or auto each (verify tree: SpecConfig's default)",
    )
    p.add_argument(
        "--runner", choices=["eager", "graph"], default="eager", help="graph: cpu compiles lazily"
    )
    p.add_argument("--device", default="cpu", help="graphrt device: cpu, cuda, npu, xpu, auto")
    p.add_argument("--dtype", default="auto", help="auto: the device's (float32 on cpu)")
    p.add_argument(
        "--batch-invariant", action="store_true", help="the target's batch-invariant ops"
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads, 0: torch's default (this model's ops are too small to share; "
        "on a busy 2-core machine 2 threads made a decode step 16x slower than 1)",
    )
    p.add_argument(
        "--explain",
        action="store_true",
        help="where outputs differ: the target's top-2 logit gap there (transformers, float32)",
    )
    p.add_argument(
        "--oracle-rate",
        type=float,
        default=None,
        help="drafts: the target's own greedy continuation (the no-draft run's) at depth d "
        "with probability RATE ** d, the assistant's elsewhere (bench/oracles.py)",
    )
    p.add_argument("--out", default=None, help="JSON results file; none: print only")
    args = p.parse_args()
    if args.oracle_rate is not None and not 0.0 <= args.oracle_rate <= 1.0:
        p.error(f"--oracle-rate {args.oracle_rate}: a probability, from 0 to 1")
    if args.explain and args.target.startswith("random:"):
        p.error("--explain loads the target with transformers: not a random: target")
    if args.threads:
        torch.set_num_threads(args.threads)

    device = devices.current(args.device)
    dtype = None if args.dtype == "auto" else parse_dtype(args.dtype)
    target = load_model(args.target, device, dtype, batch_invariant=args.batch_invariant)
    drafter = load_model(args.draft, device, dtype or target.dtype)  # they share KV
    if args.tokens == "random":  # a random target: any ids will do, one prompt a "file"
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(
            1, target.model.vocab_size, (args.files, args.prompt_len), generator=generator
        )
        prompts = ids.tolist()
    else:
        heldout = torch.load(args.tokens)["heldout"]
        prompts = heldout_prompts(heldout, target.eos_token_ids, args.files, args.prompt_len)
    print(
        f"{len(prompts)} prompts of {args.prompt_len} tokens, {args.max_new_tokens} new tokens "
        f"each, batch {args.batch_size}, runner {args.runner} on {device.describe()}, "
        f"{torch.get_num_threads()} threads",
        file=sys.stderr,
    )

    results, sequences = {}, None
    for spec in [None, *args.configs]:
        name = config_name(spec)
        results[name] = run_config(target, drafter, spec, prompts, args, device, sequences)
        if spec is None:  # what the oracle drafts from
            outputs = results[name]["output_ids"]
            sequences = {tuple(p): p + out for p, out in zip(prompts, outputs)}
        print(f"  {name}: {results[name]['decode_s']:.1f} s decoding", file=sys.stderr)

    base = results["no draft"]
    print(
        "\ntok/s: decode steps only (tokens they emitted / their wall time), after a warm-up;"
        " excludes loading, capture, compilation and prefill.\n"
    )
    print("| config | accept length | tok/s | speedup | outputs equal |")
    print("|---|---:|---:|---:|---|")
    for name, r in results.items():
        r["speedup"] = r["decode_tokens_per_s"] / base["decode_tokens_per_s"]
        same = [a == b for a, b in zip(r["output_ids"], base["output_ids"])]
        r["outputs_equal"] = all(same)
        r["requests_differing"] = [i for i, ok in enumerate(same) if not ok]
        equal = "yes" if all(same) else f"no ({len(same) - sum(same)}/{len(same)} differ)"
        print(
            f"| {name} | {r['accept_length_mean']:.2f} | {r['decode_tokens_per_s']:.1f} "
            f"| {r['speedup']:.2f}x | {equal} |"
        )
    explained = None
    if args.explain and first_differences(results, prompts):
        explained = explain_differences(args.target, results, prompts, device)
        gaps = sorted(d["top2_gap"] for d in explained)
        tied = sum(set(d["tokens"]) <= set(d["top2"]) for d in explained)
        print(
            f"\n{len(explained)} first differences; the target's top-2 logit gap there "
            f"(transformers, float32): median {statistics.median(gaps):.4f}, max {gaps[-1]:.4f}; "
            f"the differing tokens are its top two at {tied} of them"
        )
    if args.out:
        meta = {k: v for k, v in vars(args).items() if k != "out"}
        meta["explained_differences"] = explained
        meta["configs"] = [asdict(spec) for spec in args.configs]
        meta["device_name"], meta["prompts"] = device.describe(), prompts
        with open(args.out, "w") as f:
            json.dump({"args": meta, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
