"""`multidecode generate`: one completion, here or on a running server.

Here it loads the model and decodes (`strategies.complete`). With `--server URL` (or
MULTIDECODE_SERVER) it sends the request to a `multidecode serve` that already holds the model:
the same engine, so the same tokens, without importing torch or loading anything, so the command
answers in a fraction of a second. This module imports neither torch nor the library's engine
until a command runs here.
"""

from __future__ import annotations

import json
import sys
import time

import click

from ..constraints import parsed_field
from ..prompts import has_chat_template
from .common import (
    constraint_from,
    counted,
    decoding_options,
    note_cut_branches,
    note_if_cut,
    open_run,
    print_stats,
    prompt_options,
    read_prompt,
    report_errors,
    sampling_from,
    stderr,
    stop_option,
)
from .remote import Request, Server, server_option


@click.command()
@prompt_options
@click.option("--max-new-tokens", type=int, default=256, show_default=True)
@stop_option("the text")
@decoding_options("auto")
@click.option("--echo", is_flag=True, help="Print the prompt before the completion (with --json, the text starts "
                                           "with it), as the completions API's echo; a chat message and its "
                                           "reply with a blank line between them.")
@click.option("--json", "as_json", is_flag=True, help="Print the completion and its stats as JSON.")
@server_option
@report_errors
def generate(prompt, prompt_file, no_chat, max_new_tokens, stop, model_name, precision, device, speculate, draft_budget,
             show_stats, echo, as_json, constraint, server, **sampling):
    """Generate one completion, greedy unless a sampling option is given.

    With --speculate, draft tokens are verified in the same forward as the next token; the output
    is the same as without (greedy: the same as transformers' generate).
    """
    text = read_prompt(prompt, prompt_file)
    chosen = sampling_from(sampling)
    if server:
        request = Request(max_new_tokens, stop, chosen, speculate, draft_budget, constraint)
        return on_server(server, text, no_chat, request, (model_name, precision, device), echo=echo, as_json=as_json,
                         show_stats=show_stats)
    from ..strategies import complete as complete_strategy

    constraint = constraint_from(constraint)
    decoder, spec = open_run(model_name, precision, device, speculate, draft_budget, max_new_tokens=max_new_tokens,
                             sampling=chosen, stop=stop)
    start = time.perf_counter()
    run = complete_strategy.start(decoder.scheduler(), decoder.tokenizer, text, n=1, max_new_tokens=max_new_tokens,
                                  stop=stop, chat=False if no_chat else None, sample=False, speculate=spec,
                                  constraint=constraint, **chosen)
    head = echoed(text, echo, chat=not no_chat and has_chat_template(decoder.tokenizer))
    if as_json:
        done = complete_strategy.completions(run.finish())[0]
        click.echo(json.dumps({"text": head + done.text, "finish_reason": done.finish_reason,
                               "token_ids": done.token_ids, "prompt_tokens": len(done.prompt_ids), "seed": done.seed,
                               "stats": done.stats, **parsed_field(constraint, done)}, ensure_ascii=False))
    else:
        write_stream(head, ((event.text, event.finish_reason) for event in run.events))
        note_cut_branches(run.branches)
    elapsed = time.perf_counter() - start
    tokens, seed = run.stats.tokens, run.branches[0].seed
    seeded = f", seed {seed}" if seed is not None else ""  # a drawn one too: --seed it to have the text again
    stderr.print(f"[dim]{counted(tokens, 'token')} in {elapsed:.1f} s ({tokens / elapsed:.1f} tokens/s){seeded}[/dim]")
    if show_stats:
        print_stats(run.stats.as_dict())


def on_server(url: str, text: str, no_chat: bool, request: Request, asked: tuple, *, echo: bool, as_json: bool,
              show_stats: bool) -> None:
    """Run the completion on the server at `url`, once it is found to serve the model asked for."""
    server = Server(url, *asked)
    chat, fields = server.prompt(text, no_chat)
    body = {**request.body, **fields}
    start, head = time.perf_counter(), echoed(text, echo, chat=chat)
    if as_json:
        choice = server.whole(body, chat=chat)[0]
        click.echo(json.dumps({"text": head + choice["text"], "finish_reason": choice["finish_reason"],
                               "token_ids": choice["token_ids"], "prompt_tokens": len(choice["prompt_token_ids"]),
                               "seed": request.seed, "stats": server.stats, "server": url,
                               **request.parsed(choice["text"], choice["finish_reason"], server.ended_by_eos(choice))},
                              ensure_ascii=False))
    else:
        written, ended = write_stream(head, ((piece.text, piece.finish_reason)
                                                    for piece in server.pieces(body, chat=chat)))
        note_if_cut(ended == "length" and request.schema is not None and request.parsed(written, ended)["parsed"] is None)
    server.summarize("", start, show_stats=show_stats, tail=f", seed {request.seed}" if request.seed is not None else "")


def echoed(text: str, echo: bool, *, chat: bool) -> str:
    """What --echo prints before the completion: the prompt, and where the chat template made it a
    message that the model answers (not text it continues), a blank line between the two."""
    return (text + "\n\n" * chat) if echo else ""


def write_stream(head: str, pieces) -> tuple[str, str | None]:
    """Write `head`, then each (text, finish reason) piece's text as it comes, then a newline, to
    stdout; returns the text the pieces made and the finish reason."""
    sys.stdout.write(head)
    ended, written = None, []
    for text, finish_reason in pieces:
        sys.stdout.write(text)
        sys.stdout.flush()
        written.append(text)
        ended = finish_reason or ended
    sys.stdout.write("\n")
    return "".join(written), ended


__all__ = ["generate"]
