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
it is not a setting: a job may resume with another mode.

The input and output formats, resuming, the lock and the errors are documented in `docs/batch.md`.
"""

from .job import (
           MAX_CONSECUTIVE_CRASHES,
           BatchAborted,
           BatchJob,
           BatchSummary,
           LineResult,
           open_batch,
           run_batch,
           total_stats,
)
from .lines import InputLine, id_key, parse_line, scan_input
from .output import FORMAT, lock_path, meta_path
from .settings import BatchSettings, model_identity

__all__ = ["FORMAT", "MAX_CONSECUTIVE_CRASHES", "BatchAborted", "BatchJob", "BatchSettings", "BatchSummary",
           "InputLine", "LineResult", "id_key", "lock_path", "meta_path", "model_identity", "open_batch", "parse_line",
           "run_batch", "scan_input", "total_stats"]
