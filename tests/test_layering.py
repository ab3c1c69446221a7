"""Layering (DESIGN.md, STYLE.md habit 6): device code stays under devices/<vendor>/, and
core/ knows speculative decoding only through its protocols.

- core/ outside the composition roots (the CLI and serve/, which build strategies from
  flags and names) imports nothing from spec/;
- core/ imports no vendor device package (devices/cuda, npu, xpu, cpu); the device-neutral
  devices/base.py, devices/graphs.py and the registry are its interface;
- spec/ imports nothing from devices/;
- devices/ imports nothing from spec/.

Imports are read from the source (every ``import``, ``from ... import`` and
``importlib.import_module("...")``, function-level ones included), not by importing it.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = {"core": "graphrt.core", "devices": "graphrt.devices", "spec": "graphrt.spec"}
VENDORS = tuple(f"graphrt.devices.{name}" for name in ("cuda", "npu", "xpu", "cpu"))


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = [PACKAGE_DIRS[rel.parts[0]], *rel.parts[1:]]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> Iterator[tuple[int, str]]:
    """(line, absolute module name) of everything ``path`` imports, anywhere in it."""
    package = _module_name(path)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against this file's package
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            yield node.lineno, base
            for alias in node.names:  # `from graphrt.devices import cuda` names a module
                yield node.lineno, f"{base}.{alias.name}"
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            yield node.lineno, node.args[0].value


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


# Where engines are built from names, drafters included: the CLI and the serving layer.
COMPOSITION_ROOTS = {"cli", "serve"}

# (files, forbidden module prefixes, why)
RULES = [
    (
        [
            p
            for p in (ROOT / "core").rglob("*.py")
            if not COMPOSITION_ROOTS & set(p.relative_to(ROOT).parts)
        ],
        ("graphrt.spec",),
        "core/ knows spec/ only through the DecodeStrategy protocol (the CLI and serve/ "
        "compose them)",
    ),
    (list((ROOT / "core").rglob("*.py")), VENDORS, "device code lives under devices/<vendor>/"),
    (list((ROOT / "spec").rglob("*.py")), ("graphrt.devices",), "spec/ is device-neutral"),
    (list((ROOT / "devices").rglob("*.py")), ("graphrt.spec",), "devices/ know no algorithm"),
]


def violations(files: list[Path], forbidden: tuple[str, ...]) -> list[str]:
    return [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for path in sorted(files)
        for line, name in imports(path)
        if _within(name, forbidden)
    ]


@pytest.mark.parametrize("files, forbidden, why", RULES, ids=["core-spec", "core-vendor",
                         "spec-devices", "devices-spec"])  # fmt: skip
def test_layers_import_only_what_they_may(files, forbidden, why):
    assert files, "no source files found: the rule checks nothing"
    found = violations(files, forbidden)
    assert not found, f"{why}:\n" + "\n".join(found)


def test_the_import_reader_sees_every_form_of_import(tmp_path, monkeypatch):
    """A checker that missed function-level, relative or importlib imports would pass
    whatever the code did."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    source = tmp_path / "core" / "engine" / "x.py"
    source.parent.mkdir(parents=True)
    source.write_text(
        "import importlib\n"
        "def f():\n"
        "    from graphrt.spec.strategy import MTPDecoding\n"
        "    from ...devices import cuda\n"
        "    importlib.import_module('graphrt.devices.npu')\n"
        "from .. import models\n"
    )
    found = {name for _, name in imports(source)}
    assert {"graphrt.spec.strategy", "graphrt.devices.cuda", "graphrt.devices.npu"} <= found
    assert "graphrt.core.models" in found
    assert violations([source], VENDORS) == [
        "core/engine/x.py:4 imports graphrt.devices.cuda",
        "core/engine/x.py:5 imports graphrt.devices.npu",
    ]
