"""`multidecode generate`: one completion, here or on a running server.

Here it loads the model and decodes (`strategies.complete`). With `--server URL` (or
MULTIDECODE_SERVER) it sends the request to a `multidecode serve` that already holds the model:
the same engine, so the same tokens, without importing torch or loading anything, so the command
answers in a fraction of a second. This module imports neither torch nor the library's engine
until a command runs here.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

import click

from ..errors import InvalidArgument
from .common import (
    SAMPLING_SWITCHES,
    constraint_from,
    decoding_options,
    model_source,
    open_run,
    parsed,
    print_stats,
    prompt_options,
    read_prompt,
    read_text,
    report_errors,
    sampling_from,
    stderr,
)


@click.command()
@prompt_options
@click.option("--max-new-tokens", type=int, default=256, show_default=True)
@click.option("--stop", multiple=True, metavar="TEXT", help="Stop at this string (repeatable).")
@decoding_options("auto")
@click.option("--echo", is_flag=True, help="Print the prompt before the completion (with --json, the text starts "
                                           "with it), as the completions API's echo.")
@click.option("--json", "as_json", is_flag=True, help="Print the completion and its stats as JSON.")
@click.option("--server", default=None, envvar="MULTIDECODE_SERVER", metavar="URL",
              help="Send the request to this running `multidecode serve` (env MULTIDECODE_SERVER) instead of "
                   "loading the model here: the same tokens, in a fraction of a second. Its API key: env "
                   "MULTIDECODE_API_KEY.")
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
        request = Request(text, no_chat, max_new_tokens, stop, chosen, speculate, draft_budget, constraint)
        return on_server(server, request, (model_name, precision, device), echo=echo, as_json=as_json,
                         show_stats=show_stats)
    from ..strategies import complete as complete_strategy

    constraint = constraint_from(constraint)
    decoder, spec = open_run(model_name, precision, device, speculate, draft_budget, max_new_tokens=max_new_tokens,
                             sampling=chosen, stop=stop)
    start = time.perf_counter()
    run = complete_strategy.start(decoder.scheduler(), decoder.tokenizer, text, n=1, max_new_tokens=max_new_tokens,
                                  stop=stop, chat=False if no_chat else None, sample=False, speculate=spec,
                                  constraint=constraint, **chosen)
    if as_json:
        done = complete_strategy.completions(run.finish())[0]
        click.echo(json.dumps({"text": text * echo + done.text, "finish_reason": done.finish_reason,
                               "token_ids": done.token_ids, "prompt_tokens": len(done.prompt_ids), "seed": done.seed,
                               "stats": done.stats, **parsed(constraint, done)}, ensure_ascii=False))
    else:
        write_stream(text * echo, (event.text for event in run.events))
    elapsed = time.perf_counter() - start
    tokens = run.stats.tokens
    stderr.print(f"[dim]{tokens} tokens in {elapsed:.1f} s ({tokens / elapsed:.1f} tokens/s)[/dim]")
    if show_stats:
        print_stats(run.stats.as_dict())


class Request:
    """One generate command's request, as the OpenAI protocol spells it for a server."""

    def __init__(self, text, no_chat, max_new_tokens, stop, chosen: dict, speculate, draft_budget, constraint) -> None:
        self.text, self.no_chat = text, no_chat
        refused = {"--draft-budget": draft_budget, "--draft-model": speculate.draft_model,
                   "--draft-skip-layers": speculate.draft_skip_layers, "--lookahead": speculate.lookahead,
                   "--draft-head": speculate.draft_head, "--regex": constraint.regex, "--grammar": constraint.grammar}
        given = [name for name, value in refused.items() if value is not None]
        if given:
            raise InvalidArgument(f"{', '.join(given)} cannot be sent to a server (the OpenAI protocol has no field "
                                  "for it; a server's drafting is set when it starts)",
                                  "drop it, or drop --server (and MULTIDECODE_SERVER) to run here")
        self.body: dict = {"max_tokens": max_new_tokens, "return_token_ids": True,
                           "speculate": speculate.mode or "off", **({"stop": list(stop)} if stop else {})}
        self.seed = None
        if any(key in chosen for key in SAMPLING_SWITCHES):  # sampled: the seed chosen here, so it can be reported
            self.seed = chosen.get("seed", random.randrange(2**31))
            self.body |= {"temperature": chosen.get("temperature", 1.0), "seed": self.seed}
            self.body |= {key: chosen[key] for key in ("top_k", "top_p", "min_p") if key in chosen}
        else:
            self.body["temperature"] = 0
        self.body |= {key: chosen[key] for key in ("repetition_penalty", "presence_penalty", "frequency_penalty")
                      if key in chosen}
        if "logit_bias" in chosen:
            self.body["logit_bias"] = {str(token): bias for token, bias in chosen["logit_bias"].items()}
        self.schema = None
        if constraint.json_schema is not None:
            self.schema = json.loads(read_text(constraint.json_schema, "JSON schema"))
            self.body["response_format"] = {"type": "json_schema",
                                            "json_schema": {"name": "output", "schema": self.schema, "strict": True}}

    def for_model(self, chat: bool) -> dict:
        """The body for the chat route (the prompt as one user message) or the completions route."""
        prompt = {"messages": [{"role": "user", "content": self.text}]} if chat else {"prompt": self.text}
        return {**self.body, **prompt}


def on_server(url: str, request: Request, asked: tuple, *, echo: bool, as_json: bool, show_stats: bool) -> None:
    """Run `request` on the server at `url` after checking that it serves the model asked for."""
    from ..serving import remote

    key = os.environ.get("MULTIDECODE_API_KEY")
    served = remote.served_model(url, api_key=key)
    check_served(served, *asked)
    chat = not request.no_chat and bool(served.source.get("chat_template", True))
    body = request.for_model(chat)
    start = time.perf_counter()
    if as_json:
        reply = remote.complete(served, body, chat=chat, api_key=key)
        choice = reply["choices"][0]
        text = choice["message"]["content"] if chat else choice["text"]
        done = {"text": request.text * echo + text, "finish_reason": choice["finish_reason"],
                "token_ids": choice.get("token_ids"), "prompt_tokens": reply["usage"]["prompt_tokens"],
                "seed": request.seed, "stats": reply.get("multidecode"), "server": url}
        if request.schema is not None:
            done["parsed"] = json.loads(text) if choice["finish_reason"] == "stop" else None
        click.echo(json.dumps(done, ensure_ascii=False))
        usage, stats = reply["usage"], reply.get("multidecode")
    else:
        last: dict = {}

        def texts():
            for chunk in remote.stream(served, body, chat=chat, api_key=key):
                last.update(chunk)
                for choice in chunk.get("choices") or ():
                    yield (choice.get("delta") or {}).get("content") or "" if chat else choice.get("text") or ""

        write_stream(request.text * echo, texts())
        usage, stats = last.get("usage") or {}, last.get("multidecode")
    elapsed = time.perf_counter() - start
    tokens = usage.get("completion_tokens", 0)
    stderr.print(f"[dim]{tokens} tokens in {elapsed:.2f} s on the server at {url} ({served.id})[/dim]")
    if show_stats and stats:
        print_stats(stats)


def check_served(served, model_name: str | None, precision: str | None, device: str | None) -> None:
    """Refuse a server whose model is not the one the options ask for (an option left out takes
    the server's): its tokens would not be this command's."""
    has_model = served.source.get("model")
    if model_name is not None and model_name != served.id and model_source(model_name) != has_model:
        raise InvalidArgument(f"the server at {served.url} serves {has_model or served.id}, not {model_name}",
                              "drop --model to use the server's, or drop --server to load it here")
    for option, asked, has in (("--precision", precision, served.source.get("precision")),
                               ("--device", device, served.source.get("device"))):
        if asked is not None and asked != has:
            raise InvalidArgument(f"the server at {served.url} runs {option} {has or '(not said)'}, not {asked}",
                                  f"drop {option} to use the server's, or drop --server to load the model here")


def write_stream(head: str, pieces) -> None:
    """Write `head`, then each piece as it comes, then a newline, to stdout."""
    sys.stdout.write(head)
    for piece in pieces:
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")


__all__ = ["generate"]
