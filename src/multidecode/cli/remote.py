"""A decoding command's work sent to a running `multidecode serve` (`--server URL`, or the
MULTIDECODE_SERVER variable): the command's settings spelled as the OpenAI protocol spells them,
and a server checked to serve the model the command asks for, so that the tokens are the ones
the command would produce here. Nothing here imports torch: a command routed to a server starts
in a tenth of a second.
"""

from __future__ import annotations

import json
import os
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import click

from ..constraints import read_schema
from ..errors import InvalidArgument, check_positive
from ..sampling_params import per_branch_sampling
from .common import counted, model_source, print_stats, read_text, stderr

SERVER_HELP = ("Send the work to this running `multidecode serve` (env MULTIDECODE_SERVER) instead of loading "
               "the model here: the same tokens, without the wait for torch and the model. Its API key: env "
               "MULTIDECODE_API_KEY.")


def server_option(command):
    """--server URL (env MULTIDECODE_SERVER), as `server_url` reads it."""
    return click.option("--server", default=None, envvar="MULTIDECODE_SERVER", metavar="URL", help=SERVER_HELP,
                        callback=_read_server_url)(command)


def _read_server_url(context, parameter, value: str | None) -> str | None:
    """--server blank (a variable set from an empty one) is no server, as `server_url` reads it;
    any other value is checked by the command (its errors said as every command's are)."""
    return value if value is not None and value.strip() else None


def server_url(value: str | None) -> str | None:
    """A server's base URL as a user may write it: "host:port" taken as http://host:port, and an
    OpenAI client's base URL (ending in /v1) taken as the server's; anything else not http(s) refused."""
    if value is None or not value.strip():
        return None
    url = value.strip()
    if "://" not in url:
        url = "http://" + url
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 (parsing the port raises on a bad one)
    except ValueError as err:
        raise InvalidArgument(f"--server {value} is not a URL ({err})", "for example --server http://127.0.0.1:8000") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidArgument(f"--server {value} is not an http(s) URL", "for example --server http://127.0.0.1:8000")
    path = parts.path.rstrip("/").removesuffix("/v1")
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, "", ""))


class Request:
    """A command's decoding settings as a request body. Settings the protocol has no field for are
    refused; the rest are checked and read by the library's `per_branch_sampling`, so a value the
    command refuses here is refused in the same words (not as the server's field), and sampling
    follows the library's rule (a sampling setting turns it on, else greedy; `sample`: on whatever
    is given, as `complete` does; temperature 0: greedy), with the seed chosen here when none is
    given, so that it can be reported (choice i uses seed + i, as branch i does here). branches:
    how many the request makes where that is not `n` (a question each)."""

    def __init__(self, max_new_tokens: int, stop, chosen: dict, speculate, draft_budget, constraint, *,
                 sample: bool = False, n: int = 1, branches: int | None = None) -> None:
        constraint.given()  # two at once, or --no-strict alone, refused as here
        drafting = {"--draft-budget": draft_budget, "--draft-model": speculate.draft_model,
                    "--draft-skip-layers": speculate.draft_skip_layers, "--lookahead": speculate.lookahead,
                    "--draft-head": speculate.draft_head}
        for refused, why in ((drafting, "a server's drafting is set when it starts"),
                             ({"--regex": constraint.regex, "--grammar": constraint.grammar},
                              "the OpenAI protocol has no field for it: a server holds output to a JSON schema only")):
            given = [name for name, value in refused.items() if value is not None]
            if given:
                raise InvalidArgument(f"{', '.join(given)} cannot be sent to a server ({why})",
                                      "drop it, or drop --server (and MULTIDECODE_SERVER) to run here")
        check_positive("max_new_tokens", max_new_tokens)
        # the library's checks and rule (greedy or sampled, the seed drawn where none is given), so
        # the server is sent only what this command would run here
        params = per_branch_sampling(branches or n, ({"do_sample": True} if sample else {}) | chosen)[0]
        self.body: dict = {"max_tokens": max_new_tokens, "return_token_ids": True, "n": n,
                           "speculate": speculate.mode or "off", **({"stop": list(stop)} if stop else {})}
        self.seed = params.seed if params.do_sample else None
        if params.do_sample:
            self.body |= {"temperature": params.temperature, "seed": self.seed}
            self.body |= {key: getattr(params, key) for key in ("top_k", "top_p", "min_p")
                          if getattr(params, key) is not None}
        else:
            self.body["temperature"] = 0
        self.body |= {key: chosen[key] for key in ("repetition_penalty", "presence_penalty", "frequency_penalty")
                      if key in chosen}
        if "logit_bias" in chosen:
            self.body["logit_bias"] = {str(token): bias for token, bias in chosen["logit_bias"].items()}
        self.schema, self.stop = None, tuple(stop)
        if constraint.json_schema is not None:
            self.schema = read_schema(read_text(constraint.json_schema, "JSON schema"))
            self.body["response_format"] = {"type": "json_schema",
                                            "json_schema": {"name": "output", "schema": self.schema,
                                                            "strict": constraint.strict}}

    def seeds(self, count: int) -> list[int | None]:
        """The seed each of `count` choices drew with (choice i: seed + i; None when greedy)."""
        return [None if self.seed is None else self.seed + i for i in range(count)]

    def parsed(self, text: str, finish_reason: str | None, ended_by_eos: bool | None = None) -> dict:
        """{"parsed": the JSON value} where a schema holds the output, null where it was cut short,
        as the library reads it (`Completion.parsed`: the grammar matched whole). The server says
        only "stop" or "length", so it is read from the text: a value that closes itself (an
        object, an array, a string, true, false, null) is whole once it parses, even where the
        eos after it was cut at max_tokens; a bare number could have gone on ("100" of "1000"),
        so it is whole only where an eos ended it (`ended_by_eos`, from the reply's last token id
        where the server names its eos ids; else "stop" with no stop string that could have)."""
        if self.schema is None:
            return {}
        try:
            value = json.loads(text)
        except ValueError:  # cut short of its end, by max_tokens or a stop string
            return {"parsed": None}
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if ended_by_eos is None:
            ended_by_eos = finish_reason == "stop" and not self.stop
        return {"parsed": value if not number or ended_by_eos else None}


@dataclass(frozen=True)
class Piece:
    """One streamed token of one choice (a `TokenEvent`'s fields, as the stream carries them), or
    the end of a chat choice (`token_id` None: OpenAI's last chunk, an empty delta with the reason)."""

    branch: int
    token_id: int | None
    text: str
    finish_reason: str | None


class Server:
    """A running server, checked to serve the model the command's options ask for (an option left
    out takes the server's)."""

    def __init__(self, url: str, model_name: str | None, precision: str | None, device: str | None) -> None:
        from ..serving import remote

        url = server_url(url)
        self.remote, self.url, self.key = remote, url, os.environ.get("MULTIDECODE_API_KEY")
        remote.wait_ready(url, on_wait=lambda: stderr.print(f"[dim]Waiting for the server at {url} to load its "
                                                            "model...[/dim]"))
        self.served = remote.served_model(url, api_key=self.key)
        self.stats: dict | None = None  # the last reply's engine statistics
        self.usage: dict = {}
        has_model = self.served.source.get("model")
        named = model_source(model_name)  # a path that exists here is that folder, whatever the server is called
        by_name = model_name == self.served.id and not Path(model_name or "").expanduser().exists()
        if model_name is not None and not by_name and named != has_model:
            raise InvalidArgument(f"the server at {url} serves {has_model or self.served.id}, not {model_name}",
                                  "drop --model to use the server's, or drop --server to load it here")
        if precision is not None:  # its aliases (fp32, BF16) read as the server reads them: torch, only here
            from ..models.precision import parse

            precision = parse(precision)
        for option, asked, has in (("--precision", precision, self.served.source.get("precision")),
                                   ("--device", device, self.served.source.get("device"))):
            if asked is not None and not _same_setting(asked, has):
                raise InvalidArgument(f"the server at {url} runs {option} {has or '(not said)'}, not {asked}",
                                      f"drop {option} to use the server's, or drop --server to load the model here")

    def ended_by_eos(self, choice: dict) -> bool | None:
        """Whether an eos id ended a whole reply's `choice` (its last token id one of the ids the
        server names), None where the server names none."""
        eos = self.served.source.get("eos_token_ids")
        if eos is None:
            return None
        return choice["finish_reason"] == "stop" and bool(choice.get("token_ids")) and choice["token_ids"][-1] in eos

    @property
    def chat_template(self) -> bool:
        return bool(self.served.source.get("chat_template", True))

    def prompt(self, text: str, no_chat: bool) -> tuple[bool, dict]:
        """Whether the prompt goes to the chat route (as one user message, where the model has a
        chat template and --no-chat is not given: what the command does here) and its fields."""
        chat = not no_chat and self.chat_template
        return chat, {"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text}

    def whole(self, body: dict, *, chat: bool) -> list[dict]:
        """The reply's choices in order, each with its `text` (a chat reply's content too)."""
        reply = self.remote.complete(self.served, body, chat=chat, api_key=self.key)
        self.usage, self.stats = reply["usage"], reply.get("multidecode")
        choices = sorted(reply["choices"], key=lambda c: c["index"])
        return [{**c, "text": c["message"]["content"]} if chat else c for c in choices]

    def pieces(self, body: dict, *, chat: bool) -> Iterator[Piece]:
        """The streamed tokens, as they come."""
        for chunk in self.remote.stream(self.served, body, chat=chat, api_key=self.key):
            if chunk.get("usage"):
                self.usage, self.stats = chunk["usage"], chunk.get("multidecode")
            for choice in chunk.get("choices") or ():
                ids = choice.get("token_ids") or ()
                text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                for k, token in enumerate(ids):  # a chat stream's opening chunk carries none
                    last = k == len(ids) - 1
                    yield Piece(choice["index"], token, (text or "") if last else "",
                                choice.get("finish_reason") if last else None)
                if not ids and choice.get("finish_reason"):
                    yield Piece(choice["index"], None, "", choice["finish_reason"])

    def summarize(self, what: str, start: float, *, show_stats: bool, tail: str = "") -> None:
        """On stderr: the engine's statistics (with --stats), then what came back (`what`: "3
        answers"), its tokens and seconds since `start`, and from which server."""
        if show_stats and self.stats:
            print_stats(self.stats)
        stderr.print(f"[dim]{what}{', ' * bool(what)}{counted(self.usage.get('completion_tokens', 0), 'token')} in "
                     f"{time.perf_counter() - start:.2f} s on the server at {self.url} ({self.served.id}){tail}[/dim]")


def _same_setting(asked: str, has: str | None) -> bool:
    """Whether a precision or device asked for is the server's, in any case; a device by its kind
    too ("cuda" is the server's "cuda:0")."""
    asked, has = asked.strip().lower(), (has or "").lower()
    return has == asked or has.startswith(asked + ":")


__all__ = ["Piece", "Request", "Server", "server_option"]
