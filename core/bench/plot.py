"""Step latency against batch size, one line per runner plus the floor (matplotlib)."""

from __future__ import annotations

from pathlib import Path


def _pyplot():
    """matplotlib's pyplot on the Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _figure(result: dict, size: tuple[float, float]):
    """(pyplot, the result's batches, their batch sizes, figure, axes), or None when
    matplotlib is not installed."""
    plt = _pyplot()
    if plt is None:
        return None
    batches = result["batches"]
    return plt, batches, [b["batch_size"] for b in batches], *plt.subplots(figsize=size)


def _save(plt, fig, ax, path: Path, legend_size: float | None = None) -> bool:
    """Every plot's finish: a grid, the legend, the PNG at ``path``; -> True."""
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=legend_size)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def plot_latency(result: dict, path: Path) -> bool:
    """Write the PNG; False when matplotlib is not installed."""
    figure = _figure(result, (6, 4))
    if figure is None:
        return False
    import matplotlib.ticker

    plt, batches, sizes, fig, ax = figure
    for key, label in [
        ("eager_ms", "eager"),
        ("graph_ms", "graph"),
        ("hf_ms", "transformers (compile)"),
        ("floor_ms", "bandwidth floor"),
    ]:
        points = [(s, b[key]) for s, b in zip(sizes, batches) if b.get(key)]
        if points:
            style = "--" if key == "floor_ms" else "-o"
            ax.plot(*zip(*points), style, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(base=2))
    ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("decode batch size")
    ax.set_ylabel("step latency (ms, median)")
    ax.set_title(
        f"{result['model']} {result['dtype']}, prompt {result['prompt_len']}, {result['device_name']}"
    )
    return _save(plt, fig, ax, path)


def plot_context_sweep(result: dict, path: Path) -> bool:
    """A context sweep (``graphrt bench --prompt-len a,b,...``): step latency against the
    prompt length, one line per batch size (graph, else eager), its bandwidth floor
    dashed in the same colour. False when matplotlib is not installed."""
    plt = _pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    lens = result["prompt_len"]
    sizes = [b["batch_size"] for b in result["sweep"][0]["batches"]]
    for i, size in enumerate(sizes):
        runs = [next(b for b in r["batches"] if b["batch_size"] == size) for r in result["sweep"]]
        key = "graph_ms" if any(b.get("graph_ms") for b in runs) else "eager_ms"
        color = f"C{i % 10}"
        points = [(n, b[key]) for n, b in zip(lens, runs) if b.get(key)]
        if points:
            ax.plot(*zip(*points), "-o", color=color, label=f"batch {size} ({key[:-3]})")
        ax.plot(lens, [b["floor_ms"] for b in runs], "--", color=color, alpha=0.6)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(lens, [f"{n // 1024}k" if n % 1024 == 0 else str(n) for n in lens])
    ax.set_xlabel("prompt length (tokens); dashed: bandwidth floor")
    ax.set_ylabel("decode step latency (ms, median)")
    ax.set_title(f"{result['model']} {result['dtype']}, {result['device_name']}")
    return _save(plt, fig, ax, path)


def plot_spec_throughput(result: dict, path: Path) -> bool:
    """Tokens/s against request batch size: plain decode, speculative as measured, and
    what the measured round time gives at every accept length. False without matplotlib."""
    figure = _figure(result, (6.5, 4.2))
    if figure is None:
        return False
    plt, batches, sizes, fig, ax = figure
    ax.plot(sizes, [b["decode_tokens_per_s"] for b in batches], "-o", label="plain (engine step)")
    ax.plot(sizes, [b["spec_tokens_per_s"] for b in batches], "-o", label="speculative, measured")
    for i in range(len(batches[0]["tokens_per_s_at_accept_length"])):
        points = [b["tokens_per_s_at_accept_length"][i] for b in batches]
        ax.plot(sizes, points, ":", alpha=0.6, label=f"accept length {i + 1}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.set_xlabel("request batch size")
    ax.set_ylabel("tokens/s")
    ax.set_title(
        f"{result['model']} + {result['draft']}, {result['dtype']}, steps {result['spec_steps']}, "
        f"topk {result['spec_topk']}\n{result['device_name']}",
        fontsize=9,
    )
    return _save(plt, fig, ax, path, legend_size=7)
