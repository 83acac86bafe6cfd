"""What the forest runtime works on: jobs, their usage, the admission limits, the counters.

A **job** is one piece of work as the engine thread sees it (a server's request, a batch job's
line): whole prompt ids per branch (n copies of one prompt, or one prompt per question), how to
sample each, when to stop, and a **sink** that receives what it produces. Sinks are called from
the engine thread with ("token", TokenEvent), ("trace", dict), ("beams", [Beam]), ("done",
Usage) or ("error", exception); the last two end a job.

**Admission** (`admission.Admission`, the one rule every driver goes through) is counted when a
job is submitted: it holds a `Reservation` (its cache tokens, its branches, and the bytes those
need: `multidecode.memory`) until it ends, within the `Limits`. A job that does not fit now gets
`Overloaded` (or waits, if its driver asks to), never an out-of-memory error later; a job that
could never fit gets `TooLarge`. Both carry the numbers and speak of "the job" and "the runtime":
a driver words them in its own terms (a server of its request and its max_tokens, a batch job of
its line). The defaults of `Limits` are the ones `multidecode serve` starts with.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..errors import InvalidArgument, InvalidInput, MultiDecodeError, check_positive
from ..memory import gigabytes
from ..prompts import common_prefix_length
from ..sampling_params import SamplingParams


@dataclass(frozen=True)
class Reservation:
    """What a job holds from its submission to its end (or a limit on what jobs hold together):
    cache tokens, branches, and bytes."""

    tokens: int
    branches: int
    bytes: int

    def __add__(self, other: Reservation) -> Reservation:
        return Reservation(self.tokens + other.tokens, self.branches + other.branches, self.bytes + other.bytes)

    def __sub__(self, other: Reservation) -> Reservation:
        return Reservation(self.tokens - other.tokens, self.branches - other.branches, self.bytes - other.bytes)

    def exceeds(self, limit: Reservation) -> bool:
        return self.tokens > limit.tokens or self.branches > limit.branches or self.bytes > limit.bytes

    def describe(self) -> str:
        return f"{self.tokens} cache tokens, {self.branches} branches and {gigabytes(self.bytes)}"


NOTHING = Reservation(0, 0, 0)


class Overloaded(MultiDecodeError):
    """No room now: the jobs in flight hold what the limits allow (`held`), or the runtime is
    shutting down (`draining`); retry later (a server answers 503 with Retry-After)."""

    def __init__(self, message: str, hint: str | None = None, *, retry_after: int = 1,
                 held: Reservation | None = None, draining: bool = False) -> None:
        super().__init__(message, hint)
        self.retry_after, self.held, self.draining = retry_after, held, draining

    @classmethod
    def at_capacity(cls, held: Reservation, holder: str = "the runtime") -> Overloaded:
        return cls(f"{holder} is at capacity ({held.describe()} reserved)", "retry in a moment", held=held)

    @classmethod
    def shutting_down(cls, holder: str = "the runtime", hint: str = "retry elsewhere") -> Overloaded:
        return cls(f"{holder} is shutting down", hint, retry_after=5, draining=True)


class TooLarge(MultiDecodeError, ValueError):
    """A job that could never fit under the admission limits: it needs `need`, the limits are
    `limit`. The message names "the job" and "the runtime" unless a driver words it as its own
    (`reworded`): its subject (the request, the line) and its own knobs in the hint."""

    def __init__(self, need: Reservation, limit: Reservation, hint: str | None = None, *,
                 subject: str = "the job", holder: str = "the runtime") -> None:
        self.need, self.limit = need, limit
        if self.over_bytes:
            message = (f"{subject} needs about {gigabytes(need.bytes)} ({need.bytes:,} bytes), over the "
                       f"{gigabytes(limit.bytes)} {holder} may use")
        else:  # only the limits it is over
            over = [f"{need.tokens} cache tokens, over {holder}'s limit of {limit.tokens}"] * (need.tokens > limit.tokens)
            over += [f"{need.branches} branches, over {holder}'s limit of {limit.branches}"] * (
                need.branches > limit.branches)
            message = f"{subject} needs " + " and ".join(over)
        super().__init__(message, hint or "give it fewer branches or fewer new tokens")

    @property
    def over_bytes(self) -> bool:
        """Whether it needs more memory than the runtime may use (else more tokens or branches than its limits)."""
        return self.need.bytes > self.limit.bytes

    def reworded(self, hint: str, *, subject: str, holder: str) -> TooLarge:
        """The same facts in a driver's words: subject ("the request"), holder ("this server")."""
        return TooLarge(self.need, self.limit, hint, subject=subject, holder=holder)


@dataclass
class Usage:
    """What a finished job cost: its prompt tokens (each prompt it was given, not each copy:
    `Job.prompt_tokens`), how many of them were already cached, and the tokens it generated;
    stats: its decoding counters."""

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    stats: dict = field(default_factory=dict)


@dataclass(eq=False)
class Job:
    """One request's work (see the module notes). beams > 0 runs a beam search of that many beams
    over prompts[0] and returns them all; trace sends the forest nodes the job feeds each step;
    constraint holds every branch (or, a list, each) to a `constraints.Constraint`; copies: the
    branches each prompt was given (a request's n: prompts holds each prompt that many times
    in a row), which its prompt tokens count once."""

    prompts: list[list[int]]
    max_new_tokens: int
    sampling: list[SamplingParams] = field(default_factory=list)
    stop: Sequence[str] = ()
    speculate: object = None
    logprobs: int | None = None
    beams: int = 0
    trace: bool = False
    constraint: object = None
    copies: int = 1
    sink: Callable[[tuple], None] = lambda item: None
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    cached_tokens: int = 0
    cancelled: bool = False
    finished: bool = False
    work: object = None  # the scheduler work, once admitted
    steps: int = 0
    prefilled: bool = False  # its prompts all fed and indexed (a long one takes several steps)
    reservation: Reservation = NOTHING  # what it holds, from its submission to its end

    def __post_init__(self) -> None:
        """Refuse a job no request could make (no prompt; settings for other branches), before it
        is queued: an empty job failed deep in the forest. No sampling is greedy for every branch."""
        if not self.prompts or not all(len(p) for p in self.prompts):
            raise InvalidInput("a job needs at least one prompt, each of at least one token",
                               "pass prompts as a list of token-id lists")
        check_positive("max_new_tokens", self.max_new_tokens)
        if not self.sampling:
            self.sampling = [SamplingParams()] * len(self.prompts)
        elif len(self.sampling) != len(self.prompts):
            raise InvalidArgument(f"a job of {len(self.prompts)} prompts has {len(self.sampling)} sampling settings",
                                  "give one SamplingParams per prompt, or none for greedy decoding")

    @property
    def branches(self) -> int:
        return self.beams or len(self.prompts)

    @property
    def reserved_tokens(self) -> int:
        """The cache tokens it will hold, as the forest stores them: its prompts' common prefix
        once, the rest of each prompt, and max_new_tokens per branch."""
        shared = common_prefix_length(self.prompts)
        return shared + sum(len(p) - shared for p in self.prompts) + self.branches * self.max_new_tokens

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens received: each prompt's, as OpenAI bills them (two equal prompts of one
        request count twice), but not each copy of one (n choices of a prompt count it once).
        The forest computes a prompt shared by several branches once all the same; what the prefix
        cache held already is `cached_tokens`, never more than this."""
        return sum(map(len, self.prompts[::self.copies]))


@dataclass
class Limits:
    """Admission caps and the prefix cache's budget, in cache slots (tokens) and branches.

    oversized_runs_alone: a job over max_live_tokens or max_branches waits until nothing else is
    reserved and then runs alone, instead of being refused as `TooLarge` (the batch job's forest
    budget, which a large line may exceed); its bytes must fit all the same.

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
    prefill_chunk: the most prompt tokens a step feeds while other jobs decode: a longer prompt is
    fed in pieces between their steps, so that they keep their pace (0: every prompt whole in
    one step, the others waiting for it). prefill_stretch: the budget adapts to what steps cost
    here, so that a step carrying prompt tokens takes about this many times one that carries
    none, more where more jobs wait for their first token than for their next (0: always
    `prefill_chunk`). See `pacing`.
    """

    max_live_tokens: int = 32768
    max_branches: int = 256
    prefix_cache_tokens: int = 8192
    defer_tokens: int = 16
    max_running: int | None = None
    max_live_bytes: int | None = None
    oversized_runs_alone: bool = False
    gather: int = 1
    gather_s: float = 0.0
    prefill_chunk: int = 512
    prefill_stretch: float = 1.5


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


__all__ = ["NOTHING", "Counters", "Job", "Limits", "Overloaded", "Reservation", "TooLarge", "Usage"]
