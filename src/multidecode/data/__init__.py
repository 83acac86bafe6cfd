"""Texts shipped with the package: the sample documents, questions and workloads that the demo,
`multidecode explain`, the self-draft's layer choice and the benchmarks run on.

- `support_call.txt`: a support-call transcript (about 1,400 tokens), the sample document;
  `support_call_questions.txt` its 8 questions, `support_call_extra_questions.txt` 8 more;
- `water_board_meeting.txt`: minutes of a meeting, long enough to cut into chunks (margins);
- `shipping_quote.py.txt`, `speculate_workloads.jsonl`: the speculation benchmark's workloads;
- `self_draft_sample.txt`: prose and code to choose a self-draft's skipped layers on;
- `example_batch.jsonl`: a batch job's input, as `docs/batch.md` describes it;
- `similar_call_problems.jsonl`, `similar_call_parts.json`, `call_log_questions.txt`: what
  `bench batch` builds its support calls (problems, people, routers, visits, credits) and day logs
  from, and asks about the logs;
- `structured_calls.json`: `bench structured`'s short support calls, the instruction they are
  read with and the record's JSON schema;
- `drafters/<model shape>/<kind>/`: learned draft heads shipped for the embedded model;
- `distill_prompts.jsonl`: the prompts `multidecode train-drafter` distills on by default.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

SAMPLE_DOCUMENT = "support_call.txt"
SAMPLE_QUESTIONS = "support_call_questions.txt"
EXCERPT_CHARS = 1200
"""The sample excerpt's length by default (`multidecode explain`'s document): about 300 tokens with
the embedded model's tokenizer."""


def folder() -> Path:
    """This folder on disk."""
    return Path(str(resources.files(__name__)))


def text(name: str) -> str:
    """A text file of this folder, by name."""
    return resources.files(__name__).joinpath(name).read_text(encoding="utf-8")


def lines(name: str) -> list[str]:
    """A text file of this folder as its non-blank lines, stripped."""
    return [line.strip() for line in text(name).splitlines() if line.strip()]


def sample_document() -> str:
    """The sample document: a support-call transcript."""
    return text(SAMPLE_DOCUMENT)


def sample_questions(name: str = SAMPLE_QUESTIONS) -> list[str]:
    """The sample document's 8 questions (or, by name, its 8 extra questions)."""
    return lines(name)


def sample_excerpt(max_chars: int = EXCERPT_CHARS) -> str:
    """The beginning of the sample document: whole paragraphs, at most `max_chars` characters."""
    kept: list[str] = []
    for paragraph in sample_document().split("\n\n"):
        if kept and sum(len(p) + 2 for p in kept) + len(paragraph) > max_chars:
            break
        kept.append(paragraph)
    return "\n\n".join(kept).strip()


def sample_opening(tokens: int, length) -> str:
    """The sample document's opening lines, as many as it takes for `length(text)` (the tokens of
    what is built from them) to reach `tokens` (the whole document if it never does)."""
    excerpt = ""
    for line in sample_document().splitlines(keepends=True):
        excerpt += line
        if length(excerpt.strip()) >= tokens:
            break
    return excerpt.strip()


def self_draft_sample() -> str:
    """Prose and code to choose a self-draft's skipped layers on, when the user gives no text."""
    return text("self_draft_sample.txt")


__all__ = ["lines", "sample_document", "sample_excerpt", "sample_opening", "sample_questions", "self_draft_sample", "text"]
