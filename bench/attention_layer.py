"""Decode and tree-verify attention, one layer: GPU time of the partial and combine
kernels replayed from a CUDA graph (triton.testing.do_bench_cudagraph, median), for
Gemma 4 E2B's shapes (8 query heads on 1 KV head, head_dim 256 and 512), prefix 512,
decode at batch 1 and 64 and verify of 5-node chains over the same requests: the
width-invariant kernel (triton_verify) with one node a program and with nodes packed
two a program (``triton_verify.PACK_MIN_PROGRAMS`` decides between them by batch),
each output compared bit for bit with decode's rows for the same tokens; then the
one-pass kernel (triton_verify_onepass, the default) at each ``--onepass`` setting
(TARGET_PROGRAMS/MAX_TILE/split blocks[/BLOCK_N], 0: the module's own), its largest relative
error against the width-invariant output beside it; and "rows us": the chains' nodes run
as decode rows (node i a row of length prefix + i + 1, its last keys the chain's slots):
what a chain's verify costs on decode's kernel (``decode_attention``'s ``chain``, as the
engine runs it; each row checked bit for bit against decode's row over a written table).

Run on the device: python bench/attention_layer.py [--batch-sizes 1,2,4,...]
[--onepass 0/0/0,256/16384/64,...]
"""

from __future__ import annotations

import argparse

import torch
import triton

from graphrt.devices.cuda import triton_verify, triton_verify_onepass
from graphrt.devices.cuda.triton_decode import (
    NUM_KV_SPLITS,
    allocate_decode_scratch,
    decode_attention,
)
from graphrt.devices.cuda.triton_verify import tree_verify_attention
from graphrt.devices.cuda.triton_verify_onepass import onepass_verify_attention

PREFIX, NODES, HEADS = 512, 5, 8


def layer_us(
    bs: int, head_dim: int, packed: bool, onepass: list[tuple[int, int, int]] = ()
) -> tuple[float, float, bool, list[tuple[float, float]], float]:
    """(decode us, verify us, verify == decode bitwise, [(one-pass us, its largest
    relative error against verify) per ``onepass`` setting], the chain's nodes as
    decode rows us) of one layer's attention over ``bs`` requests."""
    dev, dtype = torch.device("cuda"), torch.bfloat16
    ctx = PREFIX + NODES
    slots = 1 + torch.randperm(bs * ctx, device=dev)  # scattered, as a pool's are
    k = torch.randn(bs * ctx + 1, 1, head_dim, device=dev, dtype=dtype)
    v = torch.randn_like(k)
    table = torch.zeros(bs + 1, ctx + 8, dtype=torch.int64, device=dev)
    table[1:, :ctx] = slots.view(bs, ctx)
    reqs = torch.arange(1, bs + 1, device=dev)
    scale = head_dim**-0.5
    scratch = allocate_decode_scratch(bs * NODES, HEADS, head_dim, dev)
    # decode: the root's step (seq_len PREFIX + 1)
    q = torch.randn(bs, HEADS, head_dim, device=dev, dtype=dtype)
    out = torch.empty_like(q)
    lens = torch.full((bs,), PREFIX + 1, dtype=torch.int32, device=dev)
    # verify: chains of NODES over the prefix, their slots the table's next ones
    qv = torch.randn(bs * NODES, HEADS, head_dim, device=dev, dtype=dtype)
    outv = torch.empty_like(qv)
    vlens = torch.full((bs,), PREFIX + NODES, dtype=torch.int32, device=dev)
    pos = (PREFIX + torch.arange(NODES, device=dev)).repeat(bs)
    loc = table[1:, PREFIX : PREFIX + NODES].reshape(-1).contiguous()
    depth = torch.arange(NODES, device=dev)
    mask = (depth[None, :] <= depth[:, None]).expand(bs, NODES, NODES).contiguous()

    triton_verify.PACK_MIN_PROGRAMS = 0 if packed else 2**62

    def decode() -> None:
        decode_attention(q, k, v, table, reqs, lens, out, *scratch, scale)

    def verify() -> None:
        tree_verify_attention(qv, k, v, table, reqs, vlens, pos, loc, mask, outv, *scratch, scale)

    torch.cuda.synchronize()  # do_bench_cudagraph's side stream does not wait for this one
    times = [triton.testing.do_bench_cudagraph(fn, rep=50) * 1e3 for fn in (decode, verify)]
    # Decode of every node's token on its own (the chain's slots are the table's next ones).
    verify()
    node_lens = (PREFIX + 1 + depth).repeat(bs).to(torch.int32)
    want = torch.empty_like(qv)
    decode_attention(
        qv, k, v, table, reqs.repeat_interleave(NODES), node_lens, want, *scratch, scale
    )
    rows = torch.empty_like(qv)

    def chain_as_decode() -> None:  # as the engine runs a chain: decode's kernel, its nodes' slots
        decode_attention(qv, k, v, table, reqs, vlens, rows, *scratch, scale, chain=(loc, NODES))

    torch.cuda.synchronize()
    as_decode = triton.testing.do_bench_cudagraph(chain_as_decode, rep=50) * 1e3
    chain_as_decode()
    assert torch.equal(rows, want), "a chain's rows differ from decode's"
    onepass_results = []
    module = triton_verify_onepass
    defaults = module.TARGET_PROGRAMS, module.MAX_TILE, module.split_blocks
    for setting in onepass:
        module.TARGET_PROGRAMS = setting[0] or defaults[0]
        module.MAX_TILE = setting[1] or defaults[1]
        fixed = setting[2]  # prefix blocks a split at least; 0: by head_dim
        module.split_blocks = (lambda block_d, fixed=fixed: fixed) if fixed else defaults[2]
        block_n = setting[3] if len(setting) > 3 and setting[3] else None
        fast = torch.empty_like(qv)

        def verify_onepass(fast: torch.Tensor = fast, block_n: int | None = block_n) -> None:
            onepass_verify_attention(
                qv, k, v, table, reqs, vlens, pos, loc, mask, fast, *scratch, scale,
                block_n=block_n,
            )  # fmt: skip

        torch.cuda.synchronize()
        us = triton.testing.do_bench_cudagraph(verify_onepass, rep=50) * 1e3
        verify_onepass()
        err = ((fast.float() - outv.float()).abs().max() / outv.float().abs().max()).item()
        onepass_results.append((us, err))
    module.TARGET_PROGRAMS, module.MAX_TILE, module.split_blocks = defaults
    return times[0], times[1], torch.equal(outv, want), onepass_results, as_decode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,64", help="comma list (default: 1,64)")
    parser.add_argument(
        "--onepass",
        default="0/0/0",
        help="one-pass settings TARGET_PROGRAMS/MAX_TILE/split blocks[/BLOCK_N] (0: the module's or"
        " decode's), comma list",
    )
    args = parser.parse_args()
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    onepass = [tuple(int(x) for x in c.split("/")) for c in args.onepass.split(",") if c]
    print(
        f"{'bs':>3} {'D':>4} {'packed':>6} {'programs':>8} {'decode us':>10} {'verify us':>10}"
        f" {'ratio':>6} bitwise {'rows us':>8}  one-pass us (ratio, rel err) at "
        + ", ".join("/".join(map(str, c)) for c in onepass)
    )
    for head_dim in (256, 512):
        for bs in sizes:
            for packed in (False, True):
                decode, verify, same, fast, as_decode = layer_us(
                    bs, head_dim, packed, onepass if packed else ()
                )
                # What PACK_MIN_PROGRAMS is compared with: one-node programs (rows x KV
                # heads x decode's splits).
                programs = bs * NODES * NUM_KV_SPLITS
                cells = "  ".join(f"{us:.1f} ({us / decode:.2f}, {err:.1e})" for us, err in fast)
                print(
                    f"{bs:>3} {head_dim:>4} {packed!s:>6} {programs:>8} {decode:>10.1f}"
                    f" {verify:>10.1f} {verify / decode:>6.2f} {same!s:>7} {as_decode:>8.1f}  {cells}"
                )


if __name__ == "__main__":
    main()
