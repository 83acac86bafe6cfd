"""The HTTP face of the server: OpenAI's routes on FastAPI, over one `ForestRuntime`.

Routes: `POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models` (each model with
`multidecode`: how it was loaded, its device, whether it has a chat template: what `multidecode
generate --server` checks) and `GET /v1/models/{id}` (one of them), `GET /health` (and `HEAD`:
200 when ready, 503 while loading or draining), `GET /metrics` (Prometheus text) and `GET /`
(the live page). Errors have OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`:
400 for anything a client sends wrong, 401 without the API key (saying whether none came or the
one sent is not accepted), 404 for an unknown model or route, 503 with Retry-After at the
admission cap, while draining, and for a request still running when a drain runs out. An error
after a stream has begun goes out as an error event typed as that status would be, then
`data: [DONE]`.

A request's tokens come from the engine thread through an asyncio queue. A client that goes
away (a closed stream, or a timeout on a plain request, noticed within `POLL_SECONDS`) has its
job cancelled: its branches leave the forest at the next step.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from importlib import resources
from urllib.parse import urlsplit

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware

from ..errors import InvalidArgument, MultiDecodeError
from ..prompts import has_chat_template
from ..runtime import ForestRuntime, Job, Limits, Overloaded, TooLarge
from ..speculation import LEARNED, SpeculationSettings, load_draft, load_heads
from .protocol import (
    BadRequest,
    Call,
    ChatBody,
    Choice,
    CompletionBody,
    chat_logprobs,
    completion_logprobs,
    echo_texts,
    error_body,
    parse_body,
    to_job,
    token_entry,
    tool_choice,
    usage_dict,
)

log = logging.getLogger("multidecode.serving")

MAX_BODY_BYTES = 16 * 1024 * 1024
"""The largest request body accepted (far past any prompt the model's window can hold)."""

POLL_SECONDS = 0.2
"""How often a plain (non-streamed) request checks that its client is still there."""


class ServeState:
    """What the app serves: the model's name, the `ForestRuntime` once loaded, the API key, and
    the speculation requests get unless they ask for their own (`SpeculationSettings`, or a mode)."""

    def __init__(self, name: str, *, api_key: str | None = None,
                 speculate: SpeculationSettings | str | None = None, source: dict | None = None,
                 allowed_origins: Sequence[str] = ("*",)) -> None:
        if api_key is not None and not api_key.strip():  # every request would get a 401, whatever its key
            raise InvalidArgument("the API key is empty (was the variable it came from unset?)",
                                  "give the key clients will send, or leave --api-key out to serve without one")
        if api_key is not None and not (api_key.isascii() and api_key.isprintable()):  # an HTTP header carries it
            raise InvalidArgument("the API key holds a character an HTTP header cannot carry as sent (clients send "
                                  "UTF-8, the header is read as Latin-1: every request would get a 401)",
                                  "use printable ASCII letters, digits and punctuation")
        self.name, self.api_key = name, api_key
        self.allowed_origins = tuple(map(_checked_origin, allowed_origins))  # pages whose scripts may call it (CORS)
        self.source = dict(source or {})  # how the model was asked for: model, precision, device
        self.speculate = (speculate if isinstance(speculate, SpeculationSettings)
                          else SpeculationSettings.parse(speculate))
        self.runtime: ForestRuntime | None = None
        self.load_error: BaseException | None = None
        self.started = int(time.time())

    def load(self, loader: Callable[[], tuple], *, limits: Limits | None = None, cost=None,
             background: bool = True) -> None:
        """Load the model (`loader()` returns model and tokenizer), and the draft model its
        speculation names, and start the engine thread; in the background by default, so that
        /health answers 503 meanwhile."""
        def run():
            try:
                model, tokenizer = loader()
                draft = None
                if self.speculate.own_draft:
                    draft = load_draft(self.speculate, model, tokenizer)
                elif self.speculate.mode in LEARNED:  # the server drafts with learned heads
                    draft = load_heads(self.speculate, model)
                self.source |= {"device": str(model.device), "chat_template": has_chat_template(tokenizer)}
                self.runtime = ForestRuntime(model, tokenizer, limits=limits, cost=cost, draft=draft).start()
                self.source["eos_token_ids"] = sorted(self.runtime.eos)  # a client reads why a reply ended
                log.info("model %s ready", self.name)
            except BaseException as error:  # reported by /health and by every request
                self.load_error = error
                if isinstance(error, MultiDecodeError):  # the user's to fix: its message says how, no traceback
                    log.error("loading the model failed: %s", error)
                else:
                    log.exception("loading the model failed")

        if background:
            threading.Thread(target=run, name="multidecode-load", daemon=True).start()
        else:
            run()

    def ready(self) -> ForestRuntime:
        if self.runtime is None:
            detail = f"the model failed to load: {self.load_error}" if self.load_error else "the model is loading"
            raise Overloaded(detail, retry_after=5)
        return self.runtime

    def authorize(self, request: Request) -> None:
        """Refuse a request without this server's API key (when it has one), saying whether none
        came (or not as a Bearer token) or the one that came is not this server's: the two are
        fixed in different places (the client's settings, or the key itself)."""
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "").strip()
        scheme, _, key = given.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            sent = "no Authorization header came" if not given else "the Authorization header holds no Bearer key"
            raise HTTPException(401, f"this server needs an API key, and {sent}: send Authorization: Bearer <key>")
        if not secrets.compare_digest(key.strip().encode(), self.api_key.encode()):
            raise HTTPException(401, "the API key sent is not accepted by this server: send the key it was started "
                                     "with (--api-key)")


DEFAULT_PORTS = {"http": 80, "https": 443}


def _checked_origin(origin: str) -> str:
    """`origin` as a browser sends it in its Origin header, which CORS compares exactly: "*" (any
    page), "null" (a file:// page, a sandboxed frame), or scheme://host[:port] in lower case without
    a default port (http://LocalHost:80 is sent as http://localhost). One no browser could send
    ("localhost:3000", a path, a user, a wildcard host) is refused: it would be taken, and every call
    from the page it meant refused."""
    if origin in ("*", "null"):
        return origin
    parts = urlsplit(origin.strip().rstrip("/"))
    try:
        port = parts.port
    except ValueError:  # a port that is no number
        port = None
        parts = parts._replace(netloc="")
    if (not parts.scheme or not parts.hostname or parts.path or parts.query or parts.fragment
            or "@" in parts.netloc or "*" in parts.netloc):
        raise InvalidArgument(f"allowed origin {origin!r} is not an origin a browser sends",
                              "write scheme://host[:port] with no path, e.g. http://localhost:3000 (or * for any "
                              "page, none for no other page)")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    shown = port is not None and port != DEFAULT_PORTS.get(parts.scheme)
    return f"{parts.scheme}://{host}" + (f":{port}" if shown else "")


def create_app(state: ServeState) -> FastAPI:
    """The FastAPI application over `state` (see the module notes)."""
    app = FastAPI(title="multidecode", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serve = state
    app.add_middleware(_ServerErrors)
    if state.allowed_origins:  # a browser's page on another origin (a chat front end) may call the API, as
        # OpenAI's, vLLM's and llama.cpp's servers let it; the API key still guards what it guards
        app.add_middleware(CORSMiddleware, allow_origins=list(state.allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["*"], expose_headers=["Retry-After"], max_age=600)
    _error_handlers(app)
    _info_routes(app, state)
    _completion_routes(app, state)
    return app


def _error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's shape, with its status (see the module notes)."""

    @app.exception_handler(BadRequest)
    async def bad_request(request: Request, error: BadRequest):
        return JSONResponse(error_body(str(error), param=error.param, code=error.code), status_code=400)

    @app.exception_handler(Overloaded)
    async def overloaded(request: Request, error: Overloaded):
        return JSONResponse(error_body(str(error), "server_overloaded", code="overloaded"), status_code=503,
                            headers={"Retry-After": str(error.retry_after)})

    @app.exception_handler(MultiDecodeError)
    async def user_error(request: Request, error: MultiDecodeError):
        return JSONResponse(error_body(str(error)), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException):
        # OpenAI's words: every such error is an invalid_request_error, told apart by its code
        unknown_model = isinstance(error, ModelNotServed)
        code = "model_not_found" if unknown_model else {401: "invalid_api_key"}.get(error.status_code)
        return JSONResponse(error_body(str(error.detail), param="model" if unknown_model else None, code=code),
                            status_code=error.status_code, headers=getattr(error, "headers", None))


class ModelNotServed(HTTPException):
    """A 404 for a model this server does not serve (OpenAI's code `model_not_found`, param `model`)."""

    def __init__(self, asked: str, served: str) -> None:
        super().__init__(404, f"the model {asked!r} does not exist: this server serves {served!r}")


def _info_routes(app: FastAPI, state: ServeState) -> None:
    """/health, /v1/models, /metrics and the live page."""

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: a probe that reads the status alone
    async def health(request: Request):
        if state.runtime is None or state.runtime.draining:
            status, code = "failed" if state.load_error else "draining" if state.runtime else "loading", 503
        else:
            status, code = "ok", 200
        if request.method == "HEAD":
            return Response(status_code=code)
        return JSONResponse({"status": status}, status_code=code)

    def model_object() -> dict:
        return {"id": state.name, "object": "model", "created": state.started, "owned_by": "multidecode",
                "multidecode": state.source}

    @app.get("/v1/models")
    async def models(request: Request):
        state.authorize(request)
        return {"object": "list", "data": [model_object()]}

    @app.get("/v1/models/{model_id:path}")  # a model's id may hold slashes (an organization's, a folder's)
    async def model(request: Request, model_id: str):
        state.authorize(request)
        if model_id != state.name:
            raise ModelNotServed(model_id, state.name)
        return model_object()

    @app.get("/metrics")
    async def metrics(request: Request):
        state.authorize(request)
        registry = CollectorRegistry()
        registry.register(_Collector(state))
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.api_route("/", methods=["GET", "HEAD"])  # HEAD: an uptime monitor's probe
    async def page(request: Request):
        # The page itself holds no data (every route it calls needs the key), so it is served
        # without one: a browser cannot send a header when it opens a page.
        return HTMLResponse(resources.files("multidecode.serving").joinpath("static/index.html").read_text("utf-8"))


def _completion_routes(app: FastAPI, state: ServeState) -> None:
    """/v1/completions and /v1/chat/completions: a request becomes a runtime job, its answer
    streamed or collected from what the engine thread sends."""

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _serve(request, CompletionBody)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _serve(request, ChatBody)

    async def _serve(request: Request, kind):
        state.authorize(request)
        runtime = state.ready()
        body = parse_body(await _read_body(request), request.headers.get("content-type"), kind)
        if body.model != state.name:
            raise ModelNotServed(body.model, state.name)
        engine = runtime.engine
        # Tokenizing a long prompt takes a while: off the event loop, so other streams keep flowing.
        job = await asyncio.to_thread(to_job, body, runtime.tokenizer, vocab_size=engine.vocab_size,
                                      max_positions=engine.max_positions,
                                      window_note=engine.positions_note, speculate_default=state.speculate,
                                      has_draft=runtime.draft is not None, max_branches=runtime.limits.max_branches,
                                      eos_ids=runtime.eos)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        job.sink = lambda item: loop.call_soon_threadsafe(queue.put_nowait, item)
        try:
            runtime.submit(job)
        except (TooLarge, Overloaded) as error:
            raise _in_this_servers_words(error) from None
        reply = _Reply(state, runtime, job, body, chat=kind is ChatBody)
        if body.stream:
            return StreamingResponse(reply.stream(queue), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await reply.collect(request, queue)


def _in_this_servers_words(refusal: TooLarge | Overloaded) -> MultiDecodeError:
    """The runtime's refusal of a request, said as the server's: "the request", "this server",
    and the knobs a client or an operator can turn (max_tokens, n, the server's limits)."""
    if isinstance(refusal, TooLarge):
        hint = "lower max_tokens, n or the number of questions"
        if not refusal.over_bytes:
            hint += ", or start the server with larger limits"
        branches_alone = not refusal.over_bytes and refusal.need.tokens <= refusal.limit.tokens
        return BadRequest(str(refusal.reworded(hint, subject="the request", holder="this server")),
                          "n" if branches_alone else "max_tokens")
    if refusal.draining:
        return Overloaded.shutting_down("the server", "retry against another replica")
    return Overloaded.at_capacity(refusal.held, "the server")


async def _read_body(request: Request) -> bytes:
    """The request body, refused past `MAX_BODY_BYTES` without reading the rest."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise BadRequest(f"the request body is {int(declared)} bytes, over this server's limit of {MAX_BODY_BYTES}",
                         code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise BadRequest(f"the request body is over this server's limit of {MAX_BODY_BYTES} bytes",
                             code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


class _Reply:
    """Builds one request's answer from what the engine sends, streamed or whole."""

    def __init__(self, state: ServeState, runtime: ForestRuntime, job: Job, body, *, chat: bool) -> None:
        self.state, self.runtime, self.job, self.body, self.chat = state, runtime, job, body, chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + job.id
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.choices = [Choice(i) for i in range(job.beams or len(job.prompts))]
        self.echo = echo_texts(body, runtime.tokenizer)  # each choice's prompt with echo, else []
        for choice, text in zip(self.choices, self.echo):
            choice.text = text
        self.tool = tool_choice(body)  # the call each choice is, or None

    def _call(self, choice: Choice, call: Call) -> dict:
        """Choice's tool call in OpenAI's shape: its id, the function and its arguments."""
        return {"id": f"call_{self.job.id}_{choice.index}", "type": "function",
                "function": {"name": call.name, "arguments": call.arguments}}

    def _ended_call(self, choice: Choice) -> Call | None:
        """The tool call a finished choice's text is (`ToolChoice.call`), read once for its message
        or delta and its finish reason; None for a text reply."""
        return None if self.tool is None else self.tool.call(choice.text)

    def _message(self, choice: Choice, call: Call | None) -> dict:
        """A whole reply's message: its text, or its tool call (none where the reply was cut off
        before the function's name: an empty message, finished by "length")."""
        if self.tool is None:
            return {"role": "assistant", "content": choice.text}
        return {"role": "assistant", "content": None} | ({"tool_calls": [self._call(choice, call)]} if call else {})

    def _finish(self, reason: str | None, call: Call | None) -> str | None:
        """A tool call that ended whole, as its grammar allows, is finished as "tool_calls" (OpenAI's
        word); one cut short keeps its reason ("length", or "stop" for a stop string)."""
        return "tool_calls" if reason == "stop" and call is not None and call.whole else reason

    def _head(self, chunk: bool) -> dict:
        kind = self.object + (".chunk" if chunk and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.state.name}

    def _logprobs(self, entries: list):
        if self.job.logprobs is None:
            return None
        return chat_logprobs(entries) if self.chat else completion_logprobs(entries)

    def _take(self, event) -> tuple[Choice, list]:
        choice = self.choices[event.branch]
        entries = ([token_entry(self.runtime.tokenizer, event, event.offset)] if self.job.logprobs is not None
                   else [])  # (no echo with logprobs: the offset is into the generated text)
        choice.logprobs.extend(entries)
        choice.token_ids.append(event.token_id)
        choice.text += event.text
        choice.finish_reason = event.finish_reason
        return choice, entries

    # ------------------------------------------------------------------ whole
    async def collect(self, request: Request, queue: asyncio.Queue) -> JSONResponse:
        usage = None
        check = time.monotonic() + POLL_SECONDS
        while usage is None:
            try:
                kind, payload = await asyncio.wait_for(queue.get(), POLL_SECONDS)
            except TimeoutError:
                kind = None
            if time.monotonic() >= check:  # on a timer: a steady flow of tokens must not hide a client that left
                check = time.monotonic() + POLL_SECONDS
                if await request.is_disconnected():
                    self.runtime.cancel(self.job)
                    return JSONResponse(error_body("the client went away"), status_code=499)
            if kind == "token":
                self._take(payload)
            elif kind == "beams":
                for choice, beam in zip(self.choices, payload):
                    choice.text, choice.finish_reason = choice.text + beam.text, beam.finish_reason  # after any echo
                    choice.token_ids = list(beam.token_ids)
            elif kind == "error":
                raise payload
            elif kind == "done":
                usage = payload
        choices = []
        for c in self.choices:
            if self.chat:
                call = self._ended_call(c)
                choices.append({"index": c.index, "message": self._message(c, call),
                                "logprobs": self._logprobs(c.logprobs), "finish_reason": self._finish(c.finish_reason, call)})
            else:
                choices.append({"index": c.index, "text": c.text, "logprobs": self._logprobs(c.logprobs),
                                "finish_reason": c.finish_reason})
            if self.body.return_token_ids:  # beams share the one prompt
                prompt = self.job.prompts[c.index if c.index < len(self.job.prompts) else 0]
                choices[-1] |= {"token_ids": c.token_ids, "prompt_token_ids": list(prompt)}
        return JSONResponse({**self._head(False), "choices": choices, "usage": usage_dict(usage),
                             "multidecode": usage.stats})

    # ------------------------------------------------------------------ streamed
    def _delta(self, choice: Choice, event, call: Call | None) -> dict | None:
        """A chat chunk's delta for `event` (None: nothing to send yet; `call`: the choice's call
        once it has ended). A named function's arguments stream as they come; a "required" call is
        sent when it ends, as far as it came (nothing, an empty delta, where it was cut off before
        the function's name)."""
        if self.tool is None:
            return {"content": event.text}
        if self.tool.named:
            return {"tool_calls": [{"index": 0, "function": {"arguments": event.text}}]}
        if event.finish_reason is None:
            return None
        return {"tool_calls": [{"index": 0, **self._call(choice, call)}]} if call is not None else {}

    def _ids(self, event, ids: list | None = None) -> dict:
        """A streamed choice's `token_ids` (`return_token_ids`): the event's token, or `ids`."""
        return {"token_ids": [event.token_id] if ids is None else ids} if self.body.return_token_ids else {}

    def _chat_items(self, choice: Choice, event, entries: list) -> list[dict]:
        """A chat stream's choices for a token event: its delta (none where there is nothing to send
        yet; a "required" call's carries the token ids and logprobs held back with it), then, where
        it ends the choice, OpenAI's last chunk of its own, an empty delta with the reason (the
        openai client's tool-call events wait for it)."""
        call = self._ended_call(choice) if event.finish_reason else None
        delta = self._delta(choice, event, call)
        if delta is None:
            return []
        ids = None  # the event's token
        if self.tool is not None and not self.tool.named:  # a "required" call, held back to its end
            entries, ids = choice.logprobs, list(choice.token_ids)  # every token's, sent with it
        finish = self._finish(event.finish_reason, call)
        items = []
        if finish is None or entries or any(delta.values()):
            items.append({"index": choice.index, "delta": delta, "logprobs": self._logprobs(entries),
                          "finish_reason": None, **self._ids(event, ids)})
        if finish is not None:
            items.append({"index": choice.index, "delta": {}, "logprobs": None, "finish_reason": finish,
                          **self._ids(event, [] if items else ids)})
        return items

    async def stream(self, queue: asyncio.Queue) -> AsyncIterator[str]:
        finished = False
        include_usage = self.body.stream_options is not None and self.body.stream_options.include_usage
        try:
            if self.chat:
                for c in self.choices:
                    opening = {"role": "assistant", "content": ""}
                    if self.tool is not None:  # a named function's call opens with its name; "required" waits
                        opening = {"role": "assistant", "content": None,
                                   "tool_calls": [{"index": 0, **self._call(c, self.tool.call(""))}]
                                   if self.tool.named else []}
                    yield _sse({**self._head(True), "choices": [{"index": c.index, "delta": opening,
                                                                "logprobs": None, "finish_reason": None}]})
            for c, text in zip(self.choices, self.echo):
                if text:  # echo: the prompt comes first
                    yield _sse({**self._head(True), "choices": [{"index": c.index, "text": text, "logprobs": None,
                                                                "finish_reason": None}]})
            while True:
                kind, payload = await queue.get()
                if kind == "token":
                    choice, entries = self._take(payload)
                    if not (payload.text or payload.finish_reason or entries or self.body.return_token_ids):
                        continue
                    for item in self._chat_items(choice, payload, entries) if self.chat else [{
                            "index": choice.index, "text": payload.text, "logprobs": self._logprobs(entries),
                            "finish_reason": payload.finish_reason, **self._ids(payload)}]:
                        yield _sse({**self._head(True), "choices": [item]})
                elif kind == "trace":
                    yield _sse({"id": self.id, "object": "multidecode.trace", **payload})
                elif kind == "error":
                    finished = True
                    yield _sse(_error_event(payload))
                    yield "data: [DONE]\n\n"
                    return
                elif kind == "done":
                    finished = True
                    if include_usage:
                        yield _sse({**self._head(True), "choices": [], "usage": usage_dict(payload),
                                    "multidecode": payload.stats})
                    yield "data: [DONE]\n\n"
                    return
        finally:
            if not finished:
                self.runtime.cancel(self.job)


class _ServerErrors:
    """Any other exception as a 500 in OpenAI's shape. (Starlette's handler for `Exception`
    answers too, but then re-raises to uvicorn, which closes the connection: a client that
    reuses it for its next request gets a connection error.)"""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracked(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as error:
            if started:  # too late for a status: the server ends the response
                raise
            log.exception("unexpected error")
            response = JSONResponse(error_body(f"internal error: {error}", "server_error"), status_code=500)
            await response(scope, receive, send)


def _error_event(error: BaseException) -> dict:
    """An error after a stream began, typed as its status would have been had it come first: the
    server shutting down (or at capacity) as a 503's, a request's fault as a 400's, a bug as a 500's."""
    if isinstance(error, Overloaded):
        return error_body(str(error), "server_overloaded", code="overloaded")
    if isinstance(error, MultiDecodeError):
        return error_body(str(error))
    return error_body(str(error), "server_error")


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


class _Collector:
    """Prometheus metrics read from the server's counters when /metrics is scraped."""

    def __init__(self, state: ServeState) -> None:
        self.state = state

    def collect(self):
        server = self.state.runtime
        ready = GaugeMetricFamily("multidecode_ready", "1 when the model is loaded and the server is not draining")
        ready.add_metric([], float(server is not None and not server.draining))
        yield ready
        if server is None:
            return
        c = server.counters
        counters = {
            "requests_admitted": ("requests admitted to the forest", c.admitted),
            "requests_rejected": ("requests refused at the admission cap or while draining", c.rejected),
            "requests_cancelled": ("requests whose client went away", c.cancelled),
            "prompt_tokens": ("prompt tokens received", c.prompt_tokens),
            "prompt_tokens_cached": ("prompt tokens found in the prefix cache, not computed again", c.cached_tokens),
            "generation_tokens": ("tokens generated", c.generated),
            "steps": ("scheduler steps", c.steps),
            "forward_passes": ("model forwards", c.forwards),
            "rows": ("tokens fed to the model in steps", c.rows),
            "branch_steps": ("live branches summed over steps", c.branches),
            "busy_seconds": ("seconds spent in steps", c.busy_seconds),
        }
        for name, (text, value) in counters.items():
            family = CounterMetricFamily(f"multidecode_{name}", text)
            family.add_metric([], value)
            yield family
        gauges = {
            "running_requests": ("requests decoding or waiting", server.busy),
            "cache_slots": ("KV cache slots in use", server.engine.forest.num_slots),
            "prefix_cache_tokens": ("tokens in the prefix index", len(server.index)),
        }
        for name, (text, value) in gauges.items():
            family = GaugeMetricFamily(f"multidecode_{name}", text)
            family.add_metric([], value)
            yield family


__all__ = ["ServeState", "create_app"]
