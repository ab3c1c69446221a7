"""Where a speculative round's time goes on a GPU: the draft-loop graph and the verify
graph of random:gemma4-e2b with its assistant (bf16, prompt 512), kernel by kernel
(torch.profiler), beside a plain decode graph step (its greedy tokens included). Each
graph's replay is timed too (median of 50): replay minus GPU time is what the device idles
between kernels (launch gaps that PDL or fewer kernels would close).

Run on the device: python bench/profile_round.py [topk, default 1] [kernels listed,
default 15] [batch size, default 1]. ROUND_NO_CUBLAS=1: matmuls of 2 to 16 rows never take
cuBLAS (an experiment: what cuBLAS's leaving the GEMV's PDL chain costs a verify);
ROUND_NO_PDL=1: no programmatic dependent launch, so each kernel's time is its own.
Last, a plain step of as many requests as verify has rows (the same matmul widths).
"""

from __future__ import annotations

import dataclasses
import os
import sys

import torch
from profile_step import print_kernels

from graphrt import devices
from graphrt.core.bench.profile import device_trace
from graphrt.core.bench.rounds import RoundBenchConfig, round_engines
from graphrt.core.bench.timing import median_ms
from graphrt.core.engine import Engine
from graphrt.core.models import load_model
from graphrt.devices.cuda.gemv_tuner import CUBLAS, TUNER
from graphrt.devices.cuda.triton_gemv import configs_for
from graphrt.spec import MTPDecoding, SpecConfig
from graphrt.spec.draft import draft_batch


def main() -> None:
    topk = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 15
    bs = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    device = devices.current("cuda")
    if os.environ.get("ROUND_NO_PDL") == "1":
        from graphrt.devices.cuda import pdl

        pdl.ENABLED = False  # read at each launch: the graphs captured below keep it
        print("  (ROUND_NO_PDL: kernels launched without PDL)")
    if os.environ.get("ROUND_NO_CUBLAS") == "1":
        choose = TUNER.choose

        def without_cublas(key, rows, weight, run, candidates=None):
            if rows == 1 or key[0] == "residual_linear":  # there None is "two launches"
                pass
            elif candidates is not None:
                candidates = tuple(c for c in candidates if c is not CUBLAS) or candidates
            else:
                candidates = configs_for(rows)
            return choose(key, rows, weight, run, candidates)

        TUNER.choose = without_cublas
        print("  (ROUND_NO_CUBLAS: 2 to 16 rows never on cuBLAS)")
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
    # A plain step of as many requests as verify has rows: the same matmuls' widths, so
    # what verify costs beyond it is its own (attention over a tree, the tail, launches).
    rows = bs * max(1, strategy.extra_kv_slots())
    config = dataclasses.replace(
        plain.config, max_running_requests=rows, graph_buckets=(rows,),
        kv_pool_tokens=rows * plain.config.max_context_len,
    )  # fmt: skip
    wide = Engine(target, config, device)
    for _ in range(rows):
        wide.add_request(torch.randint(0, target.model.vocab_size, (512,)).tolist())
    while wide.prefill_pending:
        wide.step()
    wide_batch = wide.build_decode_batch(wide.running)
    fn = lambda: wide.graph_runner.execute(wide_batch)  # noqa: E731
    fn()
    replay = median_ms(fn, device.synchronize, 50, 10)
    name = f"decode graph step, {rows} requests"
    print(f"  {name}: replay {replay:.3f} ms (median of 50)")
    print_kernels(name, device_trace(fn, device.synchronize, torch.device("cuda")), top=top)


if __name__ == "__main__":
    main()
