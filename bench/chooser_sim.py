"""The auto draft-length chooser (spec.adaptive) against measured step times, off the device.

A model of the speculative matrix (bench/spec_matrix.py), for tuning the chooser without a
GPU: the real ``DraftChooser`` decides every step; a step's time comes from a matrix run's
measured step times (``step_ms`` of its fixed-length cells, the oracle's, by batch size;
the nearest measured batch stands for a bucket, with +-3% noise); each drafted position is
accepted with the cell's rate, independently. Every mode of a cell reads the same draws
(common random numbers: a request's run of acceptances from each of its positions, drawn
once), so auto is compared with the fixed lengths on the same luck: with independent
draws a cell's ratio moved by +-0.03 between 16-seed runs of the same chooser. ``--text``
takes a real drafter's acceptance on real text instead (bench/pair_acceptance.py: the
embedded pair's, whose acceptance rises with depth, differs by request and drifts within
one), each request one of its sequences. Cells run as the matrix runs them, on one
chooser: for each batch size and rate, a 16-token warm-up, then ``--tokens`` new tokens a
request; each fixed length and plain decoding run the same cell alike. A closed cell (and
every warm-up) tells the chooser its batch is closed, as ``Engine.generate`` does; a
``--steady`` cell does not. Prints auto's tokens/s over the best fixed mode's, by cell,
each mode's tokens/s averaged over the seeds first.

Not modelled: the host's settling beyond what the step times hold, start-up timing's own
noise, part-filled buckets' other costs, acceptance that varies by text. Start-up times
the two ends at every bucket, as `graphrt generate` does (`graphrt serve` times every
length). Cells run in turn on one chooser, as the matrix runs them, so a cell starts from
the acceptance the one before left (0.9 before 0.5 is harsher than most traffic). A
change this favours still has to be measured on the device.

    python bench/chooser_sim.py [--matrix bench/results/h200-spec-matrix-stop40.json]
        [--rates 0.5,0.7,0.9 | --text bench/results/cpu-pair-acceptance-runs.json]
        [--batch-sizes 1,8,32,64] [--tokens 128] [--steady 2] [--references] [--seeds 4]
        [--first-seed 0]
        [--model oracle-0.7|pair] (whose measured step times) [--cold 0.2] (start-up's
        steps up to 20% slower than in use, as measured) [--bias 1.5,1.05] (start-up's
        plain steps and rounds this many times the same steps in use: the host drifts)
        [--early 8,1.6] (each cell's first 8 steps, the warm-up's too, 1.6x slower, as
        the H200's were in stop 50's matrix: the chooser learns their times as they are)
        [--switch 1.5] (a step after one of another kind 1.5 plain steps slower, as on
        an H100 with steps launched ahead, stop 69) [--drift 0.05] (the host's pace
        wanders, every step time times a factor within 0.67-1.5x, as on H100s, stop 69)
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from graphrt.core.engine import SamplingParams
from graphrt.spec.adaptive import DraftChooser

RESULTS = Path(__file__).resolve().parent / "results"
MAX_STEPS = 5
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
WARM_TOKENS = 16


@dataclass
class SimRequest:  # what the chooser reads of a request
    rid: int
    params: SamplingParams
    output_ids: list[int] = field(default_factory=lambda: [0])  # the prefill's token
    prompt_ids: list[int] = field(default_factory=lambda: [0] * 8)


class StepTimes:
    """Seconds of a step of k draft steps (0: plain) at a bucket, from a matrix run."""

    def __init__(self, path: str, model: str = "oracle-0.7"):
        cells = json.load(open(path))["cells"]
        self.ms: dict[int, list[float]] = {}
        # A matrix of both workloads: the closed cells' times (the later ones here) stand.
        for cell in sorted(cells, key=lambda c: c.get("workload", "closed") == "closed"):
            if cell["model"] != model or cell["mode"] == "auto":
                continue
            k = 0 if cell["mode"] == "plain" else int(cell["mode"])
            row = self.ms.setdefault(cell["batch_size"], [0.0] * (MAX_STEPS + 1))
            row[k] = cell["step_ms"]["plain" if k == 0 else str(k)]
        for batch, row in self.ms.items():
            # Lengths a matrix left out (stop 51's: 2 and 4), between the rounds measured on
            # either side (not from a plain step: a round's fixed cost would vanish).
            measured = [k for k, ms in enumerate(row) if ms and k > 0]
            for k in range(1, len(row)):
                if not row[k] and measured and measured[0] < k < measured[-1]:
                    lo = max(m for m in measured if m < k)
                    hi = min(m for m in measured if m > k)
                    row[k] = row[lo] + (row[hi] - row[lo]) * (k - lo) / (hi - lo)
            missing = [k for k, ms in enumerate(row) if not ms]
            if missing:
                raise SystemExit(f"{path}: {model} at batch {batch} lacks lengths {missing}")

    def __call__(self, bucket: int, k: int, rng: random.Random) -> float:
        nearest = min(self.ms, key=lambda b: abs(b - bucket))
        return self.ms[nearest][k] * 1e-3 * rng.uniform(0.97, 1.03)


def bucket_of(batch: int) -> int:
    return next(b for b in BUCKETS if batch <= b)


def acceptance_runs(seed: int, batch: int, rate: float, tokens: int) -> list[list[int]]:
    """[request][position] = the drafts a round from that output position accepts at most:
    consecutive positions accepted with probability ``rate`` each, up to MAX_STEPS (a round
    of k accepts the lesser of this and k)."""
    rng = random.Random(seed)
    runs = []
    for _ in range(batch):
        row = []
        for _ in range(tokens):
            n = 0
            while n < MAX_STEPS and rng.random() < rate:
                n += 1
            row.append(n)
        runs.append(row)
    return runs


def text_runs(seed: int, pool: list[list[int]], batch: int, tokens: int) -> list[list[int]]:
    """``batch`` requests' runs (as ``acceptance_runs``) taken from ``pool``, a real
    drafter's on real text (bench/pair_acceptance.py), each request a sequence drawn at
    random."""
    rng = random.Random(seed)
    return [pool[rng.randrange(len(pool))][:tokens] for _ in range(batch)]


def run_cell(
    times,
    rng,
    runs,
    tokens,
    chooser=None,
    fixed=None,
    first_rid=0,
    batch=None,
    early=(0, 1.0),
    switch=0.0,
    drift=(0.0, 0),
) -> float:
    """Decoding tokens/s of requests of ``tokens`` tokens (``runs``: their acceptance, as
    ``acceptance_runs``), each step chosen by ``chooser`` (which records it; or a
    ``Reference``) or of ``fixed`` draft steps. ``batch`` (default: every request at once, a closed batch): requests
    running at once, each finished one replaced by the next of ``runs`` (steady, as
    ``spec_matrix --steady``) until none is left to replace it; the cell ends there.
    ``early``: (steps, factor): the cell's first steps run that many times slower.
    ``switch``: a step of another kind than the one before costs this many plain steps
    more (the chooser's last kind carries over from cell to cell). ``drift``: (sigma,
    seed): every step time times a factor that wanders (a mean-reverting walk of its log,
    steps of ``sigma``, within 0.67-1.5x), the same walk by step for every mode."""
    pace, walk = 0.0, random.Random(drift[1])
    params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    batch = len(runs) if batch is None else batch
    reqs = [SimRequest(first_rid + i, params) for i in range(batch)]
    joined = batch
    closed = batch == len(runs)  # nothing joins (as Engine.generate tells the chooser)
    seconds = emitted = steps = 0
    while reqs:
        bucket = bucket_of(len(reqs))
        k = fixed if chooser is None else chooser.choose(bucket, reqs, closed=closed)
        step = times(bucket, k, rng) * (early[1] if steps < early[0] else 1.0)
        if drift[0]:
            pace = min(max(0.97 * pace + walk.gauss(0.0, drift[0]), -0.4), 0.4)
            step *= math.exp(pace)
        if chooser is not None:
            if switch and getattr(chooser, "sim_last", k) != k:
                step += switch * times(bucket, 0, rng)
            chooser.sim_last = k
        steps += 1
        seconds += step
        accepted = []
        for req in reqs:
            n = min(k, runs[req.rid - first_rid][len(req.output_ids) - 1])
            # The engine drops what passes the cap; the chooser sees the round's acceptance.
            emit = min(n + 1, tokens - len(req.output_ids))
            req.output_ids += [0] * emit
            emitted += emit
            if k:
                accepted.append((req, n))
        if chooser is not None:
            chooser.record(k, bucket, step, accepted)
        running = [r for r in reqs if len(r.output_ids) < tokens]
        if batch < len(runs) and len(running) < len(reqs):  # steady: replace the finished
            if joined + len(reqs) - len(running) > len(runs):
                break  # no request left to replace them: the rest are aborted
            for _ in range(len(reqs) - len(running)):
                running.append(SimRequest(first_rid + joined, params))
                joined += 1
        reqs = running
    return emitted / seconds


class Reference:
    """A chooser no engine can have, for scale: it knows every request's acceptance.
    ``foresight``: each step the length whose round emits the most tokens a second,
    knowing what it will accept. ``makespan``: the length under which the batch would
    finish soonest, each request at its own mean accept length for that length (its
    whole sequence's), the slowest deciding. The first is the best a step-by-step
    chooser could do; in a closed batch whose requests accept differently it still
    loses to plain steps, where the second does not (the requests left at the end are
    the slow ones, and their tail of small steps costs nearly full steps)."""

    def __init__(self, kind, times, runs, tokens):  # requests' ids: their index in runs
        self.kind, self.times, self.runs, self.tokens = kind, times, runs, tokens
        self.means = [
            [statistics.mean(min(n, k) + 1 for n in row) for k in range(MAX_STEPS + 1)]
            for row in runs
        ]

    def choose(self, bucket, reqs, closed=False):
        nearest = min(self.times.ms, key=lambda b: abs(b - bucket))
        ms = self.times.ms[nearest]
        left = {r.rid: self.tokens - len(r.output_ids) for r in reqs}
        if self.kind == "foresight":

            def emitted(k, r):
                n = min(k, self.runs[r.rid][len(r.output_ids) - 1])
                return min(n + 1, left[r.rid])

            return max(range(MAX_STEPS + 1), key=lambda k: sum(emitted(k, r) for r in reqs) / ms[k])
        return min(
            range(MAX_STEPS + 1),
            key=lambda k: ms[k] * max(left[r.rid] / self.means[r.rid][k] for r in reqs),
        )

    def record(self, *args, **kwargs) -> None:
        pass


def simulate(
    times,
    seed,
    batch_sizes,
    rates,
    tokens,
    cold=0.0,
    bias=(1.0, 1.0),
    text=None,
    turns=0,
    references=False,
    early=(0, 1.0),
    switch=0.0,
    drift=0.0,
) -> dict[tuple[int, float | None], list[float]]:
    """{(batch, rate): [auto's tokens/s, then each fixed mode's: plain, 1, ...]} for one
    seed. ``cold``: start-up's steps run up to this share slower than the same steps in
    use (first touches); ``bias``: start-up's plain steps and rounds this many times the
    same steps in use (the host's speed drifts: measured 0.7-1.5x on the H200, stop 43).
    ``text``: a real drafter's runs (``text_runs``) in place of the rates (rate None).
    ``turns``: cells run steady until this many requests a slot finished (0: closed).
    ``references``: the two ``Reference`` choosers' tokens/s follow the fixed modes'.
    ``early``: (steps, factor): each cell's first steps (the warm-up's too) run slower.
    ``switch``: a step after one of another kind costs this many plain steps more.
    ``drift``: the host's pace wanders by steps of this sigma (``run_cell``)."""
    rng = random.Random(seed)
    chooser = DraftChooser(MAX_STEPS, context_len=4096)
    for bucket in BUCKETS:  # start-up timing: each end three times in a row, rounds again
        for k in (MAX_STEPS,) * 3 + (0,) * 3 + (MAX_STEPS,):
            scale = (1 + rng.uniform(0, cold)) * (bias[0] if k == 0 else bias[1])
            step = times(bucket, k, rng) * scale
            if switch and getattr(chooser, "sim_last", k) != k:
                step += switch * times(bucket, 0, rng)
            chooser.sim_last = k
            chooser.record(k, bucket, step, timing=True)
    ratios, rid = {}, 0
    for batch in batch_sizes:
        for rate in rates if text is None else [None]:
            requests = batch * (1 + turns) if turns else batch
            if text is None:
                warm = acceptance_runs(rng.getrandbits(32), batch, rate, WARM_TOKENS)
                runs = acceptance_runs(rng.getrandbits(32), requests, rate, tokens)
            else:
                warm = text_runs(rng.getrandbits(32), text, batch, WARM_TOKENS)
                runs = text_runs(rng.getrandbits(32), text, requests, tokens)
            paced = (drift, rng.getrandbits(32))  # one walk for every mode of the cell
            run_cell(
                times, rng, warm, WARM_TOKENS, chooser, first_rid=rid, early=early, switch=switch
            )
            rid += batch
            auto = run_cell(
                times,
                rng,
                runs,
                tokens,
                chooser,
                first_rid=rid,
                batch=batch,
                early=early,
                switch=switch,
                drift=paced,
            )
            rid += requests
            fixed = [
                run_cell(times, rng, runs, tokens, fixed=k, batch=batch, early=early, drift=paced)
                for k in range(MAX_STEPS + 1)
            ]
            known = [
                run_cell(
                    times,
                    rng,
                    runs,
                    tokens,
                    Reference(kind, times, runs, tokens),
                    batch=batch,
                    early=early,
                    drift=paced,
                )
                for kind in (("foresight", "makespan") if references else ())
            ]
            ratios[(batch, rate)] = [auto, *fixed, *known]
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--matrix", default=str(RESULTS / "h200-spec-matrix-stop40.json"))
    parser.add_argument("--rates", default="0.5,0.7,0.9")
    parser.add_argument("--batch-sizes", default="1,8,32,64")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--first-seed", type=int, default=0, help="seeds from this one on")
    parser.add_argument("--model", default="oracle-0.7", help="whose step times (pair: its own)")
    parser.add_argument(
        "--text",
        default=None,
        help="a real drafter's acceptance on real text (bench/pair_acceptance.py's JSON) "
        "in place of --rates",
    )
    # Measured on the H200 (stop 42, the pair): start-up's plain step 1-24% over the same
    # step in use (0.675 against 0.579 ms at batch 64, 0.561 against 0.473 at 8).
    parser.add_argument(
        "--cold", type=float, default=0.0, help="start-up steps up to this share slower"
    )
    parser.add_argument(
        "--bias",
        default="1,1",
        help="start-up's plain steps, rounds: this many times the same steps in use",
    )
    # Measured on the H200 (stop 50, the pair, batch 1): a cell's first steps, the
    # warm-up's plain steps at 0.49-0.58 ms and rounds of 1 at 0.79-0.84, against 0.32
    # and 0.53 later: about 1.6x.
    parser.add_argument(
        "--early",
        default="0,1",
        metavar="STEPS,FACTOR",
        help="each cell's first STEPS steps (warm-up's too) run FACTOR times slower",
    )
    # Measured on an H100 (stop 69, the pair, batch 1, steps launched ahead): a plain step
    # between rounds 0.87-1.63 ms against 0.41-0.65 in a row, a round of 5 after a plain
    # step 1.25-1.39 against 0.80-1.06: about 1.5 plain steps more.
    parser.add_argument(
        "--switch",
        type=float,
        default=0.0,
        help="a step after one of another kind costs this many plain steps more",
    )
    # Measured on H100s (stop 69, the pair, batch 1): the same process's rounds of 5 took
    # 0.64-2.86 ms, median 1.08; fresh processes' plain decoding 1,552-5,374 tok/s.
    parser.add_argument(
        "--drift",
        type=float,
        default=0.0,
        help="the host's pace wanders: each step's log-factor moves by this sigma",
    )
    parser.add_argument(
        "--steady",
        type=int,
        default=0,
        metavar="TURNS",
        help="cells keep their batch full, each finished request replaced, until TURNS "
        "requests a slot finished (spec_matrix --steady: 2); 0: a closed batch",
    )
    parser.add_argument(
        "--references",
        action="store_true",
        help="also the choosers that know each request's acceptance (Reference)",
    )
    args = parser.parse_args()
    bias = tuple(float(b) for b in args.bias.split(","))
    early_steps, early_factor = args.early.split(",")
    times = StepTimes(args.matrix, args.model)
    rates = [float(r) for r in args.rates.split(",")]
    batches = [int(b) for b in args.batch_sizes.split(",")]
    text = json.load(open(args.text))["runs"] if args.text else None
    if text and args.tokens > min(map(len, text)):
        raise SystemExit(f"--tokens {args.tokens}: {args.text} holds {min(map(len, text))}")
    runs = [
        simulate(
            times,
            seed,
            batches,
            rates,
            args.tokens,
            args.cold,
            bias,
            text,
            args.steady,
            args.references,
            (int(early_steps), float(early_factor)),
            args.switch,
            args.drift,
        )  # fmt: skip
        for seed in range(args.first_seed, args.first_seed + args.seeds)
    ]
    # Each mode's mean over the seeds, then auto's over the best fixed mode's: the best of
    # single noisy runs (one a mode) is biased up, most where modes are close (a batch of
    # one: 128 tokens' acceptance varies by several percent a run), which once made auto
    # look 5-10% worse at batch 1 than it was.
    mean = {}
    for cell in runs[0]:
        modes = [statistics.mean(run[cell][i] for run in runs) for i in range(len(runs[0][cell]))]
        best = max(range(MAX_STEPS + 1), key=lambda k: modes[1 + k])
        mean[cell] = modes[0] / modes[1 + best]
        batch, rate = cell
        label = "text" if rate is None else f"{rate:.2f}"
        known = modes[MAX_STEPS + 2 :]
        versus = (
            f"  (foresight {known[0] / modes[1 + best]:.3f}, makespan {known[1] / modes[1 + best]:.3f})"
            if known
            else ""
        )
        print(
            f"batch {batch:>3}  rate {label}{versus}  auto / best fixed ({best}) {mean[cell]:.3f}"
        )
    print(f"worst cell {min(mean.values()):.3f}, mean {statistics.mean(mean.values()):.3f}")


if __name__ == "__main__":
    main()
