"""Are greedy tokens the same with and without programmatic dependent launch, and the
same run to run? (stop 64: bench/profile_step.py found random:llama-1b's 32 greedy tokens
for 4 prompts differing between its PDL and no-PDL engines on an H100; Gemma 4's equal.
The likely cause, found by reading afterwards and fixed: the first engine's tuner timed
cuBLAS's in-place residual add on the live stream of a first short prompt; then only the
first engine's first request differs, whatever PDL. This checks the fix: stop 65, on an
H100, every run equal, bench/results/h100-pdl-tokens-stop65.log.)

One process: engines in turn, PDL on, off, on again (graphs; 4 prompts at once, then one
prompt), then eager; each generates its prompts twice. Prints, as each run ends, whether
it agrees with the first PDL engine's and, where not, each request's first differing
position.

Run on the device: python bench/pdl_tokens.py [model, default random:llama-1b]
"""

from __future__ import annotations

import gc
import sys

import torch

from graphrt import devices
from graphrt.core.bench.decode import DecodeBenchConfig, make_engine
from graphrt.core.engine import SamplingParams
from graphrt.core.models import load_model


def tokens(engine, vocab: int, rows: tuple[int, ...]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in rows]
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    return [r.output_ids for r in engine.generate(prompts, params)]


def first_difference(a: list[list[int]], b: list[list[int]]) -> list[int | None]:
    return [
        next((i for i, (x, y) in enumerate(zip(ra, rb)) if x != y), None) for ra, rb in zip(a, b)
    ]


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else "random:llama-1b"
    device = devices.current("cuda")
    from graphrt.devices.cuda import pdl

    runs: dict[str, list[list[int]]] = {}
    four, one = (7, 60, 300, 5), (300,)
    # (run, PDL, graphs, prompts, requests at once, the run it must equal): profile_step's
    # case first (its engine ran one request at a time)
    for name, pdl_on, graphs, rows, at_once, ref in (
        ("serial-pdl", True, True, four, 1, "serial-pdl"),
        ("serial-no-pdl", False, True, four, 1, "serial-pdl"),
        ("serial-pdl-again", True, True, four, 1, "serial-pdl"),
        ("pdl", True, True, four, 4, "pdl"),
        ("no-pdl", False, True, four, 4, "pdl"),
        ("pdl-one-row", True, True, one, 4, "pdl-one-row"),
        ("no-pdl-one-row", False, True, one, 4, "pdl-one-row"),
        ("eager-pdl", True, False, four, 4, "pdl"),
        ("eager-no-pdl", False, False, four, 4, "pdl"),
    ):
        pdl.ENABLED = pdl_on
        loaded = load_model(model, device, torch.bfloat16, ops=device.model_ops())
        cfg = DecodeBenchConfig(
            batch_sizes=(at_once,), prompt_len=512, max_running_requests=at_once
        )
        engine = make_engine(loaded, device, cfg, graphs=graphs)
        vocab = loaded.model.vocab_size
        for run in (name, name + " #2"):
            runs[run] = tokens(engine, vocab, rows)
            same = runs[run] == runs[ref]
            detail = (
                ""
                if same
                else f"  first differing position per request: {first_difference(runs[run], runs[ref])}"
            )
            print(f"{run:<18} == {ref:<12}: {same}{detail}", flush=True)
        engine.cleanup()
        del engine, loaded
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
