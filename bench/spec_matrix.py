"""The speculative speed matrix (issue 20): end-to-end decoding tokens/s, measured.

Rows: models x batch sizes; columns: plain decoding, rounds of 1 to 5 draft steps, and
``--spec-steps auto``. Models:

- ``pair``: the embedded Gemma 4 pair at its real acceptance (code prompts);
- ``oracle-<rate>``: random:gemma4-e2b with its random assistant, whose drafts an oracle
  overwrites: the assistant's draft graph still runs (its cost is real), then each drafted
  node gets the target's own greedy token at its position with probability ``rate`` (a
  fixed coin per request, position and depth), else a wrong one. The oracle's overwrite is
  a few device ops between the draft and verify graphs (about 0.03 ms); real drafting
  does not pay it.

Each cell: one engine per mode (graphs captured once, reused across cells), its requests
of ``--tokens`` new tokens each, after one warm-up generate at that batch size; decoding
tokens/s counts decode steps and rounds only (prefill and captures apart), as the CLI.

Run on the device: python bench/spec_matrix.py [--batch-sizes 1,8,32,64] [--rates
0.5,0.7,0.9] [--modes plain,1,2,3,4,5,auto] [--tokens 64] [--out matrix.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch
import triton
from tokenizers import Tokenizer

from graphrt import devices
from graphrt.core.engine import Engine, EngineConfig, SamplingParams
from graphrt.core.models import load_model
from graphrt.core.pretrained import ASSISTANT_DIR, TARGET_DIR
from graphrt.spec import MTPDecoding, SpecConfig

PAIR_PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n\n",
    "class Stack:\n    def __init__(self",
]
MAX_STEPS = 5


def decoding_tokens_per_s(engine: Engine, prompts, params: SamplingParams) -> float:
    """One generate call's decoding tokens/s (what the CLI reports, for this call alone)."""
    s = engine.stats

    def counters():
        return s.generated_tokens - s.prefill_tokens, s.elapsed_s - s.prefill_s - s.lazy_capture_s

    before = counters()
    engine.generate(prompts, params)
    after = counters()
    return (after[0] - before[0]) / (after[1] - before[1])


class Oracle:
    """Overwrites a strategy's drafts with the target's greedy continuation at ``rate``."""

    def __init__(self, engine: Engine, truth: dict[tuple[int, ...], list[int]], seed: int = 0):
        self.engine, self.truth, self.rate = engine, truth, 0.0
        strategy = engine.strategy
        rows, ctx = engine.req_pool.max_requests + 1, engine.max_context_len
        dev = engine.torch_device
        self.table = torch.zeros(rows, ctx, dtype=torch.int64, device=dev)  # slot -> tokens
        generator = torch.Generator(device="cpu").manual_seed(seed)
        self.coins = torch.rand(rows, ctx, MAX_STEPS + 1, generator=generator).to(dev)
        self.vocab = engine.loaded.model.vocab_size
        self._draft, self._after_prefill = strategy.draft, strategy.after_prefill
        strategy.draft, strategy.after_prefill = self.draft, self.after_prefill

    def after_prefill(self, reqs, out) -> None:
        self._after_prefill(reqs, out)
        for req in reqs:  # the request's whole greedy sequence, by its slot
            seq = self.truth[tuple(req.prompt_ids)]
            self.table[req.req_slot, : len(seq)] = torch.tensor(seq, device=self.table.device)

    def draft(self, inputs, graphs=True, variant=None):
        tree, on_graph = self._draft(inputs, graphs, variant)
        ctx = self.table.shape[1]
        pos = (inputs.kv_lens.long().unsqueeze(1) + tree.depth).clamp(max=ctx - 1)  # (B, n)
        slots = inputs.req_slots.unsqueeze(1)
        right = self.table[slots, pos]
        coin = self.coins[slots, pos, tree.depth.clamp(max=MAX_STEPS)]
        drafted = torch.where(coin < self.rate, right, (right + 1) % self.vocab)
        tree.tokens = torch.where(tree.depth == 0, tree.tokens, drafted)
        return tree, on_graph


def engine_for(mode: str, target, drafter, device, cfg: EngineConfig) -> Engine:
    if mode == "plain":
        return Engine(target, cfg, device)
    spec = SpecConfig(MAX_STEPS, adaptive=True) if mode == "auto" else SpecConfig(int(mode))
    return Engine(target, cfg, device, MTPDecoding(drafter, spec))


def run_model(name, target, drafter, prompts_for, rates, args, device, results) -> None:
    """Every mode x batch size (x oracle rate) of one model; cells into ``results``."""
    max_bs = max(args.batch_sizes)
    prompt_len = max(len(p) for p in prompts_for(max_bs))
    cfg = EngineConfig(
        max_running_requests=max_bs,
        max_context_len=prompt_len + args.tokens + 2 * MAX_STEPS + 8,
        kv_pool_tokens=max_bs * (prompt_len + args.tokens + 2 * MAX_STEPS + 8),
    )
    params = SamplingParams(max_new_tokens=args.tokens, ignore_eos=True)
    truth = {}
    if rates != (None,):  # the target's own greedy continuations, for the oracle
        plain = engine_for("plain", target, drafter, device, cfg)
        for bs in args.batch_sizes:
            long = SamplingParams(max_new_tokens=args.tokens + MAX_STEPS + 1, ignore_eos=True)
            for req in plain.generate(prompts_for(bs), long):
                truth[tuple(req.prompt_ids)] = req.prompt_ids + req.output_ids
        plain.cleanup()
        del plain
    for mode in args.modes:
        start = time.perf_counter()
        engine = engine_for(mode, target, drafter, device, cfg)
        oracle = Oracle(engine, truth) if truth and mode != "plain" else None
        built = time.perf_counter() - start
        for bs in args.batch_sizes:
            prompts = prompts_for(bs)
            for rate in rates:
                if oracle is not None:
                    oracle.rate = rate
                s = engine.stats
                hist0 = list(s.accept_histogram)
                engine.generate(prompts, SamplingParams(max_new_tokens=16, ignore_eos=True))
                tps = decoding_tokens_per_s(engine, prompts, params)
                hist = [
                    n - (hist0[i] if i < len(hist0) else 0)
                    for i, n in enumerate(s.accept_histogram)
                ]
                rounds = sum(hist)
                cell = {
                    "model": name if rate is None else f"{name}-{rate}",
                    "batch_size": bs,
                    "mode": mode,
                    "tokens_per_s": round(tps, 1),
                    "rounds": rounds,
                    "accept_length": round(sum((k + 1) * n for k, n in enumerate(hist)) / rounds, 3)
                    if rounds
                    else None,
                }
                if mode == "auto":
                    cell["steps_by_count"] = list(engine.strategy.chooser.steps_by_count)
                results.append(cell)
                print(json.dumps(cell), flush=True)
        print(f"# {name} {mode}: engine built in {built:.1f} s", flush=True)
        engine.cleanup()
        del engine, oracle
        if device.name == "cuda":
            torch.cuda.empty_cache()


def table(results: list[dict], modes: list[str]) -> list[str]:
    """Tokens/s per (model, batch) row, by mode; auto's ratio to the best fixed mode."""
    rows: dict[tuple[str, int], dict[str, dict]] = {}
    for cell in results:
        rows.setdefault((cell["model"], cell["batch_size"]), {})[cell["mode"]] = cell
    head = f"{'model':<12} {'bs':>3} " + " ".join(f"{m:>7}" for m in modes) + "  auto/best  best"
    lines = [head]
    for (model, bs), cells in rows.items():
        values = {m: cells[m]["tokens_per_s"] for m in modes if m in cells}
        fixed = {m: v for m, v in values.items() if m != "auto"}
        best = max(fixed, key=fixed.get)
        ratio = values.get("auto", 0) / fixed[best] if fixed[best] else 0
        cols = " ".join(f"{values.get(m, 0):7.0f}" for m in modes)
        lines.append(f"{model:<12} {bs:>3} {cols}  {ratio:9.2f}  {best}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch-sizes", default="1,8,32,64")
    parser.add_argument("--rates", default="0.5,0.7,0.9")
    parser.add_argument("--modes", default="plain,1,2,3,4,5,auto")
    parser.add_argument("--models", default="pair,oracle")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--oracle-model", default="random:gemma4-e2b")
    parser.add_argument("--oracle-draft", default="random:gemma4-e2b-assistant")
    parser.add_argument("--out", default="spec-matrix.json")
    args = parser.parse_args()
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    args.modes = args.modes.split(",")
    device = devices.current(args.device)
    dtype = torch.bfloat16 if device.name == "cuda" else torch.float32
    results: list[dict] = []
    models = args.models.split(",")
    if "pair" in models:
        target = load_model(str(TARGET_DIR), device, dtype)
        drafter = load_model(str(ASSISTANT_DIR), device, dtype)
        tok = Tokenizer.from_file(str(TARGET_DIR / "tokenizer.json"))
        encoded = [tok.encode(p).ids for p in PAIR_PROMPTS]

        def pair_prompts(bs):
            return [encoded[i % len(encoded)] for i in range(bs)]

        run_model("pair", target, drafter, pair_prompts, (None,), args, device, results)
        del target, drafter
    if "oracle" in models:
        target = load_model(args.oracle_model, device, dtype)
        drafter = load_model(args.oracle_draft, device, dtype)
        vocab = target.model.vocab_size
        generator = torch.Generator().manual_seed(0)
        pool = torch.randint(
            1, vocab, (max(args.batch_sizes), args.prompt_len), generator=generator
        )

        def oracle_prompts(bs):
            return [row.tolist() for row in pool[:bs]]

        rates = tuple(float(r) for r in args.rates.split(","))
        run_model("oracle", target, drafter, oracle_prompts, rates, args, device, results)
    header = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name() if device.name == "cuda" else platform.processor(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dtype": str(dtype),
        "tokens": args.tokens,
        "prompt_len_oracle": args.prompt_len,
    }
    with open(args.out, "w") as f:
        json.dump({**header, "cells": results}, f, indent=1)
    print("\n".join(table(results, args.modes)))


if __name__ == "__main__":
    main()
