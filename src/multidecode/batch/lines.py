"""A batch job's input: a typed model of one line, whose complaints are reworded in the format's
terms, and the checks of the whole file (see `multidecode.batch` for the format)."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr, ValidationError

from ..constraints import BEST_EFFORT_HINT, Constraint
from ..errors import InvalidArgument, InvalidInput, MultiDecodeError, check_text_bytes, is_int
from ..sampling_params import per_branch_sampling
from ..strategies.ask import check_document

LINE_HINT = 'each line must be one JSON object, e.g. {"id": "call-1", "document": "...", "questions": ["..."]}'


def _not_blank(text: str) -> str:
    if not text.strip():
        raise ValueError("blank")
    return text


class LineModel(BaseModel):
    """What a line must hold; other keys are ignored. `parse_line` words its errors."""

    model_config = ConfigDict(strict=True, extra="ignore")
    id: Annotated[StrictStr, AfterValidator(_not_blank)] | StrictInt | None = None
    document: Annotated[StrictStr, AfterValidator(lambda text: check_document(text) or text)]
    questions: list[Annotated[StrictStr, AfterValidator(_not_blank)]] | None = None
    sampling: dict[StrictStr, Any] | None = None
    json_schema: dict | StrictBool | None = None  # true: any JSON value (false is refused)
    json_schema_strict: StrictBool | None = None


@dataclass(frozen=True)
class InputLine:
    """One non-blank input line, parsed. error says why it cannot run (then it is recorded as failed).
    sampling: the line's own sampling settings, over the job's (logit bias keys as token ids);
    constraint: the line's own JSON schema, which its answers follow (None: the job's); strict
    unless the line says "json_schema_strict": false (best effort: keywords the engine cannot
    enforce are ignored, as `Constraint.json_schema(strict=False)` does)."""

    line: int
    id: str | int
    document: str | None = None
    questions: tuple[str, ...] = ()
    error: MultiDecodeError | None = None
    sampling: dict[str, Any] = field(default_factory=dict, hash=False)
    constraint: Constraint | None = None
    nothing_to_ask: bool = False  # no questions of its own and none from the job (its error says so)
    unreadable: bool = False  # no JSON object at all (bad JSON, not UTF-8, a list...): its id is its number
    id_unread: bool = False  # an id given but not usable (or none readable): its number stands for it

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


def _explain(problem: dict, data: dict) -> MultiDecodeError:
    """pydantic's first complaint about a line, in the words of the input format."""
    (field, *where), value = problem["loc"], problem["input"]
    if field == "id":
        got = "an empty string" if isinstance(data["id"], str) else _kind(data["id"])
        return InvalidInput(f'"id" must be a string or an integer, got {got}',
                            'use a text id such as "call-17", or leave "id" out to use the line number')
    if field == "sampling":
        return InvalidInput(f'"sampling" must be an object, got {_kind(value)}',
                            'e.g. "sampling": {"temperature": 0.7, "logit_bias": {"42": -100}}')
    if field == "document":
        if problem["type"] == "missing":
            return InvalidInput('the line has no "document"', 'add "document": "the text to ask about"')
        if isinstance(error := problem.get("ctx", {}).get("error"), MultiDecodeError):
            return error  # check_document's: empty, or not valid Unicode
        return InvalidInput(f'"document" must be a string, got {_kind(value)}', "put the document's text in a string")
    if field == "json_schema_strict":
        return InvalidInput(f'"json_schema_strict" must be true or false, got {_kind(value)}',
                            'use "json_schema_strict": false for best effort, or leave it out')
    if field == "json_schema":
        return InvalidInput(f'"json_schema" must be a JSON object (a JSON schema) or true, got {_kind(value)}',
                            'use "json_schema": {"type": "object", "properties": {...}}')
    if not where:
        if isinstance(value, str):
            return InvalidInput('"questions" must be a list of strings, got one string', 'wrap it in a list: ["..."]')
        return InvalidInput(f'"questions" must be a list of strings, got {_kind(value)}',
                            'use "questions": ["...", "..."]')
    if problem["type"] == "value_error":
        return InvalidInput(f"question {where[0] + 1} of the line is empty", "remove it or write the question")
    return InvalidInput(f"question {where[0] + 1} of the line is {_kind(value)}, not a string",
                        "write each question as a string")


def _spelling(key: str) -> str:
    return key.lower().replace("-", "").replace("_", "").replace(" ", "")


_KNOWN_SPELLINGS = {_spelling(name): name for name in LineModel.model_fields if name != "id"}
"""A line's keys by their letters alone (not "id": a line without one takes its line number)."""


def _misspelt_key(data: dict) -> tuple[str, str] | None:
    """A key that is one of a line's keys in another case or with other separators ("Questions",
    "Document", "json-schema"), which would otherwise be ignored as any other key is: (key, the
    key meant). Other words ("question", a dataset's own field) stay ordinary keys."""
    for key in data:
        meant = _KNOWN_SPELLINGS.get(_spelling(key)) if isinstance(key, str) else None
        if meant is not None and key != meant and meant not in data:
            return key, meant
    return None


def parse_line(raw: bytes, line: int, job_questions: Sequence[str] = ()) -> InputLine:
    """Parse one input line (bytes, without its newline). Never raises for bad content: the
    problem comes back as `.error`, and the id falls back to the line number when unreadable."""
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        return InputLine(line, line, error=InvalidInput(
            f"line {line} is not UTF-8 text (bad byte at column {err.start + 1})", "save the input as UTF-8"),
            unreadable=True, id_unread=True)
    except ValueError as err:  # JSONDecodeError, or a number too long to read
        why = f"{err.msg}, column {err.colno}" if isinstance(err, json.JSONDecodeError) else str(err)
        return InputLine(line, line, error=InvalidInput(f"line {line} is not valid JSON ({why})", LINE_HINT),
                         unreadable=True, id_unread=True)
    except RecursionError:  # Python's json reads about a thousand levels of nesting
        return InputLine(line, line, error=InvalidInput(f"line {line} is nested too deeply to read",
                                                        "nest its objects and lists less deeply"),
                         unreadable=True, id_unread=True)
    if not isinstance(data, dict):
        return InputLine(line, line, error=InvalidInput(f"line {line} is {_kind(data)}, not a JSON object", LINE_HINT),
                         unreadable=True, id_unread=True)
    misspelt = _misspelt_key(data)
    if misspelt is not None:
        given = data.get("id")
        usable = bool((isinstance(given, str) and given.strip()) or is_int(given))
        key, meant = misspelt
        return InputLine(line, given if usable else line, error=InvalidInput(
            f'the line has "{key}", which is not a key a line may have: did you mean "{meant}"?',
            f'rename it to "{meant}" (other keys are ignored: this one would have been, silently)'),
            id_unread=given is not None and not usable)
    try:
        parsed = LineModel.model_validate(data)
    except ValidationError as err:
        problem = err.errors()[0]
        ident = line if problem["loc"][0] == "id" or data.get("id") is None else data["id"]
        return InputLine(line, ident, error=_explain(problem, data), id_unread=problem["loc"][0] == "id")
    ident = line if parsed.id is None else parsed.id
    questions = tuple(job_questions) + tuple(parsed.questions or ())
    if not questions:
        own = 'has no "questions"' if parsed.questions is None else 'has an empty "questions" list'
        if parsed.questions is None and "question" in data:
            own += ' (it has "question": a list of them goes in "questions")'
        return InputLine(line, ident, error=InvalidInput(
            f"the line {own} and the job has none",
            'add "questions": ["..."] to the line, or give questions for every line (--questions-file, -q)'),
            nothing_to_ask=True)
    try:
        sampling = _line_sampling(parsed.sampling or {}, len(questions))
    except MultiDecodeError as err:
        return InputLine(line, ident, error=InvalidInput(f'the line\'s "sampling": {err.message}', err.hint))
    try:
        constraint = _line_constraint(parsed)
    except MultiDecodeError as error:
        return InputLine(line, ident, error=error)
    return InputLine(line, ident, parsed.document, questions, sampling=sampling, constraint=constraint)


def _line_constraint(parsed: LineModel) -> Constraint | None:
    """The line's own JSON schema as a constraint (None: the job's). Whatever the engine refuses
    in it is an `InvalidArgument` (`Constraint.json_schema` turns all of llguidance's complaints
    into one), so the line is recorded as failed and the job goes on; the best-effort hint is
    worded for the line's own field, where --no-strict (the run's schema) would not help."""
    if parsed.json_schema is None:
        if parsed.json_schema_strict is not None:
            raise InvalidInput('the line has "json_schema_strict" but no "json_schema"',
                               'add the line\'s "json_schema", or leave "json_schema_strict" out')
        return None
    try:
        return Constraint.json_schema(parsed.json_schema, strict=parsed.json_schema_strict is not False)
    except InvalidArgument as error:
        if error.hint != BEST_EFFORT_HINT:
            raise
        raise InvalidArgument(error.message, 'leave those keywords out, or add "json_schema_strict": false to '
                                             'the line for best effort') from None


def _line_sampling(settings: dict, n: int) -> dict:
    """A line's sampling settings as `per_branch_sampling` takes them (one value, or one per
    question), checked; a logit bias's JSON keys ("42") become token ids."""
    settings = dict(settings)
    bias = settings.get("logit_bias")
    if isinstance(bias, dict):
        settings["logit_bias"] = _token_keys(bias)
    elif isinstance(bias, list):
        settings["logit_bias"] = [_token_keys(b) if isinstance(b, dict) else b for b in bias]
    per_branch_sampling(n, settings)
    return settings


def _token_keys(bias: dict) -> dict:
    bad = [key for key in bias if not (key.isascii() and key.isdigit())]
    if bad:
        raise InvalidInput(f"logit_bias keys must be token ids, got {bad[0]!r}", 'e.g. "logit_bias": {"42": -100}')
    return {int(key): value for key, value in bias.items()}


def input_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, raw bytes without the line end) for each non-blank line."""
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            if number == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            raw = raw.rstrip(b"\r\n")
            if raw.strip():
                yield number, raw


def check_input_file(path: Path) -> None:
    """Refuse an input the job cannot read again to resume (standard input), or that is missing,
    a folder, or not text, before anything runs."""
    if str(path) == "-":
        raise InvalidInput("batch needs its input in a file, not standard input",
                           "it reads the input again to resume; save it to a file first")
    if not path.exists():
        raise InvalidInput(f"the input file {path} does not exist", "check the path")
    if path.is_dir():
        raise InvalidInput(f"the input file {path} is a folder", "pass a JSON Lines file, one JSON object per line")
    if not path.is_file():  # a pipe (/dev/stdin, <(...), a fifo): read once, it is gone, or it waits for a writer
        raise InvalidInput(f"the input {path} is a pipe or a device, not a file",
                           "it reads the input again to resume; save it to a file first")
    with open(path, "rb") as handle:
        head = handle.read(8192)
    check_text_bytes(head, str(path), "JSON Lines input")


def scan_input(path: Path, job_questions: Sequence[str] = ()) -> list[tuple[int, str]]:
    """(line, key) of every non-blank input line, in order. Refuses duplicate ids, naming their lines."""
    on_lines: dict[str, list[int]] = {}  # key -> the lines it is on
    ids: dict[str, object] = {}
    repeated: list[str] = []  # keys on more than one line, in the order they were found
    lines: list[tuple[int, str]] = []
    unusable: dict[int, str] = {}  # line -> why its id could not be read (its number stands for it)
    unreadable = 0  # lines that are no JSON object at all
    asked = bool(job_questions)  # whether any line has something to ask
    first_unasked: InputLine | None = None  # the first line with nothing to ask, whose error says why
    for number, raw in input_lines(path):
        item = parse_line(raw, number, job_questions)
        asked = asked or not item.nothing_to_ask
        first_unasked = first_unasked or (item if item.nothing_to_ask else None)
        if item.id_unread:
            unusable[number] = item.error.message
        unreadable += item.unreadable
        on_lines.setdefault(item.key, []).append(number)
        if len(on_lines[item.key]) == 2:
            repeated.append(item.key)
        ids[item.key] = item.id  # as its latest line spells it (7 and "7" are one id)
        lines.append((number, item.key))
    clashes = [f"id {ids[key]!r} is on lines {', '.join(map(str, on_lines[key][:-1]))} and {on_lines[key][-1]}"
               + "".join(f" (line {n}'s id is its number, as it could not be read: {unusable[n]})"
                         for n in on_lines[key] if n in unusable)
               for key in repeated]
    if clashes:
        more = f" and {len(clashes) - 3} more" if len(clashes) > 3 else ""
        raise InvalidInput(f"{path} has duplicate ids: {'; '.join(clashes[:3])}{more}",
                           "give every line its own id (a line without one takes its line number as its id), and "
                           "mend the lines that cannot be read" if unusable else
                           "give every line its own id (a line without one takes its line number as its id)")
    if not lines:
        raise InvalidInput(f"{path} has no input lines", LINE_HINT)
    if unreadable == len(lines):  # a JSON array, a CSV, another format: every line would fail alike
        first = min(unusable)
        raise InvalidInput(f"no line of {path} can be read as a job's line (line {first}: {unusable[first]})",
                           LINE_HINT + " (a JSON array: write one element per line)")
    if not asked:  # every line would fail alike: the job's mistake, not the lines'
        example = f" (line {first_unasked.line}: {first_unasked.error.message})" if first_unasked else ""
        raise InvalidInput(f"there is nothing to ask: the job has no questions and no line of {path} has any{example}",
                           'give the job\'s questions (-q, --questions-file), or a "questions" list on each line')
    return lines
