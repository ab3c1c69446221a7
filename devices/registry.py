"""Which devices exist: the built-ins plus out-of-tree plugins, and probing among them.

Plugins register a `Device` subclass (or instance) under the entry-point
group `graphrt.devices`, with the entry point named after the device:

    [project.entry-points."graphrt.devices"]
    mydev = "graphrt_mydev:MyDevice"

A plugin that fails to load is skipped so it cannot break the built-ins;
its error is kept and reported when someone asks for it by name.
"""

from __future__ import annotations

import functools
import importlib.metadata
from dataclasses import dataclass, field

from graphrt.core.errors import DeviceUnavailableError
from graphrt.devices.base import Device, one_line
from graphrt.devices.cpu import CpuDevice
from graphrt.devices.cuda import CudaDevice
from graphrt.devices.npu import NpuDevice
from graphrt.devices.xpu import XpuDevice

ENTRY_POINT_GROUP = "graphrt.devices"

BUILTINS: dict[str, type[Device]] = {
    cls.name: cls for cls in (CpuDevice, CudaDevice, NpuDevice, XpuDevice)
}

# Accelerators probed before plugins; the CPU is the fallback after them.
PROBE_ORDER_BEFORE_PLUGINS = ("npu", "cuda", "xpu")


@dataclass(frozen=True)
class Plugins:
    """Result of loading the entry points once: devices by name, and why others failed."""

    devices: dict[str, Device] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)


@functools.cache
def load_plugins() -> Plugins:
    """Load every `graphrt.devices` entry point once per process (tests call `cache_clear`)."""
    plugins = Plugins()
    try:
        entry_points = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    except Exception:
        # Corrupt installed metadata must not take the built-in devices down with it.
        return plugins
    for entry_point in entry_points:
        try:
            plugins.devices[entry_point.name] = _load_one(entry_point)
        except Exception as error:
            plugins.errors[entry_point.name] = one_line(
                f"device plugin '{entry_point.name}' ({entry_point.value}) failed to load: "
                f"{type(error).__name__}: {error}"
            )
    return plugins


def _load_one(entry_point: importlib.metadata.EntryPoint) -> Device:
    """Turn one entry point into a Device instance, rejecting ones that do not fit."""
    if entry_point.name in BUILTINS:
        raise ValueError(f"'{entry_point.name}' is a built-in device name")
    loaded = entry_point.load()
    device = loaded() if isinstance(loaded, type) and issubclass(loaded, Device) else loaded
    if not isinstance(device, Device):
        raise TypeError(f"expected a graphrt.devices.Device subclass, got {loaded!r}")
    if getattr(device, "name", None) != entry_point.name:
        raise ValueError(
            f"the device is named {getattr(device, 'name', None)!r}; "
            "the entry point must have the same name"
        )
    return device


def names() -> list[str]:
    """Every selectable device name: built-ins first, then loaded plugins."""
    return [*BUILTINS, *load_plugins().devices]


def get(name: str) -> Device:
    """The device called `name`, not yet made ready; unknown names list the known ones."""
    if name in BUILTINS:
        return BUILTINS[name]()
    plugins = load_plugins()
    if name in plugins.devices:
        return plugins.devices[name]
    if name in plugins.errors:
        raise DeviceUnavailableError(plugins.errors[name])
    message = f"unknown device '{name}': known devices are {', '.join(names())}"
    if plugins.errors:
        message += f" (plugins that failed to load: {', '.join(plugins.errors)})"
    raise DeviceUnavailableError(message)


def probe() -> Device:
    """The first available device in the order NPU > CUDA > XPU > plugins > CPU."""
    for name in PROBE_ORDER_BEFORE_PLUGINS:
        device = BUILTINS[name]()
        if device.is_available():
            return device
    for device in load_plugins().devices.values():
        if _plugin_available(device):
            return device
    return BUILTINS["cpu"]()


def _plugin_available(device: Device) -> bool:
    """Built-ins never raise from `is_available`; a plugin's probe gets no such trust."""
    try:
        return bool(device.is_available())
    except Exception:
        return False
