"""Where a speculative round's time goes on a GPU: the draft-loop graph and the verify
graph of random:gemma4-e2b with its assistant (bf16, prompt 512, batch 1), kernel by
kernel (torch.profiler), beside a plain decode graph step.

Run on the device: python bench/profile_round.py [topk, default 1]
"""

from __future__ import annotations

import sys

import torch
from profile_step import print_kernels

from graphrt import devices
from graphrt.core.models import load_model
from graphrt.spec.bench import SpecBenchConfig, bench_engines
from graphrt.spec.config import SpecConfig


def main() -> None:
    topk = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    device = devices.current("cuda")
    target = load_model("random:gemma4-e2b", device, torch.bfloat16)
    drafter = load_model("random:gemma4-e2b-assistant", device, torch.bfloat16)
    cfg = SpecBenchConfig(batch_sizes=(1,), steps=4)
    spec, plain = bench_engines(target, drafter, device, SpecConfig(4, topk), cfg)
    prompt = torch.randint(0, target.model.vocab_size, (512,)).tolist()
    for engine in (spec, plain):
        engine.add_request(prompt)
        engine.step()  # prefill
    strategy = spec.strategy
    inputs = strategy.round_inputs(spec.running)
    tree, _ = strategy.draft(inputs)
    locs = spec.kv_pool.alloc(tree.num_nodes)
    batch = plain.build_decode_batch(plain.running)
    for name, fn in [
        ("decode graph step", lambda: plain.graph_runner.execute(batch)),
        ("draft-loop graph", lambda: strategy.draft(inputs)),
        ("verify graph", lambda: strategy.verify(inputs, tree, locs)),
    ]:
        fn()
        print_kernels(name, fn, device.synchronize, top=15)


if __name__ == "__main__":
    main()
