"""The one benchmark harness: a benchmark declared as data (cases, methods, pairs, targets) and `run`,
which measures it and returns its JSON-ready result (docs/benchmarks.md, "How the benchmarks measure")."""

from __future__ import annotations

import contextlib
import functools
import random
import time
from collections.abc import Callable, Hashable
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field

from ..models.reading import quiet_transformers
from .common import (
    ForwardCounter,
    Measurement,
    RunOutput,
    Say,
    check_identical,
    combine_sequential,
    measure_together,
    ratio,
    torch_threads,
)
from .results import Table, environment, load_average, lookup

Runner = Callable[[ForwardCounter], RunOutput]
OUTSIDE_TORCH = "outside torch"
"""`Method.model` of a method no torch model runs (llama.cpp, a server): it reports its own forwards and times."""


class Unavailable(Exception):
    """Raised by a case's `context` where its methods cannot run after all: they are skipped, saying why."""


@dataclass(frozen=True)
class Part:
    """One item of a method run item by item; `key` names it across cases (measured once)."""

    key: Hashable
    run: Runner


@dataclass(frozen=True)
class Method:
    """One way to do a case's work: `run`, or `parts` one after another; `skip`: why it cannot run here."""

    name: str
    label: str
    run: Runner | None = None
    parts: tuple[Part, ...] = ()
    short: str = ""  # for plots and column headers; default: the label
    solo: bool = False  # a costly method: rounds of its own
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
    binding: bool = True  # False: reported for comparison, set for another case

    def check(self, row: dict) -> dict | None:
        """The target as reported, or None where the row lacks the figure (a skipped method)."""
        got = lookup(row, self.path)
        if got is None:
            return None
        met = {">=": got >= self.value, ">": got > self.value, "<=": got <= self.value}[self.op]
        reported = {"name": self.name, "target": f"{self.op} {self.value:g}{self.unit}", "measured": round(got, 4),
                    "met": bool(met), "path": list(self.path), "value": self.value}
        return reported if self.binding else {**reported, "binding": False}


@dataclass(frozen=True)
class Case:
    """One workload or sweep point; `report(measurements)` adds its own figures to its row; `context()`
    is entered around its measurement and report."""

    params: dict
    methods: tuple[Method, ...]
    budget_s: float | None = 30.0  # None: exactly `repeats` rounds
    main: bool = False
    targets: tuple[Target, ...] = ()
    report: Callable[[dict[str, Measurement]], dict] | None = None
    context: Callable[[], AbstractContextManager] | None = None


@dataclass(frozen=True)
class Plot:
    """`sweep`: figures against the case parameter `x`; `bars`: a group of bars per case."""

    kind: str = "bars"
    figures: tuple[str, ...] = ("wall_s", "forward_passes", "peak_kv_bytes")
    x: str | None = None
    xlabel: str = ""


@dataclass(frozen=True)
class Benchmark:
    """A benchmark as data: `columns` are its tables' figures (none: only its `tables`), `rows_key` names
    its rows (None: one case, at the top level); `machine`: what ran where no model is loaded here."""

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
    summary: Callable[[dict], dict] | None = None  # figures over every row (it may add to rows), before targets
    tables: tuple[Table, ...] = ()
    machine: dict | None = None
    shuffle: int | None = None


def run(bench: Benchmark, *, threads: int | None = None, progress: Say | None = None) -> dict:
    """Warm up, measure every case, check identical answers (`AnswersDiffer`), return the JSON-ready result."""
    say = progress or (lambda message: None)
    started = time.perf_counter()
    with torch_threads(threads), quiet_transformers(loading=False):
        meta = environment(bench.model, launched=bench.machine)
        if bench.warmup:
            say("warming up")
            measure_together({m.name: m.run for m in bench.warmup}, {m.name: _model(bench, m) for m in bench.warmup},
                             repeats=1)
        done_parts: dict = {}
        order = None if bench.shuffle is None else random.Random(bench.shuffle)
        rows = [_measure_case(bench, case, done_parts, order, say) for case in bench.cases]
    methods = {m.name: m for case in bench.cases for m in case.methods}
    config = {**bench.config, "reference": bench.reference, "repeats": bench.repeats,
              "budgets_s": [case.budget_s for case in bench.cases]}
    meta |= {"load_average_at_end": load_average(), "elapsed_s": round(time.perf_counter() - started, 2)}
    layout = {"rows": bench.rows_key, "params": list(bench.cases[0].params), "columns": list(bench.columns),
              "pairs": [list(p) for p in bench.pairs], "plot": asdict(bench.plot),
              "short": {n: m.short or m.label for n, m in methods.items()},
              **({"tables": [asdict(t) for t in bench.tables]} if bench.tables else {})}
    result = {"benchmark": bench.name, "title": bench.title, "metadata": meta, "config": config,
              "labels": {name: m.label for name, m in methods.items()}, "layout": layout}
    if bench.rows_key is None:
        (row,) = rows
        result.update(row)
    else:
        result[bench.rows_key] = rows
        main = [row for case, row in zip(bench.cases, rows) if case.main]
        if main:
            result["main"] = main[0]
    result |= bench.summary(result) if bench.summary else {}
    result["targets"] = [t for case, row in zip(bench.cases, rows) for target in case.targets
                         if (t := target.check(row)) is not None]
    if bench.reference is not None:
        result["answers_identical"] = True
    return result


def runs(declare: Callable[..., Benchmark]) -> Callable[..., dict]:
    """`run(declare(decoder, **settings))`: a declared benchmark's measuring function."""
    @functools.wraps(declare)
    def measure(decoder, *, threads: int | None = None, progress: Say | None = None, **settings) -> dict:
        return run(declare(decoder, **settings), threads=threads, progress=progress)
    return measure


def _measure_case(bench: Benchmark, case: Case, done_parts: dict, order, say: Say) -> dict:
    """The case's row: its methods measured (inside its context) and compared, and its report."""
    skipped = {m.name: m.skip for m in case.methods if m.skip is not None}
    live = [m for m in case.methods if m.skip is None]
    try:
        with case.context() if case.context else contextlib.nullcontext():
            got = _measurements(bench, case, live, done_parts, order, say)
            _say(case, got, say)
            row = {**case.params, **_compared(bench, got)}
            row.update(case.report(got) if case.report else {})
    except Unavailable as why:
        row = {**case.params, "methods": {}}
        skipped |= {m.name: str(why) for m in live}
    return row | ({"skipped": skipped} if skipped else {})


def _measurements(bench: Benchmark, case: Case, live: list[Method], done_parts: dict, order, say: Say) -> dict:
    """Every live method measured: parts once each, solo methods in rounds of their own, the rest interleaved."""
    got: dict[str, Measurement] = {}
    for m in live:
        if m.parts:
            got[m.name] = combine_sequential(m.name, [_part(bench, m, p, done_parts, say) for p in m.parts])
        elif m.solo:
            got |= measure_together({m.name: m.run}, _model(bench, m), repeats=bench.repeats,
                                    budget_s=case.budget_s and case.budget_s / 2)
    together = {m.name: m.run for m in live if not m.parts and not m.solo}
    if together:
        models = {m.name: _model(bench, m) for m in live if m.name in together}
        got |= measure_together(together, models, repeats=bench.repeats, budget_s=case.budget_s, order=order)
    return {m.name: got[m.name] for m in live}


def _say(case: Case, got: dict[str, Measurement], say: Say) -> None:
    where = ", ".join(f"{k}={v}" for k, v in case.params.items())
    for m in case.methods:
        if m.name in got:
            runs_s = got[m.name].runs_s
            median = f" (median of {len(runs_s)})" if not m.parts and len(runs_s) > 1 else ""
            say(f"{where} {m.short or m.label}: {got[m.name].wall_s:.2f} s{median}, "
                f"{got[m.name].forward_passes} forwards")


def _compared(bench: Benchmark, got: dict[str, Measurement]) -> dict:
    """The case's measurements, checked against the reference's answers, and the pairs' ratios."""
    if bench.reference in got:
        check_identical({name: m.answers for name, m in got.items()}, reference=bench.reference)
    row: dict = {"methods": {name: m.as_dict() for name, m in got.items()}}
    answers = got[bench.reference if bench.reference in got else next(iter(got))].answers if got else []
    if answers:
        row["answer_tokens"] = [len(a) for a in answers]
    for fast, slow in bench.pairs:
        if fast in got and slow in got:
            row.setdefault(f"{fast}_vs", {})[slow] = ratios(got[fast], got[slow])
    return row


def _model(bench: Benchmark, method: Method):
    """The model whose forwards `method`'s counter sees (None: none)."""
    if method.model is None:
        return bench.model
    return None if method.model is OUTSIDE_TORCH else method.model


def _part(bench: Benchmark, method: Method, part: Part, done: dict, say: Say) -> Measurement:
    key = (method.name, part.key)
    if key not in done:
        done[key] = measure_together({method.name: part.run}, _model(bench, method), repeats=1)[method.name]
        say(f"{method.short or method.label}, item {part.key}: {done[key].wall_s:.2f} s")
    return done[key]


def ratios(fast: Measurement, slow: Measurement) -> dict:
    """fast's gain over slow: the speed-up (slow's wall time / fast's), and its other figures relative to slow's."""
    return {"speedup": slow.wall_s / fast.wall_s,
            "forward_passes_ratio": ratio(fast.forward_passes, slow.forward_passes),
            "tokens_per_s_ratio": ratio(fast.tokens_per_s, slow.tokens_per_s),
            "kv_bytes_ratio": ratio(fast.peak_kv_bytes, slow.peak_kv_bytes)}

