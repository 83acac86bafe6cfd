"""The forest runtime: long-lived forests that work joins and leaves between steps.

Both `multidecode serve` (HTTP requests) and the batch job (documents) drive it:

- `jobs`: a `Job` (prompts, sampling, stop rules, a sink for what it produces), its `Usage`, the
  admission `Limits` (one set of defaults) and the `Counters` the metrics read;
- `radix`: the `PrefixIndex`, which prompt prefixes are cached in the forest and at which node;
- `forest_runtime`: `ForestRuntime`, the engine thread: one scheduler, jobs admitted between
  steps (continuous batching), prefix hits, admission caps, cancellation, draining.
"""

from .forest_runtime import CACHE_OWNER, ForestRuntime
from .jobs import Counters, Job, Limits, Overloaded, TooLarge, Usage
from .radix import PrefixIndex

__all__ = ["CACHE_OWNER", "Counters", "ForestRuntime", "Job", "Limits", "Overloaded", "PrefixIndex", "TooLarge", "Usage"]
