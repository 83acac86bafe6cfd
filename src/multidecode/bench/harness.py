"""The one benchmark harness: a benchmark is declared as data and `run` measures it; the result
is written by `results.write_results` as `<stem>.json`, `<stem>.png` and `<stem>.md`.

Terms:
- **method** (`Method`): one way to do a case's work. `run(counter)` does it once under a
  `ForwardCounter` and returns a `RunOutput` (answers, KV bytes, the method's own counters). A
  method may instead be `parts` run one after another, each measured once and shared by every
  case that names it (one question at a time: K questions cost the sum of the first K).
- **case** (`Case`): one workload or sweep point: its parameters (`{"k": 8}`), its methods, its
  time budget and its targets.
- **reference**: the method whose answers every other method of a case must equal token for
  token (else `AnswersDiffer`); None where outputs are sampled and cannot be compared.
- **round**: every method of a case run once, in order. Rounds repeat while fewer than `repeats`
  ran and they took under the case's budget, and each method keeps its median run: interleaving
  gives the methods the same machine conditions and the same number of runs. A `solo` method (a
  costly one) gets rounds of its own under half the budget, so it does not use up the others'.
- **pair** `(fast, slow)`: the row reports `<fast>_vs[<slow>]`, the speed-up (slow's wall time
  over fast's) and fast's forward passes, tokens/s and KV bytes relative to slow's.
- **row**: one case in the JSON: its parameters, every method's `Measurement`, the pairs' ratios
  and what the case's `report` adds. A benchmark declared with one case and no `rows_key`
  keeps its row at the top level.
- **layout**: how to tabulate and draw the result (`results`), stored in the JSON with it, so
  that the files can be redrawn from the JSON alone.

Nothing here prints; `progress` gets a short message as each measurement ends.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import asdict, dataclass, field

from ..errors import InvalidArgument, is_int
from ..models.reading import quiet_transformers
from .common import (
    ForwardCounter,
    Measurement,
    Progress,
    RunOutput,
    check_identical,
    combine_sequential,
    measure_together,
    torch_threads,
)
from .results import environment, finished

Runner = Callable[[ForwardCounter], RunOutput]
OUTSIDE_TORCH = "outside torch"
"""`Method.model` of a method that no torch model runs (llama.cpp): its counter hooks nothing and
its run reports its own forward passes and times."""
NOTES = (
    "Answers are compared token for token with the reference's, up to and including the first eos.",
    ("wall_s is the median of runs_s (a method run item by item: their sum); prefill_s/decode_s are the "
     "time inside model forward calls, other_s the rest (python, masks, sampling, cache copies)."),
    ("peak_kv_bytes: for transformers, the cache tensors held at the end of generate (the largest cache "
     "held); for MultiDecode, the engine's peak allocated (preallocated) cache buffer."),
)
"""What every result's numbers mean, stored in its config."""


# ---------------------------------------------------------------------- the declaration
@dataclass(frozen=True)
class Part:
    """One item of a method run item by item; `key` names it across cases (measured once)."""

    key: Hashable
    run: Runner


@dataclass(frozen=True)
class Method:
    """One way to do a case's work: `run`, or `parts` one after another. `skip` says why it cannot
    run here (it is then left out and the reason kept in the row)."""

    name: str
    label: str
    run: Runner | None = None
    parts: tuple[Part, ...] = ()
    short: str = ""  # for plots and column headers; default: the label
    solo: bool = False
    skip: str | None = None
    model: object = None  # whose forwards its counter sees (default: the benchmark's; OUTSIDE_TORCH: none)

    @classmethod
    def named(cls, labels: dict[str, tuple[str, str]], name: str, **how) -> Method:
        """The method `name` with its (label, short label) from `labels`."""
        label, short = labels[name]
        return cls(name, label, short=short, **how)


@dataclass(frozen=True)
class Target:
    """A figure of a case's row (`path` into it) held against a value: `op` is >=, > or <=."""

    name: str
    path: tuple[str, ...]
    op: str
    value: float
    unit: str = "x"

    def check(self, row: dict) -> dict | None:
        """The target as reported, or None where the row lacks the figure (a skipped method)."""
        got = row
        for key in self.path:
            got = got.get(key) if isinstance(got, dict) else None
        if got is None:
            return None
        met = {">=": got >= self.value, ">": got > self.value, "<=": got <= self.value}[self.op]
        return {"name": self.name, "target": f"{self.op} {self.value:g}{self.unit}", "measured": round(got, 4),
                "met": bool(met), "path": list(self.path), "value": self.value}


@dataclass(frozen=True)
class Case:
    """One workload or sweep point. `report(measurements)` returns the case's own figures for its
    row (answer texts, score differences) and raises where a check beyond identical answers fails."""

    params: dict
    methods: tuple[Method, ...]
    budget_s: float = 30.0
    main: bool = False
    targets: tuple[Target, ...] = ()
    report: Callable[[dict[str, Measurement]], dict] | None = None


@dataclass(frozen=True)
class Plot:
    """`sweep`: speed-ups and each figure against the case parameter `x` (log2 axis); `bars`: one
    panel per figure, a group of bars (one per method) per case."""

    kind: str = "bars"
    figures: tuple[str, ...] = ("wall_s", "forward_passes", "peak_kv_bytes")
    x: str | None = None
    xlabel: str = ""


@dataclass(frozen=True)
class Benchmark:
    """A benchmark as data. `columns` are the figures in its tables; `rows_key` names the list of
    case rows in the JSON ("sweep", "workloads"), or is None for a benchmark of exactly one case,
    whose row then stands at the top level."""

    name: str
    title: str
    model: object
    cases: tuple[Case, ...]
    reference: str | None
    pairs: tuple[tuple[str, str], ...] = ()
    config: dict = field(default_factory=dict)
    warmup: tuple[Method, ...] = ()
    repeats: int = 3
    columns: tuple[str, ...] = ("wall_s", "forward_passes", "tokens_per_s", "peak_kv_bytes")
    plot: Plot = Plot()
    rows_key: str | None = "sweep"
    summary: Callable[[dict], dict] | None = None  # figures over every row, added to the result


# ---------------------------------------------------------------------- running it
def run(bench: Benchmark, *, threads: int | None = None, progress: Progress | None = None) -> dict:
    """Warm up, measure every case, check identical answers, and return the JSON-ready result.

    threads: torch intra-op threads for the run (restored afterwards); None keeps the setting.
    Raises `AnswersDiffer` where a method's answers differ from the reference's (or its own on a
    repeat run).
    """
    say = progress or (lambda message: None)
    started = time.perf_counter()
    with torch_threads(threads), quiet_transformers(loading=False):
        meta = environment(bench.model)
        if bench.warmup:
            say("warming up")
            measure_together({m.name: m.run for m in bench.warmup}, {m.name: _model(bench, m) for m in bench.warmup},
                             repeats=1)
        done_parts: dict = {}
        rows = [_measure_case(bench, case, done_parts, say) for case in bench.cases]
    methods = {m.name: m for case in bench.cases for m in case.methods}
    result = {
        "benchmark": bench.name,
        "title": bench.title,
        "metadata": finished(meta, started),
        "config": {**bench.config, "reference": bench.reference, "repeats": bench.repeats,
                   "budgets_s": [case.budget_s for case in bench.cases],
                   "notes": [*bench.config.get("notes", ()), *NOTES]},
        "labels": {name: m.label for name, m in methods.items()},
        "layout": {"rows": bench.rows_key, "params": list(bench.cases[0].params), "columns": list(bench.columns),
                   "pairs": [list(p) for p in bench.pairs], "plot": asdict(bench.plot),
                   "short": {name: m.short or m.label for name, m in methods.items()}},
    }
    if bench.rows_key is None:
        (row,) = rows
        result.update(row)
    else:
        result[bench.rows_key] = rows
        main = [row for case, row in zip(bench.cases, rows) if case.main]
        if main:
            result["main"] = main[0]
    result["targets"] = [t for case, row in zip(bench.cases, rows) for target in case.targets
                         if (t := target.check(row)) is not None]
    if bench.reference is not None:
        result["answers_identical"] = True
    return {**result, **(bench.summary(result) if bench.summary else {})}


def runs(declare: Callable[..., Benchmark]) -> Callable[..., dict]:
    """`run(declare(decoder, **settings))`: the function that measures a declared benchmark and
    returns its JSON-ready result (settings: `declare`'s; threads and progress: `run`'s)."""
    @functools.wraps(declare)
    def measure(decoder, *, threads: int | None = None, progress: Progress | None = None, **settings) -> dict:
        return run(declare(decoder, **settings), threads=threads, progress=progress)
    return measure


def _measure_case(bench: Benchmark, case: Case, done_parts: dict, say: Progress) -> dict:
    live = [m for m in case.methods if m.skip is None]
    got: dict[str, Measurement] = {}
    for m in live:
        if m.parts:
            got[m.name] = combine_sequential(m.name, [_part(bench, m, p, done_parts, say) for p in m.parts])
        elif m.solo:
            got |= measure_together({m.name: m.run}, _model(bench, m), repeats=bench.repeats,
                                    budget_s=case.budget_s / 2)
    together = {m.name: m.run for m in live if not m.parts and not m.solo}
    if together:
        models = {m.name: _model(bench, m) for m in live if m.name in together}
        got |= measure_together(together, models, repeats=bench.repeats, budget_s=case.budget_s)
    got = {m.name: got[m.name] for m in live}
    where = ", ".join(f"{k}={v}" for k, v in case.params.items())
    for m in live:
        median = f" (median of {len(got[m.name].runs_s)})" if not m.parts and len(got[m.name].runs_s) > 1 else ""
        say(f"{where} {m.short or m.label}: {got[m.name].wall_s:.2f} s{median}, {got[m.name].forward_passes} forwards")
    if bench.reference in got:
        check_identical({name: m.answers for name, m in got.items()}, reference=bench.reference)
    row = {**case.params, "methods": {name: m.as_dict() for name, m in got.items()},
           "answer_tokens": [len(a) for a in got[bench.reference if bench.reference in got else live[0].name].answers]}
    for fast, slow in bench.pairs:
        if fast in got and slow in got:
            row.setdefault(f"{fast}_vs", {})[slow] = ratios(got[fast], got[slow])
    skipped = {m.name: m.skip for m in case.methods if m.skip is not None}
    if skipped:
        row["skipped"] = skipped
    if case.report is not None:
        row.update(case.report(got))
    return row


def _model(bench: Benchmark, method: Method):
    """The model whose forwards `method`'s counter sees (None: none)."""
    if method.model is None:
        return bench.model
    return None if method.model is OUTSIDE_TORCH else method.model


def _part(bench: Benchmark, method: Method, part: Part, done: dict, say: Progress) -> Measurement:
    key = (method.name, part.key)
    if key not in done:
        done[key] = measure_together({method.name: part.run}, _model(bench, method), repeats=1)[method.name]
        say(f"{method.short or method.label}, item {part.key}: {done[key].wall_s:.2f} s")
    return done[key]


def ratios(fast: Measurement, slow: Measurement) -> dict:
    """fast's gain over slow: the speed-up (slow's wall time / fast's), and fast's forward passes,
    tokens/s and KV bytes relative to slow's (None where a side has none)."""
    def over(a: float, b: float) -> float | None:
        return a / b if a and b else None

    return {"speedup": slow.wall_s / fast.wall_s,
            "forward_passes_ratio": over(fast.forward_passes, slow.forward_passes),
            "tokens_per_s_ratio": over(fast.tokens_per_s, slow.tokens_per_s),
            "kv_bytes_ratio": over(fast.peak_kv_bytes, slow.peak_kv_bytes)}


def declared_only(names: Sequence[str], known: Sequence[str], what: str) -> None:
    """Refuse names outside `known` with a clear error (a typo in a method or workload list)."""
    unknown = [n for n in names if n not in known]
    if unknown:
        raise InvalidArgument(f"unknown {what}: {', '.join(unknown)}", f"use {', '.join(known)}")


def positive_counts(what: str, counts: Sequence[int], hint: str) -> None:
    """Refuse a sweep with a count that is not a positive integer."""
    if any(not is_int(k) or k < 1 for k in counts):
        raise InvalidArgument(f"every {what} must be a positive integer, got {list(counts)}", hint)
