"""Which kernel serves each skinny matmul: cuBLAS or a GEMV configuration, timed once.

Per (op, row class, weight shape, dtype, epilogue) the first call times cuBLAS (plus
the separate activation kernel the fused epilogue would save) against every
``triton_gemv`` configuration, and keeps the fastest for the life of the process.

Timing is done the way a decode step runs: inside a CUDA graph (no host launch
cost, which would favour cuBLAS's cheaper launches over Triton's), over enough
copies of the weight that each call reads it cold from memory rather than from
L2, as a step streams every weight once. The graph runner's warm-up runs come
before any capture, so every shape a graph uses is decided outside capture, and
eager and graph runs of the same rows use the same kernel and agree bitwise.

HAZARD (reproducibility): the choice is a timing, made anew in every process, and the
row class is part of the key. Two processes may pick different kernels for one shape
(float32 sums in another order: logits differ in the last bits, near-tie greedy tokens
may too), and a batch padded into a graph bucket of another class (15 verify rows run
eagerly vs 20 in the bucket-4 graph) runs another kernel than its eager twin. The
batch-invariant ops (ops.INVARIANT_OPS) offer tiles only, never cuBLAS or the row path:
every tile gives a row the same bits, so there the timing picks speed, not arithmetic.

Choices are kept on disk (``cache_path``: one JSON file per card name and torch/triton
versions, under $GRAPHRT_CACHE_DIR or ~/.cache/graphrt), so a later process takes them
without timing (a faster start) and with them the same kernels (the same bits). A
choice counts only among the same candidates it was timed among (their digest is part of
its key): a release that offers other candidates times the shape again. Entries of
earlier candidate sets stay in the file, unread. A cache that cannot be read or written
is ignored. HAZARD: the key does not cover the kernels' code: an edit of triton_gemv.py
that keeps its configurations keeps the earlier timings (and the shipped files' choices),
which may no longer be the fastest: time again (delete the cache, and rebuild the card's
shipped file from an empty one: ``bash bench/h200.sh cold``, then bench/ship_choices.py).

A candidate that does not launch on this card (a tile needing more shared memory than it
has: Triton's OutOfResources) is skipped, as never the fastest.

Under the Triton interpreter (CPU tensors, the CPU test lane) nothing can be
timed: the first GEMV configuration is taken, so the tests exercise the kernel. During a
dry run (``compile_ahead``) nothing is timed either: every candidate is compiled.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import re
import statistics
import time
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path

import torch
from triton.runtime.errors import OutOfResources

from graphrt.core.errors import GraphrtError
from graphrt.devices.cuda import compile_ahead
from graphrt.devices.cuda.triton_gemv import GemvConfig, configs_for

log = logging.getLogger(__name__)

CUBLAS = None  # the choice that means "not the GEMV": torch's own matmul
MIN_CALLS = 16  # calls of the op per timed graph
MAX_COPIES = 32  # weight copies rotated through (for weights far smaller than L2)
REPLAYS = 5  # timed replays per candidate; the median counts


def default_candidates(rows: int) -> tuple[GemvConfig | None, ...]:
    """What may serve a matmul of ``rows`` rows unless its op names its own candidates:
    ``CUBLAS`` (cuBLAS; for ``linear_rope`` its two launches at their best) and the
    GEMV's configurations for that row class (the row path at one row, tiles at 2 to 16).
    HAZARD: cuBLAS's kernels sit outside the PDL chain, which the tuner's timing (a row of
    one op's calls) cannot see. The tiles alone at 2 to 16 rows made verify at batch 1
    4-10% faster (3.08-3.23 ms against 3.23-3.56, stops 91-92, H100) but a plain
    llama-1b step of 8 and 16 requests 5-19% slower (1.83-1.86 ms against 1.56-1.65 at
    8, 1.96-2.00 against 1.77-1.86 at 16; stop 92, H100, alternated), so cuBLAS stays
    offered at every width."""
    return (CUBLAS, *configs_for(rows))


Run = Callable[[GemvConfig | None, torch.Tensor], object]
CACHE_DIR_ENV = "GRAPHRT_CACHE_DIR"


# Choices timed on a card and shipped with graphrt, one JSON file per card name (the cache
# file's format; a card's `bash bench/h200.sh cold` writes one, bench/ship_choices.py
# merges it): a fresh machine takes them instead of timing, whatever its torch and triton
# (a choice is a configuration, valid on any version; only its speed may differ). Its
# own cache file comes first, its siblings' shipped files (SIBLINGS) after its own.
SHIPPED_DIR = Path(__file__).parent / "gemv_choices"


# Cards of one architecture: where a card's shipped file lacks a shape, a sibling's choice
# serves instead of compiling every candidate ahead and timing them at the first start (a
# configuration builds on either; only its speed rank may differ a little). Stop 63: 30
# shapes missing from a fresh H100's file took the README's first command from 12 to 26 s.
SIBLINGS: dict[tuple[int, int], tuple[str, ...]] = {
    (9, 0): ("NVIDIA H100 80GB HBM3", "NVIDIA H200"),
}


def shipped_path(device_name: str) -> Path:
    return SHIPPED_DIR / (re.sub(r"[^A-Za-z0-9._+-]+", "_", device_name) + ".json")


def shipped_paths(device_name: str, capability: tuple[int, int]) -> list[Path]:
    """The shipped files a card reads, in order: its own, then its siblings' (SIBLINGS)."""
    own = shipped_path(device_name)
    siblings = (shipped_path(name) for name in SIBLINGS.get(tuple(capability), ()))
    return [own, *(path for path in siblings if path != own)]


def cache_path(device_name: str) -> Path:
    """The file of one card's choices under this torch and triton."""
    import triton

    base = os.environ.get(CACHE_DIR_ENV) or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "graphrt"
    )
    tag = f"gemv-{device_name}-torch{torch.__version__}-triton{triton.__version__}"
    return Path(base, re.sub(r"[^A-Za-z0-9._+-]+", "_", tag) + ".json")


def _disk_key(key: Hashable, candidates) -> str:
    """The cache file's key: the shape's, and a digest of the candidates it was timed
    among."""
    among = hashlib.sha1(repr(tuple(candidates)).encode()).hexdigest()[:12]
    return f"{key!r} among {among}"


def _read_choices(path: Path) -> dict:
    """A choices file's entries; {} for one that cannot be read (time anew)."""
    try:
        loaded = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


def write_choices(path: Path, entries: dict) -> None:
    """Writes a choices file whole, then renames it into place: another process reading
    it sees the old file or the new one. One sorted object, indent 0 (the shipped files
    diff line by line)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_suffix(f".{os.getpid()}.tmp")
    scratch.write_text(json.dumps(entries, indent=0, sort_keys=True))
    os.replace(scratch, path)


class GemvTuner:
    def __init__(self) -> None:
        self._choices: dict[Hashable, GemvConfig | None] = {}
        # key -> (cuBLAS ms, the chosen candidate's ms) per call: what the bench reports
        self.timings: dict[Hashable, tuple[float | None, float]] = {}  # None: cuBLAS not timed
        self.tuning_s = 0.0  # time spent tuning so far
        # HAZARD: cuBLAS keeps a workspace (32 MiB on Hopper) per stream it ever ran on, for
        # the life of the process: a fresh stream per tuned shape cycles through torch's 32
        # pooled streams and pins up to 1 GiB. Timing runs on the caller's stream (a graph
        # runner's warm-up: the capture stream, whose workspace its graphs use anyway), or
        # on this one stream when the caller is on the default stream, which cannot capture.
        self._stream: torch.cuda.Stream | None = None
        # _disk_key(key, candidates) -> the choice's fields (None: cuBLAS)
        self._disk: dict[str, dict | None] | None = None
        self._disk_path: Path | None = None
        # the same, shipped: this card's file, then its siblings' (shipped_paths)
        self._shipped: list[dict[str, dict | None]] = []

    def choose(
        self,
        key: Hashable,
        rows: int,
        weight: torch.Tensor,
        run: Run,
        candidates: tuple[GemvConfig | None, ...] | None = None,
    ) -> GemvConfig | None:
        """The configuration for ``key``; ``run(choice, weight)`` computes the op with a
        choice on a weight of ``weight``'s shape (the tuner passes copies). ``candidates``:
        what may serve it (default: ``default_candidates(rows)``).
        HAZARD: timing calls ``run`` about a hundred times a candidate, on the caller's
        inputs: it must not accumulate into them (an in-place residual add would sum every
        call into the live stream; ops.triton_linear times on a copy)."""
        choice = self._choices.get(key, "unset")
        if choice != "unset":
            return choice
        if candidates is None:
            candidates = default_candidates(rows)
        if weight.device.type != "cuda":  # the interpreter: nothing to time
            choice = next(c for c in candidates if c is not CUBLAS)
        elif torch.cuda.is_current_stream_capturing():
            raise GraphrtError(
                f"matmul {key} was not tuned before graph capture; run a warm-up forward first"
            )
        else:
            if self._disk is None:
                name = torch.cuda.get_device_name(weight.device)
                capability = torch.cuda.get_device_capability(weight.device)
                self.use_cache(cache_path(name), shipped_paths(name, capability))
            choice = self.recall(key, candidates)
            if choice == "unset" and compile_ahead.dry():
                # A dry run (compile_ahead): compile every candidate, time none; the
                # warm-up that follows times them and keeps the choice.
                for candidate in candidates:
                    if candidate is not CUBLAS:
                        run(candidate, weight)
                return next(c for c in candidates if c is not CUBLAS)
            if choice == "unset":
                choice = self._time(key, candidates, weight, run)
                self.remember(key, choice, candidates)
        self._choices[key] = choice
        return choice

    # ---- the disk cache ------------------------------------------------------------

    def use_cache(self, path: Path, shipped: Sequence[Path] = ()) -> None:
        """Recall choices from the cache file ``path`` and add new ones to it; where it
        has none for a shape, take the first ``shipped`` file's that has one (read only)."""
        self._disk_path = path
        self._disk = _read_choices(path)
        self._shipped = [_read_choices(file) for file in shipped]

    def recall(self, key: Hashable, candidates) -> GemvConfig | None | str:
        """The cached choice for ``key``, if it was timed among these same ``candidates``,
        else "unset" (a release that offers more candidates, split-K tiles say, times the
        shape again instead of keeping a choice made without them)."""
        entry = _disk_key(key, candidates)
        found = next((f for f in (self._disk or {}, *self._shipped) if entry in f), None)
        if found is None:
            return "unset"
        fields = found[entry]
        try:
            choice = None if fields is None else GemvConfig(**fields)
        except TypeError:  # written by another version of the code
            return "unset"
        return choice if choice in candidates else "unset"

    def remember(self, key: Hashable, choice: GemvConfig | None, candidates) -> None:
        """Adds ``key``'s choice among ``candidates`` to the cache file."""
        if self._disk is None or self._disk_path is None:
            return
        self._disk[_disk_key(key, candidates)] = (
            None if choice is None else dataclasses.asdict(choice)
        )
        path = self._disk_path
        # What other processes (tensor-parallel ranks on one host) wrote since this one
        # read the file is kept: each rewrites it whole.
        self._disk = {**_read_choices(path), **self._disk}
        try:
            write_choices(path, self._disk)
        except OSError as e:  # a read-only home: the choices stay in this process
            log.debug("gemv tuner cache not written (%s): %s", path, e)

    def _time(self, key, candidates, weight: torch.Tensor, run: Run) -> GemvConfig | None:
        start = time.perf_counter()
        l2 = torch.cuda.get_device_properties(weight.device).L2_cache_size
        # 3x L2 of weights, rotated, so each call reads cold; one past 2x L2 (never cached,
        # and cloning an 800 MB LM head during capture is memory the card may not have).
        copies = 1 if weight.nbytes >= 2 * l2 else min(MAX_COPIES, -(-3 * l2 // weight.nbytes))
        weights = [weight] + [weight.clone() for _ in range(copies - 1)]
        calls = weights * -(-MIN_CALLS // copies)
        stream = torch.cuda.current_stream(weight.device)
        if stream == torch.cuda.default_stream(weight.device):  # eager: capture refuses it
            if self._stream is None:
                self._stream = torch.cuda.Stream(weight.device)
            stream = self._stream
        stream.wait_stream(torch.cuda.current_stream())
        per_call = []
        with torch.cuda.stream(stream):
            for choice in candidates:
                try:
                    run(choice, weight)  # compiles outside the capture
                except OutOfResources as e:  # only a tile: cuBLAS raises no Triton error
                    log.debug("gemv %s: %s does not fit this card: %s", key, choice, e)
                    per_call.append(math.inf)
                    continue
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=stream):
                    for w in calls:
                        run(choice, w)
                graph.replay()
                samples = []
                for _ in range(REPLAYS):
                    begin, end = torch.cuda.Event(True), torch.cuda.Event(True)
                    begin.record(stream)
                    graph.replay()
                    end.record(stream)
                    end.synchronize()
                    samples.append(begin.elapsed_time(end) / len(calls))
                per_call.append(statistics.median(samples))
                graph.reset()
        torch.cuda.current_stream().wait_stream(stream)
        del weights, calls
        best = min(range(len(candidates)), key=per_call.__getitem__)
        if per_call[best] == math.inf:
            raise GraphrtError(f"no GEMV candidate for {key} fits this card's shared memory")
        self.tuning_s += time.perf_counter() - start
        cublas_ms = per_call[0] if candidates[0] is CUBLAS else None
        self.timings[key] = (cublas_ms, per_call[best])
        log.debug(
            "gemv %s: %s %.4f ms (cuBLAS %s)", key, candidates[best], per_call[best], cublas_ms
        )
        return candidates[best]

    def choices(self) -> dict[Hashable, GemvConfig | None]:
        return dict(self._choices)

    def report(self, weight_bytes: Callable[[Hashable], int] | None = None) -> list[str]:
        """One line per timed key: its choice, that time and cuBLAS's (and GB/s of weight
        read, given ``weight_bytes(key)``)."""
        lines = []
        for key, (cublas_ms, best_ms) in sorted(self.timings.items(), key=str):
            choice = self._choices[key]
            name = "cuBLAS" if choice is None else f"gemv {choice.label}"
            line = f"{key}: {name} {best_ms * 1e3:.1f} us"
            # cuBLAS is not timed where its op does not offer it (the width-invariant class).
            line += (
                " (cuBLAS not offered)"
                if cublas_ms is None
                else f" (cuBLAS {cublas_ms * 1e3:.1f} us)"
            )
            if weight_bytes is not None:
                line += f", {weight_bytes(key) / best_ms / 1e6:.0f} GB/s"
            lines.append(line)
        return lines


TUNER = GemvTuner()  # one per process: the choice depends on the shape and the card only
