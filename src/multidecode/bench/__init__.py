"""Benchmarks of MultiDecode against the transformers alternatives, measured side by side.

Each benchmark module declares its cases and methods as a `harness.Benchmark`; `harness.run`
measures it and returns a JSON-ready dict, and `write_results(result, out_dir)` writes it as
JSON, a PNG plot and a markdown table. The timing, forward-counting and KV-measuring helpers
and the transformers baselines live in `common`.
"""

from __future__ import annotations

from .ask import METHODS, run_ask_benchmark
from .batch import run_batch_benchmark, run_merged_benchmark
from .beam import run_beam_benchmark
from .common import AnswersDiffer
from .harness import write_results
from .margins import run_margins_benchmark
from .sample import run_sample_benchmark
from .speculate import run_speculate_benchmark

__all__ = ["METHODS", "AnswersDiffer", "run_ask_benchmark", "run_batch_benchmark", "run_beam_benchmark",
           "run_margins_benchmark", "run_merged_benchmark", "run_sample_benchmark", "run_speculate_benchmark", "write_results"]
