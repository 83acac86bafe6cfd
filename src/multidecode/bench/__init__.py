"""Benchmarks of MultiDecode against the alternatives, measured side by side (docs/benchmarks.md).
Importing the package registers the charts of those that draw their own (`results.CHARTS`)."""

from __future__ import annotations

from . import precision, serve, unrelated
from .ask import METHODS, run_ask_benchmark
from .batch import run_batch_benchmark, run_merged_benchmark
from .beam import run_beam_benchmark
from .common import AnswersDiffer
from .margins import run_margins_benchmark
from .results import markdown, tables, write_results
from .sample import run_sample_benchmark
from .speculate import run_speculate_benchmark

__all__ = ["METHODS", "AnswersDiffer", "markdown", "precision", "run_ask_benchmark", "run_batch_benchmark",
           "run_beam_benchmark", "run_margins_benchmark", "run_merged_benchmark", "run_sample_benchmark",
           "run_speculate_benchmark", "serve", "tables", "unrelated", "write_results"]
