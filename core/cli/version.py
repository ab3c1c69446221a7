"""graphrt's own version, for `graphrt --version` and `graphrt info`."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

# core/cli/version.py -> the source tree's root, where pyproject.toml sits.
PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def package_version() -> str:
    """The installed distribution's version; else the source tree's pyproject.toml's; else unknown.

    Without installed metadata (sources put on the path by hand, a vendored copy)
    the version line of pyproject.toml is read with a regex: tomllib is 3.11+.
    """
    try:
        return importlib.metadata.version("graphrt")
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        text = PYPROJECT.read_text()
    except OSError:
        return "unknown (not installed)"
    match = re.search(r'^version\s*=\s*"([^"]+)"', text, re.MULTILINE)
    return f"{match[1]} (source tree, not installed)" if match else "unknown (not installed)"
