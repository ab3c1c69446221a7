"""Serving load test: N concurrent streaming clients against `graphrt serve`.

Starts the server (any flags after ``--`` go to `graphrt serve`), warms it up, then for
each client count runs a closed loop: C clients, each sending its next request as soon
as its last one ended, until R requests have finished. Requests mix prompt and output
lengths (seeded); prompts are random token ids, or with ``--code-prompts`` windows of
the embedded pair's held-out Python files (this interpreter's standard library, through
the pair's tokenizer: what its drafter was trained for); ``ignore_eos`` holds every
output to its length, so a model without a tokenizer (random:llama-1b) runs it too. Tokens are
counted from the stream itself (vLLM's ``return_token_ids``).

Reported per client count: requests/s and output tokens/s over the wall time, time to
first token (TTFT), inter-token latency (ITL: the gaps between a request's tokens, a
chunk's k tokens sharing its gap) and time per output token (TPOT: a request's decode
time over its tokens after the first), at p50 and p99; from the server's /metrics, the
speculative accept length when drafting; the CPU shares of the client processes and of
the server (near 1.0 a process: bound by its Python thread). ``--client-procs N`` spreads
the clients over N processes: one saturates its core near 64 streams.

    python bench/serve_load.py --clients 1,16,64 --requests 128 -- --model random:llama-1b --dtype bfloat16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import re
import subprocess
import sys
import threading
import time
import urllib.request

import openai
from prometheus_client.parser import text_string_to_metric_families
from step_trace import percentile  # this directory's (a script's own is on sys.path)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def start_server(serve_args: list[str], timeout: float) -> tuple[subprocess.Popen, str, list]:
    cmd = [sys.executable, "-m", "graphrt.core.cli.main", "serve", "--port", "0", *serve_args]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines: list[str] = []

    def read():
        for line in proc.stderr:
            lines.append(line)
            print(f"  server: {line.rstrip()}", file=sys.stderr, flush=True)

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        for line in list(lines):
            if m := re.search(r"at (http://\S+:\d+)", line):
                return proc, m.group(1), lines
        time.sleep(0.1)
    proc.kill()
    sys.exit(f"serve_load: the server did not start: {''.join(lines)[-2000:]}")


def _process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid``, all threads (Linux /proc)."""
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_metrics(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=60).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if len(s.labels) <= 1:  # model_name only
                out[s.name] = s.value
    return out


async def one_request(client, model: str, prompt: list[int], max_tokens: int) -> dict:
    start = time.perf_counter()
    stream = await client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    arrivals: list[tuple[float, int]] = []  # (time, tokens in the chunk)
    async for chunk in stream:
        n = sum(len(getattr(c, "token_ids", None) or ()) for c in chunk.choices)
        if n:
            arrivals.append((time.perf_counter(), n))
    end = time.perf_counter()
    tokens = sum(n for _, n in arrivals)
    gaps = []
    for (t0, _), (t1, n) in zip(arrivals, arrivals[1:]):
        gaps += [(t1 - t0) / n] * n
    first = arrivals[0][0] if arrivals else end
    return {
        "tokens": tokens,
        "ttft": first - start,
        "itl": gaps,
        "tpot": (end - first) / (tokens - 1) if tokens > 1 else None,
    }


def code_tokens() -> list[list[int]]:
    """The embedded pair's held-out files (corpus_manifest.json) found in this Python's
    standard library, each as the pair's token ids."""
    import sysconfig
    from pathlib import Path

    from tokenizers import Tokenizer

    from graphrt.core import pretrained

    manifest = json.loads((Path(pretrained.__file__).parent / "corpus_manifest.json").read_text())
    tokenizer = Tokenizer.from_file(str(pretrained.TARGET_DIR / "tokenizer.json"))
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [stdlib / e["path"] for e in manifest["heldout"]["entries"]]
    return [tokenizer.encode(f.read_text()).ids for f in files if f.is_file()]


def prompt_maker(code: list[list[int]] | None, vocab: int):
    def make(rng: random.Random, n: int) -> list[int]:
        if code is None:
            return [rng.randrange(1, vocab) for _ in range(n)]
        ids = rng.choice([f for f in code if len(f) > n] or code)
        start = rng.randrange(0, max(1, len(ids) - n))
        return ids[start : start + n]

    return make


def make_work(requests, prompt_lens, output_lens, make, seed) -> list[tuple[list[int], int]]:
    """The requests of one load row, (prompt, output length) each, seeded."""
    rng = random.Random(seed)
    return [(make(rng, rng.choice(prompt_lens)), rng.choice(output_lens)) for _ in range(requests)]


async def drive(url: str, model: str, clients: int, work, start_at: float) -> list[dict]:
    """A closed loop of ``clients`` clients over ``work`` (each sends its next request
    when its last one ended), from ``start_at`` (time.monotonic: every process alike)."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
    results = []
    queue = list(reversed(work))

    async def worker():
        while queue:
            prompt, n = queue.pop()
            results.append(await one_request(client, model, prompt, n))

    await asyncio.sleep(max(0.0, start_at - time.monotonic()))
    await asyncio.gather(*(worker() for _ in range(clients)))
    await client.close()
    return results


def _drive_process(url, model, clients, work, start_at) -> tuple[list[dict], float, float]:
    """One client process's share: its results, when it ended, its CPU seconds."""
    cpu = time.process_time()
    results = asyncio.run(drive(url, model, clients, work, start_at))
    return results, time.monotonic(), time.process_time() - cpu


def load(url: str, model: str, clients: int, work, procs: int = 1) -> dict:
    """``clients`` clients over ``work``, spread over ``procs`` client processes (one
    Python process saturates its core near 64 streams: the client would set the pace)."""
    procs = max(1, min(procs, clients))
    shares = [(clients // procs + (i < clients % procs), work[i::procs]) for i in range(procs)]
    if procs == 1:
        start_at = time.monotonic()
        outs = [_drive_process(url, model, clients, work, start_at)]
    else:
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(procs) as pool:
            # Every worker started and done importing (openai, a sitecustomize) before
            # the clock starts: a task each, held long enough to spread over them.
            pool.map(time.sleep, [0.5] * procs, chunksize=1)
            start_at = time.monotonic() + 0.2
            jobs = [(url, model, c, w, start_at) for c, w in shares]
            outs = pool.starmap(_drive_process, jobs)
    wall = max(end for _, end, _ in outs) - start_at
    results = [r for rs, _, _ in outs for r in rs]
    tokens = sum(r["tokens"] for r in results)
    itl = [g for r in results for g in r["itl"]]
    tpot = [r["tpot"] for r in results if r["tpot"] is not None]
    ttft = [r["ttft"] for r in results]
    ms = 1000.0
    return {
        "clients": clients,
        "client_procs": procs,
        "requests": len(results),
        "wall_s": round(wall, 3),
        "requests_per_s": round(len(results) / wall, 3),
        "output_tokens_per_s": round(tokens / wall, 1),
        "output_tokens": tokens,
        "expected_tokens": sum(n for _, n in work),
        "ttft_ms_p50": round(percentile(ttft, 50) * ms, 2),
        "ttft_ms_p99": round(percentile(ttft, 99) * ms, 2),
        "itl_ms_p50": round(percentile(itl, 50) * ms, 3),
        "itl_ms_p99": round(percentile(itl, 99) * ms, 3),
        "tpot_ms_p50": round(percentile(tpot, 50) * ms, 3),
        "tpot_ms_p99": round(percentile(tpot, 99) * ms, 3),
        # CPU seconds a wall second, all client processes: near 1.0 a process, the
        # client is the bottleneck.
        "client_cpu_share": round(sum(cpu for _, _, cpu in outs) / wall, 3),
    }


def main() -> int:
    argv = sys.argv[1:]
    serve_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=_ints, default=[1, 16, 64])
    p.add_argument("--requests", type=int, default=128, help="per client count")
    p.add_argument("--prompt-lens", type=_ints, default=[32, 128, 512])
    p.add_argument("--output-lens", type=_ints, default=[32, 128, 256])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--client-procs",
        type=int,
        default=1,
        help="client processes the clients are spread over (one saturates near 64 streams)",
    )
    p.add_argument(
        "--code-prompts",
        action="store_true",
        help="windows of the embedded pair's held-out code instead of random ids",
    )
    p.add_argument(
        "--vocab",
        type=int,
        default=4096,
        help="random prompt ids are below this (4096: the embedded pair's vocabulary, within "
        "every preset's but llama-tiny's 512)",
    )
    p.add_argument("--start-timeout", type=float, default=600)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(own)
    proc, url, _ = start_server(serve_args, args.start_timeout)
    try:
        (model_info,) = json.load(urllib.request.urlopen(f"{url}/v1/models", timeout=60))["data"]
        model = model_info["id"]
        make = prompt_maker(code_tokens() if args.code_prompts else None, args.vocab)
        # Warm-up at the largest client count: the first requests compile kernels and tune
        # matmuls at their batch sizes; not measured.
        warm = max(args.clients)
        load(url, model, warm, make_work(warm, args.prompt_lens, [16], make, 99))
        rows = []
        for clients in args.clients:
            before = server_metrics(url)
            work = make_work(args.requests, args.prompt_lens, args.output_lens, make, args.seed)
            server_cpu = _process_cpu_s(proc.pid)
            row = load(url, model, clients, work, args.client_procs)
            # The server's CPU seconds a wall second of the row (1.0: one core busy; its
            # Python threads share one GIL).
            used = _process_cpu_s(proc.pid) - server_cpu
            row["server_cpu_share"] = round(used / row["wall_s"], 3)
            after = server_metrics(url)
            drafts = after.get("graphrt:spec_decode_num_drafts_total", 0) - before.get(
                "graphrt:spec_decode_num_drafts_total", 0
            )
            accepted = after.get("graphrt:spec_decode_num_accepted_tokens_total", 0) - before.get(
                "graphrt:spec_decode_num_accepted_tokens_total", 0
            )
            row["spec_rounds"] = int(drafts)
            row["accept_length"] = round(1 + accepted / drafts, 3) if drafts else None
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=120)
    header = (
        f"{'clients':>7} {'req/s':>7} {'out tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'ITL p50':>8} {'ITL p99':>8} {'TPOT p50':>9} {'TPOT p99':>9} {'accept':>6} {'cpu cli/srv':>11}"
    )
    print(f"\n{model} via graphrt serve {' '.join(serve_args)} (ms)\n{header}")
    for r in rows:
        accept = f"{r['accept_length']:.2f}" if r["accept_length"] else "-"
        print(
            f"{r['clients']:>7} {r['requests_per_s']:>7.2f} {r['output_tokens_per_s']:>9.1f} "
            f"{r['ttft_ms_p50']:>9.2f} {r['ttft_ms_p99']:>9.2f} {r['itl_ms_p50']:>8.3f} "
            f"{r['itl_ms_p99']:>8.3f} {r['tpot_ms_p50']:>9.3f} {r['tpot_ms_p99']:>9.3f} "
            f"{accept:>6} {r['client_cpu_share']:>5.2f}/{r['server_cpu_share']:<5.2f}"
        )
    if args.out:
        result = {"model": model, "serve_args": serve_args, "rows": rows,
                  "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}  # fmt: skip
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
