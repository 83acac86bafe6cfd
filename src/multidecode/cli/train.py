"""`multidecode train-drafter`: train Medusa heads or an EAGLE-style head for a model by
self-distillation, with progress bars and an ETA per phase; an interrupted run resumes from its
work folder."""

from __future__ import annotations

import json
import time

import click
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from ..training import TRAINABLE
from .common import check_writable_folder, load_decoder, model_options, report_errors, stderr

PHASES = {"write": "the model writes answers", "read": "the model reads them back", "train": "the heads learn"}
UNITS = {"write": "prompts", "read": "sequences", "train": "steps"}


@click.command("train-drafter")
@model_options
@click.option("--kind", type=click.Choice(TRAINABLE), default="medusa", show_default=True,
              help="What to train: Medusa heads, or an EAGLE-style decoder layer, on the model's last hidden state.")
@click.option("--prompts", "prompts", default=None, metavar="FILE.jsonl",
              help='Prompts to distill on, one {"prompt": ...} or {"document": ..., "question": ...} per line '
                   "(default: the 251 prompts shipped in the package: stories, explanations, code, summaries).")
@click.option("--heads", type=click.IntRange(1, 8), default=4, show_default=True,
              help="Medusa heads (tokens guessed ahead).")
@click.option("--draft-vocab", type=click.IntRange(256), default=8192, show_default=True,
              help="Tokens the heads choose among (the ones the model writes most); the full vocabulary costs more per step.")
@click.option("--max-new-tokens", type=click.IntRange(8), default=192, show_default=True, help="Length of each answer.")
@click.option("--epochs", type=click.FloatRange(0.01), default=4.0, show_default=True, help="Passes over the positions.")
@click.option("--limit", type=click.IntRange(1), default=None, help="Use only the first N prompts.")
@click.option("--output", default=None, metavar="DIR",
              help="Where to write the heads (default: the user cache, where --speculate medusa finds them).")
@click.option("--work", default=None, metavar="DIR", help="Where to keep the run's files (default: beside the output).")
@click.option("--json", "as_json", is_flag=True, help="Print progress and the result as JSON lines.")
@report_errors
def train_drafter(model_name, precision, device, kind, prompts, heads, draft_vocab, max_new_tokens, epochs, limit,
                  output, work, as_json):
    """Train a drafter for a model by self-distillation: the model answers the prompts, reads its
    answers back (keeping its last hidden state and its next-token distribution at every
    position), and the heads learn to guess its tokens 2, 3, ... places ahead. Each phase keeps
    its files in the work folder as it goes: run the same command again to resume. Uses the GPU
    when one is present."""
    from ..training.distill import DistillSettings, train_drafter, training_prompts

    settings = DistillSettings(kind=kind, prompts=prompts, heads=heads, draft_vocab=draft_vocab,
                               max_new_tokens=max_new_tokens, epochs=epochs, limit=limit, output=output, work=work)
    training_prompts(settings)  # a bad file is refused before the model loads, and so are folders that
    for option, folder in (("--output", output), ("--work", work)):  # could not take the run's results
        if folder is not None:
            check_writable_folder(folder, option)
    decoder = load_decoder(model_name, precision, device, exact=False)
    events = train_drafter(decoder, settings)
    if as_json:
        for event in events:
            click.echo(json.dumps({"phase": event.phase, "done": event.done, "total": event.total, **event.info}))
        return
    result = _show(events)
    stderr.print(f"[bold]The {kind} head was written to {escape(result['folder'])}[/bold] in {result['seconds']:.0f} s "
                 f"({result['tokens']:,} tokens seen)")
    if left_out := result.get("left_out"):
        shown = ", ".join(map(str, left_out[:8])) + (f" and {len(left_out) - 8} more" if len(left_out) > 8 else "")
        stderr.print(f"[yellow]note:[/yellow] {len(left_out)} prompts did not fit the model's positions with "
                     f"--max-new-tokens {max_new_tokens}, and were left out (prompts {shown})")
    if "mean_accepted" in result:
        stderr.print(f"Held out: a chain of the heads' guesses is accepted for {result['mean_accepted']:.2f} tokens on "
                     f"average; head top-1 agreement {', '.join(f'{v:.0%}' for v in result['head_top1'])}")
    elif "head_top1" in result:
        stderr.print(f"Held out: its first guess is the model's token {result['head_top1'][0]:.0%} of the time")
    if output is None:
        stderr.print(f"Use it with --speculate {kind} (and --speculate auto uses it where it pays).")
    else:  # outside the user cache: named where it is used
        use = f"--draft-head {result['folder']}" + (" --speculate eagle" if kind == "eagle" else "")
        stderr.print(f"Use it with {escape(use)}.")


def _show(events) -> dict:
    """One progress bar per phase (done/total, elapsed, ETA, the latest loss and acceptance)."""
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[unit]}"),
                  TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), TextColumn("{task.fields[info]}"),
                  console=stderr, speed_estimate_period=7 * 24 * 3600) as progress:
        tasks: dict[str, int] = {}
        started = time.perf_counter()
        for event in events:
            if event.phase == "done":
                return event.info
            if event.phase not in tasks:
                tasks[event.phase] = progress.add_task(PHASES[event.phase], total=event.total, completed=event.done,
                                                       unit=UNITS[event.phase], info="")
            progress.update(tasks[event.phase], completed=event.done, info=_info(event.info))
    return {"folder": "?", "seconds": time.perf_counter() - started, "tokens": 0}


def _info(info: dict) -> str:
    parts = []
    if "loss" in info:
        parts.append(f"loss {info['loss']:.3f}")
    if "mean_accepted" in info:
        parts.append(f"accepted {info['mean_accepted']:.2f}")
    if "tokens" in info:
        parts.append(f"{info['tokens']:,} tokens")
    return "  ".join(parts)
