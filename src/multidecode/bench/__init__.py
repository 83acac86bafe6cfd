"""Benchmarks of MultiDecode against the transformers alternatives, measured side by side.

Each benchmark module declares its cases and methods as a `harness.Benchmark` (`serve` and
`unrelated` measure on their own); every result is written by `results.write_results` as JSON,
a PNG plot and a markdown table. The timing, forward-counting and KV-measuring helpers and the
transformers baselines live in `common`. Importing the package registers every benchmark's view
(`results.VIEWS`), so that any result can be read back from its JSON alone.
"""

from __future__ import annotations

from . import serve, unrelated
from .ask import METHODS, run_ask_benchmark
from .batch import run_batch_benchmark, run_merged_benchmark
from .beam import run_beam_benchmark
from .common import AnswersDiffer
from .margins import run_margins_benchmark
from .results import markdown, tables, write_results
from .sample import run_sample_benchmark
from .speculate import run_speculate_benchmark

__all__ = ["METHODS", "AnswersDiffer", "markdown", "run_ask_benchmark", "run_batch_benchmark", "run_beam_benchmark",
           "run_margins_benchmark", "run_merged_benchmark", "run_sample_benchmark", "run_speculate_benchmark",
           "serve", "tables", "unrelated", "write_results"]
