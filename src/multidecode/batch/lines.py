"""Reading a batch job's input: JSON Lines, one document and its questions per line (see `multidecode.batch`)."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import InvalidInput, MultiDecodeError
from ..strategies.ask import check_document

LINE_HINT = 'each line must be one JSON object, e.g. {"id": "call-1", "document": "...", "questions": ["..."]}'


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

