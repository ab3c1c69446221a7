"""Packaging: core/, devices/, spec/ install as graphrt.core, graphrt.devices, graphrt.spec,
and core/package_root/__init__.py as graphrt/__init__.py (graphrt.LLM, loaded lazily).

A subpackage missing from pyproject's explicit `packages` list is silently left
out of the wheel, and a generic top-level name (`core`) in site-packages would
clash with other distributions; these tests catch both.
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOP_DIRS = ("core", "devices", "spec")
PACKAGE_ROOT = Path("core", "package_root")  # installed as the graphrt package itself
ENTRY_POINT = "graphrt = graphrt.core.cli.start_up:run"


def _load_pyproject() -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli", reason="reading pyproject.toml needs tomli on 3.10")
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def _package_dirs() -> dict[str, Path]:
    """Dotted package name -> directory, for every directory with an __init__.py."""
    found = {}
    for top in TOP_DIRS:
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT)
            name = "graphrt" if rel == PACKAGE_ROOT else "graphrt." + ".".join(rel.parts)
            found[name] = init.parent
    return found


def test_every_package_directory_is_listed_in_pyproject():
    listed = set(_load_pyproject()["tool"]["setuptools"]["packages"])
    missing = sorted(set(_package_dirs()) - listed)
    assert not missing, f"add to [tool.setuptools] packages in pyproject.toml: {missing}"


def test_every_listed_package_exists():
    # A listed package without its directory makes every wheel build fail.
    setuptools_cfg = _load_pyproject()["tool"]["setuptools"]
    want = {"graphrt": PACKAGE_ROOT.as_posix(), **{f"graphrt.{top}": top for top in TOP_DIRS}}
    assert setuptools_cfg["package-dir"] == want
    stale = sorted(set(setuptools_cfg["packages"]) - set(_package_dirs()))
    assert not stale, f"listed in pyproject.toml but no <dir>/__init__.py: {stale}"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel built from a copy of the sources (keeps build/ and *.egg-info out of the repo)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (ROOT / name).exists():
            shutil.copy2(ROOT / name, src / name)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for top in TOP_DIRS:
        shutil.copytree(ROOT / top, src / top, ignore=skip)
    dist = tmp / "dist"
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    proc = subprocess.run([*cmd, "-w", str(dist), str(src)], capture_output=True, text=True)
    assert proc.returncode == 0, f"wheel build failed:\n{proc.stdout}\n{proc.stderr}"
    (built,) = dist.glob("graphrt-*.whl")
    return built


def test_wheel_installs_everything_under_graphrt(wheel):
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        dist_info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/RECORD"))
        entry_points = zf.read(f"{dist_info}/entry_points.txt").decode()

    stray = [n for n in names if n.split("/")[0] not in ("graphrt", dist_info)]
    assert not stray, f"files outside graphrt/ in the wheel: {stray}"
    assert "graphrt/core/__init__.py" in names
    for package in _package_dirs():
        assert f"{package.replace('.', '/')}/__init__.py" in names
    # The embedded pair is package data: `graphrt generate` with no --model needs it.
    for model in ("gemma4-code-target", "gemma4-code-assistant"):
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            assert f"graphrt/core/pretrained/{model}/{name}" in names
    # graphrt's own __init__.py comes from core/package_root/, and only there.
    assert "graphrt/__init__.py" in names
    assert not [n for n in names if "package_root" in n]
    assert ENTRY_POINT in entry_points.splitlines()


def test_wheel_contents_import(wheel, tmp_path):
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
    code = (
        "import graphrt, sys; assert 'torch' not in sys.modules, 'import graphrt pulled torch'; "
        "import graphrt.core, graphrt.devices, graphrt.spec as s; "
        "assert graphrt.LLM.__module__ == 'graphrt.core.serve.llm'; print(s.__file__)"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip()) == site / "graphrt" / "spec" / "__init__.py"


@pytest.mark.parametrize("top", TOP_DIRS)
def test_installed_package_imports_from_repo_or_site_packages(top):
    try:
        module = importlib.import_module(f"graphrt.{top}")
    except ModuleNotFoundError:
        if os.environ.get("CI"):
            raise
        pytest.skip("graphrt is not installed here (pip install -e .)")
    assert module.__file__ is not None, (
        f"graphrt.{top} imported as a namespace package: the install predates "
        f"{top}/__init__.py; reinstall with `pip install -e .`"
    )
    package_dir = Path(module.__file__).resolve().parent
    in_repo = package_dir == ROOT / top
    in_site_packages = package_dir.parts[-3:] == ("site-packages", "graphrt", top)
    assert in_repo or in_site_packages, f"graphrt.{top} imported from {package_dir}"
