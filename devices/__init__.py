"""graphrt.devices: pick the device graphrt runs on.

    device = graphrt.devices.current()      # --device / GRAPHRT_DEVICE / probe
    x = torch.zeros(4, device=device.torch_device(), dtype=device.default_dtype())

Importing this package imports neither torch nor any device library
(torch_npu, triton, intel_extension_for_pytorch); a device's library is
imported only when that device is probed or selected.
"""

from __future__ import annotations

import os

from graphrt.core.errors import UsageError
from graphrt.devices.base import Device
from graphrt.devices.registry import get, names, probe

__all__ = ["Device", "current", "disable_torch_backend_autoload", "get", "names", "probe"]

ENV_VAR = "GRAPHRT_DEVICE"
AUTO = "auto"


def current(name: str | None = None) -> Device:
    """The selected device, made ready.

    An explicit `name` (the CLI's `--device`) wins, then `GRAPHRT_DEVICE`,
    else probing ("auto" also means probe). Raises `DeviceUnavailableError`
    when the chosen device is unknown or cannot be used.
    """
    if name is not None and not isinstance(name, str):
        raise UsageError(f"devices.current: name must be a device name (str), got {name!r}")
    choice = (name or os.environ.get(ENV_VAR) or AUTO).strip()
    device = probe() if choice == AUTO else get(choice)
    device.ensure_ready()
    return device


def disable_torch_backend_autoload() -> None:
    """Stop `import torch` from auto-importing device backends such as torch_npu.

    HAZARD: with torch_npu installed but no Ascend toolkit, torch's
    device-backend auto-load makes `import torch` fail on every device.
    Call this before anything imports torch (the CLI does so first); it has
    no effect once torch is imported. An explicit user setting is kept.
    """
    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
