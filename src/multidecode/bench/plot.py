"""Plots of benchmark results, drawn with matplotlib's Agg canvas (no window, no global state)."""

from __future__ import annotations

from pathlib import Path


def machine_label(result: dict) -> str:
    """What ran the benchmark, for a plot's title: model (dtype, device, threads)."""
    meta = result.get("metadata", {})
    return (f"{meta.get('model', '?')} ({meta.get('dtype', '?')}, {meta.get('device', '?')}, "
            f"threads={meta.get('threads', '?')})")


def plot_ask(result: dict, path: str | Path) -> Path:
    """Speedup of MultiDecode over each baseline vs K (left) and wall time per method vs K (right)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    path = Path(path)
    labels = result.get("labels", {})
    sweep = result["sweep"]
    ks = [row["k"] for row in sweep]
    fig = Figure(figsize=(11, 4.4), dpi=120)
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)

    styles = {"hf_sequential": ("o-", "tab:red"), "hf_batched": ("s-", "tab:orange"),
              "hf_shared_prefix": ("^-", "tab:blue"), "multidecode": ("D-", "tab:green")}
    offsets = {"hf_sequential": (6, 4), "hf_batched": (-22, 6), "hf_shared_prefix": (6, -10)}
    for name in ("hf_sequential", "hf_batched", "hf_shared_prefix"):
        points = [(row["k"], row[f"speedup_vs_{name}"]) for row in sweep if f"speedup_vs_{name}" in row]
        if points:
            marker, color = styles[name]
            left.plot(*zip(*points), marker, color=color, label=f"over {labels.get(name, name)}")
            for k, v in points:
                left.annotate(f"{v:.1f}x", (k, v), textcoords="offset points", xytext=offsets[name], fontsize=7,
                              color=color)
    left.axhline(1.0, color="grey", lw=0.8, ls="--")
    left.set_xscale("log", base=2)
    left.set_xticks(ks, [str(k) for k in ks])
    left.set_xlabel("questions K")
    left.set_ylabel("speedup of MultiDecode (wall time ratio)")
    left.set_title("MultiDecode speedup vs K")
    left.legend(fontsize=7, loc="upper left")
    left.grid(alpha=0.3)

    for name, (marker, color) in styles.items():
        points = [(row["k"], row["methods"][name]["wall_s"]) for row in sweep if name in row["methods"]]
        if points:
            right.plot(*zip(*points), marker, color=color, label=labels.get(name, name))
    right.set_xscale("log", base=2)
    right.set_yscale("log")
    right.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    right.yaxis.set_major_formatter(ScalarFormatter())
    right.yaxis.set_minor_formatter(NullFormatter())
    right.set_xticks(ks, [str(k) for k in ks])
    right.set_xlabel("questions K")
    right.set_ylabel("wall time (s)")
    right.set_title("Wall time to answer K questions")
    right.legend(fontsize=7, loc="upper left")
    right.grid(alpha=0.3, which="both")

    config = result.get("config", {})
    fig.suptitle(
        f"{machine_label(result)}: ~{max(config.get('prompt_tokens') or [0])}-token prompts, "
        f"{config.get('max_new_tokens', '?')} new tokens, greedy",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path)
    return path


def plot_sweep(
    path: str | Path,
    *,
    xs: list[int],
    xlabel: str,
    speedups: dict[str, list[float]],
    memory_mb: dict[str, list[float]],
    title: str,
    target: float | None = None,
) -> Path:
    """Two panels over a sweep: MultiDecode's speed-up per baseline (left, with the target as a
    dashed line) and each method's peak KV cache in MB (right)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    path = Path(path)
    fig = Figure(figsize=(11, 4.2), dpi=120)
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    for (label, values), marker in zip(speedups.items(), "o^s"):
        left.plot(xs, values, marker + "-", label=label)
        for x, v in zip(xs, values):
            left.annotate(f"{v:.2f}x", (x, v), textcoords="offset points", xytext=(5, 5), fontsize=7)
    left.axhline(1.0, color="grey", lw=0.8, ls="--")
    if target is not None:
        left.axhline(target, color="tab:red", lw=0.8, ls=":", label=f"target {target:g}x")
    left.set_title("speed-up of MultiDecode (wall-time ratio)")
    for (label, values), marker in zip(memory_mb.items(), "oDs^"):
        right.plot(xs, values, marker + "-", label=label)
    right.set_title("peak KV cache (MB)")
    right.set_yscale("log")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    return path
