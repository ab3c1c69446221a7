"""Device selection (DESIGN.md layer 7): order, overrides, errors, plugins, lazy imports."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import needs_gpu

import graphrt.devices as devices
from graphrt.core.errors import DeviceUnavailableError
from graphrt.devices import registry
from graphrt.devices.cpu import CpuDevice
from graphrt.devices.cuda import CudaDevice
from graphrt.devices.npu import NpuDevice
from graphrt.devices.xpu import XpuDevice

ACCELERATORS = {"npu": NpuDevice, "cuda": CudaDevice, "xpu": XpuDevice}
BUILTIN_NAMES = ["cpu", "cuda", "npu", "xpu"]
DEVICE_LIBRARIES = ("torch_npu", "triton", "intel_extension_for_pytorch")


@pytest.fixture(autouse=True)
def isolated(monkeypatch):
    """No inherited GRAPHRT_DEVICE, no installed plugins, before and after each test."""
    monkeypatch.delenv("GRAPHRT_DEVICE", raising=False)
    monkeypatch.setattr(importlib.metadata, "entry_points", _fake_entry_points([]))
    registry.load_plugins.cache_clear()
    yield
    registry.load_plugins.cache_clear()


def _fake_entry_points(entries):
    real = importlib.metadata.entry_points

    def entry_points(**params):
        if params.get("group") == registry.ENTRY_POINT_GROUP:
            return list(entries)
        return real(**params)

    return entry_points


def simulate(monkeypatch, present=(), ready=()):
    """Make the named accelerators probe as present (others absent); `ready` ones pass ensure_ready."""
    for name, cls in ACCELERATORS.items():
        monkeypatch.setattr(cls, "is_available", lambda self, up=name in present: up)
        if name in ready:
            monkeypatch.setattr(cls, "ensure_ready", lambda self: None)


# --- selection order and overrides -------------------------------------------------------------


@pytest.mark.parametrize(
    ("present", "expected"),
    [
        (("npu", "cuda", "xpu"), "npu"),
        (("cuda", "xpu"), "cuda"),
        (("npu", "xpu"), "npu"),
        (("xpu",), "xpu"),
        ((), "cpu"),
    ],
)
def test_probe_order_is_npu_cuda_xpu_then_cpu(monkeypatch, present, expected):
    simulate(monkeypatch, present=present)
    assert devices.probe().name == expected


def test_current_without_choice_probes_and_readies(monkeypatch):
    simulate(monkeypatch, present=("cuda",), ready=("cuda",))
    assert devices.current().name == "cuda"


def test_current_readies_the_probed_device(monkeypatch):
    # Present but not ready (e.g. a driver mismatch) must fail loudly, not fall back silently.
    simulate(monkeypatch, present=("xpu",))

    def ensure_ready(self):
        raise DeviceUnavailableError("device 'xpu' is broken")

    monkeypatch.setattr(XpuDevice, "ensure_ready", ensure_ready)
    with pytest.raises(DeviceUnavailableError, match="xpu"):
        devices.current()


def test_env_var_wins_over_probing(monkeypatch):
    simulate(monkeypatch, present=("npu", "cuda", "xpu"), ready=("npu", "cuda", "xpu"))
    monkeypatch.setenv("GRAPHRT_DEVICE", "cpu")
    assert devices.current().name == "cpu"


def test_explicit_name_wins_over_env_var(monkeypatch):
    simulate(monkeypatch, present=("cuda",), ready=("cuda",))
    monkeypatch.setenv("GRAPHRT_DEVICE", "cuda")
    assert devices.current("cpu").name == "cpu"
    assert devices.current().name == "cuda"


def test_auto_means_probe(monkeypatch):
    simulate(monkeypatch, present=("xpu",), ready=("xpu",))
    monkeypatch.setenv("GRAPHRT_DEVICE", "auto")
    assert devices.current().name == "xpu"
    monkeypatch.setenv("GRAPHRT_DEVICE", "cpu")
    assert devices.current("auto").name == "xpu"


# --- errors a user sees -------------------------------------------------------------------------


def assert_one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert message and "\n" not in message
    return message


@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None, reason="torch_npu installed")
def test_npu_without_torch_npu_names_the_extra():
    assert NpuDevice().is_available() is False
    with pytest.raises(DeviceUnavailableError) as error:
        devices.current("npu")
    message = assert_one_line(error)
    assert "torch_npu" in message and "graphrt[npu]" in message
    assert "torch_npu" not in sys.modules


@pytest.mark.skipif("torch_npu" in sys.modules, reason="a real torch_npu is loaded")
def test_npu_with_broken_torch_npu_is_absent_and_explained(tmp_path, monkeypatch):
    # An installed torch_npu without the Ascend toolkit fails at import time, multi-line.
    (tmp_path / "torch_npu.py").write_text(
        'raise RuntimeError("libascendcl.so: cannot open shared object file\\nsee CANN docs")\n'
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert NpuDevice().is_available() is False
    with pytest.raises(DeviceUnavailableError) as error:
        devices.current("npu")
    message = assert_one_line(error)
    assert "libascendcl.so" in message and "CANN" in message


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_cuda_absent_is_a_one_line_error():
    with pytest.raises(DeviceUnavailableError) as error:
        devices.current("cuda")
    message = assert_one_line(error)
    assert message.startswith("device 'cuda' is not available") and torch.__version__ in message


def test_unknown_name_lists_known_names():
    with pytest.raises(DeviceUnavailableError) as error:
        devices.get("tpu")
    message = assert_one_line(error)
    assert "'tpu'" in message
    assert all(name in message for name in BUILTIN_NAMES)


def test_names_are_the_builtins():
    assert devices.names() == BUILTIN_NAMES
    assert [devices.get(name).name for name in BUILTIN_NAMES] == BUILTIN_NAMES


# --- imports stay lazy --------------------------------------------------------------------------


def test_importing_and_selecting_loads_no_device_library():
    code = textwrap.dedent(
        f"""
        import sys
        import graphrt.devices
        assert "torch" not in sys.modules, "import graphrt.devices imported torch"
        import graphrt.core, graphrt.spec
        device = graphrt.devices.current()
        for name in graphrt.devices.names():
            graphrt.devices.get(name).library_versions()
        loaded = [m for m in {DEVICE_LIBRARIES!r} if m in sys.modules]
        assert not loaded, loaded
        print(device.name)
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "GRAPHRT_DEVICE"}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)  # the same graphrt this test imported
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == devices.probe().name


def test_disable_torch_backend_autoload_keeps_an_explicit_setting(monkeypatch):
    monkeypatch.delenv("TORCH_DEVICE_BACKEND_AUTOLOAD", raising=False)
    devices.disable_torch_backend_autoload()
    assert os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] == "0"
    monkeypatch.setenv("TORCH_DEVICE_BACKEND_AUTOLOAD", "1")
    devices.disable_torch_backend_autoload()
    assert os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] == "1"


# --- plugins ------------------------------------------------------------------------------------

PLUGIN_SOURCE = """
from graphrt.devices.cpu import CpuDevice

class FakeDevice(CpuDevice):
    name = "fake"
    torch_type = "cpu"
    present = False

    def is_available(self):
        return self.present

class Misnamed(CpuDevice):
    name = "other"

NOT_A_DEVICE = object()
"""


@pytest.fixture
def plugin_module(tmp_path, monkeypatch):
    """An importable plugin module; its name is unique per test so sys.modules cannot leak it."""
    module = f"graphrt_fake_plugin_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{module}.py").write_text(PLUGIN_SOURCE)
    (tmp_path / f"{module}_broken.py").write_text('raise RuntimeError("no driver\\nfor card")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    yield module
    for name in (module, f"{module}_broken"):
        sys.modules.pop(name, None)


def install_plugins(monkeypatch, **values):
    entries = [
        importlib.metadata.EntryPoint(name, value, registry.ENTRY_POINT_GROUP)
        for name, value in values.items()
    ]
    monkeypatch.setattr(importlib.metadata, "entry_points", _fake_entry_points(entries))
    registry.load_plugins.cache_clear()


def test_plugin_is_listed_selectable_and_probed_before_cpu(monkeypatch, plugin_module):
    install_plugins(monkeypatch, fake=f"{plugin_module}:FakeDevice")
    simulate(monkeypatch)
    assert devices.names() == [*BUILTIN_NAMES, "fake"]
    device = devices.get("fake")
    assert device.name == "fake" and isinstance(device, devices.Device)
    assert devices.current("fake") is device
    assert devices.probe().name == "cpu"  # plugin absent
    monkeypatch.setattr(type(device), "present", True)
    assert devices.probe() is device
    simulate(monkeypatch, present=("xpu",))
    assert devices.probe().name == "xpu"  # built-in accelerators come first


def test_plugin_may_register_an_instance(monkeypatch, plugin_module):
    module = importlib.import_module(plugin_module)
    monkeypatch.setattr(module, "INSTANCE", module.FakeDevice(), raising=False)
    install_plugins(monkeypatch, fake=f"{plugin_module}:INSTANCE")
    assert devices.get("fake") is module.INSTANCE


@pytest.mark.parametrize(
    ("name", "target", "reason"),
    [
        ("broken", "{m}_broken", "no driver for card"),
        ("missing", "graphrt_no_such_plugin_module:Device", "ModuleNotFoundError"),
        ("odd", "{m}:NOT_A_DEVICE", "TypeError"),
        ("misnamed", "{m}:Misnamed", "'other'"),
        ("cuda", "{m}:FakeDevice", "built-in"),
    ],
)
def test_broken_plugin_is_skipped_and_reported(monkeypatch, plugin_module, name, target, reason):
    install_plugins(monkeypatch, fake=f"{plugin_module}:FakeDevice")
    entries = importlib.metadata.entry_points(group=registry.ENTRY_POINT_GROUP)
    bad = importlib.metadata.EntryPoint(
        name, target.format(m=plugin_module), registry.ENTRY_POINT_GROUP
    )
    monkeypatch.setattr(importlib.metadata, "entry_points", _fake_entry_points([bad, *entries]))
    registry.load_plugins.cache_clear()

    assert devices.names() == [*BUILTIN_NAMES, "fake"]
    assert devices.current("cpu").name == "cpu"
    assert devices.get("fake").name == "fake"
    if name == "cuda":
        assert isinstance(devices.get("cuda"), CudaDevice)  # the built-in is not replaced
        return
    with pytest.raises(DeviceUnavailableError) as error:
        devices.get(name)
    message = assert_one_line(error)
    assert f"plugin '{name}'" in message and reason in message


# --- what a device reports ----------------------------------------------------------------------


def test_cpu_device_basics():
    cpu = devices.current("cpu")
    assert isinstance(cpu, CpuDevice)
    assert cpu.torch_device() == torch.device("cpu")
    assert cpu.default_dtype() == torch.float32
    assert cpu.library_versions()["torch"] == torch.__version__
    assert cpu.describe().startswith("cpu (") and "cores" in cpu.describe()
    assert cpu.graph_backends() == ("compile",)
    cpu.synchronize()


@pytest.mark.parametrize("cls", list(ACCELERATORS.values()))
def test_accelerators_default_to_bfloat16_and_name_their_extra(cls):
    device = cls()
    assert device.default_dtype() == torch.bfloat16
    assert device.extra == device.name
    assert device.torch_type == device.name
    assert device.library_versions()["torch"] == torch.__version__


def test_cpu_offers_compiled_graphs_only_with_a_cxx_compiler(monkeypatch):
    import shutil

    from graphrt.devices.cpu import CpuDevice

    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert CpuDevice().graph_backends() == ()  # the CLI then defaults to --runner eager
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/" + name)
    assert CpuDevice().graph_backends() == ("compile",)


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("kind", ["full", "breakable"])
def test_cuda_graphs_go_to_the_device_as_they_are_captured(monkeypatch, kind):
    """Each captured graph (each segment of a breakable one) is uploaded at capture
    (cuGraphUpload), so its first replay does not pay for it, and replays right."""
    from graphrt.core.graph_breaks import run_breakable
    from graphrt.core.runners.backend import ShapeKey
    from graphrt.devices.cuda import graph as cuda_graph

    uploaded = []
    upload = cuda_graph.upload_graph

    def counted(graph, stream):
        uploaded.append(graph)
        upload(graph, stream)

    monkeypatch.setattr(cuda_graph, "upload_graph", counted)
    backend = {
        "full": cuda_graph.CudaFullGraphBackend,
        "breakable": cuda_graph.CudaBreakableGraphBackend,
    }[kind]()
    x = torch.zeros(8, device="cuda")

    def run_once():
        x.add_(1.0)
        y = run_breakable(torch.mul, x, 2.0) if kind == "breakable" else x * 2.0
        return y + 1.0

    key = ShapeKey(size=1)
    try:
        with backend.capture_session():
            out = backend.capture_one(key, run_once)
        assert len(uploaded) == (2 if kind == "breakable" else 1)
        x.fill_(4.0)  # a value no warm-up or capture run left: only a replay gives 11
        with backend.replay_session():
            backend.replay(key)
        torch.cuda.synchronize()
        assert out.tolist() == [11.0] * 8  # (4 + 1) * 2 + 1
    finally:
        backend.cleanup()
