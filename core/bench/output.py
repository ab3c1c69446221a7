"""Where a bench's results go: progress lines, the JSON file, its plot, the versions."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from graphrt.core.bench.timing import host_launch_us
from graphrt.core.errors import GraphrtError
from graphrt.core.parallel.launch import is_output_rank


def report_for(args: argparse.Namespace):
    """Where progress and tables go: stdout, stderr with ``--json``; nowhere on the ranks
    of a tensor-parallel job but rank 0."""
    if not is_output_rank():
        return lambda *a: None
    return (lambda *a: print(*a, file=sys.stderr)) if args.json else print


def write_result(result: dict, args: argparse.Namespace, plot, log) -> int:
    """The JSON at ``--out``, ``plot``'s PNG beside it, the JSON on stdout with ``--json``
    (rank 0 alone in a tensor-parallel job)."""
    if not is_output_rank():
        return 0
    out = Path(args.out)
    try:
        out.write_text(json.dumps(result, indent=2))
    except OSError as e:  # checked before the run, yet gone (/proc, a full disk, a race):
        print(json.dumps(result))  # the results go to stdout rather than nowhere
        raise GraphrtError(
            f"--out: cannot write {str(out)!r} ({e.strerror or e}); the results are on stdout"
        ) from None
    log(f"wrote {out}")
    if args.plot:
        png = out.with_suffix(".png")
        if plot(result, png):
            log(f"wrote {png}")
        else:  # not silently: the user asked for a plot by default
            print(
                f"graphrt: warning: no plot written ({png.name}): matplotlib is not installed "
                "(pip install 'graphrt[bench]'; --no-plot skips it)",
                file=sys.stderr,
            )
    if args.json:
        print(json.dumps(result))
    return 0


def header(args: argparse.Namespace, device, dtype, prompt_len: int | list[int], loaded) -> dict:
    """What every bench's JSON starts with: the model, the device, the dtype, whether the
    model (``loaded``) runs batch-invariant kernels, the prompt length, the versions, and
    the host's speed now (``timing.host_launch_us``)."""
    return dict(
        model=args.model,
        device=device.name,
        device_name=device.describe(),
        dtype=str(dtype).removeprefix("torch."),
        batch_invariant=loaded.batch_invariant,
        prompt_len=prompt_len,
        versions=versions(device),
        host_launch_us=host_launch_us(device.torch_device(), device.synchronize),
    )


def versions(device) -> dict[str, str]:
    found = device.library_versions()
    try:
        import importlib.metadata

        found["transformers"] = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        pass
    found["python"] = sys.version.split()[0]
    return found


def fmt(x: float | int | None, spec: str = ".3f") -> str:
    """A table cell: ``x`` formatted, "-" where it was not measured."""
    return "-" if x is None else format(x, spec)
