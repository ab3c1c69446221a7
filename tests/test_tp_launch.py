"""The tensor-parallel process model on the CPU (gloo): ``graphrt generate --tp 2`` starts
its ranks and gives one process's tokens, rank 0 alone printing; torchrun starts the same
job on one host and across two "nodes" (two torchrun agents meeting at a c10d
rendezvous); a rank that dies or fails ends the job with one error line in bounded time.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from helpers import sigint_default

from graphrt import devices
from graphrt.core.cli.main import main
from graphrt.core.errors import UsageError
from graphrt.core.parallel.launch import GRACE_S, free_port, join

CLI = [sys.executable, "-m", "graphrt.core.cli.main"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
PROMPTS = ["--prompt-ids", "1,2,3", "--prompt-ids", "4,5,6,7,8"]


def _generate_args(path, *extra: str) -> list[str]:
    return ["generate", "--device", "cpu", "--model", str(path), *PROMPTS,
            "--max-new-tokens", "8", "--ignore-eos", "--json", *extra]  # fmt: skip


def _tokens(stdout: str) -> list[list[int]]:
    return [r["output_ids"] for r in json.loads(stdout)["requests"]]


def _run(cmd: list[str], timeout: float = 180, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def one_process(llama_gqa_untied) -> list[list[int]]:
    # The CLI's main in this process (as tests/test_cli.py runs it): a single process
    # needs no launcher, and a child would import torch again for the same tokens.
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(_generate_args(llama_gqa_untied.path)) == 0
    return _tokens(out.getvalue())


def test_tp_2_starts_two_ranks_and_gives_one_process_tokens(llama_gqa_untied, one_process):
    proc = _run(CLI + _generate_args(llama_gqa_untied.path, "--tp", "2"))
    assert proc.returncode == 0, proc.stderr
    assert _tokens(proc.stdout) == one_process
    assert json.loads(proc.stdout)["stats"]["tp"] == 2
    assert proc.stdout.count("\n") == 1  # rank 0's JSON only
    assert "Traceback" not in proc.stderr


def test_torchrun_on_one_host(llama_gqa_untied, one_process):
    cmd = TORCHRUN + ["--nproc-per-node", "2", "-m", "graphrt.core.cli.main"]
    proc = _run(cmd + _generate_args(llama_gqa_untied.path))
    assert proc.returncode == 0, proc.stderr
    assert _tokens(proc.stdout) == one_process


def test_torchrun_across_two_nodes(llama_gqa_untied, one_process):
    """Two torchrun agents, one process each, meeting at a c10d rendezvous as two hosts
    would (README: the multi-host command); whichever holds rank 0 prints."""
    port = free_port()
    nodes = [
        subprocess.Popen(
            TORCHRUN
            + [
                "--nnodes",
                "2",
                "--node-rank",
                str(n),
                "--nproc-per-node",
                "1",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                "graphrt-test",
                "-m",
                "graphrt.core.cli.main",
            ]
            + _generate_args(llama_gqa_untied.path),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for n in range(2)
    ]
    outs = [node.communicate(timeout=180) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], [err for _, err in outs]
    printed = [out for out, _ in outs if out.strip()]
    assert len(printed) == 1
    assert _tokens(printed[0]) == one_process


def test_a_killed_rank_ends_the_job_with_one_line(llama_gqa_untied):
    """Rank 1 is killed while the ranks decode in lockstep: rank 0 loses its peer in a
    collective; the job ends within the launcher's grace period, naming rank 1, and
    rank 0 still prints its requests, finished with an error, with their tokens so far."""
    args = _generate_args(llama_gqa_untied.path, "--tp", "2") + [
        "--prompt-ids", "9,10", "--prompt-ids", "11", "--max-new-tokens", "240",
    ]  # fmt: skip
    job = subprocess.Popen(CLI + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while "set up the engine" not in job.stderr.readline():  # rank 0 is about to decode
        assert job.poll() is None, job.stderr.read()
    os.kill(_rank_pid(job.pid, 1), signal.SIGKILL)
    killed = time.monotonic()
    out, err = job.communicate(timeout=120)
    assert time.monotonic() - killed < GRACE_S + 10
    assert job.returncode == 6
    assert err.strip().splitlines()[-1] == "graphrt: error: rank 1 was killed by SIGKILL"
    assert err.count("graphrt: error") == 1 and "Traceback" not in err
    if out:  # rank 0 saw the failure in a step: its requests (and tokens so far) print
        requests = json.loads(out)["requests"]
        assert len(requests) == 4 and all(r["error"] for r in requests)


@pytest.mark.parametrize(
    ("sig", "status", "line"),
    [
        (signal.SIGTERM, 143, "graphrt: terminated (SIGTERM)"),
        (signal.SIGINT, 130, "graphrt: interrupted"),
    ],
    ids=["sigterm", "sigint"],
)
def test_a_signal_to_the_launcher_stops_and_reaps_its_ranks(llama_gqa_untied, sig, status, line):
    """SIGTERM or SIGINT to `generate --tp 2` is forwarded: the ranks stop, rank 0 printing
    its requests so far (finished "interrupted"), the launcher reaps both within its grace
    period, and the job says so in one line, exit 143 or 130."""
    args = _generate_args(llama_gqa_untied.path, "--tp", "2") + [
        "--prompt-ids", "9,10", "--max-new-tokens", "400",
    ]  # fmt: skip
    job = subprocess.Popen(
        CLI + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=sigint_default,
    )  # fmt: skip
    while "set up the engine" not in job.stderr.readline():  # rank 0 is about to decode
        assert job.poll() is None, job.stderr.read()
    ranks = [_rank_pid(job.pid, r) for r in (0, 1)]
    time.sleep(0.3)
    job.send_signal(sig)
    stopped = time.monotonic()
    out, err = job.communicate(timeout=120)
    assert time.monotonic() - stopped < GRACE_S + 10
    assert job.returncode == status, err
    assert err.strip().splitlines()[-1] == line
    # One line for the job (rank 0's warnings, such as --max-new-tokens past the context,
    # are forwarded as they are: they are not about the stop).
    said = [s for s in err.splitlines() if s.startswith("graphrt:")]
    assert [s for s in said if not s.startswith("graphrt: warning:")] == [line]
    assert "Traceback" not in err
    for pid in ranks:  # reaped: gone, not left running or a zombie
        assert not os.path.exists(f"/proc/{pid}"), f"rank process {pid} outlived the job"
    # Rank 0 had set up its engine and taken its requests: whatever it generated is printed.
    # (A request whose tokens reached the context in the step before the stop says so.)
    reasons = [r["finish_reason"] for r in json.loads(out)["requests"]]
    assert (
        len(reasons) == 3 and "interrupted" in reasons and set(reasons) <= {"interrupted", "length"}
    )


def test_a_rank_that_fails_ends_the_job_with_its_one_line(llama_gqa_untied):
    proc = _run(CLI + _generate_args(llama_gqa_untied.path, "--tp", "3"))
    assert proc.returncode == 2  # a usage error, on every rank
    lines = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert "num_attention_heads (4) does not split evenly over 3 ranks" in lines[0]
    assert lines[0].startswith("graphrt: error: rank ")


def test_tp_that_contradicts_torchrun_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(UsageError, match=r"--tp 2, but this job has 4 processes"):
        join(2, devices.current("cpu"))


def test_the_cpu_ranks_of_a_host_share_its_cores(monkeypatch):
    """Each of a host's ranks gets its share of the cores this process may use (its
    affinity, a container's limit, not the host's count), one at least."""
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    threads = torch.get_num_threads()
    try:
        shares = {}
        for local_size in (1, 2, 3, 16):
            devices.current("cpu").bind_local_rank(0, local_size=local_size)
            shares[local_size] = torch.get_num_threads()
        assert shares == {1: 8, 2: 4, 3: 2, 16: 1}
    finally:
        torch.set_num_threads(threads)


def test_a_rank_leaves_its_job_with_the_groups_threads_joined():
    """``leave_job`` frees the process group, which the engine's reference cycles hold,
    and so joins its threads while the interpreter is whole: a collective library's
    thread left to interpreter shutdown can abort a finished rank (SIGABRT)."""
    script = textwrap.dedent("""
        import os, torch, torch.distributed as dist
        from graphrt.core.parallel.group import TPGroup
        from graphrt.core.parallel.launch import leave_job

        def threads():  # the names of the threads besides the main one
            return sorted(open(f"/proc/self/task/{t}/comm").read().strip()
                          for t in os.listdir("/proc/self/task") if int(t) != os.getpid())

        dist.init_process_group("gloo")
        dist.all_reduce(torch.ones(4))
        cycle = [TPGroup(rank=0, size=1, group=dist.group.WORLD)]
        cycle.append(cycle)
        del cycle
        print(threads())
        leave_job(0)
        print(threads())  # not reached if leave_job ended the process at once
    """)
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    env.update(MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    proc = _run([sys.executable, "-c", script], env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    during, after = proc.stdout.splitlines()
    assert "pt_gloo_runloop" in during  # gloo's workers, which free finished work
    assert after == "[]"


def _rank_pid(launcher: int, rank: int) -> int:
    """The pid of the launcher's child running ``rank`` (Linux: read from /proc)."""
    children = subprocess.run(["pgrep", "-P", str(launcher)], capture_output=True, text=True)
    for pid in children.stdout.split():
        with open(f"/proc/{pid}/environ", "rb") as f:
            if f"RANK={rank}".encode() in f.read().split(b"\0"):
                return int(pid)
    raise AssertionError(f"no child of {launcher} runs rank {rank}")


@pytest.mark.slow
def test_bench_tp_2_writes_rank_0s_results(llama_gqa_untied, tmp_path):
    out = tmp_path / "bench.json"
    proc = _run(CLI + ["bench", "--device", "cpu", "--model", str(llama_gqa_untied.path),
                       "--tp", "2", "--runners", "eager", "--batch-sizes", "1,2",
                       "--prompt-len", "8", "--steps", "3", "--warmup", "1",
                       "--out", str(out), "--no-plot"])  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["tp"] == 2 and [b["batch_size"] for b in result["batches"]] == [1, 2]
    assert all(b["eager_ms"] > 0 for b in result["batches"])
    assert proc.stdout.count("graphrt bench:") == 1  # rank 0's report only
    refused = _run(CLI + ["bench", "--device", "cpu", "--model", str(llama_gqa_untied.path),
                          "--tp", "2", "--runners", "eager,hf", "--out", str(out)])  # fmt: skip
    assert refused.returncode == 2 and "drop hf from --runners" in refused.stderr
    # Refused by the launcher, before any rank started (a rank's error names its rank).
    assert refused.stderr.startswith("graphrt: error:") and "rank" not in refused.stderr


def test_graphs_under_tp_only_where_they_record_collectives():
    from graphrt.core.parallel.group import TPGroup
    from graphrt.core.parallel.launch import check_runner, default_runner
    from graphrt.devices.xpu import XpuDevice

    two = TPGroup(rank=0, size=2)
    with pytest.raises(UsageError, match="xpu graphs do not record xccl collectives"):
        check_runner(XpuDevice(), "graph", two)
    check_runner(XpuDevice(), "eager", two)
    check_runner(XpuDevice(), "graph", TPGroup(rank=0, size=1))
    check_runner(devices.current("cpu"), "graph", two)
    assert default_runner(XpuDevice(), two) == "eager"


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two NVIDIA GPUs")
@pytest.mark.parametrize("all_reduce", ["nccl", "symm_mem"])
@pytest.mark.parametrize("model", ["llama_gqa_untied", "gemma4_tiny"])
def test_tp_2_on_two_gpus_gives_one_gpu_tokens(request, monkeypatch, model, all_reduce):
    """The CUDA stack end to end: NCCL, or torch's one-shot all-reduce for decode's small
    messages, captured in the CUDA graphs (graph_steps > 0 on both), float32 so that
    the split sums round like the whole."""
    monkeypatch.setenv("GRAPHRT_ALL_REDUCE", all_reduce)
    path = request.getfixturevalue(model).path
    runs = {}
    for tp in ("1", "2"):
        args = _generate_args(path, "--tp", tp, "--device", "cuda", "--dtype", "float32",
                              "--runner", "graph")  # fmt: skip
        proc = _run(CLI + args, timeout=600)
        assert proc.returncode == 0, proc.stderr
        runs[tp] = json.loads(proc.stdout)
        assert runs[tp]["stats"]["graph_steps"] > 0
    assert _tokens(json.dumps(runs["2"])) == _tokens(json.dumps(runs["1"]))


def test_the_launcher_starts_ranks_without_importing_torch():
    """`graphrt generate --tp N` runs itself N times; the launcher only spawns and joins
    them, so torch (1.5-2 s of CPU) is imported by the ranks alone."""
    script = (
        "import sys; from graphrt.core.cli.main import build_parser; "
        "from graphrt.core.parallel.launch import in_job, spawn_ranks; "
        "build_parser().parse_args(['generate', '--tp', '2']); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False"]
