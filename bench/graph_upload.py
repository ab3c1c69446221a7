"""A CUDA graph's first replay with and without ``cuGraphUpload`` after capture.

Captures graphs of ``kernels`` small kernels (one stream, as graphrt's), then times one
replay to completion, the first and the second, for graphs uploaded at capture
(``graphrt.devices.cuda.graph.upload_graph``) and graphs left to upload at their first
launch. Medians over ``graphs`` graphs each, in us.

Run on the device: python bench/graph_upload.py [kernels, default 400] [graphs, default 7]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from graphrt.devices.cuda.graph import upload_graph


def captured(kernels: int) -> tuple[torch.cuda.CUDAGraph, torch.cuda.Stream]:
    x = torch.zeros(4096, device="cuda")
    stream, graph = torch.cuda.Stream(), torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        for _ in range(kernels):
            x.add_(1.0)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(kernels):
            x.add_(1.0)
    return graph, stream


def replay_us(graph: torch.cuda.CUDAGraph) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e6


def main() -> None:
    kernels = int(sys.argv[1]) if len(sys.argv) > 1 else 400
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 7
    graphs = []  # kept alive: a freed graph's pool would be reused by the next
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {kernels} kernels a graph")
    for upload in (False, True, False, True):
        first, second = [], []
        for _ in range(count):
            graph, stream = captured(kernels)
            graphs.append(graph)
            if upload:
                upload_graph(graph, stream)
                torch.cuda.synchronize()
            first.append(replay_us(graph))
            second.append(replay_us(graph))
        label = "uploaded at capture" if upload else "uploaded at first replay"
        print(
            f"  {label:<26} first replay {statistics.median(first):8.1f} us, "
            f"second {statistics.median(second):8.1f} us"
        )


if __name__ == "__main__":
    main()
