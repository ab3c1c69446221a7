"""Where a speculative round's time goes on a GPU: the draft-loop graph and the verify
graph of random:gemma4-e2b with its assistant (bf16, prompt 512), kernel by kernel
(torch.profiler), beside a plain decode graph step (its greedy tokens included). Each
graph's replay is timed too (median of 50): replay minus GPU time is what the device idles
between kernels (launch gaps that PDL or fewer kernels would close).

Run on the device: python bench/profile_round.py [topk, default 1] [kernels listed,
default 15] [batch size, default 1]. ROUND_TILES_ONLY=1: matmuls of 2 to 16 rows choose among
the GEMV's tiles only, never cuBLAS (stop 91's default, taken back at stop 92: what cuBLAS's
leaving the GEMV's PDL chain costs a verify);
ROUND_NO_PDL=1: no programmatic dependent launch, so each kernel's time is its own.
Last, a plain step of as many requests as verify has rows (the same matmul widths), then
where verify and it part: the launches (kernel, grid, block) whose GPU time differs most,
and the GEMV choices and calls (configuration, x's stride, pointer alignment) at those
rows that only one of the two builds made (stop 74: none; same launches, yet verify's
gate/up and grid-96 GEMVs read 7-17% slower in the profiler).
"""

from __future__ import annotations

import collections
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
from graphrt.devices.cuda import compile_ahead, gemv_tuner
from graphrt.devices.cuda import ops as cuda_ops
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
    if os.environ.get("ROUND_TILES_ONLY") == "1":
        # where the tuner reads its default set (linear_rope still times its two launches,
        # which it then never picks)
        def tiles_only(rows):
            return (CUBLAS, *configs_for(rows)) if rows == 1 else configs_for(rows)

        gemv_tuner.default_candidates = tiles_only
        print("  (ROUND_TILES_ONLY: 2 to 16 rows never on cuBLAS)")
    phase = ["spec"]
    seen = collections.defaultdict(set)  # phase -> the GEMV calls' signatures at verify's rows
    choose, real_gemv = TUNER.choose, cuda_ops.gemv

    def recorded_choose(key, rows, weight, run, candidates=None):
        choice = choose(key, rows, weight, run, candidates)
        # (a dry run's answer is the first candidate, not a choice: stop 75's log listed
        # each such as "spec only")
        if rows > 1 and not compile_ahead.dry():
            seen[phase[0]].add(("choice", rows, key, repr(choice)))
        return choice

    def recorded_gemv(x, weight, bias, config, **fused):
        if x.shape[0] > 1 and not compile_ahead.dry():
            tags = "+".join(k for k, v in fused.items() if v is not None and v is not False)
            ptrs = [t.data_ptr() % 16 for t in (x, fused.get("up"), fused.get("residual"))
                    if isinstance(t, torch.Tensor)]  # fmt: skip
            seen[phase[0]].add(("gemv", x.shape[0], tuple(weight.shape), tags, x.stride(0),
                                tuple(ptrs), repr(config)))  # fmt: skip
        return real_gemv(x, weight, bias, config, **fused)

    TUNER.choose, cuda_ops.gemv = recorded_choose, recorded_gemv
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
    traces = {}
    with strategy.bench_pieces(spec.running) as pieces:
        for name, fn in [
            ("decode graph step", lambda: plain.graph_runner.execute(batch)),
            ("draft-loop graph", lambda: pieces["draft"](True)),
            ("verify graph", lambda: pieces["verify"](True)),
        ]:
            fn()
            replay = median_ms(fn, device.synchronize, 50, 10)
            print(f"  {name}: replay {replay:.3f} ms (median of 50)")
            traces[name] = device_trace(fn, device.synchronize, torch.device("cuda"))
            print_kernels(name, traces[name], top=top)
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
    phase[0] = "wide"
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
    wide_trace = device_trace(fn, device.synchronize, torch.device("cuda"))
    print_kernels(name, wide_trace, top=top)
    print_launch_differences("verify graph", traces["verify graph"], name, wide_trace, top)
    rows_seen = {s[1] for s in seen["wide"]}
    print(f"  GEMV choices and calls at {sorted(rows_seen)} rows in one build only:")
    for which, other in (("spec", "wide"), ("wide", "spec")):
        for sig in sorted(s for s in seen[which] - seen[other] if s[1] in rows_seen):
            print(f"    {which} only: {sig}")


def print_launch_differences(name_a: str, a: list[dict], name_b: str, b: list[dict], top: int):
    """Where two traces of the same matmul widths part: GPU time by kernel and launch
    (grid and block), the launches whose time or count differs most first."""

    def by_launch(trace):
        sums = collections.defaultdict(lambda: [0, 0.0])
        for e in trace:
            args = e.get("args", {})
            key = (e["name"][:40], str(args.get("grid", "")), str(args.get("block", "")))
            sums[key][0] += 1
            sums[key][1] += e["dur"]
        return sums

    sa, sb = by_launch(a), by_launch(b)
    rows = []
    for key in set(sa) | set(sb):
        (ca, ua), (cb, ub) = sa.get(key, (0, 0.0)), sb.get(key, (0, 0.0))
        rows.append((ua - ub, key, ca, ua, cb, ub))
    print(f"  launches that differ, {name_a} minus {name_b} (us):")
    for diff, (kernel, grid, block), ca, ua, cb, ub in sorted(rows, key=lambda r: -abs(r[0]))[:top]:
        print(
            f"    {diff:+8.1f}  {kernel} grid {grid} block {block}: x{ca} {ua:.1f} | x{cb} {ub:.1f}"
        )


if __name__ == "__main__":
    main()
