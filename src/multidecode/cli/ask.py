"""`multidecode ask`: many questions about one document, answered in one MultiDecode pass."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence

import click
from rich.live import Live
from rich.text import Text

from ..branches import TokenEvent
from ..errors import InvalidInput
from ..strategies import ask as ask_strategy
from ..strategies.ask import check_document, check_questions
from .common import (
    decoding_options,
    open_run,
    print_stats,
    read_lines,
    read_text,
    report_errors,
    sampling_from,
    stderr,
    stdout,
)


class AnswerBoard:
    """Collects streamed events per question and renders them: live on a terminal, else as each ends."""

    def __init__(self, questions: Sequence[str]) -> None:
        self.questions = list(questions)
        self.texts = [""] * len(questions)
        self.token_ids: list[list[int]] = [[] for _ in questions]
        self.reasons: list[str | None] = [None] * len(questions)

    def add(self, event: TokenEvent) -> bool:
        """Record an event; True when it finished its question."""
        self.texts[event.branch] += event.text
        self.token_ids[event.branch].append(event.token_id)
        self.reasons[event.branch] = event.finish_reason
        return event.finish_reason is not None

    def entry(self, i: int) -> Text:
        entry = Text()
        entry.append(f"{i + 1}. {self.questions[i]}", style="bold")
        entry.append(" done" if self.reasons[i] else " ...", style="green" if self.reasons[i] else "cyan")
        entry.append("\n   " + self.texts[i].strip().replace("\n", "\n   ") + "\n")
        return entry

    def __rich__(self) -> Text:
        return Text("\n").join(self.entry(i) for i in range(len(self.questions)))


def show_stream(events: Iterable[TokenEvent], questions: Sequence[str]) -> AnswerBoard:
    """Print answers as they are generated; returns the finished board."""
    board = AnswerBoard(questions)
    if stdout.is_terminal:
        with Live(board, console=stdout, refresh_per_second=12, transient=False):
            for event in events:
                board.add(event)
    else:
        for event in events:
            if board.add(event):
                stdout.print(board.entry(event.branch))
    return board


def gather_questions(question: Sequence[str], questions_file: str | None) -> list[str]:
    questions = list(question)
    if questions_file:
        questions += read_lines(questions_file)
    if not questions:
        raise InvalidInput("there are no questions", "pass --question TEXT (repeatable) or --questions-file FILE")
    return questions


@click.command()
@click.option("--document", "-d", required=True, metavar="FILE", help="The document, a UTF-8 text file ('-' for stdin).")
@click.option("--question", "-q", multiple=True, metavar="TEXT", help="A question (repeatable).")
@click.option("--questions-file", metavar="FILE", help="Questions, one per line.")
@click.option("--max-new-tokens", type=int, default=48, show_default=True, help="Longest answer, in tokens.")
@click.option("--stop", multiple=True, metavar="TEXT", help="Stop an answer at this string (repeatable).")
@decoding_options()
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list of answers instead of streaming text.")
@report_errors
def ask(document, question, questions_file, max_new_tokens, stop, model_name, dtype, device, as_json, speculate,
        draft_budget, show_stats, **sampling):
    """Answer many questions about one document in one pass over one shared KV cache."""
    if document == "-" and questions_file == "-":
        raise InvalidInput("--document and --questions-file cannot both read standard input",
                           "give one of them as a file")
    text = read_text(document)
    questions = gather_questions(question, questions_file)
    check_document(text)
    check_questions(questions)
    decoder, spec = open_run(model_name, dtype, device, speculate, draft_budget, max_new_tokens=max_new_tokens,
                             sampling=sampling_from(sampling), stop=stop)
    start = time.perf_counter()
    settings = dict(max_new_tokens=max_new_tokens, stop=stop, speculate=spec, **sampling_from(sampling))
    run = ask_strategy.start(decoder.scheduler(), decoder.tokenizer, text, questions, **settings)
    if as_json:
        answers = ask_strategy.answers(run.finish(), questions)
        rows = [
            {"question": a.question, "answer": a.text, "finish_reason": a.finish_reason,
             "token_ids": a.token_ids, "prompt_tokens": len(a.prompt_ids)}
            for a in answers
        ]
        click.echo(json.dumps(rows, ensure_ascii=False))
        generated = sum(len(a.token_ids) for a in answers)
    else:
        board = show_stream(run.events, questions)
        generated = sum(map(len, board.token_ids))
    elapsed = time.perf_counter() - start
    if show_stats:
        print_stats(run.stats.as_dict())
    stderr.print(
        f"[dim]{len(questions)} answer{'s' * (len(questions) != 1)}, {generated} tokens in {elapsed:.1f} s "
        f"({generated / elapsed:.1f} tokens/s), one shared pass[/dim]"
    )
