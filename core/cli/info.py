"""`graphrt info`: the selected device, the backends available, library versions."""

from __future__ import annotations

import argparse
import platform

from graphrt import devices
from graphrt.core.attention import TorchAttentionBackend
from graphrt.core.cli.version import package_version
from graphrt.core.errors import GraphrtError


def run_info(args: argparse.Namespace) -> int:
    device = devices.current(args.device)
    print(f"device:             {device.name}: {device.describe()}")
    print(f"attention backends: {TorchAttentionBackend.name}")
    graph = ", ".join(device.graph_backends()) or "none yet"
    print(f"graph backends:     {graph}")
    print(f"KV pool default:    {_kv_default(device)}")
    print("devices:")
    for name in devices.names():
        try:
            state = "available" if devices.get(name).is_available() else "not available"
        except GraphrtError as e:
            state = str(e)
        print(f"  {name:<8} {state}")
    print("versions:")
    print(f"  {'graphrt':<12} {package_version()}")
    print(f"  {'python':<12} {platform.python_version()}")
    for lib, version in device.library_versions().items():
        print(f"  {lib:<12} {version}")
    return 0


def _kv_default(device) -> str:
    """How a model's KV pool and context are sized here by default (core/engine/kv_plan)."""
    from graphrt.core.engine.kv_plan import FIXED_CONTEXT_CAP, FIXED_KV_BYTES

    fraction = device.kv_memory_fraction
    try:
        free = device.free_memory_bytes() if device.is_available() else None
    except Exception:  # noqa: BLE001 (a report line: a probe that fails only says less)
        free = None
    now = f" ({free / 2**30:.1f} GiB free now)" if free is not None else ""
    if fraction is not None:
        return (
            f"{fraction:.0%} of the memory free after loading the weights{now}; context: "
            "the model's, bounded by the pool (--kv-memory-fraction, --kv-pool-tokens)"
        )
    return (
        f"{FIXED_KV_BYTES >> 30} GiB{now}; context: the model's, at most {FIXED_CONTEXT_CAP} "
        "(--kv-pool-tokens, --max-context-len)"
    )
