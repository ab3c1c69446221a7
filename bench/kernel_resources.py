"""Registers, local-memory stack (spills), shared memory and MMA kind of the decode and
tree-verify attention kernels (width-invariant and one pass), compiled for an H200
(sm_90) on any machine: Triton's own compiler and ptxas, no GPU needed. A kernel change
that makes the attention spill shows here before a GPU is at hand.

Run anywhere with triton installed: python bench/kernel_resources.py
"""

from __future__ import annotations

from graphrt.devices.cuda import triton_verify_onepass as onepass
from graphrt.devices.cuda.offline_compile import compile_for_h200, registers_and_stack
from graphrt.devices.cuda.triton_decode import (
    _decode_combine_kernel,
    _decode_partial_kernel,
    split_constants,
)
from graphrt.devices.cuda.triton_verify import _verify_partial_kernel


def resources(kernel, constants: dict, num_warps: int) -> str:
    """Compile ``kernel`` for sm_90 with ``constants``; -> its resource usage line."""
    compiled = compile_for_h200(kernel, constants, num_warps)
    registers, stack = registers_and_stack(compiled)
    mma = "wgmma" if "wgmma" in compiled.asm["ptx"] else "mma"
    shared = compiled.metadata.shared // 1024
    return f"registers {registers}, stack {stack} bytes, shared {shared} KiB, {mma}"


def main() -> None:
    # Gemma 4 E2B: 8 query heads on one KV head; sliding layers head_dim 256, full 512.
    for head_dim, block_n in ((256, 32), (512, 16)):
        common = dict(KV_GROUP=8, **split_constants(128), BLOCK_N=block_n, HEAD_DIM=head_dim,
                      BLOCK_D=head_dim, DOT_PRECISION="tf32")  # fmt: skip
        stage1 = common | {"BLOCK_G": 16, "USE_PDL": True, "CHAIN_NODES": 0, "BLOCK_B": 0}
        print(f"decode D={head_dim}: {resources(_decode_partial_kernel, stage1, 4)}")
        combine = dict(MIN_SPLITS=16, BLOCK_S=16, BLOCK_REST=8192 // head_dim, HEAD_DIM=head_dim,
                       BLOCK_D=head_dim, LAUNCH_DEPENDENTS=True)  # fmt: skip
        print(f"combine D={head_dim}, 128 splits: {resources(_decode_combine_kernel, combine, 2)}")
        for nodes in (1, 2):  # one node a program, packed (5-node chains)
            constants = common | {"NODES": nodes, "BLOCK_G": 16, "BLOCK_T": 8}
            line = resources(_verify_partial_kernel, constants, 4)
            print(f"verify D={head_dim}, {nodes} node(s) a program: {line}")
        # One pass: a 5-node chain a program, 8 warps at the tile limit (as launched) and 4.
        nodes, block_g = onepass.program_nodes(8, 5, head_dim, 2)
        constants = dict(KV_GROUP=8, NODES=nodes, BLOCK_G=block_g, BLOCK_N=32, BLOCK_T=16,
                         SPLIT_BLOCKS=onepass.split_blocks(head_dim), HEAD_DIM=head_dim,
                         BLOCK_D=head_dim, DOT_PRECISION="tf32")  # fmt: skip
        for warps in (4, 8):
            line = resources(onepass._onepass_partial_kernel, constants, warps)
            print(f"one pass D={head_dim}, {block_g} rows, {warps} warps: {line}")


if __name__ == "__main__":
    main()
