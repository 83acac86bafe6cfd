"""`multidecode beam`: beam search with the beams as branches of one tree over one shared KV cache."""

from __future__ import annotations

import json
import time

import click
from rich.markup import escape

from .common import load_decoder, model_options, prompt_options, read_prompt, report_errors, stderr, stdout


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
         num_return_sequences, model_name, dtype, device, as_json):
    """Beam search, equal to transformers' generate(num_beams=...), with the beams' common history
    stored once in one cache and dropped beams compacted out."""
    from ..strategies.beam import check_settings, search

    text = read_prompt(prompt, prompt_file)
    settings = dict(num_beams=num_beams, max_new_tokens=max_new_tokens, length_penalty=length_penalty,
                    early_stopping=parse_early_stopping(early_stopping), num_return_sequences=num_return_sequences)
    check_settings(**settings)  # before loading a model
    decoder = load_decoder(model_name, dtype, device)
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
        f"[dim]{num_beams} beams, {run.steps} steps in {elapsed:.1f} s; {stats.forward_passes} forward passes, "
        f"peak {stats.peak_slots} cache slots for a {len(run.prompt_ids)}-token prompt, "
        f"{stats.compactions} compactions[/dim]"
    )
