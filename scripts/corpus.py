"""A text corpus built from the Python standard library's own source files.

Every machine that runs graphrt has it, so the small target/assistant pair can be
trained and evaluated without downloading anything. What went in is recorded file
by file (`Corpus.manifest`), because the stdlib differs between Python releases.

Held-out rule: a file is held out for evaluation when the first four bytes of
sha1(its path relative to root, POSIX form, UTF-8), read as a big-endian integer,
are 0 modulo 20 (about 5%). The rule looks at the path only, so a file keeps its
split across machines, Python releases and edits to its contents.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# Directory names pruned anywhere below root: third-party code, test suites (large,
# repetitive fixtures), and the IDE and 2to3 trees (not representative library code).
SKIPPED_DIRS = frozenset({"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"})
# Larger files are generated tables (pydoc topics, _pydecimal-sized monoliths) that
# would dominate the counts of a ~10 MB corpus.
MAX_FILE_BYTES = 200 * 1024
HELDOUT_MODULUS = 20  # 1 in 20 = 5%


def is_heldout(relative: str) -> bool:
    """The documented split rule (module docstring); `relative` is a POSIX path."""
    digest = hashlib.sha1(relative.encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "big") % HELDOUT_MODULUS == 0


@dataclass(frozen=True)
class Corpus:
    root: Path
    train: tuple[Path, ...]  # absolute paths, sorted by relative path
    heldout: tuple[Path, ...]

    def relative(self, path: Path) -> str:
        return path.relative_to(self.root).as_posix()

    def train_texts(self) -> Iterator[str]:
        return _read_texts(self.train)

    def heldout_texts(self) -> Iterator[str]:
        return _read_texts(self.heldout)

    def manifest(self) -> dict:
        train, heldout = self._split_manifest(self.train), self._split_manifest(self.heldout)
        return {
            "root": str(self.root),
            "python": platform.python_version(),
            "heldout_rule": "sha1(relative POSIX path)[:4] as big-endian int % 20 == 0",
            "train": train,
            "heldout": heldout,
            "total": {
                "files": train["files"] + heldout["files"],
                "bytes": train["bytes"] + heldout["bytes"],
            },
        }

    def write_manifest(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.manifest(), indent=1) + "\n", encoding="utf-8")

    def _split_manifest(self, paths: tuple[Path, ...]) -> dict:
        entries = []
        for path in paths:
            data = path.read_bytes()
            entries.append(
                {
                    "path": self.relative(path),
                    "bytes": len(data),
                    "sha1": hashlib.sha1(data).hexdigest(),
                }
            )
        return {
            "files": len(entries),
            "bytes": sum(e["bytes"] for e in entries),
            "entries": entries,
        }


def _read_texts(paths: tuple[Path, ...]) -> Iterator[str]:
    # NOTE: files are read (as bytes, decoded strictly) when iterated, not kept in
    # memory; collect() has already checked each one decodes.
    for path in paths:
        yield path.read_bytes().decode("utf-8")


def collect(root: Path | None = None) -> Corpus:
    """The *.py files under root (default: this interpreter's stdlib) that pass the skip
    rules, split into train and held-out; deterministic for a given tree."""
    root = Path(root if root is not None else sysconfig.get_paths()["stdlib"]).resolve()
    kept = sorted(_candidate_files(root), key=lambda p: p.relative_to(root).as_posix())
    train, heldout = [], []
    for path in kept:
        (heldout if is_heldout(path.relative_to(root).as_posix()) else train).append(path)
    return Corpus(root=root, train=tuple(train), heldout=tuple(heldout))


def _candidate_files(root: Path) -> Iterator[Path]:
    # os.walk rather than rglob: it prunes skipped trees before descending and does
    # not follow directory symlinks (which could loop or leave root).
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIPPED_DIRS]
        for name in filenames:
            path = Path(dirpath) / name
            if name.endswith(".py") and path.is_file() and _is_small_utf8(path):
                yield path


def _is_small_utf8(path: Path) -> bool:
    if path.stat().st_size > MAX_FILE_BYTES:
        return False
    try:
        path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
