"""A command's way to a running `multidecode serve`: the model it serves, and one completion,
streamed or whole, over the standard library alone (no torch, no openai), so that a command
routed through a resident server starts in a tenth of a second instead of loading a model.

Errors a user can cause come back as `InvalidArgument` with a hint: no server at the address,
a request the server refused (`Refused`: its message, status and reply), a server whose model
failed to load. A server still loading its model is waited for (`wait_ready`).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from ..errors import InvalidArgument

TIMEOUT_S = 600.0
"""The longest a request may go without a byte from the server."""
READY_S, POLL_S = 600.0, 0.2
"""How long a command waits for a server that is loading its model, and how often it asks."""


@dataclass(frozen=True)
class ServedModel:
    """What a server's /v1/models says of its model: `id`, the name requests send, and `source`,
    how it was loaded (model, precision, device, chat_template; empty from another server)."""

    url: str
    id: str
    source: dict = field(default_factory=dict)


def wait_ready(url: str, *, timeout_s: float = READY_S, on_wait: Callable[[], None] | None = None) -> None:
    """Return once the server at `url` is ready (/health: ok); while it loads its model, call
    `on_wait()` once and poll. A server that failed to load, that is draining, or that is still
    loading after `timeout_s` is an error."""
    deadline = time.monotonic() + timeout_s
    while (status := _health(url)) == "loading" and time.monotonic() < deadline:
        if on_wait is not None:
            on_wait()
            on_wait = None
        time.sleep(POLL_S)
    if status != "ok":
        raise InvalidArgument(f"the server at {url} is not ready (its /health says {status})",
                              "see the server's log" if status == "failed" else "wait until its /health says ok")


def _health(url: str) -> str:
    """What /health says: "ok", or (503) "loading", "draining" or "failed"."""
    try:
        return _object(url, "/health", _open(url, "/health", None, None, timeout=10.0).read()).get("status", "ok")
    except Refused as refused:
        if refused.status != 503:
            raise
        return refused.reply.get("status", "unavailable")


def served_model(url: str, *, api_key: str | None = None) -> ServedModel:
    """The model the server at `url` serves (its first, where it lists several); a server that is
    not `multidecode serve` (another OpenAI-compatible one sends no token ids) is refused."""
    listing = _object(url, "/v1/models", _open(url, "/v1/models", None, api_key, timeout=10.0).read())
    models = listing.get("data") or []
    if not models:
        raise InvalidArgument(f"the server at {url} lists no model", "start it with a model: multidecode serve")
    if not isinstance(models[0], dict) or not isinstance(models[0].get("multidecode"), dict) or "id" not in models[0]:
        raise _not_ours(url, "/v1/models")
    return ServedModel(url, models[0]["id"], models[0]["multidecode"])


def complete(served: ServedModel, body: dict, *, chat: bool, api_key: str | None = None) -> dict:
    """One request's whole answer (`body` without "model" and "stream": they are set here)."""
    route = _route(chat)
    return _object(served.url, route, _open(served.url, route, {**body, "model": served.id, "stream": False},
                                            api_key).read())


def _object(url: str, route: str, raw: bytes) -> dict:
    """A reply's JSON object; anything else is a server that is not `multidecode serve`."""
    try:
        value = json.loads(raw)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise _not_ours(url, route)
    return value


def _not_ours(url: str, route: str) -> InvalidArgument:
    return InvalidArgument(f"the server at {url} is not multidecode serve (its {route} is not multidecode's)",
                           "point --server (or MULTIDECODE_SERVER) at `multidecode serve`, or drop it to load the "
                           "model here")


def stream(served: ServedModel, body: dict, *, chat: bool, api_key: str | None = None) -> Iterator[dict]:
    """One request's streamed chunks, as dicts, through the last (the usage chunk, asked for here);
    an error event in the stream raises."""
    body = {**body, "model": served.id, "stream": True, "stream_options": {"include_usage": True}}
    with _open(served.url, _route(chat), body, api_key) as reply:
        for line in reply:
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                return
            chunk = _object(served.url, _route(chat), data)
            if "error" in chunk:
                raise _refused(served.url, chunk)
            yield chunk


def _route(chat: bool) -> str:
    return "/v1/chat/completions" if chat else "/v1/completions"


def _open(url: str, route: str, body: dict | None, api_key: str | None, timeout: float = TIMEOUT_S):
    """The server's reply to a GET (`body` None) or a JSON POST, or the error a user can act on."""
    headers = {"Content-Type": "application/json"} if body is not None else {}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url.rstrip("/") + route, data=data, headers=headers)
    try:
        return urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as error:
        try:
            reply = json.load(error)
        except ValueError:
            reply = None
        if not isinstance(reply, dict):
            reply = {"error": {"message": f"HTTP {error.code} {error.reason}"}}
        raise _refused(url, reply, error.code, key_sent=bool(api_key)) from None
    except (urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", error)
        raise InvalidArgument(f"no server answers at {url} ({reason})",
                              "start one with `multidecode serve`, or drop --server (and MULTIDECODE_SERVER) "
                              "to load the model here") from None


class Refused(InvalidArgument):
    """A server's refusal, worded for the user, with its HTTP `status` and the `reply` it sent."""

    def __init__(self, message: str, hint: str, status: int | None, reply: dict) -> None:
        super().__init__(message, hint)
        self.status, self.reply = status, reply


def _refused(url: str, reply: dict, status: int | None = None, *, key_sent: bool = False) -> Refused:
    """A refusal in the user's words; key_sent: whether the request carried an API key (a 401 then
    means that key was rejected, not that one is missing: a different fix)."""
    error = reply.get("error") or {}
    message = error.get("message") if isinstance(error, dict) else str(error)
    if status == 503:
        words = (f"the server at {url} is not ready: {message}", "wait until its /health says ok")
    elif status == 401 and key_sent:
        words = (f"the server at {url} rejected the API key sent: {message}",
                 "set MULTIDECODE_API_KEY to the key the server was started with (its --api-key)")
    elif status == 401:
        words = (f"the server at {url} wants an API key, and none was sent: {message}",
                 "set MULTIDECODE_API_KEY to the server's key")
    elif status in (404, 405):  # a path it does not serve: another program, or a path after the port
        words = (f"no multidecode server answers at {url} (HTTP {status}: {message})",
                 "check the URL: its host and port as `multidecode serve` printed them, with no path after them")
    else:
        words = (f"the server at {url} refused the request: {message}",
                 "change what it names, or drop --server to run here")
    return Refused(*words, status, reply)


__all__ = ["Refused", "ServedModel", "complete", "served_model", "stream", "wait_ready"]
