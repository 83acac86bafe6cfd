"""Writing in the margins (arXiv 2408.14906): a note per chunk of a long context, in one pass.

A long document is cut into chunks. For every chunk the model writes a short note about the
user's question (a *margin*); the margins are classified relevant or not; the final answer is
generated from the question and the relevant margins.

With MultiDecode all margins are written in one forest: each chunk's prompt is the whole prompt it
would have alone (the chat template around the question, the instruction, and the chunk). The
prompts' common run of ids (the template's start, the question and the instruction) is prefilled
once; each chunk's own ids form one branch, so chunks never see each other, and every greedy
margin equals greedy generation from that chunk's own prompt. The relevance check is one more
forest pass (one branch per margin, no decoding: the yes/no logits at each branch's end), and the
answer is one more branch.

Stages, each usable on its own:

- `split_document` / `chunks_from_list`: the chunks and their character spans;
- `margin_prompts`: the whole prompt ids of each chunk;
- `prompt_logits`: the next-token logits after whole prompts, in one feed (`PromptLogits`);
- `YesNoClassifier`: the default relevance classifier (replaceable by any callable);
- `start` -> `MarginsRun`: stream the margins, then `judge()`, then stream the answer;
- `margins`: all of it, returning a `Margins`.
"""

from __future__ import annotations

import math
import re
import string
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from numbers import Real

import torch

from ..branches import BranchRun, TokenEvent, check_fits, check_memory, prompt_feed, start_prompts, token_ids
from ..engine import FeedResult
from ..errors import InvalidArgument, InvalidInput, PromptTooLong, as_list, check_positive
from ..memory import most_branches
from ..prompts import check_document, check_text, render_prompt, share_prefix, tokenize_prompt
from ..sampling_params import per_branch_sampling
from ..scheduler import Feed, Scheduler, Settled, Work, new_scheduler
from ..stopping import stop_strings_of

NOTHING_RELEVANT = "Nothing relevant."
"""What a margin says when its chunk holds nothing about the question (the prompt asks for it)."""

MARGIN_TEMPLATE = (
    "Question: {question}\n\nBelow is one part of a long document. Write a short note with the facts from "
    "this part that help answer the question. If this part says nothing about the question, write "
    f"'{NOTHING_RELEVANT}'\n\n\"\"\"\n{{chunk}}\n\"\"\""
)
"""The user message for one chunk. Everything before `{chunk}` (the question and the instruction)
is common to all chunks, so it is prefilled once and each chunk's branch holds only its own text."""

RELEVANCE_TEMPLATE = "Question: {question}\nNote: {note}\nIs this note relevant to the question? Answer yes or no."
"""The user message for one margin's relevance check; the next token is read, not generated."""

ANSWER_TEMPLATE = (
    "Here are notes taken from the parts of a document that matter for a question.\n\n{notes}\n\n"
    "Question: {question}\nAnswer in one short sentence."
)
"""The user message for the final answer; `{notes}` is one '- note' line per relevant margin."""

NO_NOTES = "(No part of the document was found relevant.)"

YES_WORDS = ("yes",)
NO_WORDS = ("no",)

Classifier = Callable[[str, Sequence[str]], Sequence[float]]
"""classify(question, notes) -> one score per note; a note is relevant when its score is above
the threshold (0 by default; a bool counts as 1.0 or 0.0)."""

_PARAGRAPH = re.compile(r"\n[ \t\r\f\v]*\n\s*")
_LINE = re.compile(r"\n\s*")
_SENTENCE = re.compile(r"""(?:(?<=[.!?])|(?<=[.!?]["')\]]))\s+""")
_WORD = re.compile(r"\s+")
_LEVELS = (_PARAGRAPH, _LINE, _SENTENCE, _WORD)
_SENTENCE_LEVEL = 3  # levels below this (paragraph, line, sentence) always split
CHUNK_FILL = 0.7
"""A chunk ends at the strongest boundary that leaves it at least this full (of chunk_tokens)."""
_SAYS_NOTHING = re.compile(r"^\W*(nothing\b|none\W*$|n/?a\W*$|not relevant|no relevant)|nothing relevant", re.IGNORECASE)


# ---------------------------------------------------------------------- results
@dataclass(frozen=True)
class Chunk:
    """One part of the document. `document[start:end] == text`; tokens is its (approximate) token count."""

    index: int
    start: int
    end: int
    text: str
    tokens: int

    @property
    def span(self) -> tuple[int, int]:
        return (self.start, self.end)


@dataclass(frozen=True)
class Margin:
    """One chunk's note and its verdict.

    span: the chunk's (start, end) characters in `Margins.document`; prompt_ids: the whole prompt
    the note was generated from (greedy generation from it alone gives token_ids).
    relevance_score: the classifier's score (for the default, log P(yes) - log P(no)); None when
    the note was set aside unclassified because it says nothing relevant (or is empty).
    in_answer: whether the answer's prompt holds the note: every relevant one, but where together
    they would not fit in the model's window, the most relevant that do (`Margins.left_out`).
    """

    chunk_index: int
    span: tuple[int, int]
    chunk_text: str
    text: str
    token_ids: list[int]
    prompt_ids: list[int]
    finish_reason: str
    relevant: bool
    relevance_score: float | None
    in_answer: bool = False


@dataclass(frozen=True)
class Margins:
    """The margins of every chunk, and the answer written from the relevant ones.

    document: the text the spans index into (the document as given, or the chunks joined by a
    blank line when a list of chunks was given).
    stats: forward passes of each stage and the largest KV cache each held.
    """

    question: str
    document: str
    margins: list[Margin]
    answer: str
    answer_token_ids: list[int]
    answer_prompt_ids: list[int]
    answer_finish_reason: str
    stats: dict = field(default_factory=dict)

    @property
    def relevant(self) -> list[Margin]:
        return [m for m in self.margins if m.relevant]

    @property
    def left_out(self) -> list[Margin]:
        """Relevant margins the answer's prompt could not hold (the model's window was full)."""
        return [m for m in self.margins if m.relevant and not m.in_answer]


# ---------------------------------------------------------------------- chunks
def check_question(question: str) -> None:
    check_text(question, "the question", "write the question the margins should be about")


@dataclass(frozen=True)
class _Atom:
    """A piece no chunk boundary falls inside, and how strong the boundary before it is."""

    start: int
    end: int
    tokens: int
    strength: int  # 4 paragraph, 3 line, 2 sentence, 1 word, 0 inside a word


class _Counter:
    """Token counts of pieces of one text (each piece tokenized alone: an estimate for chunking)."""

    def __init__(self, tokenizer, text: str) -> None:
        self.tokenizer, self.text = tokenizer, text

    def __call__(self, start: int, end: int) -> int:
        return len(self.tokenizer(self.text[start:end], add_special_tokens=False)["input_ids"])


def _trimmed(text: str, start: int, end: int) -> tuple[int, int] | None:
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    return (start, end) if start < end else None


def _split(text: str, start: int, end: int, pattern: re.Pattern) -> list[tuple[int, int]]:
    """The trimmed, non-empty parts of text[start:end] between matches of `pattern`."""
    parts, at = [], start
    for match in pattern.finditer(text, start, end):
        if (span := _trimmed(text, at, match.start())) is not None:
            parts.append(span)
        at = match.end()
    if (span := _trimmed(text, at, end)) is not None:
        parts.append(span)
    return parts


def _atoms(text: str, span: tuple[int, int], limit: int, count: _Counter, level: int = 0,
           strength: int = len(_LEVELS)) -> list[_Atom]:
    """Cut `span` into sentences (and a sentence longer than `limit` tokens into words, a word
    longer than that into runs of characters), each marked with the strength of the boundary
    before it: 4 paragraph, 3 line, 2 sentence, 1 word, 0 inside a word."""
    if level < _SENTENCE_LEVEL:  # paragraphs, lines and sentences are always separate atoms
        parts = _split(text, *span, _LEVELS[level])
        return [a for j, part in enumerate(parts)
                for a in _atoms(text, part, limit, count, level + 1, strength if j == 0 else len(_LEVELS) - level)]
    tokens = count(*span)
    if tokens <= limit:
        return [_Atom(*span, tokens, strength)]
    if level < len(_LEVELS):
        parts = _split(text, *span, _LEVELS[level])
        if len(parts) > 1:
            return [a for j, part in enumerate(parts)
                    for a in _atoms(text, part, limit, count, level + 1, strength if j == 0 else len(_LEVELS) - level)]
    # One word longer than the limit: runs of characters of equal length.
    start, end = span
    step = math.ceil((end - start) / math.ceil(tokens / limit))
    return [_Atom(a, min(a + step, end), count(a, min(a + step, end)), strength if a == start else 0)
            for a in range(start, end, step)]


def _pack(atoms: list[_Atom], limit: int, fill: float) -> list[list[_Atom]]:
    """Group consecutive atoms into chunks of at most `limit` tokens. When the next atom does not
    fit, the chunk ends at the strongest boundary (paragraph > line > sentence > word) that keeps
    it at least `fill` full, the latest such one on a tie."""
    groups: list[list[_Atom]] = []
    current: list[_Atom] = []
    for atom in atoms:
        while current and sum(a.tokens for a in current) + atom.tokens > limit:
            best, best_strength, size = len(current), -1, 0
            for j in range(1, len(current) + 1):
                size += current[j - 1].tokens
                strength = atom.strength if j == len(current) else current[j].strength
                if size >= fill * limit and strength >= best_strength:
                    best, best_strength = j, strength
            groups.append(current[:best])
            current = current[best:]
        current.append(atom)
    if current:
        groups.append(current)
    return groups


def split_document(tokenizer, document: str, chunk_tokens: int = 300) -> list[Chunk]:
    """Cut `document` into chunks of about `chunk_tokens` tokens (at most that, unless a single
    word is longer) at natural boundaries: paragraphs first, then lines, sentences, words.

    Each chunk's span (start, end) indexes into `document` with surrounding whitespace left out;
    spans come in order, do not overlap, and what lies between them is whitespace only.
    Token counts tokenize each piece alone, so they are close to, not exactly, the ids a chunk
    gets inside its prompt.
    """
    check_document(document)
    check_positive("chunk_tokens", chunk_tokens)
    count = _Counter(tokenizer, document)
    whole = _trimmed(document, 0, len(document))
    groups = _pack(_atoms(document, whole, chunk_tokens, count), chunk_tokens, CHUNK_FILL)
    chunks = []
    for i, group in enumerate(groups):
        start, end = group[0].start, group[-1].end
        chunks.append(Chunk(i, start, end, document[start:end], sum(a.tokens for a in group)))
    return chunks


def chunks_from_list(tokenizer, chunks: Sequence[str]) -> tuple[str, list[Chunk]]:
    """Chunks given by the caller, used as they are (whitespace around each trimmed).

    Returns the document they form, joined by a blank line, which their spans index into.
    """
    if not chunks:
        raise InvalidInput("there are no chunks", "pass a document, or a list of at least one chunk")
    texts = []
    for i, chunk in enumerate(chunks):
        if not isinstance(chunk, str):
            raise InvalidInput(f"chunk {i + 1} is not text (it is {type(chunk).__name__})", "pass strings")
        if not chunk.strip():
            raise InvalidInput(f"chunk {i + 1} is empty", "remove it or give it some text")
        texts.append(chunk.strip())
    out, at = [], 0
    for i, text in enumerate(texts):
        tokens = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        out.append(Chunk(i, at, at + len(text), text, tokens))
        at += len(text) + 2
    return "\n\n".join(texts), out


def make_chunks(tokenizer, document: str | Sequence[str], chunk_tokens: int) -> tuple[str, list[Chunk]]:
    """(document, chunks) from a document (split) or a list of chunk strings (used as given)."""
    if isinstance(document, str):
        return document, split_document(tokenizer, document, chunk_tokens)
    document = as_list(document)  # a generator or an array of chunks, read once
    if document is None or not isinstance(document, Sequence):
        raise InvalidInput(f"the document must be text or a list of chunks, got {type(document).__name__}")
    return chunks_from_list(tokenizer, document)


# ---------------------------------------------------------------------- prompts
def margin_prompts(tokenizer, chunks: Sequence[Chunk | str], question: str, *,
                   template: str = MARGIN_TEMPLATE) -> list[list[int]]:
    """The whole prompt ids each chunk's margin is written from (each tokenized whole)."""
    check_question(question)
    texts = [c.text if isinstance(c, Chunk) else c for c in chunks]
    messages = [template.format(chunk=t.strip(), question=question.strip()) for t in texts]
    return [tokenize_prompt(tokenizer, render_prompt(tokenizer, m)) for m in messages]


def says_nothing(note: str) -> bool:
    """True for a note that is empty, says 'nothing relevant' anywhere, starts with 'nothing',
    'not relevant' or 'no relevant', or is just 'none' or 'n/a'."""
    return not note.strip() or bool(_SAYS_NOTHING.search(note.strip()))


def answer_prompt(tokenizer, question: str, notes: Sequence[str], *, template: str = ANSWER_TEMPLATE) -> list[int]:
    """The whole prompt ids of the final answer: the question and the relevant notes."""
    lines = "\n".join("- " + " ".join(n.split()) for n in notes) if notes else NO_NOTES
    return tokenize_prompt(tokenizer, render_prompt(tokenizer, template.format(notes=lines, question=question.strip())))


# ---------------------------------------------------------------------- scoring prompts
class PromptLogits(Work):
    """Feeds whole prompts (their common prefix once) and keeps each one's next-token logits in
    `values` ([prompts, vocab] float32); nothing is generated."""

    def __init__(self, prompts: Sequence[Sequence[int]]) -> None:
        shared = share_prefix(prompts)
        self.feed, self.ends = prompt_feed(shared.prefix_ids, shared.suffix_ids)
        self.prefix_tokens = len(shared.prefix_ids)
        self.values = torch.empty(0, 0)
        self.done = False

    def plan(self) -> Feed:
        return self.feed

    def settle(self, fed, result: FeedResult[list[int]]) -> Settled:
        row_of = {i: r for r, i in enumerate(i for i in fed if self.feed.logits[i])}
        self.values = result.logits[[row_of[end] for end in self.ends]]  # [prompts, vocab]
        self.done = True
        return Settled()

    def live(self) -> list[int]:
        return []


def prompt_logits(scheduler: Scheduler, prompts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, dict]:
    """Next-token logits after each whole prompt ([len(prompts), vocab], float32), all from one
    feed on `scheduler`, and what it cost (forwards, tokens fed, the shared prefix)."""
    if not prompts:
        raise InvalidInput("there are no prompts to score", "pass at least one prompt")
    engine = scheduler.engine
    prompts = [token_ids(p, engine.vocab_size, f"prompt {i}") for i, p in enumerate(prompts)]
    check_fits(engine, [len(p) for p in prompts], 1)
    before = engine.stats.as_dict()
    work = PromptLogits(prompts)
    engine.reserve(engine.forest.num_slots + len(work.feed))
    scheduler.admit(work)
    scheduler.run(work)
    after = engine.stats.as_dict()
    stats = {"forward_passes": after["forward_passes"] - before["forward_passes"],
             "tokens_fed": after["tokens_fed"] - before["tokens_fed"], "prefix_tokens": work.prefix_tokens}
    return work.values, stats


# ---------------------------------------------------------------------- relevance
def word_token_ids(tokenizer, words: Sequence[str]) -> set[int]:
    """Ids that start each word as the model may write it ('yes', 'Yes', ' yes', 'YES', ...):
    the spellings that are one token, or, for a word with none, each spelling's first token."""
    found: set[int] = set()
    for word in words:
        spellings = {v for w in (word, word.capitalize(), word.upper()) for v in (w, " " + w)}
        encoded = [tokenizer(s, add_special_tokens=False)["input_ids"] for s in sorted(spellings)]
        single = {ids[0] for ids in encoded if len(ids) == 1}
        found |= single or {ids[0] for ids in encoded if ids}
    return found


class YesNoClassifier:
    """The default relevance check: ask the model whether each note is relevant, in one forest
    pass (one branch per note, no decoding), and score it log P(yes) - log P(no) at the branch's
    next token.

    source: the `Scheduler` to run on, or anything with a `.model` (a `MultiDecoder`), for which
    each call runs on a new scheduler. tokenizer: the model's (default: `source.tokenizer`).
    `last_stats` holds the forwards of the latest call.
    """

    def __init__(self, source, tokenizer=None, *, template: str = RELEVANCE_TEMPLATE,
                 yes: Sequence[str] = YES_WORDS, no: Sequence[str] = NO_WORDS) -> None:
        check_template(template, "the relevance template", "note")
        self.source, self.template = source, template
        self.tokenizer = tokenizer if tokenizer is not None else source.tokenizer
        yes_ids, no_ids = word_token_ids(self.tokenizer, yes), word_token_ids(self.tokenizer, no)
        both = yes_ids & no_ids
        self.yes_ids, self.no_ids = sorted(yes_ids - both), sorted(no_ids - both)
        if not self.yes_ids or not self.no_ids:
            raise InvalidArgument("this tokenizer has no distinct tokens for 'yes' and 'no'",
                                  "pass your own classify= callable")
        self.last_stats: dict = {}

    def prompts(self, question: str, notes: Sequence[str]) -> list[list[int]]:
        tokenizer = self.tokenizer
        return [tokenize_prompt(tokenizer, render_prompt(tokenizer, self.template.format(
            question=question.strip(), note=" ".join(n.split())))) for n in notes]

    def __call__(self, question: str, notes: Sequence[str]) -> list[float]:
        if not notes:
            return []
        source = self.source
        scheduler = source if isinstance(source, Scheduler) else new_scheduler(source.model)
        values, self.last_stats = prompt_logits(scheduler, self.prompts(question, notes))  # [n, V]
        yes = torch.logsumexp(values[:, self.yes_ids], dim=-1)  # [n]
        no = torch.logsumexp(values[:, self.no_ids], dim=-1)  # [n]
        return (yes - no).tolist()


# ---------------------------------------------------------------------- the run
def _scalar_sampling(sampling: dict) -> dict:
    for key, value in sampling.items():
        if isinstance(value, (list, tuple)):
            raise InvalidInput(f"{key} takes one value here, got a list", "give one value for every margin")
    return sampling


class MarginsRun:
    """Margins being written, then judged, then answered; each stage runs when first needed.

    - iterate `events` for the margins' tokens as they are written (branch = chunk index);
    - `judge()` classifies the finished margins (one more forest pass);
    - iterate `answer_events()` for the final answer's tokens (branch 0);
    - `result()` gives the `Margins` (running whatever is left).
    Inputs are checked and the margin prompts prefilled before `start` returns.
    """

    def __init__(self, scheduler: Scheduler, tokenizer, document: str, chunks: list[Chunk], question: str, *,
                 max_margin_tokens: int, max_new_tokens: int, classify: Classifier | None, threshold: float,
                 margin_template: str, answer_template: str, stop: Sequence[str], sampling: dict) -> None:
        check_positive("max_new_tokens", max_new_tokens)
        self.scheduler, self.tokenizer = scheduler, tokenizer
        self.document, self.chunks, self.question = document, chunks, question.strip()
        self.max_new_tokens, self.threshold, self.stop = max_new_tokens, threshold, stop
        self.answer_template = answer_template
        self.sampling = _scalar_sampling(dict(sampling))
        self.classify = classify if classify is not None else YesNoClassifier(scheduler, tokenizer)
        self.prompts = margin_prompts(tokenizer, chunks, question, template=margin_template)
        # Margin i is seeded seed + i and the answer seed + n: checked here, before any margin runs.
        *margins, self.answer_sampling = per_branch_sampling(len(chunks) + 1, self.sampling)
        self._check_fits(max_margin_tokens, margin_template)
        shared = share_prefix(self.prompts)  # the forest's own memory check, said in margins' words
        check_memory(scheduler.engine, len(shared.prefix_ids), [len(s) for s in shared.suffix_ids], max_margin_tokens,
                     0, fewer="give fewer chunks (a shorter document, or a larger chunk_tokens)",
                     new_tokens="max_margin_tokens")
        self.margin_run: BranchRun = start_prompts(
            scheduler, self.prompts, max_new_tokens=max_margin_tokens, sampling=margins, tokenizer=tokenizer, stop=stop)
        self.events: Iterator[TokenEvent] = self.margin_run.events
        self.verdicts: list[tuple[bool, float | None]] | None = None
        self.answer_run: BranchRun | None = None
        self.in_answer: list[int] = []  # the margins the answer is written from (`answer_notes`)
        self.stats: dict = {}

    def _check_fits(self, max_margin_tokens: int, margin_template: str) -> None:
        """Refuse, before any margin is written, a chunk's margin prompt that does not fit the
        model's positions with `max_margin_tokens`, and an answer that could not fit with
        `max_new_tokens` whatever the notes (its prompt with one empty note), each naming the
        setting to lower (the forest's own check would say max_new_tokens for either)."""
        limit = self.scheduler.engine.max_positions
        if limit is None:
            return
        longest = max(range(len(self.prompts)), key=lambda i: len(self.prompts[i]))
        length = len(self.prompts[longest])
        if length + max_margin_tokens - 1 > limit:
            room = limit - length + 1
            (bare,) = margin_prompts(self.tokenizer, [""], self.question, template=margin_template)
            if room <= 0 and len(bare) >= limit:  # no chunk is short enough: the question is too long
                raise PromptTooLong(f"a margin's prompt without its chunk (the question and the instructions) is "
                                    f"{len(bare)} tokens, and the model takes at most {limit} positions",
                                    "shorten the question")
            raise PromptTooLong(f"chunk {longest + 1}'s margin prompt is {length} tokens and max_margin_tokens is "
                                f"{max_margin_tokens}: more than the model's {limit} positions",
                                f"lower max_margin_tokens to {room}, or chunk_tokens" if room > 0 else
                                "lower chunk_tokens (or pass shorter chunks)", fits=max(room, 0) or None)
        least = min(len(answer_prompt(self.tokenizer, self.question, notes, template=self.answer_template))
                    for notes in ([], [""]))
        if least + self.max_new_tokens - 1 > limit:
            raise PromptTooLong(f"the answer's prompt takes at least {least} tokens and max_new_tokens is "
                                f"{self.max_new_tokens}: more than the model's {limit} positions",
                                f"lower max_new_tokens to {limit - least + 1} at most", fits=limit - least + 1)

    # -- margins
    def margin_texts(self) -> list[str]:
        """The finished margins' texts (writing whatever is left first)."""
        self.margin_run.finish()
        return [b.output.text.strip() for b in self.margin_run.branches]

    # -- relevance
    def judge(self) -> list[tuple[bool, float | None]]:
        """(relevant, score) for every margin; notes that say nothing relevant are not classified."""
        if self.verdicts is not None:
            return self.verdicts
        texts = self.margin_texts()
        asked = [i for i, t in enumerate(texts) if not says_nothing(t)]
        classify = self.classify
        scores = list(classify(self.question, [texts[i] for i in asked])) if asked else []
        if len(scores) != len(asked):
            raise InvalidArgument(f"the classifier gave {len(scores)} scores for {len(asked)} notes",
                                  "return one score (or bool) per note")
        verdicts: list[tuple[bool, float | None]] = [(False, None)] * len(texts)
        for i, score in zip(asked, scores):
            value = float(score)
            verdicts[i] = (value > self.threshold, value)
        self.verdicts = verdicts
        self.stats["relevance"] = dict(getattr(classify, "last_stats", {}) or {}) if asked else {}
        return verdicts

    # -- the answer
    def start_answer(self) -> BranchRun:
        if self.answer_run is None:
            self.in_answer = self.answer_notes()
            texts = self.margin_texts()
            ids = answer_prompt(self.tokenizer, self.question, [texts[i] for i in self.in_answer],
                                template=self.answer_template)
            self.answer_run = start_prompts(
                self.scheduler, [ids], max_new_tokens=self.max_new_tokens,
                sampling=[self.answer_sampling], tokenizer=self.tokenizer, stop=self.stop)
        return self.answer_run

    def answer_notes(self) -> list[int]:
        """The margins the answer is written from, in document order: every relevant one, or, where
        their prompt would not fit in the model's window with `max_new_tokens`, the most relevant
        that do (hundreds of relevant notes outgrow a window that holds every chunk)."""
        texts, verdicts = self.margin_texts(), self.judge()
        relevant = [i for i, (yes, _) in enumerate(verdicts) if yes]
        limit = self.scheduler.engine.max_positions
        if limit is None:
            return relevant
        ranked = sorted(relevant, key=lambda i: -verdicts[i][1])  # the most relevant first

        def fits(k: int) -> bool:
            ids = answer_prompt(self.tokenizer, self.question, [texts[i] for i in sorted(ranked[:k])],
                                template=self.answer_template)
            return len(ids) + self.max_new_tokens - 1 <= limit

        if fits(len(ranked)):
            return relevant
        held = most_branches(fits, len(ranked))
        if not held:
            raise PromptTooLong(f"the answer's prompt does not hold even the most relevant note in the model's "
                                f"{limit} positions, with max_new_tokens {self.max_new_tokens}",
                                "lower max_margin_tokens (shorter notes) or max_new_tokens")
        return sorted(ranked[:held])

    def answer_events(self) -> Iterator[TokenEvent]:
        """The final answer's tokens as they are generated (judging the margins first)."""
        return self.start_answer().events

    # -- everything
    def result(self) -> Margins:
        texts = self.margin_texts()
        verdicts = self.judge()
        answer = self.start_answer().finish().branches[0]
        margins = [
            Margin(c.index, c.span, c.text, text, list(b.output.token_ids), self.prompts[i],
                   b.output.finish_reason, relevant, score, i in self.in_answer)
            for i, (c, b, text, (relevant, score)) in enumerate(
                zip(self.chunks, self.margin_run.branches, texts, verdicts))
        ]
        stats = {"margins": self.margin_run.stats.as_dict(), "relevance": self.stats.get("relevance", {}),
                 "answer": self.answer_run.stats.as_dict() | {"notes": len(self.in_answer)}}
        return Margins(self.question, self.document, margins, answer.output.text.strip(),
                       list(answer.output.token_ids), self.answer_run.prompts[0],
                       answer.output.finish_reason, stats)


def check_threshold(threshold) -> None:
    """Refuse a relevance threshold that is not a number: NaN compares false with every score, so
    every margin would be dropped as irrelevant, silently."""
    if isinstance(threshold, bool) or not isinstance(threshold, Real) or math.isnan(threshold):
        raise InvalidArgument(f"threshold must be a number, got {threshold!r}",
                              "give a log-odds of yes over no, e.g. 0 (yes at least as likely as no)")


def check_template(template, name: str, needed: str, optional: str = "question") -> None:
    """Refuse a prompt template that is no string, names a field other than `{needed}` and
    `{optional}`, or lacks `{needed}` (the text it exists to carry); a literal brace is `{{`."""
    if not isinstance(template, str):
        raise InvalidArgument(f"{name} must be a string, got {type(template).__name__}",
                              f"write the prompt with {{{needed}}} where the text goes")
    try:
        fields = {field for _, field, _, _ in string.Formatter().parse(template) if field is not None}
    except ValueError as err:  # a lone { or }
        raise InvalidArgument(f"{name} is not a format string ({err})", "write a literal brace as {{ or }}") from None
    unknown = sorted(fields - {needed, optional})
    if unknown:
        raise InvalidArgument(f"{name} names {', '.join('{' + f + '}' for f in unknown)}, which it is not given",
                              f"use {{{needed}}} and {{{optional}}} only, and write a literal brace as {{{{ or }}}}")
    if needed not in fields:
        raise InvalidArgument(f"{name} has no {{{needed}}}, so the model would never see it",
                              f"put {{{needed}}} where the text goes")


def start(scheduler: Scheduler, tokenizer, document: str | Sequence[str], question: str, *, chunk_tokens: int = 300,
          max_margin_tokens: int = 48, max_new_tokens: int = 64, classify: Classifier | None = None,
          threshold: float = 0.0, margin_template: str = MARGIN_TEMPLATE, answer_template: str = ANSWER_TEMPLATE,
          stop: Sequence[str] = (), **sampling) -> MarginsRun:
    """Cut the document into chunks and start writing every chunk's margin in one forest.

    document: text (cut into chunks of about `chunk_tokens` tokens) or a list of chunk strings.
    max_margin_tokens: longest margin; max_new_tokens: longest final answer.
    classify: `classify(question, notes) -> scores` (default `YesNoClassifier(scheduler, tokenizer)`), called
        once with every note that does not say it found nothing (`says_nothing`); a note is
        relevant when its score is above `threshold`. Notes that say nothing are not relevant.
    margin_template: the margin prompt (with `{chunk}` and `{question}`); answer_template: the
        answer prompt (with `{notes}` and `{question}`).
    stop: stop strings for the margins and the answer.
    Sampling settings (`do_sample`, `temperature`, ..., one value each) apply to the margins and
    the answer; greedy by default. With `seed=s`, margin i uses seed s + i and the answer s + n.
    Greedy margins equal greedy generation from each `Margin.prompt_ids` alone.
    """
    check_question(question)
    check_positive("chunk_tokens", chunk_tokens)
    check_positive("max_margin_tokens", max_margin_tokens)
    check_threshold(threshold)
    check_template(margin_template, "margin_template", "chunk")
    check_template(answer_template, "answer_template", "notes")
    text, chunks = make_chunks(tokenizer, document, chunk_tokens)
    return MarginsRun(scheduler, tokenizer, text, chunks, question, max_margin_tokens=max_margin_tokens,
                      max_new_tokens=max_new_tokens, classify=classify, threshold=threshold,
                      margin_template=margin_template,
                      answer_template=answer_template, stop=stop_strings_of(stop), sampling=sampling)


def margins(scheduler: Scheduler, tokenizer, document: str | Sequence[str], question: str, **settings) -> Margins:
    """Writing in the margins, start to end: settings as for `start`."""
    return start(scheduler, tokenizer, document, question, **settings).result()
