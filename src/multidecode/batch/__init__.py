"""Batch jobs: the same questions about many documents, into one resumable JSON Lines file.

Thousands of transcripts, the same 8 questions for each: every document is answered as
`MultiDecoder.ask` would answer it alone, several documents share each forward (`merged`), and
each line's record is appended to the output the moment it finishes. The library prints nothing:
`BatchJob.run` yields a `LineResult` per finished line; `multidecode batch` only formats them.

Usage::

    settings = BatchSettings(questions=("Who called?", "Was it solved?"), max_new_tokens=48)
    with open_batch("calls.jsonl", "answers.jsonl", settings) as job:   # checks, locks, repairs
        for result in job.run(decoder):                                  # one per finished line
            ...
        summary = job.summary()
    # or, all at once: run_batch(decoder, "calls.jsonl", "answers.jsonl", questions=[...])

Speculation (`run(decoder, speculate=...)`, `--speculate`) makes a job faster, never different, so
it is not a setting: a job may resume with another mode. "suffix" (or "auto") drafts from the
answers to the job's earlier documents, which pays on many similar documents.

Input (JSON Lines, UTF-8)
-------------------------
One JSON object per line: ``{"id": "call-17", "document": "...", "questions": ["...", ...]}``.

- ``document``: a non-blank string (required).
- ``questions``: a list of non-blank strings. The job's questions (``BatchSettings.questions``,
  ``--questions-file``, ``-q``) come first, then the line's own, so a line can add questions but
  never drop the job's; a line needs ``questions`` only when the job has none.
- ``id``: a string or an integer, optional: the key of records and of resuming. Without one (or
  with ``null``) a line's id is its 1-based line number. Ids are compared as text (``7`` and
  ``"7"`` are one id). Give ids if the input may be edited between runs; appending is always safe.
- Other keys are ignored; blank lines are skipped (they still count in line numbers).

With a seed s, question i of every document uses seed s + i, so answers do not depend on where a
job was stopped. Duplicate ids are refused before anything runs (the message names their lines):
the job keeps one record per id. A line that cannot be read (bad JSON, not an object, a bad id)
takes its line number as its id, so it is still recorded once.

Output (JSON Lines, UTF-8)
--------------------------
One record per input line, in the order lines finish (merged forests may reorder them)::

    {"id": "call-17", "line": 17,
     "answers": [{"question": "...", "answer": "...", "finish_reason": "stop", "tokens": 12}, ...],
     "error": null, "tokens": 96, "elapsed_s": 0.412, "settings": "3f2a9c0e1b7d"}

A failed line has ``"answers": []`` and ``"error": {"type": ..., "message": ..., "hint": ...}``,
where ``type`` is the exception class (``InvalidInput``, ``PromptTooLong``, or for an unexpected
failure such as running out of memory, its Python class). ``tokens`` counts generated tokens;
``settings`` is the fingerprint of everything the answers depend on. Each record is one
``write`` of the line and its newline, in append mode, then ``fsync``: a crash can at worst
leave one unfinished last line. ``OUT.meta.json`` holds the settings behind the fingerprint
(model, dtype, job questions, max_new_tokens, stop, sampling, instruction), for people and for
naming what changed; the records alone carry what resuming needs.

Resuming
--------
Running the same job again resumes it, after Ctrl-C, a kill or a crash. On open, before anything runs:

- an unfinished or unreadable last line (a write cut short) is truncated away and done again;
  any other line that is not a record stops the job (nothing is dropped from inside a file);
- every id with a record is skipped, failed ones included (a failure is a result), unless
  ``retry_failed=True`` (``--retry-failed``): then the output is first rewritten without the
  failed records of the input's ids (a temporary file, fsync-ed, renamed over it), and those
  lines run again. Every id has at most one record at every moment;
- records made with other settings stop the job, naming the differences (device, speculation
  and the forest budget do not count: they do not change the answers);
- while a job writes, it holds a lock on ``OUT.lock`` (an ``flock``, via ``filelock``), so two
  runs cannot interleave; the lock dies with its process, so a killed run leaves none behind.

`BatchJob.stop()` asks `run` to start no further line (the CLI calls it on the first Ctrl-C or
SIGTERM); the lines in flight finish. Records that exist stay valid in every case.

Errors
------
A problem with one line (bad JSON, no document, an empty question, a document too long for the
model, ...) is recorded in its record and the job goes on. A problem with the job (a missing
input, duplicate ids, an output with other settings or not a batch output, an output locked by
another run) raises a `MultiDecodeError` from `open_batch` before anything runs. Unexpected
failures are recorded too, but `MAX_CONSECUTIVE_CRASHES` in a row stop the job with
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
from .output import FORMAT, lock_path, meta_path

__all__ = ["FORMAT", "MAX_CONSECUTIVE_CRASHES", "BatchAborted", "BatchJob", "BatchSettings", "BatchSummary",
           "InputLine", "LineResult", "id_key", "lock_path", "meta_path", "model_identity", "open_batch", "parse_line",
           "run_batch", "scan_input", "total_stats"]
