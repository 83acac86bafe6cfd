"""Drawing a recorded step: the forest panel (one lane per branch) and the attention-mask panel.

A **band**, in the mask panel, is a run of adjacent cache slots that every row of the step sees
alike, drawn as one wider column. Merging them is lossless: a band is all seen or all hidden by
each row. The shared prefix is one band; so is each branch's stretch of an earlier step.
Drawing uses matplotlib's Agg canvas (no window, no global state).
"""

from __future__ import annotations

import textwrap
import unicodedata
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from .step import Lane, StepView

if TYPE_CHECKING:
    from matplotlib.figure import Figure

STATUS_COLOURS = {
    "head": "#3465a4",
    "accepted": "#2e9d5b",
    "rejected": "#d64550",
    "side": "#9a86b8",
    "next": "#ffffff",
}
PREFIX_COLOUR = "#6b7280"
HISTORY_COLOUR = "#b4c0d0"
EMPTY_COLOUR = "#eef0f3"


def shown(text: str, limit: int) -> str:
    """A token's text made visible: spaces at its ends as ␣, newlines as ⏎, cut to `limit` chars."""
    text = _printable(text.replace("\r", "").replace("\t", "⇥").replace("\n", "⏎"))
    stripped = text.strip(" ")
    if stripped != text:
        lead = len(text) - len(text.lstrip(" "))
        trail = len(text) - len(text.rstrip(" "))
        text = "␣" * lead + stripped + "␣" * trail if stripped else "␣" * len(text)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _printable(text: str) -> str:
    """Control characters (a byte token's 0x04) written as an escape, \\x04: no font draws them."""
    return "".join(f"\\x{ord(c):02x}" if unicodedata.category(c) == "Cc" else c for c in text)


def _flat(text: str) -> str:
    return _printable(" ".join(text.replace("\n", " ⏎ ").split()))


def _wrap(text: str, width: int, lines: int, *, keep: str = "start") -> str:
    """`text` wrapped to `width` columns in at most `lines` lines; what does not fit is cut with …,
    keeping the start, the end, or both (all lines but the last from the start, the last from the end)."""
    flat = _flat(text)
    wrapped = textwrap.wrap(flat, width, break_on_hyphens=False) or [""]
    if len(wrapped) <= lines:
        return "\n".join(wrapped)
    if keep == "both" and lines >= 2:
        return "\n".join([*wrapped[: lines - 1], "…" + flat[-(width - 1):].lstrip()])
    budget = width * lines - 2
    if keep == "end":
        return "\n".join(textwrap.wrap("…" + flat[-budget:].lstrip(), width)[-lines:])
    return "\n".join(textwrap.wrap(flat[:budget].rstrip() + " …", width)[:lines])


def draw(view: StepView, *, title: str = "", figsize: tuple[float, float] = (14.0, 7.0), dpi: int = 120) -> Figure:
    """Both panels of one step (see the module notes); returns a matplotlib Figure."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, dpi=dpi)
    FigureCanvasAgg(fig)
    _draw_forest(fig.add_axes((0.01, 0.11, 0.615, 0.76)), view)  # the legend goes under it
    _draw_mask(fig.add_axes((0.655, 0.02, 0.335, 0.85)), view)
    if title:
        fig.suptitle(title, fontsize=11, y=0.985, va="top", linespacing=1.4)
    _legend(fig, side=any(lane.side for lane in view.lanes))
    return fig


def save(figure: Figure, path: str | Path, *, dpi: int | None = None) -> Path:
    """Write the figure as a PNG (parent folders created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():  # a glyph the font lacks (a rare script) is drawn as a box, not said
        warnings.filterwarnings("ignore", message="Glyph .* missing from font")
        figure.savefig(path, dpi=dpi or figure.dpi, format="png", facecolor="white")
    return path


def _legend(fig, *, side: bool) -> None:
    """The colours' meanings; side nodes' only where the step has some (lookahead's window)."""
    from matplotlib.patches import Patch

    handles = [
        Patch(facecolor=STATUS_COLOURS["head"], label="head: the branch's newest token, fed this step"),
        Patch(facecolor=STATUS_COLOURS["accepted"], label="draft accepted (the target chose it too)"),
        Patch(facecolor=STATUS_COLOURS["rejected"], label="draft rejected (taken back after the step)"),
        *([Patch(facecolor=STATUS_COLOURS["side"], label="side node (fed for its logits, never verified)")]
          if side else []),
        Patch(facecolor="white", edgecolor="#333333", linestyle="--",
              label="the target's next token (+n: what the branch gains)"),
        Patch(facecolor=PREFIX_COLOUR, label="shared prefix (cached once)"),
        Patch(facecolor=HISTORY_COLOUR, label="a branch's earlier tokens (cached)"),
    ]
    fig.legend(handles=handles, loc="lower left", ncol=3, fontsize=8.5, frameon=False,
               bbox_to_anchor=(0.005, 0.005), columnspacing=1.5)


# forest panel geometry, in data units (vertically, one unit is one row of a lane)
_PREFIX_X = (0.0, 3.1)
_TAIL_X = (3.55, 7.75)
_ANSWER_X = (8.1, 12.3)
_HEAD_X = 13.75  # centre of the head's box
_DX = 2.45  # one depth (one position) further
_NODE_W, _NODE_H = 2.2, 0.6
_WIDE_DEPTH = 5  # node columns that fit at full width (the default budget's chain and the next token)
_LANE_GAP = 0.6
_CHAR_EM = {"monospace": 0.6, "sans-serif": 0.57, "bold": 0.64}  # mean glyph width, in ems


def _layout(lane: Lane) -> tuple[dict[int, tuple[int, int]], tuple[int, int], int]:
    """Grid places (depth, row) of a lane's nodes and of its next token, and the rows it needs.

    Leaves take rows depth-first and a parent sits on its first child's row, so the head, the
    accepted path and the next token (the last accepted node's first child) form the lane's top row.
    """
    kids: dict[int, list[int]] = {}
    for n in lane.nodes[1:]:
        kids.setdefault(n.parent, []).append(n.node)
    depth = {n.node: n.depth for n in lane.nodes}
    last = ([n.node for n in lane.accepted] or [lane.nodes[0].node])[-1]
    rows: dict[int, int] = {}
    count = 0

    def place(node: int) -> int:
        nonlocal count
        first = None
        if node == last:  # the next token comes first under it
            first, count = count, count + 1
        for child in kids.get(node, []):
            row = place(child)
            first = row if first is None else first
        if first is None:
            first, count = count, count + 1
        rows[node] = first
        return first

    place(lane.nodes[0].node)
    return {n: (depth[n], rows[n]) for n in rows}, (depth[last] + 1, rows[last]), max(count, 1)


class _Canvas:
    """One panel's axes with its scale (points per data unit), and the few marks it draws."""

    def __init__(self, ax, right: float, top: float, bottom: float) -> None:
        self.ax = ax
        box = ax.get_position()
        fig_w, fig_h = ax.figure.get_size_inches()
        self.x_pt = box.width * fig_w * 72 / (right + 0.05)  # points per data unit, to fit text to boxes
        self.y_pt = box.height * fig_h * 72 / (bottom + 0.2 - top)

    def chars(self, width: float, size: float, kind: str = "sans-serif") -> int:
        """How many characters of font `size` fit in `width` data units."""
        return max(4, int((width * self.x_pt - 8) / (size * _CHAR_EM[kind])))

    def lines(self, height: float, size: float) -> int:
        return max(1, int(height * self.y_pt / (size * 1.25)))

    def box(self, x0, x1, y0, y1, *, face, edge="#4b5563", style="-", lw=0.9) -> None:
        from matplotlib.patches import FancyBboxPatch

        self.ax.add_patch(FancyBboxPatch((x0, y0), x1 - x0, y1 - y0, boxstyle="round,pad=0,rounding_size=0.1",
                                         facecolor=face, edgecolor=edge, linestyle=style, linewidth=lw, zorder=2,
                                         mutation_aspect=self.x_pt / self.y_pt))

    def text(self, x, y, s, **kw) -> None:
        kw.setdefault("fontsize", 8)
        kw.setdefault("ha", "center")
        kw.setdefault("va", "center")
        self.ax.text(x, y, s, parse_math=False, zorder=4, **kw)

    def line(self, x0, y0, x1, y1, *, colour="#9ca3af", lw=1.0, style="-") -> None:
        self.ax.plot([x0, x1], [y0, y1], color=colour, lw=lw, ls=style, zorder=1, solid_capstyle="round")


_PAD = 0.12
_GREY, _DARK = "#6b7280", "#374151"


def _draw_forest(ax, view: StepView) -> None:
    """The forest panel: the shared prefix, then a lane per branch (its prompt tail, its answer so
    far, and the nodes it fed this step, by depth below its head)."""
    layouts = [_layout(lane) for lane in view.lanes]
    max_depth = max(max([d for d, _ in places.values()] + [nxt[0]]) for places, nxt, _ in layouts)
    tops, y = [], 0.0
    for _, _, height in layouts:
        tops.append(y)
        y += height + _LANE_GAP
    bottom = y - _LANE_GAP
    # node columns at full width up to _WIDE_DEPTH; deeper trees share that width
    right = _HEAD_X + _DX * min(max_depth, _WIDE_DEPTH) + _NODE_W / 2 + 0.9
    dx = min(_DX, (right - 1.0 - _HEAD_X) / (max_depth + 0.45))
    node_w = min(_NODE_W, 0.9 * dx)
    header = -0.75
    ax.set_xlim(-0.05, right)
    ax.set_ylim(bottom + 0.05, header - 0.15)
    ax.set_axis_off()
    canvas = _Canvas(ax, right, header, bottom)
    _draw_prefix(canvas, view, bottom)
    for lane, top, (places, next_place, height) in zip(view.lanes, tops, layouts):
        _draw_history(canvas, view, lane, top, height, node_w)
        _draw_fed(canvas, lane, top, places, next_place, dx, node_w)
    canvas.text((_PREFIX_X[0] + _ANSWER_X[1]) / 2, header + 0.05, "cached before this step", fontsize=8,
                color=_DARK, va="bottom")
    canvas.text((_HEAD_X - node_w / 2 + right) / 2, header + 0.05, "fed this step: each head with its draft tree",
                fontsize=8, color=_DARK, va="bottom")
    for d in range(max_depth + 1):
        canvas.text(_HEAD_X + dx * d, header + 0.45, "head" if d == 0 else f"+{d}", fontsize=6.5, color="#9ca3af")
    ax.set_title("the forest at this step: one lane per branch; x = depth below the head (one position each)",
                 fontsize=9.5, loc="left", pad=9)


def _draw_prefix(canvas: _Canvas, view: StepView, bottom: float) -> None:
    """The shared prefix: one box for all lanes."""
    x0, x1 = _PREFIX_X
    canvas.box(x0, x1, 0.0, bottom, face="#e5e7eb", edge=PREFIX_COLOUR, lw=1.2)
    canvas.text((x0 + x1) / 2, 0.12, "shared prefix", fontsize=8.5, weight="bold", va="top")
    n = view.prefix_length
    canvas.text((x0 + x1) / 2, 0.5, f"{n} tokens\ncached once\npos 0–{n - 1}", fontsize=7, va="top", color=_DARK,
                linespacing=1.3)
    size = 6.5
    canvas.text(x0 + _PAD, 1.45, _wrap(view.prefix_text, canvas.chars(x1 - x0 - 2 * _PAD, size, "monospace"),
                                       canvas.lines(bottom - 1.65, size), keep="both"),
                fontsize=size, ha="left", va="top", color="#4b5563", family="monospace", linespacing=1.2)


def _draw_history(canvas: _Canvas, view: StepView, lane: Lane, top: float, height: float, node_w: float) -> None:
    """A lane's cached part: its own prompt tail, then its answer before the head."""
    mid = top + 0.5
    y0, y1 = top + 0.04, top + height - 0.04
    canvas.line(_PREFIX_X[1], mid, _TAIL_X[0], mid)
    canvas.line(_TAIL_X[1], mid, _ANSWER_X[0], mid)
    canvas.line(_ANSWER_X[1], mid, _HEAD_X - node_w / 2, mid)
    start = view.prefix_length
    for (bx0, bx1), head, body, foot, keep in (
        (_TAIL_X, f"Q{lane.branch + 1} · prompt tail", lane.tail_text, _span(start, len(lane.tail)), "both"),
        (_ANSWER_X, "answer so far", lane.answer_text, _span(start + len(lane.tail), len(lane.answer)), "end"),
    ):
        canvas.box(bx0, bx1, y0, y1, face="#f3f4f6", edge=HISTORY_COLOUR, lw=1.2)
        canvas.text(bx0 + _PAD, y0 + 0.06, shown_line(head, canvas.chars(bx1 - bx0, 7, "bold")), fontsize=7,
                    ha="left", va="top", weight="bold", color=_DARK)
        room = (y1 - y0) - 0.3 - (0.22 if foot else 0)
        size = 7
        width = canvas.chars(bx1 - bx0 - _PAD, size, "monospace")
        if body:
            canvas.text(bx0 + _PAD, y0 + 0.3, _wrap(body, width, canvas.lines(room, size), keep=keep), fontsize=size,
                        ha="left", va="top", linespacing=1.2, family="monospace", color="#111827")
        else:
            empty = "(the head is its first token)" if bx0 == _ANSWER_X[0] else "(none)"
            canvas.text(bx0 + _PAD, y0 + 0.3, _wrap(empty, canvas.chars(bx1 - bx0 - _PAD, size), 2), fontsize=size,
                        ha="left", va="top", style="italic", color=_GREY)
        if foot:
            canvas.text(bx1 - _PAD, y1 - 0.05, foot, fontsize=6, ha="right", va="bottom", color=_GREY)


def _draw_fed(canvas: _Canvas, lane: Lane, top: float, places: dict[int, tuple[int, int]],
              next_place: tuple[int, int], dx: float, node_w: float) -> None:
    """A lane's nodes fed this step (edges first, then boxes), and the target's next token."""
    at = {node: (_HEAD_X + dx * d, top + r + 0.5) for node, (d, r) in places.items()}
    for n in lane.nodes[1:]:
        (xa, ya), (xb, yb) = at[n.parent], at[n.node]
        canvas.line(xa + node_w / 2, ya, xb - node_w / 2, yb, colour=STATUS_COLOURS[n.status],
                    lw=2.4 if n.status == "accepted" else 1.2)
    last = ([n.node for n in lane.accepted] or [lane.nodes[0].node])[-1]
    nx, ny = _HEAD_X + dx * next_place[0], top + next_place[1] + 0.5
    if lane.next_token is not None:
        canvas.line(at[last][0] + node_w / 2, at[last][1], nx - node_w / 2, ny, colour="#333333", lw=1.2, style="--")
    fits = canvas.chars(node_w, 8, "monospace")
    for n in lane.nodes:
        x, yc = at[n.node]
        canvas.box(x - node_w / 2, x + node_w / 2, yc - _NODE_H / 2, yc + _NODE_H / 2, face=STATUS_COLOURS[n.status],
                   edge="#1f2937" if n.status == "head" else "none", lw=1.0)
        canvas.text(x, yc, shown(n.text, fits), color="white", fontsize=8, weight="bold", family="monospace")
        canvas.text(x, yc + _NODE_H / 2 + 0.03, f"p{n.position}", fontsize=6, va="top", color=_GREY)
    if lane.next_token is None:  # it ended on its last accepted draft: the caption goes beside that
        nx, ny = at[last][0] + node_w, at[last][1]
    else:
        canvas.box(nx - node_w / 2, nx + node_w / 2, ny - _NODE_H / 2, ny + _NODE_H / 2, face="white", edge="#333333",
                   style="--", lw=1.1)
        canvas.text(nx, ny, shown(lane.next_text, fits), color="#111827", fontsize=8, weight="bold", family="monospace")
    caption = ("next · " if lane.next_token is not None else "") + f"+{lane.gained}" + (" · done" if lane.finished else "")
    canvas.text(nx, ny + _NODE_H / 2 + 0.03, caption, fontsize=6, va="top",
                color=STATUS_COLOURS["accepted"] if lane.gained > 1 else _GREY)


def _span(start: int, count: int) -> str:
    """'n tokens, pos a–b' for a stretch of a lane ('' when empty)."""
    if not count:
        return ""
    where = f"pos {start}" if count == 1 else f"pos {start}–{start + count - 1}"
    return f"{count} token{'s' * (count != 1)}, {where}"


def shown_line(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _bands(view: StepView) -> list[dict]:
    """Mask columns: runs of adjacent slots every row sees alike (see the module notes); each
    slot fed in this step stays a column of its own."""
    fed = {n.slot: n for n in view.rows}
    columns: list[dict] = []
    visible = view.visible  # [rows, slots]
    for slot in range(view.num_slots):
        owner = view.slot_branch[slot]
        if columns and slot not in fed and columns[-1]["node"] is None and columns[-1]["owner"] == owner and bool(
                (visible[:, slot] == visible[:, columns[-1]["first"]]).all()):
            columns[-1]["last"] = slot
            continue
        columns.append({"first": slot, "last": slot, "owner": owner, "node": fed.get(slot)})
    return columns


def _draw_mask(ax, view: StepView) -> None:
    """The mask panel: a row per fed node, a column per cache slot (or band), coloured where the
    row sees the slot."""
    rows = view.rows
    columns = _bands(view)
    widths = [1.0 if c["node"] is not None else 1.6 for c in columns]
    lefts = [sum(widths[:i]) for i in range(len(columns))]
    width = sum(widths)
    _mask_cells(ax, view, columns, lefts, widths)
    # groups: a line between branches (rows, and this step's columns), one between cached and fed
    starts = [0]
    for lane in view.lanes:
        starts.append(starts[-1] + len(lane.nodes))
    for r in starts[1:-1]:
        ax.plot([0, width], [r, r], color="#111827", lw=1.2, zorder=4)
    first_fed = next((i for i, c in enumerate(columns) if c["node"] is not None), len(columns))
    ax.plot([lefts[first_fed]] * 2, [0, len(rows)], color="#111827", lw=1.4, zorder=4)
    fed_cols = {c["node"].node: i for i, c in enumerate(columns) if c["node"] is not None}
    for lane in view.lanes[1:]:
        i = fed_cols[lane.nodes[0].node]
        ax.plot([lefts[i]] * 2, [0, len(rows)], color="#111827", lw=0.8, ls=":", zorder=4)
    # labels sit at fixed distances in points from the matrix, and the limits leave room for them
    box = ax.get_position()
    fig_w, fig_h = ax.figure.get_size_inches()
    w_pt, h_pt = box.width * fig_w * 72, box.height * fig_h * 72
    span_x = (width + 0.1) / (1 - _MASK_LEFT / w_pt)
    span_y = len(rows) / (1 - (_MASK_TOP + _MASK_BOTTOM) / h_pt)
    ax.set_xlim(width + 0.1 - span_x, width + 0.1)
    ax.set_ylim(len(rows) + span_y * _MASK_BOTTOM / h_pt, -span_y * _MASK_TOP / h_pt)
    cell_w, cell_h = w_pt / span_x, h_pt / span_y  # points per column of width 1, per row
    _mask_labels(ax, view, columns, lefts, widths, starts, first_fed,
                 col_size=max(4.5, min(6.5, 0.85 * cell_w)), row_size=max(4.5, min(7.0, 0.75 * cell_h)))
    ax.set_axis_off()
    ax.set_title("its attention mask: each fed node sees itself and its ancestors", fontsize=9.5, loc="left", pad=2)


def _mask_cells(ax, view: StepView, columns: list[dict], lefts: list[float], widths: list[float]) -> None:
    """One cell per (row, column): its colour says what the row sees there; a node's own cell is outlined."""
    from matplotlib.patches import Rectangle

    for r, row in enumerate(view.rows):
        for c, col in enumerate(columns):
            if not bool(view.visible[r, col["first"]]):
                colour = EMPTY_COLOUR
            elif col["node"] is not None:
                colour = STATUS_COLOURS[col["node"].status]
            else:
                colour = PREFIX_COLOUR if col["owner"] == -1 else HISTORY_COLOUR
            own = col["node"] is not None and col["node"].node == row.node
            ax.add_patch(Rectangle((lefts[c], r), widths[c], 1, facecolor=colour,
                                   edgecolor="#111827" if own else "white", linewidth=1.3 if own else 0.6,
                                   zorder=3 if own else 2))


def _mask_labels(ax, view: StepView, columns: list[dict], lefts: list[float], widths: list[float],
                 starts: list[int], first_fed: int, *, col_size: float, row_size: float) -> None:
    """Branch names beside row groups, tokens beside rows, slot ranges or tokens under columns."""
    rows, width = view.rows, sum(widths)

    def label(x, y, s, dx=0.0, dy=0.0, **kw):
        ax.annotate(s, (x, y), xytext=(dx, dy), textcoords="offset points", annotation_clip=False,
                    parse_math=False, **kw)

    for lane, r0, r1 in zip(view.lanes, starts, starts[1:]):
        label(0, (r0 + r1) / 2, f"Q{lane.branch + 1}", dx=-_MASK_LEFT + 6, fontsize=8, weight="bold", ha="left",
              va="center", rotation=90, color="#374151")
    for r, row in enumerate(rows):
        label(0, r + 0.5, shown(row.text, 10), dx=-3, fontsize=row_size, ha="right", va="center", family="monospace",
              color=STATUS_COLOURS[row.status], weight="bold")
    for c, col in enumerate(columns):  # slot ranges for bands, tokens for this step's nodes
        if col["node"] is not None:
            text, colour = shown(col["node"].text, 10), STATUS_COLOURS[col["node"].status]
            family, weight = "monospace", "bold"
        else:
            span = f"{col['first']}" if col["first"] == col["last"] else f"{col['first']}–{col['last']}"
            text = ("prefix " if col["owner"] == -1 else "") + span
            colour, family, weight = "#4b5563", "sans-serif", "normal"
        label(lefts[c] + widths[c] / 2, len(rows), text, dy=-3, fontsize=col_size, ha="center", va="top", rotation=90,
              family=family, color=colour, weight=weight)
    label(lefts[first_fed] / 2, 0, "cached before this step", dy=4, fontsize=7.5, ha="center", va="bottom",
          color="#374151")
    label((lefts[first_fed] + width) / 2, 0, "fed this step", dy=4, fontsize=7.5, ha="center", va="bottom",
          color="#374151")
    label(width / 2, len(rows), f"columns: the {view.num_slots} cache slots in order; adjacent slots that every row "
          "sees alike\nare merged into one wider column, labelled with its slot range", dy=-_MASK_BOTTOM + 24,
          fontsize=7, ha="center", va="top", color="#4b5563")


_MASK_LEFT, _MASK_TOP, _MASK_BOTTOM = 66.0, 18.0, 82.0  # points around the mask's matrix for its labels


__all__ = ["draw", "save", "shown"]
