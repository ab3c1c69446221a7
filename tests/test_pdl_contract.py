"""Every Triton kernel launched with programmatic dependent launch keeps pdl.py's contract.

A kernel launched with ``launch_pdl`` that touched its inputs before ``griddepcontrol.wait``
would read the previous kernel's outputs half written: inside a CUDA graph on an H200 a
race that shows as an occasional wrong token, never on the CPU lane (the interpreter
skips the PTX). So the contract is checked in the source: before its wait a kernel that
takes ``USE_PDL`` names no pointer but its weights' (decode attention's stage 1 also its
rows' lengths and request slots), stores nothing and never returns, and every launch of
such a kernel passes ``pdl.launch_options()``, so the wait (a constexpr) and the launch
attribute never disagree. Under the interpreter a stand-in for the wait stores what the
kernel before would have, only then: stage 1 must not see the step's key before it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from helpers import OLD_INTERPRETER, needs_triton, run_under_triton_interpreter

CUDA = Path(__file__).resolve().parents[1] / "devices" / "cuda"
# Pointers no kernel of a step writes: a PDL kernel may read them before its wait.
WEIGHTS = {"W", "Weight", "NormWeight", "NextNormWeight", "LayerScalar", "Bias"}
# The step's inputs, final before its first kernel: decode attention's stage 1 reads its
# rows' lengths and request slots before its wait (never this step's key and value, which
# the kernel before it stores: the stand-in test below).
STEP_INPUTS = {"SeqLens", "ReqPoolIndices"}
EARLY_READS = {"_decode_partial_kernel": WEIGHTS | STEP_INPUTS}


def _kernels():
    for path in sorted(CUDA.glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and any(
                ast.unparse(d) == "triton.jit" for d in node.decorator_list
            ):
                yield node


def _params(fn: ast.FunctionDef) -> list[str]:
    return [a.arg for a in fn.args.args]


def _pdl_kernels() -> dict[str, ast.FunctionDef]:
    return {fn.name: fn for fn in _kernels() if "USE_PDL" in _params(fn)}


def _pointers(fn: ast.FunctionDef) -> set[str]:
    """Tensor arguments: capitalised (the kernels' naming) and not constexpr, less the
    GEMV's sizes M, N, K (scalars)."""
    return {
        a.arg
        for a in fn.args.args
        if a.arg[0].isupper() and a.annotation is None and a.arg not in ("M", "N", "K")
    }


def _names(node: ast.AST) -> set[str]:
    """Names a statement reads, but not a pointer's ``.dtype`` (a type, not memory)."""
    types = {
        id(n.value) for n in ast.walk(node) if isinstance(n, ast.Attribute) and n.attr == "dtype"
    }
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and id(n) not in types}


WAIT = "pdl.wait_for_predecessor()"


def _before_waits(fn: ast.FunctionDef) -> list[list[ast.stmt]]:
    """For each path to a ``pdl.wait_for_predecessor()`` in the kernel, the statements run
    before it on that path. Every PDL kernel waits through it, never ``gdc_wait()`` itself:
    the one wait the CPU stand-in below replaces. A branch that holds a wait and ends in a
    return (decode attention's work list) is a path of its own; the code after it, another."""
    source = ast.unparse(fn)
    assert "gdc_wait()" not in source, f"{fn.name} calls gdc_wait(): wait_for_predecessor()"
    paths = _paths_to_waits(fn.body, [])
    assert paths, f"{fn.name} takes USE_PDL but never waits (griddepcontrol.wait)"
    return paths


def _paths_to_waits(body: list[ast.stmt], before: list[ast.stmt]) -> list[list[ast.stmt]]:
    paths = []
    for stmt in body:
        if WAIT not in ast.unparse(stmt):
            before = before + [stmt]
            continue
        if isinstance(stmt, ast.Expr):  # the wait itself
            return paths + [before]
        assert isinstance(stmt, ast.If) and WAIT not in ast.unparse(stmt.orelse), ast.unparse(stmt)
        # The branch's condition runs before the wait, then its statements up to it.
        paths += _paths_to_waits(stmt.body, before + [ast.Expr(stmt.test)])
        if not isinstance(stmt.body[-1], ast.Return):
            return paths  # ``if USE_PDL: wait``: this path has waited
    return paths


def test_the_gemv_and_decode_attention_are_launched_with_pdl():
    assert {"_gemv_kernel", "_decode_partial_kernel"} <= set(_pdl_kernels())  # the parse found them


@pytest.mark.parametrize("name", sorted(_pdl_kernels()))
def test_a_pdl_kernel_reads_only_weights_or_step_inputs_before_its_wait(name):
    fn = _pdl_kernels()[name]
    pointers = _pointers(fn)
    allowed = EARLY_READS.get(name, WEIGHTS)
    paths = _before_waits(fn)
    # Decode attention: the grid by rows and the work list wait on paths of their own.
    assert len(paths) == (2 if name == "_decode_partial_kernel" else 1), len(paths)
    for early in paths:
        # Names bound before the wait from activation pointers would carry them past it.
        touched = set().union(*(_names(s) for s in early)) if early else set()
        assert not (touched & (pointers - allowed)), (
            f"{name} names {sorted(touched & (pointers - allowed))} before its wait"
        )
        assert not any("tl.store" in ast.unparse(s) for s in early), (
            f"{name} stores before its wait"
        )
        # A program that returned without waiting could let the kernel finish before the one
        # before it, and the next kernel (launched without PDL) start on half-written inputs.
        returns = [n for s in early for n in ast.walk(s) if isinstance(n, ast.Return)]
        assert not returns, f"{name} may return before its wait (line {returns[0].lineno})"


# (head_dim, num_heads, sliding window, lengths): one KV head; 16-key blocks, one split, one
# program (the interpreter runs programs one after another: the stand-in's store holds for
# the ones after). Rows whose new key is in their first block (1, 5, 16; 64 with its
# window from key 56), or past it (17, 40; 70).
STAND_IN_CASES = [(24, 4, None, (1, 5, 16, 17, 40)), (16, 2, 8, (64, 70))]


def stand_in_results() -> dict:
    """Runs under TRITON_INTERPRET=1 (the subprocess below): decode attention's stage 1
    launched as with PDL, where the kernel before it stores the step's key and value only
    when stage 1 waits. Until then the cache holds NaN where they go. -> each case, on the
    grid by rows and on the work list: its output equal (bit for bit) to the launch without
    PDL, and finite."""
    return {
        f"D{head_dim}-window{window}-len{seq_len}-{'listed' if listed else 'rows'}": (
            _stand_in_case(head_dim, num_heads, window, seq_len, listed)
        )
        for head_dim, num_heads, window, lengths in STAND_IN_CASES
        for seq_len in lengths
        for listed in (False, True)
    }


def _stand_in_case(
    head_dim: int, num_heads: int, window: int | None, seq_len: int, listed: bool
) -> bool:
    from graphrt.devices.cuda import pdl
    from graphrt.devices.cuda import triton_decode as td

    gen = torch.Generator().manual_seed(seq_len)
    slots = 96
    k_buffer = torch.randn(slots, 1, head_dim, generator=gen)
    v_buffer = torch.randn(slots, 1, head_dim, generator=gen)
    table = torch.zeros(2, 128, dtype=torch.int64)
    table[1, :seq_len] = torch.randperm(slots - 1, generator=gen)[:seq_len] + 1
    new_slot = int(table[1, seq_len - 1])
    new_k, new_v = k_buffer[new_slot].clone(), v_buffer[new_slot].clone()
    q = torch.randn(1, num_heads, head_dim, generator=gen)
    req, lens = torch.tensor([1]), torch.tensor([seq_len], dtype=torch.int32)

    def attend():
        out = torch.empty_like(q)
        scratch = td.allocate_decode_scratch(1, num_heads, head_dim, q.device, 1)
        args = (q, k_buffer, v_buffer, table, req, lens, out, *scratch, 0.3, window)
        return td.decode_attention(*args, block_n=16, programs=1, short_splits=1, work_list=listed)

    plain = attend()  # no PDL (the interpreter's default)
    k_buffer[new_slot], v_buffer[new_slot] = float("nan"), float("nan")

    def predecessor_finishes():  # what the kernel before stores, at the wait
        k_buffer[new_slot], v_buffer[new_slot] = new_k, new_v

    with_pdl = {"USE_PDL": True, "launch_pdl": False}  # (no launch attribute on a CPU)
    saved = pdl.wait_for_predecessor, pdl.launch_options
    pdl.wait_for_predecessor, pdl.launch_options = predecessor_finishes, lambda: with_pdl
    try:
        early = attend()
    finally:
        pdl.wait_for_predecessor, pdl.launch_options = saved
    return torch.equal(early, plain) and bool(torch.isfinite(early).all())


@needs_triton
@pytest.mark.skipif(OLD_INTERPRETER, reason="triton < 3.7: its interpreter mishandles loop bounds")
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU lane's interpreter test")
def test_decode_attention_reads_the_steps_own_key_only_after_its_wait():
    """Launched with PDL, stage 1 starts while the kernel before it (the qkv GEMV's rope
    epilogue, the rope kernel, store_kv) may still be storing this step's key and value.
    A stand-in for the wait stores them only then: a program that read them early (as a
    first block read before the wait did, stop 65) would see NaN where they go, or a key
    of zeros where it masked them out and never read them again."""
    results = run_under_triton_interpreter(__file__)
    assert len(results) == 2 * sum(len(c[-1]) for c in STAND_IN_CASES)
    assert all(results.values()), {case: ok for case, ok in results.items() if not ok}


def test_every_launch_of_a_pdl_kernel_passes_launch_options():
    pdl_kernels = set(_pdl_kernels())
    launched = set()
    for path in sorted(CUDA.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            # kernel[grid](...)
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)):
                continue
            kernel = ast.unparse(node.func.value)
            keywords = [ast.unparse(k) for k in node.keywords]
            where = f"{path.name}:{node.lineno} {kernel}"
            if kernel not in pdl_kernels:
                assert not any(k.startswith("launch_pdl=") for k in keywords), (
                    f"{where} is launched with PDL but takes no USE_PDL (it never waits)"
                )
                continue
            launched.add(kernel)
            assert "**pdl.launch_options()" in keywords, f"{where} launches without launch_options"
            assert not any(k.startswith(("USE_PDL=", "launch_pdl=")) for k in keywords), where
    assert launched == pdl_kernels


@pytest.mark.cuda
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
    reason="PDL needs an sm_90+ NVIDIA GPU",
)
def test_cuda_greedy_tokens_are_the_same_with_pdl_and_without_in_fresh_engines():
    """PDL only schedules: the same kernels with and without it, and in two engines of one
    process, give the same greedy tokens (graphs; four prompts one request at a time, as
    bench/profile_step.py generates them: stop 64 saw random:llama-1b's differ there
    between its PDL and no-PDL engines, the likely cause the first engine's tuner adding
    into the live residual, test_tuner_side_effects; bench/pdl_tokens.py separates the
    cases)."""
    from graphrt import devices
    from graphrt.core.bench.decode import DecodeBenchConfig, make_engine
    from graphrt.core.engine import SamplingParams
    from graphrt.core.models import load_model
    from graphrt.devices.cuda import pdl

    device = devices.current("cuda")
    gen = torch.Generator().manual_seed(0)
    runs, shipped = {}, pdl.ENABLED
    try:
        for name, pdl_on in (("pdl", True), ("no-pdl", False), ("pdl again", True)):
            pdl.ENABLED = pdl_on
            loaded = load_model("random:llama-1b", device, torch.bfloat16, ops=device.model_ops())
            cfg = DecodeBenchConfig(batch_sizes=(1,), prompt_len=512, max_running_requests=1)
            engine = make_engine(loaded, device, cfg, graphs=True)
            if not runs:
                vocab = loaded.model.vocab_size
                prompts = [
                    torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (7, 60, 300, 5)
                ]
            params = SamplingParams(max_new_tokens=32, ignore_eos=True)
            runs[name] = [r.output_ids for r in engine.generate(prompts, params)]
            # every decode step on the graphs (31 a request), not an eager fallback
            assert engine.stats.graph_steps >= 4 * 31, (name, engine.stats)
            engine.cleanup()
            del engine, loaded
            torch.cuda.empty_cache()
    finally:
        pdl.ENABLED = shipped
    assert runs["pdl again"] == runs["pdl"], "two engines with PDL differ: not PDL's doing"
    assert runs["no-pdl"] == runs["pdl"]


if __name__ == "__main__":
    # The CPU lane's subprocess (TRITON_INTERPRET=1 is already in its environment).
    import json

    print(json.dumps(stand_in_results()))
