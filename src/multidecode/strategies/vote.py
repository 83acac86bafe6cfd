"""Parallel reasoning and self-consistency: n sampled traces in one forest, and a majority vote.

Self-consistency (Wang et al., 2022, arXiv 2203.11171) samples several reasoning traces for one
question and answers with the most frequent final answer. Here the traces are branches of one
forest over one prefill. An *extractor* turns a trace into its final answer; the default reads an
"Answer:" line, else the last number, else the last line, and can be replaced. A trace held to a
constraint (a JSON schema, a regex, a grammar) is its answer whole: the constraint is the answer's
form, so the default votes on the JSON value (written canonically: key order and spacing do not
split a vote) or on the matched text, and a trace cut short before matching gives no answer. To
vote on one field of a JSON answer, pass an extractor (`lambda text: json.loads(text)["answer"]`).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..errors import InvalidArgument, InvalidInput, PromptTooLong
from ..scheduler import Scheduler
from .complete import Completion, complete

INSTRUCTION = "Think step by step. Then give the final answer on its own last line, as 'Answer: <answer>'."
_ANSWER_MARK = re.compile(r"answer\s*(?:is)?\s*[:=]", re.IGNORECASE)
"""What introduces a final answer ("Answer:", "the answer is:"); the text after its last
occurrence on a line is the answer ("the final answer is: Answer: 51" gives 51)."""
_NUMBER = re.compile(r"-?(?:(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)")
"""A number, its commas only those between groups of three digits ("1,200"): "2,3" is two numbers;
a decimal may start at its point (".5")."""
_LETTERS_BEFORE = re.compile(r"[^\d-]*[A-Za-z]")
"""Words before an answer's only number ("x = 5", "about 3"): not a bare number, kept as text."""
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
"""LaTeX's boxed answer (`$\\boxed{51}$`): its content is the answer."""
_ANSWER_PHRASE = re.compile(r"^(?:so\s*,?\s*)?(?:the\s+)?(?:final\s+)?answer\s+is\s+", re.IGNORECASE)
"""A phrase restating the mark before the answer ("Answer: The answer is Paris")."""
_REMARK = re.compile(r"\s+\([^()]*\)\s*$")
"""A remark in parentheses after the answer ("51 (since 17*3=51)")."""
_WORKING = re.compile(r"^[\d\s.,+\-*/×÷^()]*=\s*(?=[^=]*$)")
"""Arithmetic ending in "=" before the answer ("3 * 17 = 51"): no letters, so not "x = 5"."""
_MINUS = str.maketrans({"\u2212": "-"})
"""The minus sign of typography (U+2212) read as "-": "−51" is not 51 (an en dash is a range's, "10–20")."""
_DECORATION = " \t.,:;!?\"'*_`$"
_LEADING_DECORATION = re.compile(r"^(?:[ \t,:;!?\"'*_`]|\.(?!\d))+")
"""Decoration before an answer: the same marks, but not the point of a decimal (".5")."""
_INLINE_MATH = re.compile(r"^\$+(.*?)\$+$")
"""An answer wholly in LaTeX's inline math delimiters ("$x = 5$")."""


@dataclass(frozen=True)
class Trace:
    """One reasoning trace and the answer extracted from it (None when none was found)."""

    text: str
    answer: str | None
    token_ids: list[int]
    finish_reason: str
    seed: int | None
    parsed: object = None  # held to a JSON schema or object: the text's JSON value (None: cut short)
    matched: bool | None = None  # held to a constraint: whether the text matches it whole (None: free)


@dataclass(frozen=True)
class Vote:
    """The majority answer (None if no trace gave one), the vote counts, most frequent first, and the traces."""

    question: str
    answer: str | None
    counts: dict[str, int]
    traces: list[Trace]

    @property
    def tied(self) -> list[str]:
        """The answers that share the highest count, where more than one does (no majority); else []."""
        top = max(self.counts.values(), default=0)
        leaders = [answer for answer, count in self.counts.items() if count == top]
        return leaders if len(leaders) > 1 else []

    @property
    def is_majority(self) -> bool:
        """Whether more than half of all traces gave `answer` (else it is only the most common)."""
        return self.answer is not None and 2 * self.counts[self.answer] > len(self.traces)

    @property
    def agreement(self) -> float:
        """Share of all traces that gave the majority answer."""
        return self.counts.get(self.answer, 0) / len(self.traces) if self.answer is not None else 0.0


def normalize(answer: str) -> str | None:
    """Comparable form of an answer: a LaTeX box's content, without a restating "the answer is", a
    remark in parentheses after it or arithmetic before its "="; then one number in one spelling
    (`_canonical_number`), else lowercase text without surrounding punctuation or markdown emphasis."""
    text = answer.translate(_MINUS).strip()
    if boxed := _BOXED.findall(text):
        text = boxed[-1]
    text = _INLINE_MATH.sub(r"\1", text)
    text = _REMARK.sub("", _ANSWER_PHRASE.sub("", _LEADING_DECORATION.sub("", text.rstrip(_DECORATION))))
    text = _WORKING.sub("", text).strip()
    numbers = _NUMBER.findall(text)
    if len(numbers) == 1 and not _LETTERS_BEFORE.match(text):  # "51", "$1,200", "51 apples"
        return _canonical_number(numbers[0])
    return text.lower() or None


def _canonical_number(number: str) -> str:
    """One spelling per value: no group commas, leading zeros or trailing decimal zeros, and
    no sign on zero ("007" is "7", "-0.0" is "0", ".5" is "0.5")."""
    sign, digits = ("-", number[1:]) if number.startswith("-") else ("", number)
    whole, _, fraction = digits.replace(",", "").partition(".")
    value = (whole.lstrip("0") or "0") + ("." + fraction.rstrip("0") if fraction.rstrip("0") else "")
    return "0" if value == "0" else sign + value


def extract_answer(trace: str, *, marked_only: bool = False) -> str | None:
    """The final answer of a trace: an 'Answer: ...' line, else its last number, else its last line.
    marked_only: the 'Answer:' line alone (for a trace cut short, whose last number is any number
    it was working with: "17 * 3" cut after its restatement of the question would vote 3)."""
    trace = trace.translate(_MINUS)
    lines = [line.strip() for line in trace.strip().splitlines() if line.strip()]
    for i in reversed(range(len(lines))):
        marks = list(_ANSWER_MARK.finditer(lines[i]))
        if not marks:
            continue
        after = lines[i][marks[-1].end():]
        if after.strip():
            return normalize(after)
        if i + 1 < len(lines):  # "Answer:" ending its line: the answer is the next line
            return normalize(lines[i + 1])
    if marked_only:
        return None
    numbers = _NUMBER.findall(trace)
    if numbers:
        return normalize(numbers[-1])
    if not lines or _ANSWER_MARK.fullmatch(lines[-1].rstrip(_DECORATION) + ":"):  # ended on a bare "Answer:"
        return None
    return normalize(lines[-1])


def constrained_answer(completion: Completion) -> str | None:
    """The answer of a trace held to a constraint: its JSON value in canonical form (sorted keys,
    one spacing), else its matched text normalised; None when it was cut short of a match."""
    if not completion.matched:
        return None
    if completion.parsed is not None:
        return json.dumps(completion.parsed, sort_keys=True, ensure_ascii=False)
    return normalize(completion.text)


def vote_prompt(question: str, instruction: str | None = INSTRUCTION, *, constrained: bool = False) -> str:
    """The prompt of every trace: the question, then the instruction. Under a constraint the
    default instruction (an "Answer:" line) is left out: the constraint forbids that line."""
    if not isinstance(question, str):
        raise InvalidInput(f"the question must be text, got {type(question).__name__}", "pass the question as a string")
    if not question.strip():
        raise InvalidInput("the question is empty", "write the question to reason about")
    if constrained and instruction == INSTRUCTION:
        instruction = None
    return question.strip() + (f"\n{instruction}" if instruction else "")


def vote_settings(sampling: dict) -> dict:
    """Self-consistency samples at temperature 0.7 unless told otherwise."""
    return {"temperature": 0.7, **sampling}


def tally(question: str, done: Sequence[Completion], extract: Callable[[str], str | None] | None = None) -> Vote:
    """Extract each trace's answer and count the votes. extract: text -> answer; None (the
    default) takes a constrained trace whole (`constrained_answer`) and reads a free one with
    `extract_answer`, by its 'Answer:' line alone where max_new_tokens cut it short."""
    def answer(c: Completion) -> str | None:
        if extract is not None:
            return as_vote(extract(c.text))
        if c.matched is not None:
            return constrained_answer(c)
        return extract_answer(c.text, marked_only=c.finish_reason == "length")

    traces = [Trace(c.text, answer(c), c.token_ids, c.finish_reason, c.seed, c.parsed, c.matched) for c in done]
    counts = Counter(t.answer for t in traces if t.answer is not None)
    ranked = dict(counts.most_common())  # ties keep the order in which answers first appeared
    return Vote(question, next(iter(ranked), None), ranked, traces)


def as_vote(answer):
    """An extractor's answer as a vote: it must be hashable (text, a number) or None (no answer)."""
    try:
        hash(answer)
    except TypeError:
        raise InvalidArgument(f"extract returned a {type(answer).__name__}, which cannot be counted as a vote",
                              "return text or a number (None: no answer), e.g. json.dumps(value, sort_keys=True)"
                              ) from None
    return answer


def vote(scheduler: Scheduler, tokenizer, question: str, *, n: int = 8, max_new_tokens: int = 256,
         extract: Callable[[str], str | None] | None = None, instruction: str | None = INSTRUCTION,
         **settings) -> Vote:
    """Sample n traces for `question` in one forest and vote on their extracted answers (see `tally`);
    `settings` are `complete`'s (speculate, constraint, chat, stop, sampling) but logprobs, which no
    `Trace` keeps."""
    if settings.get("logprobs") is not None:
        raise InvalidArgument("vote keeps no log-probabilities, so it takes no logprobs=",
                              "use complete(prompt, n=..., logprobs=k) to rank the traces by them")
    if extract is not None and not callable(extract):
        raise InvalidArgument(f"extract must be a function from a trace's text to its answer, got {extract!r}",
                              "pass e.g. extract=lambda text: text.split()[-1], or none for the default")
    prompt = vote_prompt(question, instruction, constrained=settings.get("constraint") is not None)
    try:
        done = complete(scheduler, tokenizer, prompt, n=n, max_new_tokens=max_new_tokens, **vote_settings(settings))
    except PromptTooLong as err:  # said of the question (the forest's words are a document's: "use margins")
        shorter = "shorten the question" + (" (or the instruction)" if instruction else "")
        raise PromptTooLong(err.message, shorter if not err.fits else f"lower max_new_tokens to {err.fits}, or "
                            f"{shorter}", fits=err.fits) from None
    return tally(question, done, extract)
