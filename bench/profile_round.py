"""Where a speculative round's time goes on a GPU: the draft-loop graph and the verify
graph of random:gemma4-e2b with its assistant (bf16, prompt 512), kernel by kernel
(torch.profiler), beside a plain decode graph step (its greedy tokens included). Each
graph's replay is timed too (median of 50): replay minus GPU time is what the device idles
between kernels (launch gaps that PDL or fewer kernels would close).

Run on the device: python bench/profile_round.py [topk, default 1] [kernels listed,
default 15] [batch size, default 1]
"""

from __future__ import annotations

import sys

import torch
from profile_step import print_kernels

from graphrt import devices
from graphrt.core.bench.profile import device_trace
from graphrt.core.bench.rounds import RoundBenchConfig, round_engines
from graphrt.core.bench.timing import median_ms
from graphrt.core.models import load_model
from graphrt.spec import MTPDecoding, SpecConfig
from graphrt.spec.draft import draft_batch


def main() -> None:
    topk = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 15
    bs = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    device = devices.current("cuda")
    target = load_model("random:gemma4-e2b", device, torch.bfloat16)
    drafter = load_model("random:gemma4-e2b-assistant", device, torch.bfloat16)
    cfg = RoundBenchConfig(batch_sizes=(bs,), steps=4)
    strategy = MTPDecoding(drafter, SpecConfig(4, topk, one_graph=False))  # its two graphs
    spec, plain = round_engines(target, strategy, device, cfg)
    for engine in (spec, plain):
        for _ in range(bs):
            engine.add_request(torch.randint(0, target.model.vocab_size, (512,)).tolist())
        while engine.prefill_pending:
            engine.step()  # prefill
    batch = plain.build_decode_batch(plain.running)
    print(f"== batch {bs}, topk {topk}")
    with strategy.bench_pieces(spec.running) as pieces:
        for name, fn in [
            ("decode graph step", lambda: plain.graph_runner.execute(batch)),
            ("draft-loop graph", lambda: pieces["draft"](True)),
            ("verify graph", lambda: pieces["verify"](True)),
        ]:
            fn()
            replay = median_ms(fn, device.synchronize, 50, 10)
            print(f"  {name}: replay {replay:.3f} ms (median of 50)")
            print_kernels(name, device_trace(fn, device.synchronize, torch.device("cuda")), top=top)
        # The draft loop's graph alone: "replay" above is its execute, whose 6 input copies
        # and 5 output clones a one-graph round (the default) does not have.
        draft = strategy.draft_graph
        inputs = strategy.round_inputs(spec.running)
        draft.load_batch(draft_batch(inputs.root, inputs.seed_hidden, inputs.req_slots,
                                     inputs.kv_lens, inputs.kv_lens_cpu))  # fmt: skip
        key, _ = draft._loaded
        alone = median_ms(lambda: draft.backend.replay(key), device.synchronize, 50, 10)
        print(f"  draft-loop graph alone: replay only {alone:.3f} ms (median of 50)")


if __name__ == "__main__":
    main()
