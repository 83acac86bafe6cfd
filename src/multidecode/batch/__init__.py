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

from .job import (
    MAX_CONSECUTIVE_CRASHES,
    BatchAborted,
    BatchJob,
    BatchSettings,
    BatchSummary,
    LineResult,
    model_identity,
    open_batch,
    run_batch,
    total_stats,
)
from .lines import InputLine, id_key, parse_line, scan_input
from .output import FORMAT, meta_path

__all__ = ["FORMAT", "MAX_CONSECUTIVE_CRASHES", "BatchAborted", "BatchJob", "BatchSettings", "BatchSummary",
           "InputLine", "LineResult", "id_key", "meta_path", "model_identity", "open_batch", "parse_line",
           "run_batch", "scan_input", "total_stats"]
