"""The decoding commands but `generate` (in `generate`): `ask` (many questions about one document
in one pass), `complete` (n completions of one prompt), `vote` (self-consistency), `beam` (beam
search) and `margins` (writing in the margins). Each parses its options, calls its strategy in
`multidecode.strategies` and formats what comes back: streamed text, a table, or `--json`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING

import click
from rich.live import Live
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from ..constraints import parsed_field
from ..errors import InvalidArgument, InvalidInput, check_positive
from ..prompts import check_document, check_questions, check_text
from ..sampling_params import greedy_temperature, switches_given
from .common import (
    Output,
    check_early,
    constraint_from,
    counted,
    decoding_options,
    load_decoder,
    model_options,
    note_cut_branches,
    open_run,
    print_stats,
    prompt_options,
    read_lines,
    read_prompt,
    read_text,
    report_errors,
    sampling_from,
    sampling_options,
    stderr,
    stdout,
    stop_option,
)
from .remote import Request, Server, server_option

if TYPE_CHECKING:  # the strategies import torch: each command imports its own when it runs here
    from ..branches import TokenEvent
    from ..strategies import margins as margins_strategy

BOARD_STATES = MappingProxyType({None: (" ...", "cyan"), "stop": (" done", "green"),
                                  "length": (" cut at {limit}", "yellow")})
"""How a board entry's state is shown: going on, ended (eos or a stop string), or cut by the limit
(the option that set it, `AnswerBoard.limit`)."""


class AnswerBoard:
    """Collects streamed events per question and renders them: live on a terminal, else as each ends."""

    def __init__(self, questions: Sequence[str], limit: str = "--max-new-tokens") -> None:
        self.questions, self.limit = list(questions), limit
        self.texts = [""] * len(questions)
        self.token_ids: list[list[int]] = [[] for _ in questions]
        self.reasons: list[str | None] = [None] * len(questions)

    def add(self, event: TokenEvent) -> bool:
        """Record an event; True when it finished its question."""
        self.texts[event.branch] += event.text
        if event.token_id is not None:  # None: a served chat choice's last chunk, which only ends it
            self.token_ids[event.branch].append(event.token_id)
        self.reasons[event.branch] = event.finish_reason
        return event.finish_reason is not None

    def entry(self, i: int) -> Text:
        entry = Text()
        entry.append(f"{i + 1}. {self.questions[i]}", style="bold")
        label, style = BOARD_STATES.get(self.reasons[i], BOARD_STATES["stop"])
        entry.append(label.format(limit=self.limit), style)
        entry.append("\n   " + self.texts[i].strip().replace("\n", "\n   ") + "\n")
        return entry

    def __rich__(self) -> Text:
        return Text("\n").join(self.entry(i) for i in range(len(self.questions)))


def drain_counting(run, total: int, doing: str, done: str) -> None:
    """Run `run` to its end, a progress bar on stderr counting its branches as they finish (the
    output waits for all of them: `--json`, or a vote)."""
    columns = [TextColumn(doing), BarColumn(), MofNCompleteColumn(), TextColumn(done), TimeElapsedColumn()]
    with Progress(*columns, console=stderr, transient=True) as bar:
        task = bar.add_task("", total=total)
        for event in run.events:
            if event.finish_reason is not None:
                bar.advance(task)


def show_stream(events: Iterable[TokenEvent], questions: Sequence[str], limit: str = "--max-new-tokens") -> AnswerBoard:
    """Print answers as they are generated; returns the finished board. limit: the option whose
    length an answer cut short reached."""
    board = AnswerBoard(questions, limit)
    if stdout.is_terminal:  # a live board wraps its lines: soft-wrapped (`stdout`), rich would crop them
        live = Output(file=stdout.file, highlight=False, force_terminal=True)
        with Live(board, console=live, refresh_per_second=12, transient=False):
            for event in events:
                board.add(event)
    else:
        for event in events:
            if board.add(event):
                stdout.print(board.entry(event.branch))
    return board


def stream_run(run, labels: Sequence[str]) -> int:
    """A local run's answers printed as they are generated (`show_stream`), those cut short
    noted; returns the tokens generated."""
    board = show_stream(run.events, labels)
    note_cut_branches(run.branches)
    return sum(map(len, board.token_ids))


def summarize_run(run, what: str, generated: int, start: float, *, show_stats: bool, how: str) -> None:
    """On stderr, after a local run: its statistics (with --stats), then what came back (`what`:
    "3 answers"), its `generated` tokens, the seconds since `start` and the rate, and `how`."""
    elapsed = time.perf_counter() - start
    if show_stats:
        print_stats(run.stats.as_dict())
    stderr.print(f"[dim]{what}, {counted(generated, 'token')} in {elapsed:.1f} s "
                 f"({generated / elapsed:.1f} tokens/s), {how}[/dim]")


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
@stop_option("an answer")
@decoding_options()
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list of answers instead of streaming text.")
@server_option
@report_errors
def ask(document, question, questions_file, max_new_tokens, stop, model_name, precision, device, as_json, speculate,
        draft_budget, show_stats, constraint, server, **sampling):
    """Answer many questions about one document in one pass over one shared KV cache."""
    text = read_text(document)
    questions = gather_questions(question, questions_file)
    check_document(text)
    check_questions(questions)
    if server:
        request = Request(max_new_tokens, stop, sampling_from(sampling), speculate, draft_budget, constraint,
                          branches=len(questions))
        return ask_on_server(server, text, questions, request, (model_name, precision, device), as_json=as_json,
                             show_stats=show_stats)
    from ..strategies import ask as ask_strategy

    constraint = constraint_from(constraint)
    decoder, spec = open_run(model_name, precision, device, speculate, draft_budget, max_new_tokens=max_new_tokens,
                             sampling=sampling_from(sampling), stop=stop)
    start = time.perf_counter()
    settings = dict(max_new_tokens=max_new_tokens, stop=stop, speculate=spec, constraint=constraint,
                    **sampling_from(sampling))
    run = ask_strategy.start(decoder.scheduler(), decoder.tokenizer, text, questions, **settings)
    if as_json:
        answers = ask_strategy.answers(run.finish(), questions)
        rows = [
            {"question": a.question, "answer": a.text, "finish_reason": a.finish_reason, "seed": a.seed,
             "token_ids": a.token_ids, "prompt_tokens": len(a.prompt_ids), **parsed_field(constraint, a)}
            for a in answers
        ]
        click.echo(json.dumps(rows, ensure_ascii=False))
        generated = sum(len(a.token_ids) for a in answers)
    else:
        generated = stream_run(run, questions)
    summarize_run(run, counted(len(questions), 'answer'), generated, start, show_stats=show_stats,
                  how="one shared pass")


def ask_on_server(url: str, text: str, questions: list[str], request: Request, asked: tuple, *, as_json: bool,
                  show_stats: bool) -> None:
    """The questions sent to the server at `url` as one request (its `questions` extension: one
    forest there too), once the server is found to serve the model asked for."""
    server = Server(url, *asked)
    if not server.chat_template:
        raise InvalidArgument(f"the model on the server at {url} has no chat template, and ask sends each question "
                              "as a chat turn there (here it would add a plain 'Answer:' line)",
                              "drop --server to ask here")
    body = {**request.body, "messages": [{"role": "user", "content": text}], "questions": list(questions)}
    start = time.perf_counter()
    if as_json:
        choices = server.whole(body, chat=True)
        seeds = request.seeds(len(questions))
        click.echo(json.dumps([{"question": q, "answer": c["text"], "finish_reason": c["finish_reason"], "seed": seed,
                                "token_ids": c["token_ids"], "prompt_tokens": len(c["prompt_token_ids"]),
                                **request.parsed(c["text"], c["finish_reason"], server.ended_by_eos(c))}
                               for q, c, seed in zip(questions, choices, seeds, strict=True)], ensure_ascii=False))
    else:
        show_stream(server.pieces(body, chat=True), questions)
    server.summarize(counted(len(questions), 'answer'), start, show_stats=show_stats,
                     tail=", one shared pass")


@click.command()
@prompt_options
@click.option("--n", "-n", "n", type=int, default=4, show_default=True, help="Number of completions.")
@click.option("--max-new-tokens", type=int, default=64, show_default=True)
@click.option("--greedy", is_flag=True, help="Greedy decoding (all n completions are then identical).")
@stop_option("a completion")
@decoding_options(temperature="Sampling temperature (default 1; 0 is greedy, as --greedy).")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list of completions.")
@click.option("--logprobs", is_flag=True, help="With --json: each completion's token log-probabilities "
              "(\"logprobs\") and their sum (\"logprob\"), to rank completions by.")
@server_option
@report_errors
def complete(prompt, prompt_file, no_chat, n, max_new_tokens, greedy, stop, model_name, precision, device, as_json,
             logprobs, speculate, draft_budget, show_stats, constraint, server, **sampling):
    """n completions of one prompt from one prefill, sampled side by side.

    Each completion reports its seed; `--seed S` makes completion i use S + i, the same as a
    single completion run with `--seed S+i`.
    """
    text = read_prompt(prompt, prompt_file)
    chosen = sampling_from(sampling)
    switches = switches_given(chosen)
    if greedy and switches:
        flags = ", ".join("--" + k.replace("_", "-") for k in switches)
        raise InvalidArgument(f"--greedy cannot be combined with {flags}", "drop --greedy to sample")
    greedy = greedy or greedy_temperature(chosen.get("temperature"))
    if logprobs and not as_json:
        raise InvalidArgument("--logprobs adds to the JSON output", "add --json")
    if server:
        check_positive("n", n)
        request = Request(max_new_tokens, stop, chosen, speculate, draft_budget, constraint, sample=not greedy, n=n)
        return complete_on_server(server, text, no_chat, request, (model_name, precision, device), as_json=as_json,
                                  show_stats=show_stats, logprobs=logprobs)
    from ..strategies import complete as complete_strategy
    from ..strategies.complete import Waves

    if greedy:
        chosen["do_sample"] = False
    constraint = constraint_from(constraint)
    decoder, spec = open_run(model_name, precision, device, speculate, draft_budget, max_new_tokens=max_new_tokens, n=n,
                             sampling=chosen, stop=stop)
    settings = dict(n=n, max_new_tokens=max_new_tokens, stop=stop, chat=False if no_chat else None, speculate=spec,
                    constraint=constraint, logprobs=0 if logprobs else None, **chosen)
    start = time.perf_counter()
    run = complete_strategy.start(decoder.scheduler(), decoder.tokenizer, text, **settings)
    if as_json:
        drain_counting(run, n, "completing", "completions done")
        done = complete_strategy.completions(run)
        click.echo(json.dumps([{"index": c.index, "text": c.text, "finish_reason": c.finish_reason, "seed": c.seed,
                                "token_ids": c.token_ids, "prompt_tokens": len(c.prompt_ids), **parsed_field(constraint, c),
                                **scored(c.logprobs if logprobs else None)} for c in done], ensure_ascii=False))
        generated = sum(len(c.token_ids) for c in done)
    else:
        labels = [f"completion {i + 1}" + (f" (seed {params.seed})" if params.do_sample else "")
                  for i, params in enumerate(run.sampling)]
        generated = stream_run(run, labels)
    waves = len(run.runs) if isinstance(run, Waves) else 1
    how = "one prefill" if waves == 1 else f"in {waves} waves of up to {run.size} (all at once would not fit in memory)"
    summarize_run(run, counted(n, 'completion'), generated, start, show_stats=show_stats, how=how)


def scored(logprobs: list[float] | None) -> dict:
    """A JSON row's token log-probabilities and their sum, where they were asked for."""
    return {} if logprobs is None else {"logprobs": logprobs, "logprob": sum(logprobs)}


def complete_on_server(url: str, text: str, no_chat: bool, request: Request, asked: tuple, *, as_json: bool,
                       show_stats: bool, logprobs: bool = False) -> None:
    """The n completions as one request to the server at `url` (n choices: one forest there too)."""
    server = Server(url, *asked)
    chat, fields = server.prompt(text, no_chat)
    body = {**request.body, **fields, **({"logprobs": True if chat else 0} if logprobs else {})}

    def token_logprobs(choice: dict) -> list[float] | None:
        if not logprobs:
            return None
        return ([e["logprob"] for e in choice["logprobs"]["content"]] if chat
                else choice["logprobs"]["token_logprobs"])

    seeds = request.seeds(request.body["n"])
    start = time.perf_counter()
    if as_json:
        choices = server.whole(body, chat=chat)
        click.echo(json.dumps([{"index": c["index"], "text": c["text"], "finish_reason": c["finish_reason"],
                                "seed": seed, "token_ids": c["token_ids"], "prompt_tokens": len(c["prompt_token_ids"]),
                                **request.parsed(c["text"], c["finish_reason"], server.ended_by_eos(c)),
                                **scored(token_logprobs(c))}
                               for c, seed in zip(choices, seeds, strict=True)], ensure_ascii=False))
    else:
        labels = [f"completion {i + 1}" + (f" (seed {seed})" if seed is not None else "") for i, seed in enumerate(seeds)]
        show_stream(server.pieces(body, chat=chat), labels)
    server.summarize(counted(len(seeds), 'completion'), start, show_stats=show_stats)


@click.command()
@click.option("--question", "-q", required=True, metavar="TEXT", help="The question to reason about.")
@click.option("--n", "-n", "n", type=int, default=8, show_default=True, help="Number of reasoning traces.")
@click.option("--max-new-tokens", type=int, default=256, show_default=True)
@decoding_options(temperature="Sampling temperature (default 0.7; 0 is greedy: every trace the same).")
@click.option("--show-traces", is_flag=True, help="Print every trace, not only the answers.")
@click.option("--json", "as_json", is_flag=True, help="Print the vote as JSON.")
@report_errors
def vote(question, n, max_new_tokens, model_name, precision, device, show_traces, as_json, speculate, draft_budget,
         show_stats, constraint, **sampling):
    """Self-consistency: n sampled reasoning traces in one forest, and the majority answer."""
    from ..strategies import complete as complete_strategy
    from ..strategies.vote import tally, vote_prompt, vote_settings

    check_text(question, "the question", "write the question to reason about")
    if n > 1 and greedy_temperature(sampling.get("temperature")):
        stderr.print("[yellow]note:[/yellow] --temperature 0 is greedy: every trace will be the same, so their vote "
                     "tells nothing (leave it out to sample at 0.7)")
    constraint = constraint_from(constraint)
    decoder, spec = open_run(model_name, precision, device, speculate, draft_budget, max_new_tokens=max_new_tokens, n=n,
                             sampling=vote_settings(sampling_from(sampling)))
    prompt = vote_prompt(question, constrained=constraint is not None)
    run = complete_strategy.start(decoder.scheduler(), decoder.tokenizer, prompt, n=n, max_new_tokens=max_new_tokens,
                         speculate=spec, constraint=constraint, **vote_settings(sampling_from(sampling)))
    drain_counting(run, n, "reasoning", "traces done")
    result = tally(question, complete_strategy.completions(run))
    if show_stats:
        print_stats(run.stats.as_dict())
    if as_json:
        click.echo(json.dumps({"question": question, "answer": result.answer, "counts": result.counts,
                               "agreement": result.agreement, "tied": result.tied,
                               "traces": [{"answer": t.answer, "text": t.text, "token_ids": t.token_ids, "seed": t.seed,
                                           "finish_reason": t.finish_reason, **parsed_field(constraint, t)}
                                          for t in result.traces]},
                              ensure_ascii=False))
        return
    if show_traces:
        for i, trace in enumerate(result.traces):
            seeded = f" (seed {trace.seed})" if trace.seed is not None else ""  # greedy traces have none
            stdout.print(f"[bold]trace {i + 1}[/bold]{seeded} -> {escape(repr(trace.answer))}")
            stdout.print(trace.text.strip(), markup=False)
            stdout.print()
    note_cut_branches(run.branches)
    show_vote(result, n)


def show_vote(result, n: int) -> None:
    """The votes as a table, and the answer: a majority, the most common of a minority, or a tie."""
    table = Table(title=counted(n, "trace"), title_justify="left")
    table.add_column("answer")
    table.add_column("votes", justify="right")
    for answer, count in result.counts.items():
        table.add_row(Text(answer), str(count))
    missing = sum(t.answer is None for t in result.traces)
    if missing:
        table.add_row("[dim](no answer found)[/dim]", str(missing))
    stdout.print(table)
    if result.answer is None:
        stdout.print("No trace gave an answer.")
    elif result.tied:
        stdout.print(f"No majority: a tie between {escape(', '.join(result.tied))} "
                     f"({result.counts[result.answer]} of {counted(len(result.traces), 'trace')} each)")
    else:
        count, total = result.counts[result.answer], len(result.traces)
        label = "Majority answer" if result.is_majority else "Most common answer (no majority)"
        stdout.print(f"{label}: [bold]{escape(result.answer)}[/bold] ({count} of {counted(total, 'trace')}, "
                     f"{count / total:.0%})")


def parse_early_stopping(value: str) -> bool | str:
    return {"true": True, "false": False, "never": "never"}[value.lower()]


@click.command()
@prompt_options
@click.option("--num-beams", "-b", type=int, default=4, show_default=True, help="Beams kept at every step.")
@click.option("--max-new-tokens", type=int, default=32, show_default=True, help="Longest hypothesis, in tokens.")
@click.option("--length-penalty", type=float, default=1.0, show_default=True,
              help="Score = log-prob sum / length ** this (> 0 favours longer hypotheses).")
@click.option("--early-stopping", type=click.Choice(["true", "false", "never"], case_sensitive=False),
              default="false", show_default=True,
              help="When the search ends once num-beams hypotheses are finished (as in transformers).")
@click.option("--num-return-sequences", "-n", type=int, default=1, show_default=True,
              help="How many of the best hypotheses to print (at most --num-beams).")
@model_options
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list of the returned beams.")
@report_errors
def beam(prompt, prompt_file, no_chat, num_beams, max_new_tokens, length_penalty, early_stopping,
         num_return_sequences, model_name, precision, device, as_json):
    """Beam search, equal to transformers' generate(num_beams=...), with the beams' common history
    stored once in one cache and dropped beams compacted out."""
    from ..strategies.beam import check_settings, search

    text = read_prompt(prompt, prompt_file)
    settings = dict(num_beams=num_beams, max_new_tokens=max_new_tokens, length_penalty=length_penalty,
                    early_stopping=parse_early_stopping(early_stopping), num_return_sequences=num_return_sequences)
    check_settings(**settings)  # before loading a model
    decoder = load_decoder(model_name, precision, device)
    start = time.perf_counter()
    with stderr.status("searching..."):
        run = search(decoder.scheduler(), decoder.tokenizer, text, chat=False if no_chat else None, **settings)
    elapsed = time.perf_counter() - start
    if as_json:
        click.echo(json.dumps([
            {"rank": b.index + 1, "text": b.text, "score": b.score, "finish_reason": b.finish_reason,
             "token_ids": b.token_ids, "prompt_tokens": len(b.prompt_ids)}
            for b in run.beams
        ], ensure_ascii=False))
    else:
        for b in run.beams:
            stdout.print(f"[bold]{b.index + 1}.[/bold] score {b.score:.4f} [dim]({len(b.token_ids)} tokens, "
                         f"{b.finish_reason})[/dim]")
            stdout.print("   " + escape(b.text.strip()).replace("\n", "\n   "))
    stats = run.stats
    stderr.print(
        f"[dim]{counted(num_beams, 'beam')}, {counted(run.steps, 'step')} in {elapsed:.1f} s; {stats.forward_passes} forward passes, "
        f"peak {stats.peak_slots} cache slots for a {len(run.prompt_ids)}-token prompt, "
        f"{stats.compactions} compactions[/dim]"
    )


def result_json(result: margins_strategy.Margins) -> dict:
    return {
        "question": result.question,
        "answer": result.answer,
        "answer_finish_reason": result.answer_finish_reason,
        "answer_token_ids": result.answer_token_ids,
        "notes_in_answer": sum(m.in_answer for m in result.margins),  # 0: written from no part of the document
        "margins": [
            {"chunk": m.chunk_index, "span": list(m.span), "margin": m.text,
             "relevant": m.relevant, "relevance_score": m.relevance_score, "in_answer": m.in_answer,
             "finish_reason": m.finish_reason,
             "token_ids": m.token_ids, "prompt_tokens": len(m.prompt_ids)}
            for m in result.margins
        ],
        "stats": result.stats,
    }


def verdicts_table(run: margins_strategy.MarginsRun, verdicts) -> Table:
    table = Table(title="Relevance", title_justify="left")
    for column in ("chunk", "characters", "relevant", "score"):
        table.add_column(column, justify="right" if column != "relevant" else "left")
    for chunk, (relevant, score) in zip(run.chunks, verdicts):
        mark = "[green]yes[/green]" if relevant else "[dim]no[/dim]"
        shown = "said nothing" if score is None else f"{score:+.2f}"
        table.add_row(str(chunk.index + 1), f"{chunk.start}-{chunk.end}", mark, shown)
    return table


@click.command()
@click.option("--document", "-d", required=True, metavar="FILE",
              help="The document, a UTF-8 text file ('-' for stdin).")
@click.option("--question", "-q", default=None, metavar="TEXT", help="The question the margins are about (required).")
@click.option("--chunk-tokens", type=int, default=300, show_default=True,
              help="Tokens per chunk at most; chunks end at paragraphs, lines or sentences.")
@click.option("--max-margin-tokens", type=int, default=48, show_default=True, help="Longest margin, in tokens.")
@click.option("--max-new-tokens", type=int, default=64, show_default=True, help="Longest final answer, in tokens.")
@click.option("--threshold", type=float, default=0.0, show_default=True,
              help="A margin is relevant when log P(yes) - log P(no) is above this.")
@model_options
@sampling_options
@click.option("--json", "as_json", is_flag=True, help="Print the margins, verdicts and answer as JSON.")
@report_errors
def margins(document, question, chunk_tokens, max_margin_tokens, max_new_tokens, threshold, model_name, precision,
            device, as_json, **sampling):
    """Write a note about the question for every chunk of a long document (all chunks in one pass),
    keep the relevant notes, and answer from them (arXiv 2408.14906)."""
    from ..strategies import margins as margins_strategy

    text = read_text(document)
    if question is None or not question.strip():
        raise InvalidInput("there is no question", "pass --question TEXT")
    check_document(text)
    for name, value in (("chunk_tokens", chunk_tokens), ("max_margin_tokens", max_margin_tokens)):
        check_positive(name, value)
    margins_strategy.check_threshold(threshold)
    check_early(max_new_tokens=max_new_tokens, sampling=sampling_from(sampling))
    decoder = load_decoder(model_name, precision, device)
    start = time.perf_counter()
    run = margins_strategy.start(decoder.scheduler(), decoder.tokenizer, text, question, chunk_tokens=chunk_tokens,
                         max_margin_tokens=max_margin_tokens, max_new_tokens=max_new_tokens, threshold=threshold,
                         **sampling_from(sampling))
    stderr.print(f"[dim]{counted(len(run.chunks), 'chunk')} of at most {counted(chunk_tokens, 'token')}; "
                 "writing their margins in one pass[/dim]")
    if as_json:
        result = run.result()
        click.echo(json.dumps(result_json(result), ensure_ascii=False))
    else:
        show_stream(run.events, [f"chunk, characters {c.start}-{c.end}" for c in run.chunks], "--max-margin-tokens")
        verdicts = run.judge()
        stdout.print(verdicts_table(run, verdicts))
        stdout.print(Text("Answer", style="bold"))
        show_stream(run.answer_events(), [question.strip()])
        result = run.result()
    elapsed = time.perf_counter() - start
    kept = sum(m.relevant for m in result.margins)
    passes = sum(s.get("forward_passes", 0) for s in result.stats.values())
    stderr.print(
        f"[dim]{counted(len(result.margins), 'margin')} ({kept} relevant) and the answer in {elapsed:.1f} s, "
        f"{counted(passes, 'forward pass', 'forward passes')}[/dim]"
    )
    if not any(m.in_answer for m in result.margins):
        stderr.print("[yellow]note:[/yellow] no note was judged relevant, so the answer was written from none: "
                     "nothing in it comes from the document (lower --threshold to keep more notes)")
    if result.left_out:
        stderr.print(f"[yellow]note:[/yellow] the answer was written from the {kept - len(result.left_out)} most "
                     f"relevant notes: {len(result.left_out)} more did not fit in the model's window (raise "
                     "--threshold or lower --max-margin-tokens to keep fewer, shorter notes)")


__all__ = ["ask", "beam", "complete", "margins", "vote"]
