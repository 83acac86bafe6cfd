"""The one results layer of the benchmarks: what ran, a result's tables and chart (by its layout, or
its own in `CHARTS`), and its files `<stem>.json`, `.md` and `.png`, each drawn from the JSON alone."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
from collections import ChainMap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..models.converted import model_display_name
from ..models.packed import activation_dtype, weight_count, weights_device, weights_precision
from ..user_cache import replace_atomically

TITLE_SIZE, NOTE_SIZE = 9, 7


def environment(model=None, *, launched: dict | None = None) -> dict:
    """What ran: the model loaded here or in a server (`launched`), versions, threads, the machine, its load, the date."""
    import transformers

    from ..version import __version__

    facts = dict(launched or {})
    if model is not None:
        facts = {"model": model_display_name(model), "model_type": getattr(model.config, "model_type", None),
                 "parameters": weight_count(model),  # packed weights included
                 "dtype": weights_precision(model),  # what the weights are held as ("int4", "bfloat16", ...)
                 "compute_dtype": str(activation_dtype(model)).removeprefix("torch."), "device": str(weights_device(model)),
                 "attn_implementation": getattr(model.config, "_attn_implementation", None)}
    return {"model": None, "dtype": None, "device": None, **facts, "torch": torch.__version__,
            "transformers": transformers.__version__, "multidecode": __version__,
            "python": platform.python_version(), "platform": platform.platform(),
            "threads": facts.get("threads") or torch.get_num_threads(), "cpu_count": os.cpu_count(),
            "load_average_at_start": load_average(), "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")}


def load_average() -> list[float] | None:
    try:
        return list(os.getloadavg())
    except OSError:
        return None


def machine_label(result: dict) -> str:
    """What ran the benchmark: model (dtype, device, threads)."""
    meta = result.get("metadata", {})
    return (f"{meta.get('model', '?')} ({meta.get('dtype', '?')}, {meta.get('device', '?')}, "
            f"threads={meta.get('threads', '?')})")


@dataclass(frozen=True)
class TextTable:
    """A table as text cells; its first `lead` columns name the row (left-aligned)."""

    title: str
    header: list[str]
    rows: list[list[str]]
    lead: int = 1


@dataclass(frozen=True)
class Line:
    """A series of (x, y) points (bars: x is the group's index); `notes` label points (None: not)."""

    label: str
    points: list[tuple[float, float]]
    style: dict = field(default_factory=dict)  # matplotlib's: marker, ls, color
    notes: list[str | None] | None = None


@dataclass(frozen=True)
class Panel:
    """One plot: lines (with `groups`: a bar per line in each group), reference lines `hlines` (y, style)."""

    title: str
    lines: list[Line]
    hlines: list[tuple[float, dict]] = field(default_factory=list)
    log_y: bool = False
    ylabel: str = ""
    groups: list[str] | None = None


@dataclass(frozen=True)
class Chart:
    """Panels side by side, lines against `x` (log2); legend: per panel ("each"), "first" or below ("figure")."""

    panels: list[Panel]
    x: list = field(default_factory=list)
    xlabel: str = ""
    legend: str = "each"
    title: str | None = None  # default: the result's title


@dataclass(frozen=True)
class Column:
    """A table column: the figure at `path` ("a.b", "{name}": the method's) times `scale`, written with `form`."""

    header: str
    path: str
    form: str = "{}"
    scale: float = 1.0


@dataclass(frozen=True)
class Table:
    """A table as data, stored in a result's layout: a row per case (`rows` "cases") or per method of the
    dict `rows` in every case (or the result); `sort`: by case parameters; the first `lead` columns name the row."""

    title: str
    columns: tuple[Column, ...]
    rows: str = "cases"
    lead: int = 1
    sort: tuple[str, ...] = ()


CHARTS: dict[str, Callable[[dict], Chart]] = {}
"""Benchmarks that draw a chart of their own, by name; the rest draw their layout's (`layout_chart`)."""


def fmt(value: float | None, form: str) -> str:
    return "" if value is None else form.format(value)


def lookup(record, path: Sequence[str]):
    """The value at `path` (a key per level) in nested dicts, None where a level lacks it."""
    for key in path:
        record = record.get(key) if isinstance(record, Mapping) else None
    return record


def column_table(result: dict, table: dict) -> list[TextTable]:
    """A `Table` stored in the result's layout, drawn from its rows (none where it has no records)."""
    short, rows, key = result["layout"]["short"], rows_of(result), table["rows"]
    records = rows
    if key != "cases":  # a record per method of a dict by method in every row, or in the result
        records = [ChainMap({"name": name, "label": short.get(name, name)}, figures, row)
                   for row in [row for row in rows if key in row] or [result] for name, figures in row[key].items()]
    if table["sort"]:
        order = list(short)
        records = sorted(records, key=lambda r: (*(r[p] for p in table["sort"]), order.index(r["name"])))

    def cell(column: dict, record: Mapping) -> str:
        value = lookup(record, column["path"].format(name=record.get("name")).split("."))
        if column["form"] == "yes/no":
            return {True: "yes", False: "**no**"}.get(value, "")
        return fmt(value if value is None or column["scale"] == 1 else value * column["scale"], column["form"])

    cells = [[cell(column, record) for column in table["columns"]] for record in records]
    return [TextTable(table["title"], [c["header"] for c in table["columns"]], cells, table["lead"])] if records else []


def targets_table(result: dict) -> list[TextTable]:
    """The result's targets: what each wants, what was measured and whether it was met."""
    return [TextTable("Targets", ["target", "wanted", "measured", "met"],
                      [[t["name"], t["target"], f"{t['measured']:g}" + "x" * t["target"].endswith("x"),
                        "yes" if t["met"] else "**no**"] for t in result["targets"]])] if result.get("targets") else []


def findings(result: dict) -> list[str]:
    """What the result says beyond its tables: whose answers every method matched, what did not run."""
    lines = []
    if result.get("answers_identical"):
        lines.append(f"Every method gave the same tokens as {result['labels'][result['config']['reference']]}.")
    if result.get("logits_identical"):
        lines.append(f"Every variant's logits matched its reference on every step (largest difference "
                     f"{result['max_abs_diff']:.1e}, allowed {result['config']['atol']:g}).")
    skipped = {name: why for row in [result, *rows_of(result)] for name, why in row.get("skipped", {}).items()}
    return lines + [f"Not run: {result['labels'][name]} ({why})." for name, why in skipped.items()]


def markdown(result: dict) -> str:
    """The result's tables as markdown, after what ran them and its findings."""
    meta = result["metadata"]
    loads = [", ".join(f"{x:.2f}" for x in meta.get(f"load_average_at_{when}") or ()) or "?" for when in ("start", "end")]
    lines = [(f"Measured {meta['date']} on {machine_label(result)}, torch {meta['torch']}, transformers "
              f"{meta['transformers']}; load average at start {loads[0]}, at end {loads[1]}."), *findings(result)]
    for table in tables(result):
        lines += ["", f"**{table.title}**", "", *markdown_table(table)]
    return "\n".join(lines) + "\n"


def markdown_table(table: TextTable) -> list[str]:
    """A table's lines in markdown: its header, the alignment row (numbers to the right), its rows."""
    align = ["---" if i < table.lead or not any(c[i][:1].isdigit() for c in table.rows) else "---:"
             for i in range(len(table.header))]
    return ["| " + " | ".join(table.header) + " |", "|" + "|".join(align) + "|",
            *("| " + " | ".join(row) + " |" for row in table.rows)]


def plot(result: dict, path: str | Path) -> Path:
    """Draw the result's chart into `path` (whole or not at all)."""
    path = Path(path)
    replace_atomically(path, [png(result)], durable=False)
    return path


def png(result: dict) -> bytes:
    """The result's chart as PNG bytes (matplotlib's Agg canvas: no window, no global state)."""
    import io

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    chart = CHARTS.get(result["benchmark"], layout_chart)(result)
    below = chart.legend == "figure"
    fig = Figure(figsize=(max(8.0, 4.6 * len(chart.panels)), 4.6 + below), dpi=120)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(chart.panels), squeeze=False)[0]
    for i, (ax, panel) in enumerate(zip(axes, chart.panels)):
        (_bars if panel.groups is not None else _lines)(ax, panel, chart)
        for y, style in panel.hlines:
            ax.axhline(y, lw=0.8, **style)
        ax.set_title(panel.title, fontsize=TITLE_SIZE)
        ax.set_ylabel(panel.ylabel)
        if chart.legend == "each" or chart.legend == "first" and i == 0:
            ax.legend(fontsize=NOTE_SIZE, loc="best")
    if below:
        handles = {label: h for ax in axes for h, label in zip(*ax.get_legend_handles_labels())}
        fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=4, fontsize=NOTE_SIZE,
                   frameon=False)
    fig.suptitle(f"{chart.title or result['title']} - {machine_label(result)}", fontsize=TITLE_SIZE)
    fig.tight_layout(rect=(0, 0.12 if below else 0, 1, 1))
    drawn = io.BytesIO()
    fig.savefig(drawn, format="png")
    return drawn.getvalue()


def _lines(ax, panel: Panel, chart: Chart) -> None:
    for line in panel.lines:
        drawn = ax.plot(*zip(*line.points), **{"marker": "o", **line.style}, label=line.label)[0]
        for (x, y), note in zip(line.points, line.notes or ()):
            if note:
                ax.annotate(note, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=NOTE_SIZE,
                            color=drawn.get_color())
    ax.set_xscale("log", base=2)
    ax.set_xticks(chart.x, [str(x) for x in chart.x])
    ax.set_xlabel(chart.xlabel)
    if panel.log_y:  # ticks at 1, 2 and 5 times each power of ten, written plainly
        from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
    ax.grid(alpha=0.3, which="both" if panel.log_y else "major")


def _bars(ax, panel: Panel, chart: Chart) -> None:
    width = 0.8 / len(panel.lines)
    for i, line in enumerate(panel.lines):
        xs = [x + (i - (len(panel.lines) - 1) / 2) * width for x, _ in line.points]
        bars = ax.bar(xs, [y for _, y in line.points], width, label=line.label)
        for bar, note in zip(bars, line.notes or ()):
            ax.annotate(note, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                        fontsize=6, textcoords="offset points", xytext=(0, 2))
    ax.set_xticks(range(len(panel.groups)), panel.groups, fontsize=8)
    ax.margins(y=0.25)
    ax.grid(alpha=0.3, axis="y")


def write_results(result: dict, out_dir: str | Path, *, stem: str | None = None) -> list[Path]:
    """Write `<stem>.json`, `.png` and `.md` (stem: `bench_<benchmark>`) in `out_dir`; returns the paths."""
    path = write_json(result, out_dir, stem=stem)
    return [path, *redraw(path)]


def write_json(result: dict, out_dir: str | Path, *, stem: str | None = None) -> Path:
    """Write the result's `<stem>.json` in `out_dir` whole or not at all (a full disk leaves no
    cut-short result that reads as written); returns its path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{stem or 'bench_' + result['benchmark']}.json"
    replace_atomically(path, [(json.dumps(result, indent=2) + "\n").encode("utf-8")])
    return path


def redraw(path: str | Path) -> list[Path]:
    """Draw the `.png` and `.md` beside a result's `<stem>.json` from the JSON alone; returns their paths."""
    path = Path(path)
    result = json.loads(path.read_text(encoding="utf-8"))
    drawn = [path.with_name(path.stem + ".png"), path.with_name(path.stem + ".md")]
    contents = [png(result), markdown(result).encode("utf-8")]  # both drawn first: a result that cannot be
    for target, content in zip(drawn, contents):                # drawn leaves the pair there as it was
        try:
            replace_atomically(target, [content], durable=False)
        except OSError as err:  # named by the file it is for (a full disk's write names none)
            raise OSError(err.errno, err.strerror, str(target)) from err
    return drawn


FIGURES = {
    # name in a method's JSON (or its `extra`): (column header, format, scale)
    "wall_s": ("wall", "{:.2f} s", 1.0),
    "forward_passes": ("forwards", "{:.0f}", 1.0),
    "tokens_per_s": ("tokens/s", "{:.1f}", 1.0),
    "documents_per_s": ("documents/s", "{:.3f}", 1.0),
    "tokens_per_forward": ("tokens/forward", "{:.2f}", 1.0),
    "acceptance": ("acceptance", "{:.2f}", 1.0),
    "peak_kv_bytes": ("peak KV", "{:.1f} MB", 1e-6),
    "prefill_s": ("prefill", "{:.2f} s", 1.0),
    "decode_s": ("decode", "{:.2f} s", 1.0),
    "decode_ms_per_step": ("decode step", "{:.0f} ms", 1.0),
}


def figure(method: dict, name: str) -> float | None:
    """A method's figure by name, scaled for display (MB for bytes); None where it has none."""
    value = method[name] if name in method else method.get("extra", {}).get(name)
    return None if value is None else value * FIGURES[name][2]


def figure_title(name: str) -> str:
    """A figure's name with its unit, for a plot panel: "wall (s)"."""
    header, form, _ = FIGURES[name]
    return f"{header} ({form.split()[-1]})" if " " in form else header


def rows_of(result: dict) -> list[dict]:
    """The result's case rows (the result itself for a benchmark of one case)."""
    key = result.get("layout", {}).get("rows")
    return result[key] if key else [result]


def speedup(row: dict, fast: str, slow: str) -> float | None:
    return row.get(f"{fast}_vs", {}).get(slow, {}).get("speedup")


def tables(result: dict) -> list[TextTable]:
    """The result's tables: its figures by method (where the layout names columns), its declared tables, its targets."""
    layout = result["layout"]
    declared = [drawn for table in layout.get("tables", ()) for drawn in column_table(result, table)]
    return (figure_tables(result) if layout["columns"] else []) + declared + targets_table(result)


def figure_tables(result: dict) -> list[TextTable]:
    """The main case (or every case) with a row per method; a summary row per sweep point."""
    layout, rows = result["layout"], rows_of(result)
    short, params = layout["short"], layout["params"]
    fasts = list(dict.fromkeys(fast for fast, _ in layout["pairs"]))
    slows = [slow for slow in dict.fromkeys(slow for _, slow in layout["pairs"])  # a column only where it has a figure
             if any(speedup(row, fast, slow) for row in rows for fast in fasts)]

    def method_rows(row: dict, lead: list[str]) -> list[list[str]]:
        return [lead + [result["labels"][name]] + [fmt(figure(m, c), FIGURES[c][1]) for c in layout["columns"]]
                + [fmt(speedup(row, name, slow), "{:.2f}x") for slow in slows] for name, m in row["methods"].items()]

    figure_header = [FIGURES[c][0] for c in layout["columns"]] + [f"speed-up over {short[s]}" for s in slows]
    main = result.get("main", rows[0] if len(rows) == 1 else None)  # the only case is the main one
    out = []
    if main is not None:
        where = ", ".join(f"{p} = {main[p]}" for p in params)
        out.append(TextTable(f"{result['title']} ({where})", ["method", *figure_header], method_rows(main, [])))
    if len(rows) > 1 and main is None:
        out.append(TextTable(result["title"], [*params, "method", *figure_header],
                             [r for row in rows for r in method_rows(row, [str(row[p]) for p in params])]))
    elif len(rows) > 1:
        names = list(dict.fromkeys(n for row in rows for n in row["methods"]))
        pairs = [(f, s) for f in fasts for s in slows if any(speedup(row, f, s) for row in rows)]
        out.append(TextTable(
            f"{result['title']}: sweep", [*params, *(f"{short[n]} wall" for n in names),
                                          *(f"{short[f]} over {short[s]}" for f, s in pairs)],
            [[str(row[p]) for p in params]
             + [fmt(row["methods"][n]["wall_s"], "{:.2f} s") if n in row["methods"] else "" for n in names]
             + [fmt(speedup(row, f, s), "{:.2f}x") for f, s in pairs] for row in rows]))
    return out


def layout_chart(result: dict) -> Chart:
    """`sweep`: every pair's speed-up, then each figure per method, against `x`; `bars`: a panel per figure."""
    layout, rows = result["layout"], rows_of(result)
    spec, short = layout["plot"], layout["short"]
    names = list(dict.fromkeys(n for row in rows for n in row["methods"]))
    if spec["kind"] == "bars":
        groups = [", ".join(v if isinstance(v := row[p], str) else f"{p} = {v}" for p in layout["params"])
                  for row in rows]
        return Chart([Panel(figure_title(name), [_bar_line(layout, rows, method, name) for method in names],
                            groups=groups) for name in spec["figures"]], legend="first")
    x = spec["x"]
    speedups = [Line(f"{short[fast]} over {short[slow]}", points, notes=[f"{v:.2f}x" for _, v in points])
                for fast, slow in layout["pairs"]
                if (points := [(row[x], v) for row in rows if (v := speedup(row, fast, slow)) is not None])]
    targets = sorted({t["value"] for t in result.get("targets", []) if t["path"][-1] == "speedup"})
    hlines = [(1.0, {"color": "grey", "ls": "--"})] + [(v, {"color": "tab:red", "ls": ":", "label": f"target {v:g}x"})
                                                       for v in targets]
    panels = [Panel("speed-up (wall-time ratio)", speedups, hlines)]
    panels += [Panel(figure_title(name), [Line(short[m], [(row[x], figure(row["methods"][m], name)) for row in rows
                                                          if m in row["methods"]]) for m in names], log_y=True)
               for name in spec["figures"]]
    return Chart(panels, [row[x] for row in rows], spec["xlabel"] or x)


def _bar_line(layout: dict, rows: list[dict], method: str, name: str) -> Line:
    values = [figure(row["methods"][method], name) if method in row["methods"] else None for row in rows]
    notes = [fmt(v, FIGURES[name][1].split()[0]) + ("".join(
        f"\n{s:.2f}x" for f, slow in layout["pairs"] if f == method and (s := speedup(row, f, slow)) is not None)
        if name == "wall_s" else "") for row, v in zip(rows, values)]
    return Line(layout["short"][method], [(i, v or 0) for i, v in enumerate(values)], notes=notes)
