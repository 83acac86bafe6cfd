"""What a forward costs on this hardware, how often drafts are accepted, and the draft budget.

Speculation pays only when the tokens it gains are worth more than what the extra draft rows
cost in the forward. Both sides are measured, never assumed:

- **cost curve** t(q, L): seconds for one forward that feeds q new tokens over L cached ones.
  On a GPU it is nearly flat in q; on this project's CPU 2 or 3 rows cost 1.04x-1.15x one, 4 cost
  1.44x and 8 cost 1.82x (on another CPU, where one row takes a matrix-vector path, 2 rows cost
  1.73x). The shape decides what speculation may cost, so it is measured, never assumed; but
  no run waits for a full measurement (`measure_cost`, seconds to minutes on a loaded CPU).
  `cost_curve` gives a `LearnedCurve`: the machine class's prior, corrected by a probe of at
  most `PROBE_BUDGET_S` seconds that later runs complete (`probe_cost`), and by every forward the
  engines over the model run anyway (`engine.time_forwards`: each is a timing of its own q and
  L); robust fits of bounded samples, kept on disk per model, device, dtype and thread count,
  merged and written atomically, refined by every run.
- **acceptance**: how often a draft node is accepted once its parent is, tracked per branch and
  per *bucket* (the proposer's kind of guess, first candidate or alternative), with the rates
  of the whole group as the prior of each branch (`AcceptanceTracker`). Because verification
  accepts exactly the draft tokens that equal the tokens the branch then produces (see
  `verify`), a proposal's outcome is known from the branch's later tokens whether or not it was
  fed: every step teaches the tracker, including steps that speculated nothing.
- **budget** (`choose_draft_count`): each step, every draft node's chance of acceptance is the
  product of the rates along its path. With M required rows (each branch's newest token) and
  the D most likely draft nodes added, the step is expected to yield (branches + sum of the D
  chances) tokens in t(M + D, L) seconds; D maximises that rate. D = 0 (no speculation) wins
  whenever drafts would not pay for their rows.
"""

from __future__ import annotations

import atexit
import hashlib
import itertools
import json
import math
import os
import platform
import statistics
import time
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path

import torch

from .engine import Engine, time_forwards
from .forest import ROOT
from .models.packed import activation_dtype, weight_count, weights_device, weights_precision
from .user_cache import cache_dir, replace_atomically

SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
"""Tokens per forward timed by `measure_cost`; larger forwards are extrapolated linearly."""

CONTEXTS = (128, 1024)
"""Cached tokens under the timed forwards; other lengths are interpolated linearly."""

PRIOR_WEIGHT = 4.0
"""How many observations a prior rate is worth."""


# ---------------------------------------------------------------------- the cost curve
@dataclass(frozen=True)
class CostCurve:
    """Forward time by new tokens q and cached tokens L, from measurements.

    sizes: the q measured (ascending, starting at 1); contexts: the L measured (ascending);
    seconds[c][i]: the time of a forward of sizes[i] tokens over contexts[c] cached ones.
    """

    sizes: tuple[int, ...]
    contexts: tuple[int, ...]
    seconds: tuple[tuple[float, ...], ...]
    key: str = ""

    def time(self, q: int, context: int = 0) -> float:
        """Seconds for a forward of q tokens over `context` cached tokens (interpolated)."""
        if len(self.contexts) == 1:
            return _interpolate(self.sizes, self.seconds[0], q)
        # only the two context rows around `context` (or the last two, past the ends) count
        i = min(max(bisect_left(self.contexts, context), 1), len(self.contexts) - 1)
        pair = [_interpolate(self.sizes, self.seconds[c], q) for c in (i - 1, i)]
        return max(_interpolate(self.contexts[i - 1 : i + 1], pair, context), 1e-9)

    def relative(self, q: int, context: int = 0) -> float:
        """t(q) / t(1) at `context`."""
        return self.time(q, context) / self.time(1, context)

    @classmethod
    def from_relative(cls, relative: dict[int, float]) -> CostCurve:
        """A curve from relative costs {q: t(q)/t(1)} (for tests and what-if studies)."""
        sizes = tuple(sorted(relative))
        return cls(sizes, (0,), (tuple(float(relative[q]) for q in sizes),))

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> CostCurve:
        return cls(tuple(data["sizes"]), tuple(data["contexts"]), tuple(tuple(r) for r in data["seconds"]),
                   data.get("key", ""))


def _interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear y(x) through (xs, ys); linear extrapolation past either end."""
    if len(xs) == 1:
        return ys[0]
    i = min(max(bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def model_key(model) -> str:
    """What a cost curve depends on: the model's shape, dtype, weights' precision (int4 and int8
    codes are buffers, not parameters, and compute in the same dtype, yet time differently),
    device, attention kernel, torch version and thread count."""
    device = weights_device(model)
    facts = {
        "config": model.config.to_json_string(use_diff=False),
        "parameters": weight_count(model),
        "dtype": str(activation_dtype(model)),
        "weights": weights_precision(model),
        "device": f"{device.type}:{device_name(device)}",
        "attention": getattr(model.config, "_attn_implementation", None),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:20]


def device_name(device: torch.device) -> str:
    """What the hardware is, as far as a cost curve cares: the GPU's name, or the CPU's model and
    core count (two different CPUs sharing one cache folder must not share a curve)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            model = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), model)
    except OSError:
        pass
    return f"{model} x{os.cpu_count()}"


def measure_cost(model, *, sizes: Sequence[int] = SIZES, contexts: Sequence[int] = CONTEXTS,
                 repeats: int = 3) -> CostCurve:
    """Time the engine's forwards of each size over each context length (median of `repeats`,
    after one warm-up), on a scratch engine: the model's other work is not disturbed.

    Draft rows are fed as siblings under the context's last token, the masked (forest) path that
    a speculative step takes; times are made non-decreasing in q.
    """
    generator = torch.Generator().manual_seed(0)
    engine = Engine(model)
    vocab = engine.vocab_size
    limit = engine.max_positions or 1 << 30
    contexts = [c for c in contexts if c + 2 < limit] or [max(1, limit // 4)]
    sizes = sorted({int(q) for q in sizes} | {1})
    engine.reserve(max(contexts) + max(sizes))
    table = []
    for context in contexts:
        engine.compact([])
        leaf = engine.feed_chain(torch.randint(3, vocab, (context,), generator=generator).tolist()).nodes[-1]
        row = []
        for q in sizes:
            times = []
            for attempt in range(repeats + 1):
                tokens = torch.randint(3, vocab, (q,), generator=generator).tolist()
                fed, elapsed = _timed_feed(engine, tokens, [leaf] * q)
                engine.drop(fed)
                if attempt:  # the first is a warm-up
                    times.append(elapsed)
            row.append(sorted(times)[len(times) // 2])
        for i in range(1, len(row)):
            row[i] = max(row[i], row[i - 1])
        table.append(tuple(row))
    return CostCurve(tuple(sizes), tuple(contexts), tuple(table), model_key(model))


# ---------------------------------------------------------------------- the learned curve
ROW_BINS = SIZES + (96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)
"""Rows per forward that `LearnedCurve` keeps apart; a forward of other rows counts toward the
nearest on a log scale (as its ratio to the prior at its own rows, so little is lost)."""

CONTEXT_BINS = (0, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
"""Cached tokens that `LearnedCurve` keeps apart (nearest on a log scale)."""

SAMPLES_PER_CELL = 15
"""The newest timings kept per (rows, cached tokens) cell: memory and the file stay bounded, and an
old machine load is forgotten."""

TRUSTED_SAMPLES = 3
"""A cell timed this often stands on its own median; a cell timed less borrows from its row and
its column (see `fit_table`)."""

DERIVED_WEIGHT = 0.01
"""How much a time not timed itself (one from the row and column effects) counts against timed ones
when the table is made non-decreasing."""

REFRESH_EVERY = 8
"""New timings before the table is fitted again (a fit takes well under a millisecond)."""

SAVE_EVERY = 64
"""New timings kept in memory before they are merged into the curve's file."""

PROBE_BUDGET_S = 1.0
"""Wall time one probe may take: the most a command waits for the curve (see `probe_cost`)."""

PROBE_CONTEXT = 32
"""Cached tokens under the probe's forwards: few, since on a CPU their prefill costs as much as
many of the forwards timed over them (126 tokens cost 18 forwards of one here); how the cost grows
with the cache is learned from the forwards decoding runs."""

PROBE_ORDER = (1, 8, 2, 4, 16, 3, 32, 64, 6, 12, 24, 48)
"""The sizes the probe times, the most telling first (a probe cut short by its budget still has
the curve's shape); each is timed `PROBE_REPEATS` times in all, over as many runs as it takes."""

PROBE_REPEATS = 3
"""Probe timings of each size in all (their median counts): as many as `measure_cost` takes."""

PREFILL_GUESS = 16.0
"""The probe's prefill of `PROBE_CONTEXT` tokens, in warm-up forwards of one token: if that would
not fit the budget, the probe stops there (the machine is too slow to probe in time)."""

FORMAT = 2
"""The stored curve's format; a file of any other (today's: a measured table) is rebuilt."""

CPU_PRIOR = {1: 1.0, 2: 1.04, 3: 1.15, 4: 1.44, 8: 1.82, 16: 2.08, 32: 2.58, 64: 4.07}
"""t(q)/t(1) on this project's 2-core CPU (docs/speculation.md): the curve of a CPU before any timing."""

GPU_PRIOR = {1: 1.0, 8: 1.0, 16: 1.06, 32: 1.71, 64: 2.37}
"""t(q)/t(1) on one H100 (docs/speculation.md): the curve of any other device before any timing."""

CONTEXT_PRIOR = 8192
"""Before any timing, a forward over this many cached tokens costs twice one over none."""


def class_prior(device: torch.device) -> CostCurve:
    """What a forward costs on a machine of this class, before anything here is timed (in units of
    one row over no cache): the shape of a CPU's or a GPU's curve, linear in the cached tokens."""
    shape = CPU_PRIOR if device.type == "cpu" else GPU_PRIOR
    sizes = tuple(sorted(shape))
    row = tuple(shape[q] for q in sizes)
    return CostCurve(sizes, (0, CONTEXT_PRIOR), (row, tuple(2 * t for t in row)))


def _bin_edges(bins: Sequence[int]) -> list[float]:
    """The borders between adjacent bins, halfway on a log scale (of 1 + x, so that 0 is a bin)."""
    return [math.sqrt((1 + a) * (1 + b)) - 1 for a, b in itertools.pairwise(bins)]


_ROW_EDGES, _CONTEXT_EDGES = _bin_edges(ROW_BINS), _bin_edges(CONTEXT_BINS)


def cell_of(rows: int, cached: int) -> tuple[int, int]:
    """The (row bin, context bin) indices a forward of `rows` over `cached` tokens is kept in."""
    return bisect_right(_ROW_EDGES, rows), bisect_right(_CONTEXT_EDGES, cached)


@dataclass
class LearnedCurve:
    """Forward time t(q, L) learned from the forwards that run anyway: a prior by the machine's class
    (`class_prior`), corrected by timings (a quick probe's, `probe_cost`, and every forward an
    engine over the model runs: `engine.time_forwards`).

    cells: (row bin, context bin) -> the newest timings there, each as its ratio to the prior at its
    own size (`ROW_BINS` x `CONTEXT_BINS`, at most `SAMPLES_PER_CELL`). probed: size -> probe
    timings taken so far. path: the file it is kept in (None: memory only). The curve itself is a
    `CostCurve` fitted to the cells (`fit_table`), fitted again every `REFRESH_EVERY` timings.
    """

    key: str
    prior: CostCurve
    cells: dict[tuple[int, int], list[float]] = field(default_factory=dict)
    probed: dict[int, int] = field(default_factory=dict)
    path: Path | None = field(default=None, compare=False)
    probe_ran: bool = field(default=False, compare=False)  # a probe ran in this process
    kept: bool = field(default=False, compare=False)  # the last `save` reached its file (False: none, or unwritable)
    pending: list[tuple[tuple[int, int], float]] = field(default_factory=list, compare=False, repr=False)
    fitted: CostCurve | None = field(default=None, compare=False, repr=False)
    unfitted: int = field(default=0, compare=False, repr=False)  # timings since `fitted` was fitted

    def time(self, q: int, context: int = 0) -> float:
        """Seconds for a forward of q tokens over `context` cached tokens (as `CostCurve.time`)."""
        return self.table().time(q, context)

    def relative(self, q: int, context: int = 0) -> float:
        """t(q) / t(1) at `context`."""
        table = self.table()
        return table.time(q, context) / table.time(1, context)

    def table(self) -> CostCurve:
        """The curve as a table over the bins, fitted to the timings so far."""
        if self.fitted is None or self.unfitted >= REFRESH_EVERY:
            self.fitted, self.unfitted = fit_table(self.prior, self.cells, self.key), 0
        return self.fitted

    def record(self, rows: int, cached: int, seconds: float, *, probe: bool = False) -> None:
        """One timed forward of `rows` new tokens over `cached` ones (an engine's recorder; see
        `engine.time_forwards`). Kept to disk every `SAVE_EVERY` timings and when the process ends."""
        if rows < 1 or not (math.isfinite(seconds) and seconds > 0):
            return
        cell, ratio = cell_of(rows, cached), seconds / self.prior.time(rows, cached)
        self.keep(cell, ratio)
        self.pending.append((cell, ratio))
        if probe:
            self.probed[rows] = self.probed.get(rows, 0) + 1
        elif len(self.pending) >= SAVE_EVERY:
            self.save()

    def keep(self, cell: tuple[int, int], ratio: float) -> None:
        samples = self.cells.setdefault(cell, [])
        samples.append(ratio)
        del samples[:-SAMPLES_PER_CELL]
        self.unfitted += 1

    def probe_plan(self) -> list[int]:
        """The probe's forwards still to time, in rounds: every size once before any twice."""
        return [q for round_ in range(PROBE_REPEATS) for q in PROBE_ORDER if self.probed.get(q, 0) <= round_]

    @property
    def complete(self) -> bool:
        """Whether the probe has timed every size `PROBE_REPEATS` times (no run waits for it again)."""
        return not self.probe_plan()

    def save(self) -> None:
        """Keep the new timings in the file, merged with what it holds now (another process may have
        learned meanwhile), written atomically; a folder that cannot be written loses only that."""
        if self.path is not None:
            stored = read_curve(self.path, self.key)
            if stored is not None and stored.prior == self.prior:
                for cell, ratio in self.pending:
                    stored.keep(cell, ratio)
                for q, count in self.probed.items():
                    stored.probed[q] = max(count, stored.probed.get(q, 0))
                self.cells, self.probed, self.fitted = stored.cells, stored.probed, None
            self.kept = write_atomically(self.path, self.as_dict())
        self.pending.clear()

    def as_dict(self) -> dict:
        return {"format": FORMAT, "key": self.key, "prior": self.prior.as_dict(),
                "probed": {str(q): n for q, n in sorted(self.probed.items())},
                "cells": [[ROW_BINS[r], CONTEXT_BINS[c], samples] for (r, c), samples in sorted(self.cells.items())]}

    @classmethod
    def from_dict(cls, data: dict, key: str) -> LearnedCurve:
        """The curve `as_dict` wrote for `key`; ValueError where it is not one (corrupt), or one of
        another format, key or set of bins (stale)."""
        if data.get("format") != FORMAT or data.get("key") != key:
            raise ValueError("a curve of another format or model")
        prior = checked_curve(CostCurve.from_dict(data["prior"]))
        cells = {}
        for rows, context, samples in data["cells"]:
            ratios = [float(x) for x in samples]
            if not ratios or not all(math.isfinite(x) and x > 0 for x in ratios):
                raise ValueError("a cell without valid timings")
            cells[ROW_BINS.index(rows), CONTEXT_BINS.index(context)] = ratios[-SAMPLES_PER_CELL:]
        probed = {int(q): int(n) for q, n in data["probed"].items()}
        return cls(key, prior, cells, probed)


def checked_curve(curve: CostCurve) -> CostCurve:
    """`curve` if it is a table of positive finite times over ascending sizes and contexts, else ValueError."""
    ascending = all(a < b for pairs in (curve.sizes, curve.contexts) for a, b in itertools.pairwise(pairs))
    shaped = len(curve.seconds) == len(curve.contexts) and all(len(r) == len(curve.sizes) for r in curve.seconds)
    finite = all(math.isfinite(t) and t > 0 for r in curve.seconds for t in r)
    if not (curve.sizes and curve.sizes[0] >= 1 and ascending and shaped and finite):
        raise ValueError("not a cost table")
    return curve


# ---------------------------------------------------------------------- fitting the learned curve
def fit_table(prior: CostCurve, cells: dict[tuple[int, int], list[float]], key: str = "") -> CostCurve:
    """The prior corrected by the timings, at every bin: t = prior x ratio.

    Each cell's ratio is the median of its timings (robust to a slow outlier). A cell timed
    `TRUSTED_SAMPLES` times or more keeps its own; any other cell takes a row effect plus a column
    effect in log ratio (`median_polish` over the timed cells, each weighted by its timings),
    interpolated between timed rows and columns and held flat past them: a size timed at one
    context length tells every other length its shape, and a length timed at some sizes scales
    the others. No timing at all: the prior. Each context's times are then made non-decreasing in
    q (`non_decreasing`): a row more never costs less, whatever the noise says.
    """
    logs = {cell: (math.log(statistics.median(samples)), len(samples)) for cell, samples in cells.items()}
    row_effect, context_effect = median_polish(logs)
    rows, contexts = spread_over_bins(row_effect, len(ROW_BINS)), spread_over_bins(context_effect, len(CONTEXT_BINS))
    base = prior_table(prior)
    table = []
    for c in range(len(CONTEXT_BINS)):
        line, weights = [], []
        for r in range(len(ROW_BINS)):
            own, weight = logs.get((r, c), (0.0, 0))
            trusted = weight >= TRUSTED_SAMPLES
            line.append(base[c][r] * math.exp(own if trusted else rows[r] + contexts[c]))
            weights.append(weight if trusted else DERIVED_WEIGHT)
        table.append(tuple(non_decreasing(line, weights)))
    return CostCurve(ROW_BINS, CONTEXT_BINS, tuple(table), key)


@lru_cache(maxsize=8)
def prior_table(prior: CostCurve) -> tuple[tuple[float, ...], ...]:
    """The prior at every bin: [context bin][row bin]."""
    return tuple(tuple(prior.time(q, context) for q in ROW_BINS) for context in CONTEXT_BINS)


def median_polish(cells: dict[tuple[int, int], tuple[float, int]],
                  rounds: int = 4) -> tuple[dict[int, float], dict[int, float]]:
    """Additive row and column effects, value[r, c] ~ row[r] + column[c], over the cells given as
    (value, weight) (Tukey's median polish, with weighted medians: one wild cell, or one timed
    once beside cells timed often, moves neither effect much)."""
    by_row: dict[int, list[tuple[int, float, int]]] = {}
    by_column: dict[int, list[tuple[int, float, int]]] = {}
    for (r, c), (v, w) in cells.items():
        by_row.setdefault(r, []).append((c, v, w))
        by_column.setdefault(c, []).append((r, v, w))
    row = dict.fromkeys(by_row, 0.0)
    column = dict.fromkeys(by_column, 0.0)
    for _ in range(rounds):
        row = {r: weighted_median([(v - column[c], w) for c, v, w in line]) for r, line in by_row.items()}
        column = {c: weighted_median([(v - row[r], w) for r, v, w in line]) for c, line in by_column.items()}
    return row, column


def weighted_median(pairs: Sequence[tuple[float, float]]) -> float:
    """The median of values given as (value, weight): the value where the sorted weights pass half
    (the mean of the two where they reach it exactly)."""
    ordered = sorted(pairs)
    half, passed = sum(w for _, w in ordered) / 2, 0.0
    for i, (value, weight) in enumerate(ordered):
        passed += weight
        if passed > half:
            return value
        if passed == half:
            return (value + ordered[i + 1][0]) / 2
    return ordered[-1][0]


def spread_over_bins(effects: dict[int, float], bins: int) -> list[float]:
    """Effects known at some bin indices -> one per bin: interpolated between them, the nearest
    past them, 0 where none is known."""
    if not effects:
        return [0.0] * bins
    known = sorted(effects)
    values = [effects[i] for i in known]
    return [values[0] if i <= known[0] else values[-1] if i >= known[-1] else _interpolate(known, values, i)
            for i in range(bins)]


def non_decreasing(values: Sequence[float], weights: Sequence[float] | None = None) -> list[float]:
    """The closest non-decreasing sequence in weighted least squares (pool adjacent violators): a
    dip is averaged with what it undercuts, rather than a spike carried up to every size after
    it; a value of little weight (one not timed) moves to meet its well-timed neighbours."""
    blocks: list[tuple[float, float, int]] = []  # (mean, weight, count)
    for v, w in zip(values, weights or [1.0] * len(values)):
        blocks.append((v, w, 1))
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, w2, n2), (m1, w1, n1) = blocks.pop(), blocks.pop()
            blocks.append(((m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, n1 + n2))
    return [m for m, _, n in blocks for _ in range(n)]


# ---------------------------------------------------------------------- the quick probe
def probe_cost(curve: LearnedCurve, model, budget_s: float = PROBE_BUDGET_S, *,
               clock: Callable[[], float] = time.perf_counter) -> float:
    """Time the forwards `curve`'s probe still lacks (`LearnedCurve.probe_plan`), within `budget_s`
    seconds of wall time: forwards of q siblings over `PROBE_CONTEXT` cached tokens on a scratch
    engine, after a warm-up. No forward starts that would end past the budget by the probe's own
    estimate (the largest size timed so far, scaled up in proportion: costs grow more slowly than
    that); what is left waits for the next run's probe. Returns the seconds it took (by `clock`,
    the wall clock unless a test gives its own)."""
    started = clock()
    wanted = curve.probe_plan()
    if budget_s <= 0 or not wanted:
        return 0.0
    curve.probe_ran = True
    previous = time_forwards(model, None)  # the probe's forwards are its samples, not counted twice
    try:
        _probe(curve, Engine(model), wanted, started + budget_s, clock)
    finally:
        time_forwards(model, previous)
    return clock() - started


def _probe(curve: LearnedCurve, engine: Engine, wanted: list[int], deadline: float,
           clock: Callable[[], float]) -> None:
    generator = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(3, engine.vocab_size, (n,), generator=generator).tolist()

    limit = engine.max_positions or 1 << 30
    context = max(2, min(PROBE_CONTEXT, limit // 4))
    wanted = [q for q in wanted if context + q < limit]
    if not wanted:
        return
    engine.reserve(context + max(wanted))
    head = _timed_feed(engine, tokens(1), [ROOT], clock)[0]  # warm-up: first-call work, not a sample
    head, warm = _timed_feed(engine, tokens(1), head, clock)  # what one row costs, to guess the prefill's
    if clock() + PREFILL_GUESS * warm > deadline:
        return
    leaf = engine.feed_chain(tokens(context - 2), head[0]).nodes[-1]
    engine.drop(_timed_feed(engine, tokens(2), [leaf] * 2, clock)[0])  # the masked path's first call
    timed: dict[int, float] = {}
    for q in wanted:
        below = max((s for s in timed if s <= q), default=None)
        estimate = timed[below] * q / below if below else warm * q
        if clock() + estimate > deadline:
            continue
        fed, seconds = _timed_feed(engine, tokens(q), [leaf] * q, clock)
        engine.drop(fed)
        timed[q] = seconds
        curve.record(q, context, seconds, probe=True)


def _timed_feed(engine: Engine, tokens: list[int], parents: list[int],
                clock: Callable[[], float] = time.perf_counter) -> tuple[list[int], float]:
    """Feed `tokens` under `parents` (logits at every one, as a draft step asks), waiting for the
    device: the new nodes and the seconds it took."""
    started = clock()
    fed = engine.feed(tokens, parents, logits_for=range(len(tokens))).nodes
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    return fed, clock() - started


# ---------------------------------------------------------------------- keeping it
_CURVES: dict[str, LearnedCurve] = {}


def costs_dir() -> Path:
    """Where learned curves are kept: $MULTIDECODE_COSTS, else `costs/` in the model cache folder."""
    if os.environ.get("MULTIDECODE_COSTS"):
        return Path(os.environ["MULTIDECODE_COSTS"]).expanduser()
    return cache_dir() / "costs"


def read_curve(path: Path, key: str) -> LearnedCurve | None:
    """The curve kept at `path` for `key`, or None where there is none, or it is corrupt or stale
    (another format, model or set of bins: not trusted, so rebuilt)."""
    try:
        curve = LearnedCurve.from_dict(json.loads(path.read_text(encoding="utf-8")), key)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, ArithmeticError):  # 1e400: an overflow
        return None
    curve.path = path
    return curve


def write_atomically(path: Path, data: dict) -> bool:
    """Write `data` as JSON to `path` through a temporary file (a reader never sees half a file);
    a folder that cannot be written loses only the saving. Returns whether it was written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        replace_atomically(path, [json.dumps(data).encode("utf-8")], durable=False)  # saved while decoding
    except OSError:
        return False
    return True


def cost_curve(model, *, folder: Path | None = None, measure: bool = True,
               budget_s: float = PROBE_BUDGET_S) -> LearnedCurve | None:
    """The cost curve of `model` here (a `LearnedCurve`): from memory, else from disk (`folder`,
    default `costs_dir()`), else the prior of the machine's class. Where its probe is incomplete
    and none ran in this process yet, one probe of at most `budget_s` seconds runs first (and is
    saved): the most a run waits. From then on every engine over `model` teaches it
    (`engine.time_forwards`). measure=False: None where nothing is kept, and no probe."""
    key = model_key(model)
    curve = _CURVES.get(key)
    if curve is None:
        path = Path(folder if folder is not None else costs_dir()) / f"{key}.json"
        curve = read_curve(path, key)
        if curve is None and not measure:
            return None
        curve = curve or LearnedCurve(key, class_prior(weights_device(model)), path=path)
        _CURVES[key] = curve
        atexit.register(curve.save)
    if measure and not curve.probe_ran and not curve.complete:
        probe_cost(curve, model, budget_s)
        curve.save()
    time_forwards(model, curve.record)
    return curve


def probe_due(model, *, folder: Path | None = None) -> bool:
    """Whether `cost_curve(model)` would probe now (a caller may say so while it waits)."""
    key = model_key(model)
    curve = _CURVES.get(key)
    if curve is None:
        curve = read_curve(Path(folder if folder is not None else costs_dir()) / f"{key}.json", key)
    return curve is None or (not curve.probe_ran and not curve.complete)


def quick_curve(model, *, budget_s: float = PROBE_BUDGET_S) -> LearnedCurve:
    """A new curve of `model` from its machine class's prior and one probe, in memory only (nothing
    read or written): what a first run here starts from (for benchmarks and what-if studies)."""
    curve = LearnedCurve(model_key(model), class_prior(weights_device(model)))
    probe_cost(curve, model, budget_s)
    return curve


# ---------------------------------------------------------------------- acceptance
Bucket = tuple[int, bool]
"""(the proposer's kind of guess, whether the node is an alternative to an earlier sibling)."""


@dataclass
class _Counts:
    accepted: float = 0.0
    tried: float = 0.0

    def rate(self, prior: float, weight: float = PRIOR_WEIGHT) -> float:
        return (self.accepted + weight * prior) / (self.tried + weight)


@dataclass
class _Pending:
    """A proposal waiting for the branch's later tokens: its tree and how far it matched."""

    start: int  # index in the branch's output of the first guessed token
    tokens: list[int]
    children: dict[int, list[int]]  # node -> its children, -1 for the top level
    buckets: list[Bucket]
    priors: list[float]
    at: int = -1  # the deepest node matched so far (-1: none yet)
    depth: int = 0


@dataclass
class AcceptanceTracker:
    """Acceptance rates of one group's drafts, per branch, with the group's rates as the prior.

    `record_proposal` remembers a proposal (fed or not); `score_proposals` scores remembered proposals
    against the tokens the branch produced since; `node_chances` estimates each node of a new
    proposal.
    """

    pooled: dict[Bucket, _Counts] = field(default_factory=dict)
    branches: dict[int, dict[Bucket, _Counts]] = field(default_factory=dict)
    pending: dict[int, list[_Pending]] = field(default_factory=dict)
    max_pending: int = 32

    def rate(self, branch: int, bucket: Bucket, prior: float) -> float:
        pooled = self.pooled.get(bucket, _Counts()).rate(prior)
        own = self.branches.get(branch, {}).get(bucket)
        return own.rate(pooled) if own is not None else pooled

    def node_chances(self, branch: int, draft) -> list[float]:
        """Each node's estimated chance of being accepted: the product of the rates on its path."""
        chances: list[float] = []
        for parent, bucket, prior in zip(draft.parents, _buckets(draft), draft.priors):
            above = 1.0 if parent < 0 else chances[parent]
            chances.append(above * self.rate(branch, bucket, prior))
        return chances

    def record_proposal(self, branch: int, start: int, draft) -> None:
        if not len(draft):
            return
        children: dict[int, list[int]] = {}
        for i, parent in enumerate(draft.parents):
            children.setdefault(parent, []).append(i)
        queue = self.pending.setdefault(branch, [])
        queue.append(_Pending(start, list(draft.tokens), children, _buckets(draft), list(draft.priors)))
        del queue[: -self.max_pending]

    def score_proposals(self, branch: int, output: Sequence[int], finished: bool) -> None:
        """Score remembered proposals of `branch` against its output so far."""
        queue = self.pending.get(branch, [])
        still = []
        for p in queue:
            done = False
            while p.start + p.depth < len(output):
                actual = output[p.start + p.depth]
                kids = p.children.get(p.at, [])
                match = None
                for kid in kids:
                    hit = p.tokens[kid] == actual
                    self._count(branch, p.buckets[kid], hit)
                    if hit:
                        match = kid
                if match is None:
                    done = True
                    break
                p.at, p.depth = match, p.depth + 1
            if not done and not finished and p.children.get(p.at):
                still.append(p)
        self.pending[branch] = still

    def _count(self, branch: int, bucket: Bucket, hit: bool) -> None:
        for counts in (self.pooled.setdefault(bucket, _Counts()),
                       self.branches.setdefault(branch, {}).setdefault(bucket, _Counts())):
            counts.tried += 1
            counts.accepted += hit


def _buckets(draft) -> list[Bucket]:
    return [(kind, rank > 0) for kind, rank in zip(draft.kinds, draft.ranks())]


# ---------------------------------------------------------------------- the budget
def choose_draft_count(curve: CostCurve, *, required: int, expected: float, chances: Sequence[float],
                       context: int = 0, margin: float = 0.03) -> int:
    """How many of the most likely draft nodes to feed with `required` other rows.

    expected: tokens the step yields without drafts; chances: each draft node's chance of being
    accepted (sorted best first). The count maximises expected tokens per second; a count above
    0 must beat no speculation by `margin` (estimates are noisy, a loss is worse than a miss).
    """
    if not chances or required < 1:
        return 0
    plain = expected / curve.time(required, context)
    best, best_rate = 0, plain * (1 + margin)
    gain = expected
    for d, chance in enumerate(chances, start=1):
        gain += chance
        rate = gain / curve.time(required + d, context)
        if rate > best_rate:
            best, best_rate = d, rate
    return best
