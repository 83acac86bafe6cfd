"""`multidecode complete` (n completions of one prompt) and `multidecode vote` (self-consistency)."""

from __future__ import annotations

import json
import time

import click
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from ..errors import InvalidArgument
from ..prompts import check_text
from ..strategies import complete as strategy
from .ask import show_stream
from .common import (
    decoding_options,
    open_run,
    print_stats,
    prompt_options,
    read_prompt,
    report_errors,
    sampling_from,
    stderr,
    stdout,
)


@click.command()
@prompt_options
@click.option("--n", "-n", "n", type=int, default=4, show_default=True, help="Number of completions.")
@click.option("--max-new-tokens", type=int, default=64, show_default=True)
@click.option("--greedy", is_flag=True, help="Greedy decoding (all n completions are then identical).")
@click.option("--stop", multiple=True, metavar="TEXT", help="Stop a completion at this string (repeatable).")
@decoding_options()
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list of completions.")
@report_errors
def complete(prompt, prompt_file, no_chat, n, max_new_tokens, greedy, stop, model_name, dtype, device, as_json,
             speculate, draft_budget, show_stats, **sampling):
    """n completions of one prompt from one prefill, sampled side by side.

    Each completion reports its seed; `--seed S` makes completion i use S + i, the same as a
    single completion run with `--seed S+i`.
    """
    text = read_prompt(prompt, prompt_file)
    chosen = sampling_from(sampling)
    if greedy and set(chosen) - {"repetition_penalty"}:
        flags = ", ".join("--" + k.replace("_", "-") for k in chosen if k != "repetition_penalty")
        raise InvalidArgument(f"--greedy cannot be combined with {flags}", "drop --greedy to sample")
    if greedy:
        chosen["do_sample"] = False
    decoder, spec = open_run(model_name, dtype, device, speculate, draft_budget, max_new_tokens=max_new_tokens, n=n,
                             sampling=chosen, stop=stop)
    settings = dict(n=n, max_new_tokens=max_new_tokens, stop=stop, chat=False if no_chat else None, speculate=spec,
                    **chosen)
    start = time.perf_counter()
    run = strategy.start(decoder.scheduler(), decoder.tokenizer, text, **settings)
    if as_json:
        done = strategy.completions(run.finish())
        click.echo(json.dumps([{"index": c.index, "text": c.text, "finish_reason": c.finish_reason, "seed": c.seed,
                                "token_ids": c.token_ids} for c in done], ensure_ascii=False))
        generated = sum(len(c.token_ids) for c in done)
    else:
        labels = [f"completion {b.index + 1}" + (f" (seed {b.sampler.params.seed})" if b.sampler.params.do_sample
                                                   else "") for b in run.branches]
        board = show_stream(run.events, labels)
        generated = sum(map(len, board.token_ids))
    elapsed = time.perf_counter() - start
    if show_stats:
        print_stats(run.stats.as_dict())
    stderr.print(f"[dim]{n} completion{'s' * (n != 1)}, {generated} tokens in {elapsed:.1f} s ({generated / elapsed:.1f} tokens/s), "
                 f"one prefill[/dim]")


@click.command()
@click.option("--question", "-q", required=True, metavar="TEXT", help="The question to reason about.")
@click.option("--n", "-n", "n", type=int, default=8, show_default=True, help="Number of reasoning traces.")
@click.option("--max-new-tokens", type=int, default=256, show_default=True)
@decoding_options()
@click.option("--show-traces", is_flag=True, help="Print every trace, not only the answers.")
@click.option("--json", "as_json", is_flag=True, help="Print the vote as JSON.")
@report_errors
def vote(question, n, max_new_tokens, model_name, dtype, device, show_traces, as_json, speculate, draft_budget,
         show_stats, **sampling):
    """Self-consistency: n sampled reasoning traces in one forest, and the majority answer."""
    from ..strategies.vote import tally, vote_prompt, vote_settings

    check_text(question, "the question", "write the question to reason about")
    decoder, spec = open_run(model_name, dtype, device, speculate, draft_budget, max_new_tokens=max_new_tokens, n=n,
                             sampling=vote_settings(sampling_from(sampling)))
    prompt = vote_prompt(question)
    run = strategy.start(decoder.scheduler(), decoder.tokenizer, prompt, n=n, max_new_tokens=max_new_tokens,
                         speculate=spec, **vote_settings(sampling_from(sampling)))
    columns = [TextColumn("reasoning"), BarColumn(), MofNCompleteColumn(), TextColumn("traces done"),
               TimeElapsedColumn()]
    with Progress(*columns, console=stderr, transient=True) as bar:
        task = bar.add_task("", total=n)
        for event in run.events:
            if event.finish_reason is not None:
                bar.advance(task)
    result = tally(question, strategy.completions(run))
    if show_stats:
        print_stats(run.stats.as_dict())
    if as_json:
        click.echo(json.dumps({"question": question, "answer": result.answer, "counts": result.counts,
                               "agreement": result.agreement,
                               "traces": [{"answer": t.answer, "text": t.text, "seed": t.seed,
                                           "finish_reason": t.finish_reason} for t in result.traces]},
                              ensure_ascii=False))
        return
    if show_traces:
        for i, trace in enumerate(result.traces):
            stdout.print(f"[bold]trace {i + 1}[/bold] (seed {trace.seed}) -> {escape(repr(trace.answer))}")
            stdout.print(trace.text.strip(), markup=False)
            stdout.print()
    table = Table(title=f"{n} traces", title_justify="left")
    table.add_column("answer")
    table.add_column("votes", justify="right")
    for answer, count in result.counts.items():
        table.add_row(Text(answer), str(count))
    missing = sum(t.answer is None for t in result.traces)
    if missing:
        table.add_row("[dim](no answer found)[/dim]", str(missing))
    stdout.print(table)
    stdout.print(f"Majority answer: [bold]{escape(result.answer)}[/bold] ({result.agreement:.0%} of traces)"
                 if result.answer is not None else "No trace gave an answer.")
