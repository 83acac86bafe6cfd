"""What the forest runtime works on: jobs, their usage, the admission limits, the counters.

A **job** is one piece of work as the engine thread sees it (a server's request, a batch job's
line): whole prompt ids per branch (n copies of one prompt, or one prompt per question), how to
sample each, when to stop, and a **sink** that receives what it produces. Sinks are called from
the engine thread with ("token", TokenEvent), ("trace", dict), ("beams", [Beam]), ("done",
Usage) or ("error", exception); the last two end a job.

**Admission limits** (`Limits`) are counted when a job is submitted: it reserves its prompt
tokens plus its branches' max_new_tokens, its branches, and the bytes those need
(`multidecode.memory`: KV cache, visibility rows, logits). Past any cap `submit` raises
`Overloaded` (a server answers 503 with Retry-After), never an out-of-memory error later; a job
that would not fit even alone raises `TooLarge`. The defaults here are the ones `multidecode
serve` starts with.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..errors import MultiDecodeError
from ..sampling import SamplingParams


class Overloaded(MultiDecodeError):
    """The server is at its admission cap (or draining); retry later."""

    def __init__(self, message: str, hint: str | None = None, *, retry_after: int = 1) -> None:
        super().__init__(message, hint)
        self.retry_after = retry_after


class TooLarge(MultiDecodeError, ValueError):
    """A request that could never fit under the admission cap."""


@dataclass
class Usage:
    """What a finished job cost: its prompt tokens (each distinct prompt once), how many of them
    were already cached, and the tokens it generated; stats: its decoding counters."""

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    stats: dict = field(default_factory=dict)


@dataclass(eq=False)
class Job:
    """One request's work (see the module notes). beams > 0 runs a beam search of that many beams
    over prompts[0] and returns them all; trace sends the forest nodes the job feeds each step."""

    prompts: list[list[int]]
    max_new_tokens: int
    sampling: list[SamplingParams] = field(default_factory=list)
    stop: Sequence[str] = ()
    speculate: object = None
    logprobs: int | None = None
    beams: int = 0
    trace: bool = False
    sink: Callable[[tuple], None] = lambda item: None
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    cached_tokens: int = 0
    cancelled: bool = False
    finished: bool = False
    work: object = None  # the scheduler work, once admitted
    steps: int = 0

    @property
    def branches(self) -> int:
        return self.beams or len(self.prompts)

    @property
    def reserved_tokens(self) -> int:
        return sum(map(len, self.prompts)) + self.branches * self.max_new_tokens

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens received, each distinct prompt once (n copies of one prompt count once)."""
        return sum(map(len, {tuple(p) for p in self.prompts}))


@dataclass
class Limits:
    """Admission caps and the prefix cache's budget, in cache slots (tokens) and branches.

    defer_tokens: a waiting job that shares this many uncached prefix tokens with one admitted in
    the same round waits a step to hit the cache instead of computing them again.
    max_running: at most this many jobs decode at once; the rest wait their turn (1 serves one
    request at a time: the baseline a forest is measured against).
    max_live_bytes: the bytes admitted jobs may need together (None: what `memory.budget_bytes`
    gives when the runtime starts, the available memory less a margin).
    gather, gather_s: an idle engine (nothing running, nothing deferred) that gets a job waits
    until `gather` jobs wait, at most `gather_s` seconds, before it admits them: jobs sent
    together then decode together from their first step, however their requests were delayed on
    the way in (the serve benchmark's `--gather-s`; 1 or 0 s: no waiting).
    """

    max_live_tokens: int = 32768
    max_branches: int = 256
    prefix_cache_tokens: int = 8192
    defer_tokens: int = 16
    max_running: int | None = None
    max_live_bytes: int | None = None
    gather: int = 1
    gather_s: float = 0.0


@dataclass
class Counters:
    """Running totals the metrics endpoint and the benchmark read (written by the engine thread)."""

    admitted: int = 0
    rejected: int = 0
    cancelled: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated: int = 0
    steps: int = 0
    forwards: int = 0
    rows: int = 0
    branches: int = 0
    busy_seconds: float = 0.0

    def count_step(self, forwards: int, rows: int, branches: int, seconds: float) -> None:
        self.steps += 1
        self.forwards += forwards
        self.rows += rows
        self.branches += branches
        self.busy_seconds += seconds


__all__ = ["Counters", "Job", "Limits", "Overloaded", "TooLarge", "Usage"]
