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
