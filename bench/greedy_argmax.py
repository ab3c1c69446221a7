"""The greedy sampler by vocabulary width: torch's ``max(dim=-1)`` (``TORCH_OPS``) against
``triton_argmax.greedy_tokens`` (CUDA's ``ModelOps.greedy_tokens``), each called 20 times
inside a CUDA graph, median us a call of 10 replays, float32 rows as decode's logits.

On an H100 (stop 60) torch took 26.8 us over Llama 3's 128,256 logits at 1 to 64 rows and
9.0-9.7 us over 131,072 or 262,144: a width that is not a power of two gets a slow
reduction schedule. bench/results/h100-torch-max-probe-stop60.log.

    python bench/greedy_argmax.py [--shapes 1x128256,8x128256,1x262144]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from graphrt.core.models.ops import TORCH_OPS
from graphrt.devices.cuda.triton_argmax import greedy_tokens

CALLS, REPLAYS = 20, 10
SHAPES = "1x128256,8x128256,64x128256,1x262144,8x262144,320x262144,1x128000,1x131072"


def graph_us(fn) -> float:
    """Median us a call of ``fn``, CALLS calls captured in one graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compiles outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(CALLS):
                fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(REPLAYS):
        begin, end = torch.cuda.Event(True), torch.cuda.Event(True)
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(begin.elapsed_time(end) / CALLS * 1e3)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default=SHAPES, help="ROWSxVOCAB,...")
    args = parser.parse_args()
    print(f"{'rows':>5} {'vocab':>7} {'torch us':>9} {'triton us':>9} {'same':>5}")
    for text in args.shapes.split(","):
        rows, vocab = (int(x) for x in text.split("x"))
        logits = torch.randn(rows, vocab, device="cuda")
        same = torch.equal(greedy_tokens(logits), TORCH_OPS.greedy_tokens(logits))
        torch_us = graph_us(lambda x=logits: TORCH_OPS.greedy_tokens(x))
        triton_us = graph_us(lambda x=logits: greedy_tokens(x))
        print(f"{rows:>5} {vocab:>7} {torch_us:>9.1f} {triton_us:>9.1f} {str(same):>5}")


if __name__ == "__main__":
    main()
