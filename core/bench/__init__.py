"""Everything behind `graphrt bench`, in one package.

- ``decode``: decode step latency per batch size (eager, graph, the transformers peer)
  against the bandwidth floor (``timing``), kernels per step (``profile``);
- ``rounds``: the pieces of a speculative round (``--draft``), timed through the
  ``DecodeStrategy.bench_pieces`` protocol, so nothing here imports spec/;
- ``peer_hf``: transformers on the same weights; ``plot`` and ``output``: PNG, JSON, tables.

core/cli/bench.py maps the flags onto these and builds the speculative strategy.
"""
