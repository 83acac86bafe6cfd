"""Plots of benchmark results, drawn from the JSON alone as its layout says, with matplotlib's Agg
canvas (no window, no global state).

- `sweep`: the speed-up of every pair, then each of the layout's figures per method (log scale),
  against the case parameter `x` on a log2 axis;
- `bars`: one panel per figure, a group of bars (one per method) per case, the wall-time bars
  marked with their speed-ups.
"""

from __future__ import annotations

from pathlib import Path

from .harness import FIGURES, figure, figure_title, fmt, machine_label, rows_of, speedup


def plot(result: dict, path: str | Path) -> Path:
    """Draw the result as its layout says (matplotlib's Agg canvas: no window, no global state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    path = Path(path)
    spec = result["layout"]["plot"]
    panels = (1 if spec["kind"] == "sweep" else 0) + len(spec["figures"])
    fig = Figure(figsize=(max(8.0, 4.2 * panels), 4.4), dpi=120)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, panels, squeeze=False)[0]
    (_sweep if spec["kind"] == "sweep" else _bars)(result, spec, list(axes))
    fig.suptitle(f"{result['title']} - {machine_label(result)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    return path


def _sweep(result: dict, spec: dict, axes: list) -> None:
    rows, short = rows_of(result), result["layout"]["short"]
    xs = [row[spec["x"]] for row in rows]
    left = axes[0]
    for fast, slow in result["layout"]["pairs"]:
        points = [(row[spec["x"]], v) for row in rows if (v := speedup(row, fast, slow)) is not None]
        if points:
            line = left.plot(*zip(*points), "o-", label=f"{short[fast]} over {short[slow]}")[0]
            for x, v in points:
                left.annotate(f"{v:.2f}x", (x, v), textcoords="offset points", xytext=(4, 4), fontsize=7,
                              color=line.get_color())
    left.axhline(1.0, color="grey", lw=0.8, ls="--")
    for value in sorted({t["value"] for t in result.get("targets", []) if t["path"][-1] == "speedup"}):
        left.axhline(value, color="tab:red", lw=0.8, ls=":", label=f"target {value:g}x")
    left.set_title("speed-up (wall-time ratio)", fontsize=9)
    for ax, name in zip(axes[1:], spec["figures"]):
        for method in dict.fromkeys(n for row in rows for n in row["methods"]):
            points = [(row[spec["x"]], figure(row["methods"][method], name))
                      for row in rows if method in row["methods"]]
            ax.plot(*zip(*points), "o-", label=short[method])
        ax.set_yscale("log")
        ax.set_title(figure_title(name), fontsize=9)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel(spec["xlabel"] or spec["x"])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")


def _bars(result: dict, spec: dict, axes: list) -> None:
    rows, layout = rows_of(result), result["layout"]
    names = list(dict.fromkeys(n for row in rows for n in row["methods"]))
    width = 0.8 / len(names)
    groups = [", ".join(v if isinstance(v := row[p], str) else f"{p} = {v}" for p in layout["params"]) for row in rows]
    for ax, name in zip(axes, spec["figures"]):
        for i, method in enumerate(names):
            xs = [g + (i - (len(names) - 1) / 2) * width for g in range(len(rows))]
            values = [figure(row["methods"][method], name) if method in row["methods"] else None for row in rows]
            bars = ax.bar(xs, [v or 0 for v in values], width, label=layout["short"][method])
            for bar, row, value in zip(bars, rows, values):
                text = fmt(value, FIGURES[name][1].split()[0])
                if name == "wall_s":
                    text += "".join(f"\n{v:.2f}x" for f, s in layout["pairs"]
                                    if f == method and (v := speedup(row, f, s)) is not None)
                ax.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                            va="bottom", fontsize=6, textcoords="offset points", xytext=(0, 2))
        ax.set_title(figure_title(name), fontsize=9)
        ax.set_xticks(range(len(rows)), groups, fontsize=8)
        ax.margins(y=0.25)
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=7, loc="best")
