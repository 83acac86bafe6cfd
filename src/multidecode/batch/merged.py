"""Merged forests: several documents' questions decoded in the same forwards.

A batch job's lines are independent, so nothing forces one document at a time. `ForestAnswerer`
hands each line (its question prompts, one branch per question) to a `ForestRuntime` engine
thread: one scheduler, one KV cache, jobs admitted and retired between steps. `answer_merged`
keeps that forest full: it submits the next line as soon as the runtime admits it, and yields
each line's `LineOutcome` as the line finishes, which may be out of input order.

Terms: a line is *in flight* from its submission until its outcome. Whether it may start is the
runtime's admission, the same as a server's request (`multidecode.runtime.admission`): a line
*reserves* cache tokens (its document once, each question's own tokens, and questions x
max_new_tokens), its questions as branches, and the bytes they need. The *forest budget* is the
runtime's limits: `forest_tokens` reserved and `forest_branches` questions in flight, and the
bytes the machine has; a line that alone needs more tokens or questions than the budget still
runs, alone, and a line that needs more bytes than the machine has fails (`TooLarge`).

Exactness: a branch attends only to its ancestors (its own document and question) at the
positions it would have alone, and its sampler is seeded per question (seed + i), so a line's
answers equal `MultiDecoder.ask` on that line alone, whatever shares its forwards (`tests/
test_batch_merged.py` checks it token for token). The runtime's prefix cache also lets documents
share the chat template's opening tokens, computed once.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Self

from ..errors import PromptTooLong
from ..runtime import ForestRuntime, Job, Limits, TooLarge
from ..sampling_params import check_vocabulary, per_branch_sampling
from ..strategies.ask import Answer, answers_of, question_prompts
from .lines import InputLine

FOREST_TOKENS = 8192
"""Default forest budget, in cache tokens: about 4 documents of 1,000 tokens with 8 answers of 48."""
FOREST_BRANCHES = 32
"""Default cap on the questions in flight: past a few dozen rows a CPU step costs about its
rows, and a stopped job waits for every line in flight."""
CACHE_TOKENS = 512
"""Prompt tokens the merged forest keeps for later lines (the shared opening of the chat
template); documents differ, so a larger cache would only add attention to every step."""
PREFILL_CHUNK = 0
"""By default a line's document is fed whole, the lines decoding waiting for it: nobody watches a
batch line's tokens arrive, and reading a document in pieces (`Limits.prefill_chunk`) only adds
steps. A positive value paces it as a server does."""


@dataclass(frozen=True)
class LineOutcome:
    """How a batch line ended, before it is recorded: its answers, or the error that stopped it
    (`BatchJob.record` turns it into the line's record). elapsed_s runs from its submission to its
    end (in a merged forest that includes the steps it shared). forest_forwards: the forest that
    answered it (a name of its own) and the forward passes that forest had made when the line ended,
    so a job's forwards are the last count of each forest, however many lines shared them."""

    item: InputLine
    answers: tuple[Answer, ...] = ()
    error: BaseException | None = None
    elapsed_s: float = 0.0
    forest_forwards: tuple[str, int] | None = None


@dataclass
class Ticket:
    """A line ready to submit: its job (one branch per question) and its question prompts."""

    item: InputLine
    job: Job
    prompts: list[list[int]]


class ForestAnswerer:
    """Answers batch lines in one forest on a background engine thread (see the module notes).

    decoder: a `MultiDecoder`; settings: the job's `BatchSettings`; speculate: as for
    `MultiDecoder.ask` (bound per line, so "draft" gets a fresh proposer each time).
    forest_tokens, forest_branches: the forest budget (forest_tokens=0 runs one line at a time);
    cache_tokens: the prompt tokens kept cached for later lines; prefill_chunk: the most document
    tokens a step feeds while other lines decode (0: whole, see `PREFILL_CHUNK`).
    """

    def __init__(self, decoder, settings, *, speculate=None, forest_tokens: int = FOREST_TOKENS,
                 forest_branches: int = FOREST_BRANCHES, cache_tokens: int = CACHE_TOKENS,
                 prefill_chunk: int = PREFILL_CHUNK) -> None:
        settings.check_model(decoder.model)
        self.decoder = decoder
        self.settings = settings
        self.speculate = speculate
        limits = Limits(max_live_tokens=forest_tokens, max_branches=forest_branches, prefix_cache_tokens=cache_tokens,
                        oversized_runs_alone=True, prefill_chunk=prefill_chunk)
        self.runtime = ForestRuntime(decoder.model, decoder.tokenizer, limits=limits, compaction=decoder.compaction,
                                     cost=decoder.cost).start()
        self.name = uuid.uuid4().hex  # tells its forest from a Ray worker's, or another run's

    def forward_count(self) -> tuple[str, int]:
        """This answerer's name and its forest's forward passes so far (`LineOutcome.forest_forwards`)."""
        return self.name, self.runtime.engine.stats.forward_passes

    def prepare(self, item: InputLine) -> Ticket | LineOutcome:
        """Tokenize a line's prompts; a line that cannot run comes back as its failed `LineOutcome`."""
        if item.error is not None:
            return LineOutcome(item, error=item.error)
        settings = self.settings
        try:
            prompts = question_prompts(self.decoder.tokenizer, item.document, item.questions,
                                       instruction=settings.instruction)
            sampling = per_branch_sampling(len(prompts), {**settings.sampling, **item.sampling})
            check_vocabulary(sampling, self.decoder.model.get_input_embeddings().num_embeddings, whose="question {}",
                             first=1)  # as the line numbers its questions, not as the runtime its branches
        except Exception as error:  # noqa: BLE001 - recorded as the line's failure
            return LineOutcome(item, error=error)
        job = Job(prompts=prompts, max_new_tokens=settings.max_new_tokens, sampling=sampling, stop=settings.stop,
                  speculate=self.decoder.speculation(self.speculate),
                  constraint=item.constraint or settings.constraint)
        return Ticket(item, job, prompts)

    def submit(self, ticket: Ticket, *, wait: bool = False) -> Future[LineOutcome] | None:
        """Queue a prepared line, if the runtime admits it now (with wait: once it does); None if
        it must wait for a line in flight to finish. The future's result is the line's
        `LineOutcome` (never an exception)."""
        future: Future[LineOutcome] = Future()
        started = time.perf_counter()
        item, questions = ticket.item, ticket.item.questions

        def sink(message: tuple) -> None:
            kind, value = message
            if kind == "done":
                answers = answers_of(questions, ticket.job.work.branches, ticket.prompts, value.stats)
                future.set_result(LineOutcome(item, tuple(answers), elapsed_s=time.perf_counter() - started,
                                              forest_forwards=self.forward_count()))
            elif kind == "error":
                future.set_result(LineOutcome(item, error=_in_the_jobs_words(value),
                                              elapsed_s=time.perf_counter() - started, forest_forwards=self.forward_count()))

        ticket.job.sink = sink
        try:
            if wait:
                self.runtime.submit(ticket.job, wait=True)
            elif not self.runtime.offer(ticket.job):
                return None
        except TooLarge as error:  # more than the machine has, even alone: the line's failure
            elapsed_s = time.perf_counter() - started
            future.set_result(LineOutcome(item, error=_in_the_jobs_words(error), elapsed_s=elapsed_s))
        return future

    def answer(self, item: InputLine) -> LineOutcome:
        """One line, blocking until it is done (other threads' lines share its forwards)."""
        ticket = self.prepare(item)
        return ticket if isinstance(ticket, LineOutcome) else self.submit(ticket, wait=True).result()

    def close(self) -> None:
        self.runtime.stop()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _in_the_jobs_words(error: Exception) -> Exception:
    """A refusal of a line, said as the batch job's (the line's record keeps it): "the line", "this
    job", and the knobs of a job. A prompt too long for the job's max_new_tokens is mended by a
    shorter document: a lower max_new_tokens is another job's setting, which an output holding
    results made with this one refuses."""
    if isinstance(error, TooLarge):
        return error.reworded("ask it fewer questions, or lower --max-new-tokens", subject="the line",
                              holder="this job")
    if isinstance(error, PromptTooLong) and error.fits is not None:
        return PromptTooLong(error.message, f"shorten the line's document, then rerun with --retry-failed; or answer "
                             f"the whole job with --max-new-tokens {error.fits} (into a new --output where lines "
                             "already have results)", fits=error.fits)
    return error


def answer_merged(answerer: ForestAnswerer, items: Iterable[InputLine], *,
                  stopping: Callable[[], bool] = lambda: False) -> Iterator[LineOutcome]:
    """Each line's `LineOutcome`, as lines finish, keeping the answerer's forest as full as the
    runtime's admission allows (its forest budget and the machine's bytes).

    Lines are taken from `items` only when there is room, so a generator may read them lazily.
    Once `stopping()` is true no further line starts; the lines in flight finish.
    """
    items = iter(items)
    in_flight: set[Future[LineOutcome]] = set()
    waiting: Ticket | None = None  # prepared, but no room until a line in flight finishes
    exhausted = False
    while True:
        while not stopping() and (waiting is not None or not exhausted):
            if waiting is None:
                item = next(items, None)
                if item is None:
                    exhausted = True
                    break
                prepared = answerer.prepare(item)
                if isinstance(prepared, LineOutcome):
                    yield prepared
                    continue
                waiting = prepared
            future = answerer.submit(waiting, wait=not in_flight)  # alone, it starts once the forest is empty
            if future is None:
                break
            in_flight.add(future)
            waiting = None
        if not in_flight:
            return
        done, _ = wait(in_flight, return_when=FIRST_COMPLETED)
        for future in sorted(done, key=lambda f: f.result().item.line):
            in_flight.discard(future)
            yield future.result()


__all__ = ["CACHE_TOKENS", "FOREST_BRANCHES", "FOREST_TOKENS", "PREFILL_CHUNK", "ForestAnswerer", "LineOutcome",
           "Ticket",
           "answer_merged"]
