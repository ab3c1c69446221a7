"""Start-up's step figures against the same steps in use (issue 20: auto's plain figure).

An auto engine on the embedded pair times a plain step and its rounds at start-up
(``MTPDecoding.step_timing``); the chooser weighs every step on those figures until
real steps of each kind replace them. Here, per start-up variant (each kind three times
in a row, as now; the kinds interleaved, as before stop 43; eight times in a row; and
start-up's timing run a second time right after the first, the fastest kept), the
figures start-up left, then the median of the same kinds run in use (forced,
``--tokens`` a request), at each batch size, side by side in one process.

Run on the device: python bench/step_timing.py [--batch-sizes 1,64] [--tokens 64]
"""

from __future__ import annotations

import argparse
import statistics

import torch
from spec_matrix import PAIR_PROMPTS, step_timer
from tokenizers import Tokenizer

from graphrt import devices
from graphrt.core.engine import Engine, EngineConfig, SamplingParams
from graphrt.core.models import load_model
from graphrt.core.pretrained import ASSISTANT_DIR, TARGET_DIR
from graphrt.spec import MTPDecoding, SpecConfig

KINDS = (0, 1, 5)  # a plain step, the shortest and the longest rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch-sizes", default="1,64")
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    device = devices.current(args.device)
    dtype = torch.bfloat16 if device.name == "cuda" else torch.float32
    target = load_model(str(TARGET_DIR), device, dtype)
    drafter = load_model(str(ASSISTANT_DIR), device, dtype)
    tok = Tokenizer.from_file(str(TARGET_DIR / "tokenizer.json"))
    encoded = [tok.encode(p).ids for p in PAIR_PROMPTS]
    context = max(map(len, encoded)) + args.tokens + 128  # start-up's 8-in-a-row steps fit
    cfg = EngineConfig(
        max_running_requests=max(sizes),
        max_context_len=context,
        kv_pool_tokens=max(sizes) * context,
    )
    in_a_row = MTPDecoding.step_timing

    def interleaved(self):
        sizes_, kinds = in_a_row(self)
        distinct = tuple(dict.fromkeys(kinds))
        return sizes_, distinct * (len(kinds) // len(distinct))

    def eight_in_a_row(self):
        sizes_, kinds = in_a_row(self)
        return sizes_, tuple(k for k in dict.fromkeys(kinds) for _ in range(8))

    engines = {}
    variants = (
        ("in a row", in_a_row),
        ("interleaved", interleaved),
        ("8 in a row", eight_in_a_row),
        ("second pass", in_a_row),
    )
    try:
        for order, timing in variants:
            MTPDecoding.step_timing = timing
            spec = SpecConfig(5, adaptive=True)
            engine = Engine(target, cfg, device, MTPDecoding(drafter, spec))
            if order == "second pass":  # start-up's timing again, warm: does it come down?
                engine._time_steps()
            engines[order] = engine
    finally:
        MTPDecoding.step_timing = in_a_row  # the class's own again
    rows = []
    for order, engine in engines.items():
        chooser = engine.strategy.chooser
        start_up = {
            b: {k: min(bucket.seconds.get(k, [float("nan")])) * 1e3 for k in KINDS}
            for b, bucket in chooser._buckets.items()
        }
        for bs in sizes:
            prompts = [encoded[i % len(encoded)] for i in range(bs)]
            params = SamplingParams(max_new_tokens=args.tokens, ignore_eos=True)
            for k in KINDS:
                engine.strategy.force_step(k)
                engine.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True))
                with step_timer(engine, bs) as ms:
                    engine.generate(prompts, params)
                engine.strategy.force_step(None)
                in_use = statistics.median(ms.values()) if ms else float("nan")
                figure = start_up.get(engine.strategy._bucket(bs), {}).get(k, float("nan"))
                rows.append((order, bs, k, figure, in_use))
    print(f"{device.name}, {dtype}: start-up's figure against the same step in use (ms)")
    print(f"{'start-up':<14} {'bs':>3} {'kind':>5} {'start-up':>9} {'in use':>8} {'ratio':>6}")
    for order, bs, k, figure, in_use in rows:
        kind = "plain" if k == 0 else f"r{k}"
        print(f"{order:<14} {bs:>3} {kind:>5} {figure:9.3f} {in_use:8.3f} {figure / in_use:6.2f}")


if __name__ == "__main__":
    main()
