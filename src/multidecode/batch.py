"""Batch jobs: the same questions about many documents, into one resumable JSON Lines file.

This is the seed's motivating example at scale: thousands of transcripts, the same 8 questions for
each. Every document is answered with `MultiDecoder.ask` (one forest, one shared KV cache per
document), and its result is appended to the output as one JSON line the moment it is done. The
library prints nothing: `BatchJob.run` yields a `LineResult` per finished line, and the command
(`multidecode batch`) only formats them.

Usage::

    settings = BatchSettings(questions=("Who called?", "Was it solved?"), max_new_tokens=48)
    with open_batch("calls.jsonl", "answers.jsonl", settings) as job:   # checks, repairs, locks
        for result in job.run(decoder):                                  # one per finished line
            ...
        summary = job.summary()
    # or, all at once: run_batch(decoder, "calls.jsonl", "answers.jsonl", questions=[...])

Speculation (`run(decoder, speculate=...)`, `--speculate`) makes a job faster, never different,
so it is not one of the settings below: a job may be resumed with another speculation mode.
"suffix" (or "auto") drafts from the answers to the job's earlier documents, which the process's
shared suffix store keeps: it pays on many similar documents, whose answers repeat each other.

Input (JSON Lines, UTF-8)
-------------------------
One JSON object per line: ``{"id": "call-17", "document": "...", "questions": ["...", ...]}``.

- ``document`` (string, required, not blank).
- ``questions`` (list of non-blank strings). Job-level questions (``BatchSettings.questions``,
  ``--questions-file`` / ``-q``) are asked of every document **first**, followed by the line's own
  questions, so a line can add questions but never drops the job's. A line needs ``questions``
  only when the job has none.
- ``id`` (string or integer, optional): the key that output records and resumption use. Without
  one (or with ``null``) the id is the line's 1-based line number. Ids are compared as text, so
  ``7`` and ``"7"`` are the same id. Give explicit ids if the input may be edited between runs;
  appending lines is always safe (the next run does just the new ones).
- Other keys are ignored. Blank lines are skipped (they still count in line numbers).

Sampling settings apply to every document alike: with a seed s, question i of every document
uses seed s + i, so a line's answers do not depend on where a job was stopped and resumed.

Duplicate ids are refused up front, before anything runs: two results for one id could not be
told apart, and the job's invariant is one record per id. A line that cannot be read (bad JSON,
not an object, a bad id) gets its line number as its id, so it is still recorded once.

Output (JSON Lines, UTF-8)
--------------------------
One record per finished input line, in the order they finish::

    {"id": "call-17", "line": 17,
     "answers": [{"question": "...", "answer": "...", "finish_reason": "stop", "tokens": 12}, ...],
     "error": null, "tokens": 96, "elapsed_s": 0.412, "settings": "3f2a9c0e1b7d"}

A failed line has ``"answers": []`` and ``"error": {"type": "InvalidInput", "message": "...",
"hint": "..."}``; ``type`` is the exception class (``InvalidInput``, ``PromptTooLong``, or for an
unexpected failure such as running out of memory, its Python class). ``tokens`` counts generated
tokens; ``settings`` is a fingerprint of everything the answers depend on (below).

Each record is written with one ``write`` of the whole line and its newline to a file opened in
append mode, then ``fsync``-ed, so a crash or a kill can at worst leave one unterminated last line.

Beside the output, ``OUT.meta.json`` holds the settings behind the fingerprint (model, dtype,
job questions, max_new_tokens, stop strings, sampling, instruction), written atomically. It is
for people and for naming what changed; the records alone carry what resuming needs.

Resuming
--------
Running the same job again resumes it; nothing else is needed after Ctrl-C, a kill or a crash.
On open, the output is checked and repaired before anything runs:

- an unterminated last line, or a last line that is not valid JSON (a write cut short), is
  truncated away; that line is simply done again. Any other line that is not a record of this
  format stops the job with an error (nothing is ever dropped from the middle of a file);
- every id with a record is finished and skipped, including failed lines: a failure is a result.
  ``retry_failed=True`` (``--retry-failed``) redoes the failed lines whose ids are in the input: the
  output is first rewritten without their records (to a temporary file, fsync-ed, then renamed
  over the output), and they are run again like new lines. So every id has at most one record at
  every moment, and readers never need to deduplicate;
- records whose fingerprint differs from this job's settings stop the job with an error that
  names the differences: mixing answers from two settings in one file would be silent corruption.
  Device and batch options do not count (they do not change the answers);
- the output is locked (``flock``) while a job writes to it, so two runs cannot interleave; the
  lock dies with its process, so a killed run leaves no stale lock.

`BatchJob.stop()` asks `run` to stop before the next line (the CLI calls it on the first Ctrl-C
or SIGTERM). Records that exist stay valid in every case.

Errors
------
Problems with one line (bad JSON, no document, an empty question, a prompt too long for the
model, ...) are recorded in that line's record and the job goes on. Problems with the job itself
(a missing input, duplicate ids, an output that belongs to other settings or is not a batch
output) raise a `MultiDecodeError` from `open_batch` before anything runs. An unexpected failure
on a line is recorded too, but after `MAX_CONSECUTIVE_CRASHES` of them in a row the job stops with
`BatchAborted`: then the model or the device is broken, not the lines.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from .decoding import check_positive
from .errors import InvalidInput, MultiDecodeError
from .sampling import per_branch_sampling
from .strategies.ask import check_document, check_questions

FORMAT = "multidecode-batch/1"
MAX_CONSECUTIVE_CRASHES = 5
LINE_HINT = 'each line must be one JSON object, e.g. {"id": "call-1", "document": "...", "questions": ["..."]}'


class BatchAborted(MultiDecodeError):
    """Several lines in a row failed for reasons that are not their input: the job stopped."""

    exit_code = 1


# ---------------------------------------------------------------------- settings
@dataclass(frozen=True)
class BatchSettings:
    """Everything a batch job's answers depend on.

    questions: asked of every document, before the line's own questions.
    model, dtype: labels of the model the answers come from (any stable text, such as a resolved
    folder path or a hub id); they go into the fingerprint, so a job cannot be resumed with
    another model by mistake.
    sampling: keyword arguments for `MultiDecoder.ask` (temperature, top_k, top_p, min_p,
    repetition_penalty, seed, do_sample).
    """

    questions: tuple[str, ...] = ()
    max_new_tokens: int = 48
    stop: tuple[str, ...] = ()
    sampling: Mapping[str, Any] = field(default_factory=dict)
    instruction: str | None = None
    model: str | None = None
    dtype: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "questions", tuple(self.questions))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "sampling", dict(self.sampling))

    def check(self) -> None:
        """Refuse settings that would make every line fail (a job error, not a line error)."""
        check_positive("max_new_tokens", self.max_new_tokens)
        per_branch_sampling(1, dict(self.sampling))
        if self.questions:
            check_questions(list(self.questions))
        for text in self.stop:
            if not isinstance(text, str) or not text:
                raise InvalidInput("a stop string is empty", "remove it or give the text to stop at")

    def as_dict(self) -> dict:
        return {"model": self.model, "dtype": self.dtype or "float32", "questions": list(self.questions),
                "max_new_tokens": self.max_new_tokens, "stop": list(self.stop),
                "sampling": dict(sorted(self.sampling.items())), "instruction": self.instruction}

    @property
    def fingerprint(self) -> str:
        """12 hex digits of the SHA-256 of the settings as canonical JSON."""
        text = json.dumps(self.as_dict(), sort_keys=True, ensure_ascii=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:12]


def model_identity(name: str | os.PathLike | None) -> str:
    """A stable label for a model name as `load` takes it: the embedded model, a resolved local
    path (so that a relative path from another folder is the same model), or a hub id."""
    if name is None:
        return "embedded:SmolLM2-135M-Instruct"
    path = Path(name).expanduser()
    return str(path.resolve()) if path.exists() else str(name)


# ---------------------------------------------------------------------- input lines
@dataclass(frozen=True)
class InputLine:
    """One non-blank input line, parsed. error says why it cannot run (then it is recorded as failed)."""

    line: int
    id: str | int
    document: str | None = None
    questions: tuple[str, ...] = ()
    error: MultiDecodeError | None = None

    @property
    def key(self) -> str:
        return id_key(self.id)


def id_key(value: str | int) -> str:
    """Ids are compared as text: 7 and "7" are one id."""
    return str(value)


def _kind(value) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "an integer",
             float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def parse_line(raw: bytes, line: int, job_questions: Sequence[str] = ()) -> InputLine:
    """Parse one input line (bytes, without its newline). Never raises for bad content: the
    problem comes back as `.error`, and the id falls back to the line number when unreadable."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        return InputLine(line, line, error=InvalidInput(
            f"line {line} is not UTF-8 text (bad byte at column {err.start + 1})", "save the input as UTF-8"))
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        return InputLine(line, line, error=InvalidInput(
            f"line {line} is not valid JSON ({err.msg} at column {err.colno})", LINE_HINT))
    if not isinstance(data, dict):
        return InputLine(line, line, error=InvalidInput(f"line {line} is {_kind(data)}, not a JSON object", LINE_HINT))
    ident = data.get("id")
    if ident is None:
        ident = line
    elif isinstance(ident, bool) or not isinstance(ident, (str, int)) or (isinstance(ident, str) and not ident.strip()):
        bad = "an empty string" if isinstance(ident, str) else _kind(ident)
        return InputLine(line, line, error=InvalidInput(
            f'"id" must be a string or an integer, got {bad}',
            'use a text id such as "call-17", or leave "id" out to use the line number'))
    try:
        return InputLine(line, ident, _document_of(data), _questions_of(data, job_questions))
    except MultiDecodeError as err:
        return InputLine(line, ident, error=err)


def _document_of(data: dict) -> str:
    if "document" not in data:
        raise InvalidInput('the line has no "document"', 'add "document": "the text to ask about"')
    document = data["document"]
    if not isinstance(document, str):
        raise InvalidInput(f'"document" must be a string, got {_kind(document)}', "put the document's text in a string")
    check_document(document)
    return document


def _questions_of(data: dict, job_questions: Sequence[str]) -> tuple[str, ...]:
    own = data.get("questions")
    if own is None:
        if not job_questions:
            raise InvalidInput('the line has no "questions" and the job has none',
                               'add "questions": ["..."] to the line, or give job-level questions (--questions-file)')
        return tuple(job_questions)
    if isinstance(own, str):
        raise InvalidInput('"questions" must be a list of strings, got one string', 'wrap it in a list: ["..."]')
    if not isinstance(own, list):
        raise InvalidInput(f'"questions" must be a list of strings, got {_kind(own)}',
                           'use "questions": ["...", "..."]')
    for i, question in enumerate(own):
        if not isinstance(question, str):
            raise InvalidInput(f"question {i + 1} of the line is {_kind(question)}, not a string",
                               "write each question as a string")
        if not question.strip():
            raise InvalidInput(f"question {i + 1} of the line is empty", "remove it or write the question")
    questions = tuple(job_questions) + tuple(own)
    if not questions:
        raise InvalidInput('the line\'s "questions" is empty and the job has none',
                           "ask at least one question, on the line or for the whole job (--questions-file)")
    return questions


def _input_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, raw bytes without the line end) for each non-blank line."""
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            if number == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            raw = raw.rstrip(b"\r\n")
            if raw.strip():
                yield number, raw


def _check_input_file(path: Path) -> None:
    if str(path) == "-":
        raise InvalidInput("batch needs its input in a file, not standard input",
                           "it reads the input again to resume; save it to a file first")
    if not path.exists():
        raise InvalidInput(f"the input file {path} does not exist", "check the path")
    if path.is_dir():
        raise InvalidInput(f"the input file {path} is a folder", "pass a JSON Lines file, one JSON object per line")
    with open(path, "rb") as handle:
        head = handle.read(8192)
    if head.startswith(b"\x1f\x8b") or b"\x00" in head:
        raise InvalidInput(f"{path} is not a text file (it holds binary data)",
                           "pass uncompressed JSON Lines text (gunzip it first if it is compressed)")


def scan_input(path: Path, job_questions: Sequence[str] = ()) -> list[tuple[int, str]]:
    """(line, key) of every non-blank input line, in order. Refuses duplicate ids."""
    seen: dict[str, int] = {}
    lines: list[tuple[int, str]] = []
    clashes: list[str] = []
    for number, raw in _input_lines(path):
        item = parse_line(raw, number, job_questions)
        if item.key in seen:
            clashes.append(f"id {item.id!r} is on lines {seen[item.key]} and {number}")
        else:
            seen[item.key] = number
        lines.append((number, item.key))
    if clashes:
        more = f" and {len(clashes) - 3} more" if len(clashes) > 3 else ""
        raise InvalidInput(f"{path} has duplicate ids: {'; '.join(clashes[:3])}{more}",
                           "give every line its own id (a line without one takes its line number as its id)")
    if not lines:
        raise InvalidInput(f"{path} has no input lines", LINE_HINT)
    return lines


# ---------------------------------------------------------------------- the output file
@dataclass
class _Existing:
    """What an output file already holds: its ids, which of them failed, and the fingerprints seen."""

    done: dict[str, bool] = field(default_factory=dict)  # id key -> whether its record is a failure
    fingerprints: set[str] = field(default_factory=set)
    repaired: bool = False


def _cut_short(raw: bytes) -> bool:
    """Whether an unreadable last line is what an interrupted write leaves: the start of a record
    (or zeros, from a file system that lost the data), never another file's JSON."""
    stripped = raw.strip(b"\x00 \t\r\n")
    if not stripped:
        return True
    if not stripped.startswith(b'{"id"'):
        return False
    try:
        json.loads(stripped.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return True
    return not raw.endswith(b"\n")  # whole JSON but no newline: the write did not finish


def _read_existing(fd: int, path: Path) -> _Existing:
    """Scan the output (holding its lock); truncate a cut-short last line; refuse anything else odd."""
    existing = _Existing()
    lines_at: dict[str, int] = {}
    offset = 0
    end_of_good = 0
    unreadable: tuple[int, bytes] | None = None  # a line that is not a record: allowed only last
    with os.fdopen(os.dup(fd), "rb") as handle:
        handle.seek(0)
        for number, raw in enumerate(handle, start=1):
            offset += len(raw)
            if unreadable is not None:
                _refuse_not_a_record(path, *unreadable)
            record = _parse_record(raw) if raw.endswith(b"\n") else None
            if record is None:
                if raw.strip() == b"" and raw.endswith(b"\n"):  # a blank line (an edited file): harmless
                    end_of_good = offset
                else:
                    unreadable = (number, raw)
                continue
            key = id_key(record["id"])
            if key in existing.done:
                raise InvalidInput(
                    f"{path} has two records for id {record['id']!r} (lines {lines_at[key]} and {number})",
                    "keep one of them; a batch output holds one record per id")
            lines_at[key] = number
            existing.done[key] = record["error"] is not None
            existing.fingerprints.add(record["settings"])
            end_of_good = offset
    if unreadable is not None:
        if not _cut_short(unreadable[1]):
            _refuse_not_a_record(path, *unreadable)
        os.ftruncate(fd, end_of_good)
        os.fsync(fd)
        existing.repaired = True
    return existing


def _parse_record(raw: bytes) -> dict | None:
    try:
        record = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    if (not isinstance(record, dict) or not isinstance(record.get("id"), (str, int)) or isinstance(record["id"], bool)
            or "error" not in record or not isinstance(record.get("settings"), str)):
        return None
    return record


def _refuse_not_a_record(path: Path, number: int, raw: bytes):
    raise InvalidInput(f"{path} is not a multidecode batch output: line {number} is not a result record",
                       "is it the right output file? Write results to a new file, or fix that line")


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # not every platform can open a folder
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _lock(fd: int, path: Path) -> None:
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock; do not run two jobs on one output
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise InvalidInput(f"{path} is being written by another multidecode batch run",
                           "wait for it to finish (or stop it), or write to another --output") from None


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def meta_path(output: str | os.PathLike) -> Path:
    """The settings file written beside an output: OUT.meta.json."""
    output = Path(output)
    return output.with_name(output.name + ".meta.json")


def _settings_differences(stored: Mapping, current: Mapping) -> list[str]:
    return [f"{key} was {json.dumps(stored.get(key), ensure_ascii=False)}, "
            f"now {json.dumps(current.get(key), ensure_ascii=False)}"
            for key in sorted(set(stored) | set(current)) if stored.get(key) != current.get(key)]


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _encode(record: dict) -> bytes:
    try:
        return (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate from the input: escape everything instead
        return (json.dumps(record, ensure_ascii=True) + "\n").encode("ascii")


# ---------------------------------------------------------------------- results and summary
@dataclass(frozen=True)
class LineResult:
    """One finished input line: `record` is exactly what was written to the output; `answers`
    are its `Answer`s themselves (token ids, decode stats), which the output does not keep."""

    record: dict
    answers: tuple = field(default=(), compare=False, repr=False)

    @property
    def id(self) -> str | int:
        return self.record["id"]

    @property
    def line(self) -> int:
        return self.record["line"]

    @property
    def error(self) -> dict | None:
        return self.record["error"]

    @property
    def ok(self) -> bool:
        return self.record["error"] is None

    @property
    def tokens(self) -> int:
        return self.record["tokens"]

    @property
    def elapsed_s(self) -> float:
        return self.record["elapsed_s"]

    @property
    def stats(self) -> dict:
        """The line's decode stats (forwards, drafted, accepted; see `DecodeStats`); {} if it failed."""
        return dict(self.answers[0].stats) if self.answers else {}


def total_stats(stats: Iterable[Mapping]) -> dict:
    """Several runs' decode stats (`LineResult.stats`) as one: counts summed, ratios of the sums.
    Totals may be totalled again, so a long job can keep one running total instead of every line's."""
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

    total: non-blank input lines. skipped: lines already in the output when the run began.
    retried: failed records removed to be done again (retry_failed). done: lines finished in this
    run, failed: how many of those failed. remaining: lines still without a record.
    earlier_failures: failed records from earlier runs that stay (not retried).
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

    @property
    def complete(self) -> bool:
        return self.remaining == 0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def lines_per_s(self) -> float:
        return self.done / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def as_dict(self) -> dict:
        return {"input": self.input, "output": self.output, "total": self.total, "skipped": self.skipped,
                "retried": self.retried, "done": self.done, "failed": self.failed, "remaining": self.remaining,
                "complete": self.complete, "tokens": self.tokens, "elapsed_s": round(self.elapsed_s, 3),
                "tokens_per_s": round(self.tokens_per_s, 2), "lines_per_s": round(self.lines_per_s, 3),
                "earlier_failures": self.earlier_failures, "repaired": self.repaired, "failures": self.failures}


# ---------------------------------------------------------------------- the job
class BatchJob:
    """An opened batch job: the input scanned, the output repaired and locked. Use `open_batch`."""

    #: failures kept in the summary (the output holds them all)
    MAX_LISTED_FAILURES = 20

    def __init__(self, input_path: Path, output_path: Path, settings: BatchSettings, fd: int,
                 lines: list[tuple[int, str]], existing: _Existing, retried: int) -> None:
        self.input_path = input_path
        self.output_path = output_path
        self.settings = settings
        self.fingerprint = settings.fingerprint
        self._fd: int | None = fd
        input_keys = {key for _, key in lines}
        self.total = len(lines)
        self.pending: dict[int, str] = {line: key for line, key in lines if key not in existing.done}
        self.skipped = self.total - len(self.pending)
        self.retried = retried
        self.repaired = existing.repaired
        self.earlier_failures = sum(1 for key, failed in existing.done.items() if failed and key in input_keys)
        self.foreign = sum(1 for key in existing.done if key not in input_keys)
        self.done = 0
        self.failed = 0
        self.tokens = 0
        self.elapsed_s = 0.0
        self.failures: list[dict] = []
        self._stop = False
        self._crashes = 0

    # -------------------------------------------------------------- control
    def stop(self) -> None:
        """Ask `run` to stop before it starts the next line (safe to call from a signal handler)."""
        self._stop = True

    @property
    def stopping(self) -> bool:
        return self._stop

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the lock
            self._fd = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -------------------------------------------------------------- running
    def run(self, decoder, *, speculate=None) -> Iterator[LineResult]:
        """Answer every pending line in input order, appending each record as it finishes.

        Yields a `LineResult` after each record is on disk. Ends at the end of the input or at
        `stop()`; an exception (KeyboardInterrupt included) leaves every written record valid.
        speculate: `MultiDecoder.ask`'s, for every line; it never changes the answers. "suffix"
        or "auto" draft from the answers to the earlier documents (the process's shared suffix
        store), which pays on many similar documents; a `Proposer` or `Speculation` object is
        used for every line alike, so one with its own store learns from this job alone.
        """
        if self._fd is None:
            raise InvalidInput("this batch job is closed", "open it again with open_batch")
        settings = self.settings
        started = time.perf_counter()
        base_elapsed = self.elapsed_s
        try:
            for number, raw in _input_lines(self.input_path):
                if self._stop:
                    return
                key = self.pending.get(number)
                if key is None:
                    continue
                item = parse_line(raw, number, settings.questions)
                if item.key != key:  # the input changed under us: leave this line to the next run
                    continue
                record, answers = self._answer(decoder, item, speculate)
                self._append(record)
                del self.pending[number]
                self._count(record)
                self.elapsed_s = base_elapsed + time.perf_counter() - started
                yield LineResult(record, tuple(answers))
                if self._crashes >= MAX_CONSECUTIVE_CRASHES:
                    error = record["error"]
                    raise BatchAborted(
                        f"{self._crashes} lines in a row failed with unexpected errors (last: {error['type']}: "
                        f"{error['message']}); the model or the device looks broken",
                        "fix the cause, then rerun the same command with --retry-failed to redo those lines")
        finally:
            self.elapsed_s = base_elapsed + time.perf_counter() - started

    def _answer(self, decoder, item: InputLine, speculate) -> tuple[dict, list]:
        start = time.perf_counter()
        answers, error = [], item.error
        if error is None:
            try:
                answers = decoder.ask(item.document, list(item.questions), max_new_tokens=self.settings.max_new_tokens,
                                      stop=self.settings.stop, instruction=self.settings.instruction,
                                      speculate=speculate, **self.settings.sampling)
                self._crashes = 0
            except MultiDecodeError as err:
                error = err
                self._crashes = 0
            except Exception as err:  # noqa: BLE001 - one bad line must not end a night-long job
                error = err
                self._crashes += 1
        else:
            self._crashes = 0
        return {
            "id": item.id,
            "line": item.line,
            "answers": [{"question": a.question, "answer": a.text, "finish_reason": a.finish_reason,
                         "tokens": len(a.token_ids)} for a in answers],
            "error": None if error is None else _error_record(error),
            "tokens": sum(len(a.token_ids) for a in answers),
            "elapsed_s": round(time.perf_counter() - start, 4),
            "settings": self.fingerprint,
        }, answers

    def _append(self, record: dict) -> None:
        _write_all(self._fd, _encode(record))  # one write in practice; a cut-short one is repaired on resume
        os.fsync(self._fd)

    def _count(self, record: dict) -> None:
        self.done += 1
        self.tokens += record["tokens"]
        if record["error"] is not None:
            self.failed += 1
            if len(self.failures) < self.MAX_LISTED_FAILURES:
                self.failures.append({"id": record["id"], "line": record["line"], **record["error"]})

    def summary(self) -> BatchSummary:
        return BatchSummary(
            input=str(self.input_path), output=str(self.output_path), total=self.total, skipped=self.skipped,
            retried=self.retried, done=self.done, failed=self.failed, remaining=len(self.pending),
            tokens=self.tokens, elapsed_s=self.elapsed_s, earlier_failures=self.earlier_failures,
            repaired=self.repaired, failures=list(self.failures))


def _error_record(err: BaseException) -> dict:
    if isinstance(err, MultiDecodeError):
        return {"type": type(err).__name__, "message": err.message, "hint": err.hint}
    message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return {"type": type(err).__name__, "message": message,
            "hint": "an unexpected error, not a problem with this line's input; rerun with --retry-failed "
                    "to try it again, and report it if it persists"}


def open_batch(input_path: str | os.PathLike, output_path: str | os.PathLike, settings: BatchSettings | None = None,
               *, retry_failed: bool = False) -> BatchJob:
    """Open a batch job: check the settings and the input, then create or repair, check and lock
    the output (see the module docstring). Raises a `MultiDecodeError` for a problem with the job;
    problems with single lines are left for `run` to record."""
    settings = settings or BatchSettings()
    settings.check()
    input_path, output_path = Path(input_path), Path(output_path)
    _check_input_file(input_path)
    if output_path.is_dir():
        raise InvalidInput(f"the output {output_path} is a folder", "pass a file name, such as answers.jsonl")
    if not output_path.parent.is_dir():
        raise InvalidInput(f"the folder of the output {output_path} does not exist", "create it first")
    if output_path.exists() and os.path.samefile(input_path, output_path):
        raise InvalidInput("the output is the input file", "write results to a new file, such as answers.jsonl")
    lines = scan_input(input_path, settings.questions)

    created = not output_path.exists()
    fd = os.open(output_path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        if created:
            _fsync_dir(output_path.parent)
        _lock(fd, output_path)
        existing = _read_existing(fd, output_path)
        _check_settings(output_path, settings, existing)
        retried = 0
        if retry_failed:
            input_keys = {key for _, key in lines}
            redo = {key for key, failed in existing.done.items() if failed and key in input_keys}
            if redo:
                fd = _rewrite_without(fd, output_path, redo)
                for key in redo:
                    del existing.done[key]
                retried = len(redo)
        _write_meta(output_path, settings, input_path)
    except BaseException:
        os.close(fd)
        raise
    return BatchJob(input_path, output_path, settings, fd, lines, existing, retried)


def _check_settings(path: Path, settings: BatchSettings, existing: _Existing) -> None:
    others = existing.fingerprints - {settings.fingerprint}
    if not others:
        return
    differences: list[str] = []
    with contextlib.suppress(OSError, ValueError, AttributeError):
        meta = json.loads(meta_path(path).read_text(encoding="utf-8"))
        if meta.get("fingerprint") in others:
            differences = _settings_differences(meta.get("settings", {}), settings.as_dict())
    said = f": {'; '.join(differences)}" if differences else f" (fingerprint {', '.join(sorted(others))}, " \
                                                                 f"these settings are {settings.fingerprint})"
    raise InvalidInput(f"{path} holds results made with other settings{said}",
                       "rerun with the settings it was started with, or write these results to a new --output")


def _rewrite_without(fd: int, path: Path, drop: set[str]) -> int:
    """Atomically replace the output with a copy that lacks the records of `drop`; returns the new
    file's descriptor, already locked (the old one stays locked until it is closed)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.retry.tmp")
    new_fd = os.open(tmp, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        with contextlib.suppress(OSError):
            os.fchmod(new_fd, os.fstat(fd).st_mode & 0o7777)
        _lock(new_fd, tmp)
        with os.fdopen(os.dup(fd), "rb") as handle:
            handle.seek(0)
            for raw in handle:
                record = _parse_record(raw)
                if record is not None and id_key(record["id"]) in drop:
                    continue
                _write_all(new_fd, raw)
        os.fsync(new_fd)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        os.close(new_fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    os.close(fd)
    return new_fd


def _write_meta(path: Path, settings: BatchSettings, input_path: Path) -> None:
    meta = meta_path(path)
    with contextlib.suppress(OSError, ValueError, AttributeError):
        if json.loads(meta.read_text(encoding="utf-8")).get("fingerprint") == settings.fingerprint:
            return
    from . import __version__

    data = {"format": FORMAT, "fingerprint": settings.fingerprint, "settings": settings.as_dict(),
            "input": str(input_path.resolve()), "multidecode": __version__}
    _write_atomically(meta, (json.dumps(data, ensure_ascii=False, indent=2) + "\n").encode("utf-8"))


def run_batch(decoder, input_path: str | os.PathLike, output_path: str | os.PathLike, *,
              questions: Sequence[str] = (), max_new_tokens: int = 48, stop: Sequence[str] = (),
              instruction: str | None = None, retry_failed: bool = False, model: str | None = None,
              speculate=None, **sampling) -> BatchSummary:
    """Run (or resume) a whole batch job silently and return its summary.

    model: the label that goes into the settings fingerprint (default: the model's
    `name_or_path`, which for a local folder is its path).
    speculate: as for `BatchJob.run` (not a setting: it never changes the answers). "suffix" or
    "auto" draft from the answers to the job's earlier documents, which pays on similar ones.
    """
    if model is None:
        name = getattr(decoder.model.config, "name_or_path", None) or getattr(decoder.model.config, "_name_or_path", "")
        model = model_identity(name) if name else type(decoder.model).__name__
    settings = BatchSettings(questions=tuple(questions), max_new_tokens=max_new_tokens, stop=tuple(stop),
                             sampling=sampling, instruction=instruction, model=model,
                             dtype=str(decoder.model.dtype).removeprefix("torch."))
    with open_batch(input_path, output_path, settings, retry_failed=retry_failed) as job:
        for _ in job.run(decoder, speculate=speculate):
            pass
        return job.summary()
