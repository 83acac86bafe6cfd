"""`multidecode generate`: one completion of one prompt, streamed, with speculation if asked."""

from __future__ import annotations

import json
import sys
import time

import click

from ..strategies import complete as strategy
from .common import (
    decoding_options,
    open_run,
    print_stats,
    prompt_options,
    read_prompt,
    report_errors,
    sampling_from,
    stderr,
)


@click.command()
@prompt_options
@click.option("--max-new-tokens", type=int, default=256, show_default=True)
@click.option("--stop", multiple=True, metavar="TEXT", help="Stop at this string (repeatable).")
@decoding_options("auto")
@click.option("--json", "as_json", is_flag=True, help="Print the completion and its stats as JSON.")
@report_errors
def generate(prompt, prompt_file, no_chat, max_new_tokens, stop, model_name, dtype, device, speculate, draft_budget,
             show_stats, as_json, **sampling):
    """Generate one completion, greedy unless a sampling option is given.

    With --speculate, draft tokens are verified in the same forward as the next token; the output
    is the same as without (greedy: the same as transformers' generate).
    """
    text = read_prompt(prompt, prompt_file)
    chosen = sampling_from(sampling)
    decoder, spec = open_run(model_name, dtype, device, speculate, draft_budget, max_new_tokens=max_new_tokens,
                             sampling=chosen, stop=stop)
    start = time.perf_counter()
    run = strategy.start(decoder.scheduler(), decoder.tokenizer, text, n=1, max_new_tokens=max_new_tokens, stop=stop,
                         chat=False if no_chat else None, sample=False, speculate=spec, **chosen)
    if as_json:
        done = strategy.completions(run.finish())[0]
        click.echo(json.dumps({"text": done.text, "finish_reason": done.finish_reason, "token_ids": done.token_ids,
                               "prompt_tokens": len(done.prompt_ids), "seed": done.seed, "stats": done.stats},
                              ensure_ascii=False))
    else:
        for event in run.events:
            sys.stdout.write(event.text)
            sys.stdout.flush()
        sys.stdout.write("\n")
    elapsed = time.perf_counter() - start
    tokens = run.stats.tokens
    stderr.print(f"[dim]{tokens} tokens in {elapsed:.1f} s ({tokens / elapsed:.1f} tokens/s)[/dim]")
    if show_stats:
        print_stats(run.stats.as_dict())
