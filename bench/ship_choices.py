"""Ship a card's GEMV tuner choices: merge the cache files a device call brought back
into ``devices/cuda/gemv_choices/`` (the file a fresh machine of that card reads).

`bash bench/h200.sh cold` brings back the tuner's cache file of its cold start, named
``gemv-CARD-torchX-tritonY.json``: the shapes that start had to time, none of them in the
card's shipped file (its recalled choices are not written again). A shape missing there
makes every fresh start of that card time it and compile all its candidates ahead (stop
63: 30 shapes, 89 GEMV variants, 12.1 -> 26.2 s on an H100). The merge keeps every entry
already shipped and adds or replaces the file's own.

    python bench/ship_choices.py /work/.device/N/gemv-NVIDIA_H100_80GB_HBM3-*.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from graphrt.devices.cuda.gemv_tuner import SHIPPED_DIR, write_choices

CACHE_NAME = re.compile(r"gemv-(?P<card>.+?)-torch.*-triton[^-]*\.json$")


def ship(cache_file: Path, into: Path = SHIPPED_DIR) -> tuple[Path, int, int]:
    """Merge one cache file into its card's shipped file: (that file, entries added,
    entries changed)."""
    match = CACHE_NAME.match(cache_file.name)
    if match is None:
        raise ValueError(f"{cache_file.name}: not a tuner cache file (gemv-CARD-torch...json)")
    timed = json.loads(cache_file.read_text())
    if not isinstance(timed, dict):
        raise ValueError(f"{cache_file}: not a choices file (a JSON object)")
    target = into / f"{match['card']}.json"
    shipped = json.loads(target.read_text()) if target.exists() else {}
    added = sum(key not in shipped for key in timed)
    changed = sum(key in shipped and shipped[key] != value for key, value in timed.items())
    shipped.update(timed)
    write_choices(target, shipped)
    return target, added, changed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path, help="gemv-CARD-torch...json files")
    parser.add_argument("--into", type=Path, default=SHIPPED_DIR, help="the shipped choices")
    args = parser.parse_args()
    for path in args.files:
        try:
            target, added, changed = ship(path, args.into)
        except (OSError, ValueError) as e:
            print(f"ship_choices: {e}", file=sys.stderr)
            return 1
        print(f"{target}: {added} added, {changed} changed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
