"""A batch job: its settings, its run over the pending lines, and its summary (see `multidecode.batch`)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Self

from ..constraints import parsed_field
from ..errors import InvalidArgument, InvalidInput, MultiDecodeError, check_positive, is_int
from .lines import InputLine, check_input_file, input_lines, parse_line, scan_input
from .merged import FOREST_BRANCHES, FOREST_TOKENS, PREFILL_CHUNK, ForestAnswerer, LineOutcome, answer_merged
from .output import OutputFile
from .settings import BatchSettings, model_identity

MAX_CONSECUTIVE_CRASHES = 5
UNEXPECTED_HINT = ("an unexpected error, not a problem with this line's input; rerun with --retry-failed to try it "
                   "again, and report it if it persists")


class BatchAborted(MultiDecodeError):
    """Several lines in a row failed for reasons that are not their input: the job stopped."""

    exit_code = 1


# ---------------------------------------------------------------------- results and summary
@dataclass(frozen=True)
class LineResult:
    """One finished input line: `record` is exactly what was written to the output; `answers`
    are its `Answer`s themselves (token ids, decode stats), which the output does not keep."""

    record: dict
    answers: tuple = field(default=(), compare=False, repr=False)
    id = property(lambda self: self.record["id"])
    line = property(lambda self: self.record["line"])
    error = property(lambda self: self.record["error"])
    ok = property(lambda self: self.record["error"] is None)
    tokens = property(lambda self: self.record["tokens"])
    elapsed_s = property(lambda self: self.record["elapsed_s"])

    @property
    def stats(self) -> dict:
        """The line's decode stats (forwards, drafted, accepted; see `DecodeStats`); {} if it failed."""
        return dict(self.answers[0].stats) if self.answers else {}


def total_stats(stats: Iterable[Mapping]) -> dict:
    """Several runs' decode stats (`LineResult.stats`) as one: counts summed, ratios of the sums.
    Totals may be totalled again, so a long job can keep one running total instead of every line's.
    Lines that shared a forest count each shared forward once per line ("forward_passes" here: the
    forwards each line took part in); `BatchSummary.forward_passes` is the forests' own count."""
    stats = [s for s in stats if s]
    total = {key: sum(s.get(key, 0) for s in stats)
             for key in ("steps", "forward_passes", "tokens", "drafted", "accepted", "steps_speculating")}
    modes = {mode for s in stats if s.get("speculate") for mode in s["speculate"].split("+")}
    budgets = sum(s.get("mean_draft_budget", 0.0) * s.get("steps", 0) for s in stats)
    return {"speculate": "+".join(sorted(modes)) or None, "runs": sum(s.get("runs", 1) for s in stats), **total,
            "tokens_per_forward": total["tokens"] / total["forward_passes"] if total["forward_passes"] else 0.0,
            "acceptance": total["accepted"] / total["drafted"] if total["drafted"] else None,
            "mean_draft_budget": budgets / total["steps"] if total["steps"] else 0.0}


@dataclass(frozen=True)
class BatchSummary:
    """Counts for one run of a job (a run ends at the end of the input, at stop(), or at an error).

    total: non-blank input lines (lines appended while the run read them included). skipped: lines
    already in the output when the run began. retried: failed records removed to be done again
    (retry_failed). done: lines finished in this run, failed: how many of those failed. remaining:
    lines still without a record.
    earlier_failures: failed records from earlier runs that stay (not retried). forward_passes: the
    forwards this run's forests made (a forward that carried several lines counts once).
    """

    input: str
    output: str
    total: int
    skipped: int
    retried: int
    done: int
    failed: int
    remaining: int
    tokens: int
    elapsed_s: float
    earlier_failures: int
    repaired: bool
    failures: list[dict] = field(default_factory=list)
    forward_passes: int = 0

    complete = property(lambda self: self.remaining == 0)
    tokens_per_s = property(lambda self: self.tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0)
    lines_per_s = property(lambda self: self.done / self.elapsed_s if self.elapsed_s > 0 else 0.0)

    def as_dict(self) -> dict:
        return asdict(self) | {"complete": self.complete, "elapsed_s": round(self.elapsed_s, 3),
                               "tokens_per_s": round(self.tokens_per_s, 2), "lines_per_s": round(self.lines_per_s, 3)}


# ---------------------------------------------------------------------- the job
class BatchJob:
    """An opened batch job: the input scanned, the output repaired and locked. Use `open_batch`."""

    #: failures kept in the summary (the output holds them all)
    MAX_LISTED_FAILURES = 20

    def __init__(self, input_path: Path, output: OutputFile, settings: BatchSettings, lines: list[tuple[int, str]],
                 retried: int) -> None:
        self.input_path, self.output_path, self._output = input_path, output.given, output
        self.settings, self.fingerprint = settings, settings.fingerprint
        input_keys = {key for _, key in lines}
        self.total, self.retried, self.repaired = len(lines), retried, output.repaired
        self.pending: dict[int, str] = {line: key for line, key in lines if key not in output.recorded}
        self.skipped = self.total - len(self.pending)
        self.earlier_failures = sum(failed and key in input_keys for key, failed in output.recorded.items())
        self.foreign = len(output.recorded.keys() - input_keys)
        self.done = self.failed = self.tokens = 0
        self.last_line = max((line for line, _ in lines), default=0)  # lines after it came during the run
        self.appended = 0  # such lines `pending_items` met: left to the next run, so the job is not complete
        self.elapsed_s = 0.0
        self.failures: list[dict] = []
        self._forest_forwards: dict[str, int] = {}  # forest name -> its forwards (`LineOutcome.forest_forwards`)
        self._stop = False
        self._crashes, self._last_crash = 0, None

    def stop(self) -> None:
        """Ask `run` to start no further line; the lines in flight finish (safe from a signal handler)."""
        self._stop = True

    @property
    def stopping(self) -> bool:
        return self._stop

    def close(self) -> None:
        self._output.close()  # releases the lock

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        self._output.discard()  # ended before its first record (failed, or stopped while loading): nothing stays
        self.close()

    def run(self, decoder, *, speculate=None, forest_tokens: int = FOREST_TOKENS,
            forest_branches: int = FOREST_BRANCHES, prefill_chunk: int = PREFILL_CHUNK) -> Iterator[LineResult]:
        """Answer every pending line, several documents per forest (`merged`: up to `forest_tokens`
        reserved and `forest_branches` questions in flight; forest_tokens=0 runs one line at a
        time; prefill_chunk: `ForestAnswerer`'s), and yield each `LineResult` once its record is on disk, in the order lines finish. Ends at the end of the input, or after `stop()` once
        the lines in flight finish; any exception (KeyboardInterrupt too) leaves every written
        record valid. speculate: `MultiDecoder.ask`'s, for every line; it never changes the answers.
        """
        self._check_open()
        check_positive("forest_branches", forest_branches)
        if not is_int(forest_tokens) or forest_tokens < 0:
            raise InvalidArgument(f"forest_tokens must be 0 or a positive integer, got {forest_tokens!r}",
                                  "0 runs one document at a time")
        with ForestAnswerer(decoder, self.settings, speculate=speculate, forest_tokens=forest_tokens,
                            forest_branches=forest_branches, prefill_chunk=prefill_chunk) as answerer:
            outcomes = answer_merged(answerer, self.pending_items(), stopping=lambda: self._stop)
            yield from self.record(outcomes)

    def pending_items(self) -> Iterator[InputLine]:
        """The lines still without a record, parsed, in input order; ends early after `stop()`.
        A line whose id changed since the job was opened, or added since, is left to the next run."""
        for number, raw in input_lines(self.input_path):
            if self._stop:
                return
            if number > self.last_line:
                self.appended += 1
                continue
            key = self.pending.get(number)
            if key is not None and (item := parse_line(raw, number, self.settings.questions)).key == key:
                yield item

    def record(self, outcomes: Iterable[LineOutcome]) -> Iterator[LineResult]:
        """Append each outcome's record (fsync-ed) and yield its `LineResult`, from any backend
        (the local merged forest or Ray workers). An outcome for a line that already has a record
        is dropped, so a line retried elsewhere is never written twice."""
        self._check_open()
        started, base_elapsed = time.perf_counter(), self.elapsed_s
        try:
            for outcome in outcomes:
                if outcome.item.line not in self.pending:
                    continue
                record = self._record(outcome)
                self._output.append(record)
                if outcome.forest_forwards is not None:
                    name, forwards = outcome.forest_forwards
                    self._forest_forwards[name] = max(forwards, self._forest_forwards.get(name, 0))
                del self.pending[outcome.item.line]
                self.done, self.tokens = self.done + 1, self.tokens + record["tokens"]
                if record["error"] is not None:
                    self.failed += 1
                    if len(self.failures) < self.MAX_LISTED_FAILURES:
                        self.failures.append({"id": record["id"], "line": record["line"], **record["error"]})
                self.elapsed_s = base_elapsed + time.perf_counter() - started
                yield LineResult(record, outcome.answers)
                if self._crashes >= MAX_CONSECUTIVE_CRASHES:
                    error = record["error"]
                    raise BatchAborted(
                        f"{self._crashes} unexpected errors in a row (last: {error['type']}: {error['message']}); "
                        "the model or the device looks broken",
                        "fix the cause, then rerun the same command with --retry-failed to redo those lines")
        finally:
            self.elapsed_s = base_elapsed + time.perf_counter() - started

    def _check_open(self) -> None:
        if self._output.closed:
            raise InvalidInput("this batch job is closed", "open it again with open_batch")

    def _record(self, outcome: LineOutcome) -> dict:
        """The output record of an outcome; counts unexpected errors (one failed step that took
        several lines with it counts once)."""
        error, answers = outcome.error, outcome.answers
        constraint = outcome.item.constraint or self.settings.constraint
        if error is None or isinstance(error, MultiDecodeError):
            self._crashes = 0
        elif error is not self._last_crash:
            self._crashes, self._last_crash = self._crashes + 1, error
        return {
            "id": outcome.item.id,
            "line": outcome.item.line,
            "answers": [{"question": a.question, "answer": a.text, "finish_reason": a.finish_reason,
                         "tokens": len(a.token_ids), **({} if a.seed is None else {"seed": a.seed}),
                         **parsed_field(constraint, a)} for a in answers],
            "error": None if error is None else _error_record(error),
            "tokens": sum(len(a.token_ids) for a in answers),
            "elapsed_s": round(outcome.elapsed_s, 4),
            "settings": self.fingerprint,
        }

    def summary(self) -> BatchSummary:
        return BatchSummary(
            input=str(self.input_path), output=str(self.output_path), total=self.total + self.appended,
            skipped=self.skipped, retried=self.retried, done=self.done, failed=self.failed,
            remaining=len(self.pending) + self.appended, tokens=self.tokens, elapsed_s=self.elapsed_s,
            earlier_failures=self.earlier_failures, repaired=self.repaired, failures=list(self.failures),
            forward_passes=sum(self._forest_forwards.values()))


def _error_record(err) -> dict:
    """type, message and hint of a line's error. Any object works (a Ray worker's picklable stand-in
    too): its class name, its .message (else the first line of its text) and its .hint when it has one."""
    text, hint = str(err).strip(), getattr(err, "hint", None)
    message = str(getattr(err, "message", "") or "") or (text.splitlines()[0] if text else type(err).__name__)
    hint = str(hint) if hint else None if isinstance(err, MultiDecodeError) else UNEXPECTED_HINT
    return {"type": type(err).__name__, "message": message, "hint": hint}


def open_batch(input_path: str | os.PathLike, output_path: str | os.PathLike, settings: BatchSettings | None = None,
               *, retry_failed: bool = False) -> BatchJob:
    """Open a batch job: check the settings and the input, then lock, create or repair, and check
    the output (see `multidecode.batch`). Raises a `MultiDecodeError` for a problem with the job;
    problems with single lines are left for `run` to record."""
    settings = settings or BatchSettings()
    settings.check()
    input_path, output_path = Path(input_path), Path(output_path)
    check_input_file(input_path)
    if output_path.is_dir():
        raise InvalidInput(f"the output {output_path} is a folder", "pass a file name, such as answers.jsonl")
    if not output_path.parent.is_dir():
        raise InvalidInput(f"the folder of the output {output_path} does not exist", "create it first")
    if output_path.exists() and os.path.samefile(input_path, output_path):
        raise InvalidInput("the output is the input file", "write results to a new file, such as answers.jsonl")
    if output_path.exists() and not output_path.is_file():
        raise InvalidInput(f"the output {output_path} is not a regular file (a device or a pipe)",
                           "the job appends its results to a file and resumes from it: pass a file name, such as "
                           "answers.jsonl")
    lines = scan_input(input_path, settings.questions)
    output = OutputFile(output_path)
    try:
        output.check_settings(settings)
        input_keys = {key for _, key in lines}
        output.check_input(input_path, input_keys)
        failed = {key for key, failure in output.recorded.items() if failure} if retry_failed else set()
        redo = failed & input_keys  # failures of ids no longer in the input (a line mended with a new id) go too
        if failed:
            output.drop(failed)
        output.write_meta(settings, input_path)
    except BaseException:
        output.discard()
        output.close()
        raise
    return BatchJob(input_path, output, settings, lines, len(redo))



def run_batch(decoder, input_path: str | os.PathLike, output_path: str | os.PathLike, *,
              questions: Sequence[str] = (), max_new_tokens: int = 48, stop: Sequence[str] = (),
              instruction: str | None = None, retry_failed: bool = False, model: str | None = None,
              precision: str | None = None, speculate=None, forest_tokens: int = FOREST_TOKENS, forest_branches: int = FOREST_BRANCHES,
              constraint=None, **sampling) -> BatchSummary:
    """Run (or resume) a whole batch job silently and return its summary.

    model, precision: the labels that go into the settings fingerprint (defaults: what `load` was
    given, as `settings.model_identity` labels it, the command line's label too, so a job started
    here resumes there and back; for a decoder built without `load`, the model's `name_or_path`;
    and the precision it runs at, as `MultiDecoder.memory()` names it).
    speculate: as for `BatchJob.run` (not a setting: it never changes the answers). "suffix" or
    "auto" draft from the answers to the job's earlier documents, which pays on similar ones.
    forest_tokens, forest_branches: the merged forest's budget (`BatchJob.run`; forest_tokens=0 runs
    one document at a time). constraint: a `Constraint` every answer follows (a line's own
    "json_schema" takes its place for that line); records then carry each answer's "parsed" value.
    """
    loaded = getattr(decoder, "loaded", None)
    if model is None and loaded is not None:
        model = model_identity(None if loaded.source == "embedded" else loaded.source)
    elif model is None:
        name = getattr(decoder.model.config, "name_or_path", None) or getattr(decoder.model.config, "_name_or_path", "")
        model = model_identity(name) if name else type(decoder.model).__name__
    precision = precision or (loaded.precision.identity if loaded is not None else decoder.memory()["precision"])
    settings = BatchSettings(questions=questions, max_new_tokens=max_new_tokens, stop=stop,
                             sampling=sampling, instruction=instruction, model=model, precision=precision,
                             constraint=constraint)
    with open_batch(input_path, output_path, settings, retry_failed=retry_failed) as job:
        for _ in job.run(decoder, speculate=speculate, forest_tokens=forest_tokens, forest_branches=forest_branches):
            pass
        return job.summary()
