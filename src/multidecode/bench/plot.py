"""Plots of benchmark results, drawn with matplotlib's Agg canvas (no window, no global state)."""

from __future__ import annotations

from pathlib import Path


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

    meta, config = result.get("metadata", {}), result.get("config", {})
    fig.suptitle(
        f"{meta.get('model', '?')} ({meta.get('dtype', '?')}, {meta.get('device', '?')}, "
        f"threads={meta.get('threads', '?')}): ~{max(config.get('prompt_tokens') or [0])}-token prompts, "
        f"{config.get('max_new_tokens', '?')} new tokens, greedy",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path)
    return path
