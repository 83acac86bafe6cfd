"""`multidecode serve`: the OpenAI-compatible server (see `multidecode.serving`)."""

from __future__ import annotations

import logging
import math
from dataclasses import fields

import click
from rich.logging import RichHandler
from rich.markup import escape

from ..runtime import Limits
from .common import (
    COMPILE_HELP,
    model_options,
    model_source,
    report_errors,
    speculate_options,
    speculation_from,
    stderr,
)

EMBEDDED_NAME = "SmolLM2-135M-Instruct"
DEFAULTS = {f.name: f.default for f in fields(Limits)}
"""The admission limits' defaults: the runtime's own."""


@click.command()
@model_options
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (loopback by default).")
@click.option("--port", default=8000, show_default=True, type=int, help="Port to listen on (0: any free port).")
@click.option("--api-key", default=None, envvar="MULTIDECODE_API_KEY", metavar="KEY",
              help="Require 'Authorization: Bearer KEY' on every route but /health and the live page at / "
                   "(which holds no data: its requests send the key) (env MULTIDECODE_API_KEY).")
@click.option("--allowed-origin", "allowed_origins", multiple=True, default=("*",), show_default=True, metavar="ORIGIN",
              help="A web page's origin whose scripts may call the API (CORS), e.g. http://localhost:3000; "
                   "repeat for several, 'none' for no page but this server's own.")
@click.option("--served-model-name", default=None, metavar="NAME",
              help="The model name clients send (default: the --model argument, or SmolLM2-135M-Instruct).")
@speculate_options(stats=False, scope="Default for requests that name no mode (default: off).")
@click.option("--max-live-tokens", default=DEFAULTS["max_live_tokens"], show_default=True, type=int,
              help="Admission cap: cache tokens reserved by running requests (prompt + n x max_tokens).")
@click.option("--max-branches", default=DEFAULTS["max_branches"], show_default=True, type=int,
              help="Admission cap: live branches.")
@click.option("--prefix-cache-tokens", default=DEFAULTS["prefix_cache_tokens"], show_default=True, type=int,
              help="Prompt tokens kept cached for later requests once their own requests end.")
@click.option("--max-running", default=None, type=int, hidden=True,
              help="Requests decoding at once, the rest waiting (1: one at a time, the serve benchmark's baseline).")
@click.option("--gather", default=DEFAULTS["gather"], type=int, hidden=True,
              help="An idle engine waits until this many requests wait, at most --gather-s seconds, before its "
                   "first step (the serve benchmark's --gather-s).")
@click.option("--gather-s", default=DEFAULTS["gather_s"], type=float, hidden=True,
              help="The most seconds an idle engine waits for --gather requests.")
@click.option("--prefill-chunk", default=DEFAULTS["prefill_chunk"], show_default=True, type=int,
              help="The most prompt tokens a step feeds while other requests decode: a longer prompt is read in "
                   "pieces between their tokens (0: every prompt whole, the others waiting for it).")
@click.option("--prefill-stretch", default=DEFAULTS["prefill_stretch"], show_default=True, type=float,
              help="Fit each piece to this machine: a step that reads prompt tokens may take about this many times "
                   "one that does not (more while more requests wait for a first token than stream), by the step "
                   "times measured (0: always --prefill-chunk tokens).")
@click.option("--threads", default=None, type=int, hidden=True, help="torch threads (the serve benchmark's).")
@click.option("--compile", "compile_step", is_flag=True, help=COMPILE_HELP)
@click.option("--drain-timeout", default=30.0, show_default=True, type=float,
              help="On SIGTERM, seconds to let running requests finish (new ones get 503) before exiting.")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]), help="debug logs every step.")
@report_errors
def serve(model_name, precision, device, host, port, api_key, allowed_origins, served_model_name, speculate, draft_budget,
          max_live_tokens, max_branches, prefix_cache_tokens, max_running, gather, gather_s, prefill_chunk,
          prefill_stretch, threads, compile_step, drain_timeout, log_level):
    """Serve the model over HTTP with OpenAI's API; concurrent requests decode as one forest.

    Routes: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics, and / (a live
    page: a document and questions answered side by side, and the forest as it grows).
    Extensions in the request body: speculate, use_beam_search, questions.
    """
    from ..compiled import compile_forward
    from ..models.loading import load_model_and_tokenizer, refuse_unreadable
    from ..serving.app import ServeState
    from ..serving.launch import serve_until_stopped

    limits = Limits(max_live_tokens=max_live_tokens, max_branches=max_branches,
                    prefix_cache_tokens=prefix_cache_tokens, max_running=max_running, gather=gather, gather_s=gather_s,
                    prefill_chunk=prefill_chunk, prefill_stretch=prefill_stretch)
    check_limits(limits, threads, drain_timeout)
    canonical = check_precision_and_device(precision, device)
    settings = speculation_from(speculate, draft_budget)
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    logging.basicConfig(level=log_level.upper(), format="%(message)s", datefmt="[%X]",
                        handlers=[RichHandler(console=stderr, show_path=False)])
    name = served_model_name or model_name or EMBEDDED_NAME
    state = ServeState(name, api_key=api_key, speculate=settings, allowed_origins=[
                           o for o in allowed_origins if o.lower() != "none"],
                       source={"model": model_source(model_name), "precision": canonical})
    if model_name is not None:  # before the server says where it listens: the model loads behind that
        refuse_unreadable(model_name)

    def loader():
        model, tokenizer = load_model_and_tokenizer(model_name, precision=precision, device=device)
        if compile_step:
            compile_forward(model)
        return model, tokenizer

    serve_until_stopped(state, loader, host=host, port=port,
        limits=limits, drain_timeout=drain_timeout, log_level=log_level,
        on_listening=lambda url: stderr.print(f"Serving {escape(name)} on {url} (loading the model; /health says "
                                              f"when ready). Commands reach it with --server {url} (or "
                                              f"export MULTIDECODE_SERVER={url})"))


def check_precision_and_device(precision: str | None, device: str | None) -> str:
    """Refuse an unknown precision or device, or one this machine cannot run, before the server
    says where it listens (the model loads behind it); returns the precision's canonical name (fp32
    as float32, None as auto), as /v1/models tells clients, who compare theirs with it."""
    from ..models import precision as precisions
    from ..models.loading import resolve_device

    canonical = precisions.parse(precision)
    precisions.check(canonical, resolve_device(device))
    return canonical


def check_limits(limits: Limits, threads: int | None, drain_timeout: float = 0.0) -> None:
    """Refuse limits that could never admit a request, and times that are not numbers (nan and inf
    passed every comparison below: the server started, and every request was a 500)."""
    from ..errors import InvalidArgument

    for option, value, example in (("--gather-s", limits.gather_s, 0), ("--prefill-stretch", limits.prefill_stretch,
                                   1.5), ("--drain-timeout", drain_timeout, 30)):
        if not math.isfinite(value) or value < 0:
            raise InvalidArgument(f"{option} must be a finite number, 0 or more, got {value}",
                                  f"for example {option} {example}")
    for option, value, least in (("--max-live-tokens", limits.max_live_tokens, 1),
                                 ("--max-branches", limits.max_branches, 1),
                                 ("--prefix-cache-tokens", limits.prefix_cache_tokens, 0),
                                 ("--max-running", limits.max_running, 1), ("--gather", limits.gather, 1),
                                 ("--gather-s", limits.gather_s, 0), ("--prefill-chunk", limits.prefill_chunk, 0),
                                 ("--prefill-stretch", limits.prefill_stretch, 0), ("--threads", threads, 1)):
        if value is not None and value < least:
            raise InvalidArgument(f"{option} must be at least {least}, got {value}", f"pass a larger {option}")
    if 0 < limits.prefill_stretch <= 1:
        raise InvalidArgument(f"--prefill-stretch must be over 1 (or 0: no adapting), got {limits.prefill_stretch}",
                              "for example --prefill-stretch 1.5")


__all__ = ["serve"]
