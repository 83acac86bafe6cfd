"""Benchmarks of MultiDecode against the transformers alternatives, measured side by side.

`run_ask_benchmark(decoder, ...)` measures many questions about one document and returns a
JSON-ready dict; `write_results(result, out_dir)` writes it as JSON and a PNG plot. The timing,
forward-counting, KV-measuring helpers and the transformers baselines live in `common`.
"""

from __future__ import annotations

import json
from pathlib import Path

from .ask import METHODS, run_ask_benchmark
from .beam import run_beam_benchmark
from .common import AnswersDiffer
from .margins import run_margins_benchmark
from .sample import run_sample_benchmark

PLOTS = {
    "ask": ("multidecode.bench.plot", "plot_ask"),
    "sample": ("multidecode.bench.sample", "plot_sample"),
    "beam": ("multidecode.bench.beam", "plot_beam"),
    "margins": ("multidecode.bench.margins", "plot_margins"),
}
"""Benchmark name -> (module, function) drawing its PNG."""


def write_results(result: dict, out_dir: str | Path, *, stem: str | None = None) -> list[Path]:
    """Write `result` as `<stem>.json` and, where the benchmark has a plot, `<stem>.png` in
    `out_dir` (created); returns the paths. stem defaults to `bench_<benchmark name>`."""
    import importlib

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = result.get("benchmark", "results")
    stem = stem or f"bench_{name}"
    json_path = out / f"{stem}.json"
    json_path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    paths = [json_path]
    if name in PLOTS:
        module, function = PLOTS[name]
        paths.append(getattr(importlib.import_module(module), function)(result, out / f"{stem}.png"))
    return paths


__all__ = ["METHODS", "AnswersDiffer", "run_ask_benchmark", "run_beam_benchmark", "run_margins_benchmark", "run_sample_benchmark", "write_results"]
