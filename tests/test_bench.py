"""The decode bench (`graphrt bench`): the bytes a step reads, its floor, its JSON."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from helpers import CPU

from graphrt.core.bench import decode
from graphrt.core.bench.decode import DecodeBenchConfig, make_engine, run_decode_bench
from graphrt.core.bench.timing import achieved_gbps, floor_ms, step_bytes_read
from graphrt.core.cli.bench import hf_peer_problem
from graphrt.core.models import load_model

F32 = 4  # bytes: the models below load in float32
BF16 = 2  # bytes: the KV pool dtype the byte counts are asked for


def saved_config(checkpoint) -> SimpleNamespace:
    """The checkpoint's config.json as attributes (transformers' config objects refuse
    global reads of Gemma 4's per-layer fields)."""
    return SimpleNamespace(**json.loads((checkpoint.path / "config.json").read_text()))


def llama_weights_by_hand(c) -> int:
    """Elements every Llama decode step multiplies by: projections, norms, one LM head."""
    hidden, head_dim = c.hidden_size, c.hidden_size // c.num_attention_heads
    q, kv = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim
    layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * c.intermediate_size + 2 * hidden
    return c.vocab_size * hidden + c.num_hidden_layers * layer + hidden


def gemma4_head_dims(c) -> list[int]:
    """Each layer's head dim: transformers 5.24 saves the full layers' own under
    per_layer_config, earlier releases as global_head_dim."""
    per_layer = getattr(c, "per_layer_config", None) or {}
    full = getattr(c, "global_head_dim", c.head_dim)
    return [
        per_layer.get(str(i), {}).get("head_dim", c.head_dim if t == "sliding_attention" else full)
        for i, t in enumerate(c.layer_types)
    ]


@pytest.mark.parametrize("fixture", ["llama_tied", "llama_gqa_untied"])
def test_llama_step_reads_every_weight_once_and_gathers_untied_embedding_rows(fixture, request):
    checkpoint = request.getfixturevalue(fixture)
    c = saved_config(checkpoint)
    model = load_model(str(checkpoint.path), CPU, torch.float32).model
    seq_lens = [5, 9, 1]
    read = step_bytes_read(model, seq_lens, torch.bfloat16)

    # Tied: the embedding is the LM head, read whole once. Untied: the head is read
    # whole and the embedding only gathers one row per request.
    assert read.weights == llama_weights_by_hand(c) * F32
    gathered = 0 if c.tie_word_embeddings else len(seq_lens) * c.hidden_size * F32
    assert read.gathered == gathered
    head_dim = c.hidden_size // c.num_attention_heads
    kv_per_token = c.num_hidden_layers * c.num_key_value_heads * head_dim * 2 * BF16
    assert read.kv == sum(seq_lens) * kv_per_token
    assert read.total == read.weights + read.gathered + read.kv


def test_gemma4_step_gathers_per_layer_rows_caps_sliding_kv_and_counts_sharing_layers(
    gemma4_tiny,
):
    c = saved_config(gemma4_tiny)
    model = load_model(str(gemma4_tiny.path), CPU, torch.float32).model
    seq_lens = [3, 10]  # the window (6) caps only the second request
    read = step_bytes_read(model, seq_lens, torch.bfloat16)

    hidden, heads, kv_heads, ple = (
        c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.hidden_size_per_layer_input
    )  # fmt: skip
    layers, first_shared = c.num_hidden_layers, c.num_hidden_layers - c.num_kv_shared_layers
    head_dims = gemma4_head_dims(c)
    assert head_dims == [16, 32, 16, 16, 32, 16, 32]  # sliding layers 16, full ones 32

    # Weights: the tied embedding once (it is the LM head), never the per-layer table.
    weights = c.vocab_size * hidden + hidden * layers * ple + ple + hidden  # + projection, norms
    for i, d in enumerate(head_dims):
        sharing = i >= first_shared  # no K/V projection, K norm; a double-wide MLP
        attn = hidden * heads * d * 2 + d  # q and o projections, q norm
        if not sharing:
            attn += hidden * 2 * kv_heads * d + d  # k, v projections, k norm (v's has no scale)
        mlp = 3 * hidden * c.intermediate_size * (2 if sharing else 1)
        per_layer_input = 2 * hidden * ple + hidden
        weights += attn + mlp + 4 * hidden + per_layer_input + 1  # 4 norms, layer_scalar
    assert read.weights == weights * F32

    # The per-layer table (vocab x layers * ple) gathers one row per request.
    assert read.gathered == len(seq_lens) * layers * ple * F32
    assert c.vocab_size_per_layer_input * layers * ple * F32 > 100 * read.gathered

    # KV: every layer reads, sharing ones included; sliding layers at most the window.
    window = c.sliding_window
    kv = 0
    for t, d in zip(c.layer_types, head_dims):
        tokens = sum(min(s, window) if t == "sliding_attention" else s for s in seq_lens)
        kv += tokens * kv_heads * d * 2 * BF16
    assert read.kv == kv
    assert (window, sum(seq_lens)) == (6, 13)  # the numbers above: 3 + 6 sliding, 13 full


def test_floor_and_achieved_bandwidth():
    assert floor_ms(2_000_000_000, bandwidth_gbps=1000.0) == pytest.approx(2.0)
    assert achieved_gbps(2_000_000_000, ms=4.0) == pytest.approx(500.0)
    assert achieved_gbps(2_000_000_000, ms=None) is None


def test_transformers_peer_is_skipped_for_sliding_window_models(llama_tied, gemma4_tiny):
    """transformers' sliding StaticCache recompiles the compiled peer every decode step."""
    assert hf_peer_problem(load_model(str(llama_tied.path), CPU, torch.float32).model) is None
    gemma4 = load_model(str(gemma4_tiny.path), CPU, torch.float32).model
    assert "recompile" in hf_peer_problem(gemma4)


def standin_graph_device():
    """A CPU device whose graph backend is the stand-in CUDA graph (no compile)."""
    from graphrt.devices.cpu import CpuDevice
    from graphrt.devices.cuda.graph import CudaFullGraphBackend

    class GraphDevice(CpuDevice):
        def _graph_backend_factories(self):
            from conformance.standin import StandInGraphModule

            return {"standin": lambda: CudaFullGraphBackend(module=StandInGraphModule())}

    return GraphDevice()


def test_decode_bench_reports_bytes_floor_bandwidth_and_kernels(monkeypatch, gemma4_tiny):
    monkeypatch.setattr(decode, "copy_bandwidth_gbps", lambda *a: 10.0)  # skips a 1 GiB copy
    loaded = load_model(str(gemma4_tiny.path), CPU, torch.float32)
    cfg = DecodeBenchConfig(
        batch_sizes=(1, 2), prompt_len=8, steps=2, warmup=1, max_running_requests=2
    )
    engine = make_engine(loaded, standin_graph_device(), cfg, graphs=True)
    lines = []
    results, bandwidth, _ = run_decode_bench(engine, cfg, lambda: None, report=lines.append)

    assert bandwidth == 10.0 and [r.batch_size for r in results] == [1, 2]
    for r in results:
        seq_lens = [cfg.prompt_len + 1] * r.batch_size  # the prompt and the new token
        read = step_bytes_read(loaded.model, seq_lens, engine.kv_pool.dtype)
        assert (r.weight_bytes_read, r.gathered_bytes_read, r.kv_bytes_read) == (
            read.weights, read.gathered, read.kv
        )  # fmt: skip
        assert r.bytes_read == read.total
        assert r.floor_ms == pytest.approx(read.total / 10e9 * 1e3)
        assert r.graph_ms > 0 and r.eager_ms > 0
        assert r.graph_over_floor == pytest.approx(r.graph_ms / r.floor_ms)
        assert r.graph_gbps == pytest.approx(read.total / r.graph_ms / 1e6)
        assert r.eager_gbps == pytest.approx(read.total / r.eager_ms / 1e6)
        assert r.graph_kernels is None and r.eager_kernels is None  # the CPU has no kernels
    assert results[1].kv_bytes_read == 2 * results[0].kv_bytes_read
    assert results[1].gathered_bytes_read == 2 * results[0].gathered_bytes_read
    assert lines[-3] == decode.HEADER and "kernels g/e" in decode.HEADER
    assert lines[-1].split()[-1] == "-/-"  # kernels: none seen on the CPU


def test_cli_bench_writes_the_new_fields(monkeypatch, tmp_path, capsys):
    from graphrt.core.cli.main import main

    monkeypatch.setattr(decode, "copy_bandwidth_gbps", lambda *a: 10.0)
    out = tmp_path / "bench.json"
    argv = ["bench", "--model", "random:llama-tiny", "--device", "cpu", "--runners", "eager"]
    argv += ["--batch-sizes", "1,2", "--prompt-len", "8", "--steps", "2", "--warmup", "1"]
    assert main([*argv, "--out", str(out), "--no-plot"]) == 0
    result = json.loads(out.read_text())
    fields = {"bytes_read", "weight_bytes_read", "gathered_bytes_read", "kv_bytes_read",
              "floor_ms", "graph_over_floor", "graph_gbps", "eager_gbps", "graph_kernels",
              "eager_kernels"}  # fmt: skip
    for batch in result["batches"]:
        assert fields <= set(batch)
        assert batch["eager_gbps"] > 0 and batch["graph_gbps"] is None
        assert batch["eager_kernels"] is None


def test_cuda_names_its_collective_kernels_and_nothing_else():
    import re

    from graphrt.devices.cuda import CudaDevice

    pattern = re.compile(CudaDevice.collective_kernels, re.IGNORECASE)
    for kernel in (
        "ncclDevKernel_AllReduce_Sum_bf16_RING_LL",
        "ncclKernel_AllGather_RING_LL_Sum_int8_t",
    ):
        assert pattern.search(kernel)
    for kernel in (
        "gemv_kernel",
        "_fused_add_rmsnorm",
        "paged_decode_attention",
        "cutlass_80_wmma",
    ):
        assert not pattern.search(kernel)
