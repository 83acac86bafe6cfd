"""Batch-job inputs and outputs for the tests of `multidecode batch` (local and on Ray).

`write_lines` writes a JSON Lines input, `documents(n)` makes n small documents with two
questions each, `records` reads an output back (checking it ends with a whole line), `by_id`
keys records by id (refusing duplicates), `results` drops what may differ between runs (the
timing), and `one_thread` runs torch on one thread, as the job's subprocesses and Ray workers do,
so that in-process reference runs match their numerics.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import torch

WORDS = ["router", "cable", "ticket", "fiber", "call", "modem", "line", "signal", "office", "evening", "light", "storm"]


@contextmanager
def one_thread():
    """Subprocesses run with OMP_NUM_THREADS=1; in-process reference runs match their numerics."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def write_lines(path: Path, rows) -> Path:
    """rows: dicts (written as JSON) or raw strings (written as they are)."""
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows),
                    encoding="utf-8")
    return path


def records(path: Path) -> list[dict]:
    text = path.read_text(encoding="utf-8")
    assert text == "" or text.endswith("\n"), "the output ends with an unfinished line"
    return [json.loads(line) for line in text.splitlines()]


def by_id(rows: list[dict]) -> dict:
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)), f"duplicate ids: {sorted(i for i in ids if ids.count(i) > 1)}"
    return {r["id"]: r for r in rows}


def results(rows: list[dict]) -> dict:
    """What must not depend on interruptions: everything but the timing."""
    return {r["id"]: {k: v for k, v in r.items() if k != "elapsed_s"} for r in rows}


def documents(n: int) -> list[dict]:
    return [{"id": f"doc-{i}", "document": f"Call {i}: the {WORDS[i % 12]} and the {WORDS[(i * 5) % 12]} failed.",
             "questions": ["what failed?", f"when did call {i} happen?"]} for i in range(n)]
