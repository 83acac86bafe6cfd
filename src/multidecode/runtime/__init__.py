"""The forest runtime: long-lived forests that work joins and leaves between steps.

Both `multidecode serve` (HTTP requests) and the batch job (documents) drive it:

- `jobs`: a `Job` (prompts, sampling, stop rules, a sink for what it produces), its `Usage`, the
  `Reservation` it holds, the admission `Limits` (one set of defaults), the refusals `TooLarge`
  and `Overloaded` (numbers a driver words its own way) and the `Counters` the metrics read;
- `admission`: `Admission`, the one rule by which the server's requests and the batch job's
  lines start (tokens, branches and bytes held together, within the limits);
- `radix`: the `PrefixIndex`, which prompt prefixes are cached in the forest and at which node;
- `pacing`: the `PrefillPacer`, how many prompt tokens a step may feed beside the streams
  decoding, from the step times measured (a long prompt is read in pieces);
- `forest_runtime`: `ForestRuntime`, the engine thread: one scheduler, jobs admitted between
  steps (continuous batching), prefix hits, prompts paced, jobs refused or waiting for room,
  cancellation, draining.
"""

from .admission import Admission
from .forest_runtime import CACHE_OWNER, ForestRuntime
from .jobs import Counters, Job, Limits, Overloaded, Reservation, TooLarge, Usage
from .radix import PrefixIndex

__all__ = ["CACHE_OWNER", "Admission", "Counters", "ForestRuntime", "Job", "Limits", "Overloaded", "PrefixIndex",
           "Reservation", "TooLarge", "Usage"]
