"""`multidecode serve`: the OpenAI-compatible server (see `multidecode.serving`)."""

from __future__ import annotations

import logging
import threading
import time

import click
from rich.logging import RichHandler
from rich.markup import escape

from ..errors import InvalidArgument, MultiDecodeError
from .common import model_options, report_errors, stderr

EMBEDDED_NAME = "SmolLM2-135M-Instruct"


@click.command()
@model_options
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (loopback by default).")
@click.option("--port", default=8000, show_default=True, type=int)
@click.option("--api-key", default=None, envvar="MULTIDECODE_API_KEY", metavar="KEY",
              help="Require 'Authorization: Bearer KEY' on every route but /health (env MULTIDECODE_API_KEY).")
@click.option("--served-model-name", default=None, metavar="NAME",
              help="The model name clients send (default: the --model argument, or SmolLM2-135M-Instruct).")
@click.option("--speculate", default=None, type=click.Choice(["lookup", "suffix", "lookahead", "auto"]),
              help="Draft in every branch unless a request says otherwise (default: off).")
@click.option("--max-live-tokens", default=32768, show_default=True, type=int,
              help="Admission cap: cache tokens reserved by running requests (prompt + n x max_tokens).")
@click.option("--max-branches", default=256, show_default=True, type=int, help="Admission cap: live branches.")
@click.option("--prefix-cache-tokens", default=8192, show_default=True, type=int,
              help="Prompt tokens kept cached for later requests once their own requests end.")
@click.option("--drain-timeout", default=30.0, show_default=True, type=float,
              help="On SIGTERM, seconds to let running requests finish (new ones get 503) before exiting.")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]), help="debug logs every step.")
@report_errors
def serve(model_name, dtype, device, host, port, api_key, served_model_name, speculate, max_live_tokens,
          max_branches, prefix_cache_tokens, drain_timeout, log_level):
    """Serve the model over HTTP with OpenAI's API; concurrent requests decode as one forest.

    Routes: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics, and / (a live
    page: a document and questions answered side by side, and the forest as it grows).
    Extensions in the request body: speculate, use_beam_search, questions.
    """
    import uvicorn

    from ..models.loading import load_model_and_tokenizer
    from ..runtime import Limits
    from ..serving.app import DrainingServer, ServeState, create_app

    for option, value, least in (("--max-live-tokens", max_live_tokens, 1), ("--max-branches", max_branches, 1),
                                 ("--port", port, 0), ("--prefix-cache-tokens", prefix_cache_tokens, 0)):
        if value < least:
            raise InvalidArgument(f"{option} must be at least {least}, got {value}", f"pass a larger {option}")
    logging.basicConfig(level=log_level.upper(), format="%(message)s", datefmt="[%X]",
                        handlers=[RichHandler(console=stderr, show_path=False)])
    name = served_model_name or model_name or EMBEDDED_NAME
    state = ServeState(name, api_key=api_key, speculate=speculate)
    limits = Limits(max_live_tokens=max_live_tokens, max_branches=max_branches, prefix_cache_tokens=prefix_cache_tokens)
    config = uvicorn.Config(create_app(state), host=host, port=port, log_level=log_level, access_log=False)
    server = DrainingServer(config, state, drain_timeout=drain_timeout)
    stderr.print(f"Serving {escape(name)} on http://{host}:{port} (loading the model; /health says when ready)")
    state.load(lambda: load_model_and_tokenizer(model_name, dtype=dtype, device=device), limits=limits)
    threading.Thread(target=_exit_if_load_fails, args=(state, server), daemon=True).start()
    server.run()
    if isinstance(state.load_error, MultiDecodeError):
        raise state.load_error
    if state.load_error is not None:
        raise SystemExit(1)


def _exit_if_load_fails(state, server) -> None:
    while state.server is None and state.load_error is None:
        time.sleep(0.1)
    if state.load_error is not None:
        server.should_exit = True


__all__ = ["serve"]
