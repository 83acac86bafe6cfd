"""A server on a free loopback port for tests: a tiny model (or the embedded one) behind the real
ASGI stack, started in this process, and the real `openai` client pointed at it. The tiny model's
folder is conftest's `model_dir` fixture: `running_server(tiny_loader(model_dir))`."""

from __future__ import annotations

import functools
import math
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import uvicorn
from tiny_models import EOS

from multidecode.models.loading import load_model_and_tokenizer
from multidecode.runtime import Limits
from multidecode.serving.app import ServeState, create_app
from multidecode.serving.launch import DrainingServer, free_port

MODEL = "tiny"


class Running:
    """A started server: its base URL, its state (the `ForestRuntime` is `state.runtime`), clients."""

    def __init__(self, state: ServeState, port: int, uvicorn_server) -> None:
        self.state, self.port, self.uvicorn = state, port, uvicorn_server
        self.url = f"http://127.0.0.1:{port}"

    @property
    def forest(self):
        return self.state.runtime

    def client(self, **kwargs) -> openai.OpenAI:
        kwargs.setdefault("api_key", self.state.api_key or "none")
        return openai.OpenAI(base_url=self.url + "/v1", max_retries=0, **kwargs)

    def async_client(self, **kwargs) -> openai.AsyncOpenAI:
        kwargs.setdefault("api_key", self.state.api_key or "none")
        return openai.AsyncOpenAI(base_url=self.url + "/v1", max_retries=0, **kwargs)

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Until no request is running and the engine has settled its cache (it holds the indexed
        prompt prefixes only: the engine thread settles it right after the last step, later on a
        loaded machine)."""
        from multidecode.runtime import forest_runtime

        forest = self.forest

        def settled() -> bool:  # compacted to the indexed prefixes, and renumbered where that is due
            nodes = forest.engine.forest
            due = len(nodes) > max(nodes.num_slots, forest_runtime.RENUMBER_FACTOR * max(nodes.num_slots,
                                                                                         forest_runtime.MIN_RENUMBER))
            return nodes.num_slots == len(forest.index) and not due

        if not wait_until(lambda: not forest.busy and not forest.scheduler.works, timeout, every=0.02):
            raise TimeoutError("the server did not go idle")
        if not wait_until(settled, timeout, every=0.02):
            raise TimeoutError(f"the idle server's cache kept {forest.engine.forest.num_slots - len(forest.index)} "
                               "slots beyond its indexed prefixes, or was not renumbered")


def tiny_loader(folder: Path):
    return lambda: load_model_and_tokenizer(str(folder))


@contextmanager
def running_server(loader, *, name: str = MODEL, api_key: str | None = None, limits: Limits | None = None,
                   background: bool = False, drain_timeout: float = 5.0, speculate=None, source: dict | None = None,
                   allowed_origins=("*",)):
    """Serve `loader()`'s model on a free port until the block ends (speculate: the server's own;
    source: how the model was asked for, as `multidecode serve` reports it in /v1/models)."""
    state = ServeState(name, api_key=api_key, speculate=speculate, source=source, allowed_origins=allowed_origins)
    port = free_port()
    server = DrainingServer(uvicorn.Config(create_app(state), host="127.0.0.1", port=port, log_level="warning"),
                            state, drain_timeout=drain_timeout)
    thread = threading.Thread(target=server.run, daemon=True)
    state.load(loader, limits=limits, background=background)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline:
            raise TimeoutError("the server did not start")
        time.sleep(0.02)
    try:
        yield Running(state, port, server)
    finally:
        server.should_exit = True
        thread.join(10)
        if state.runtime is not None:
            state.runtime.stop()


def chat_prompt_ids(running: Running, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """The prompt ids the server builds for `messages` (and `tools`) through its chat template."""
    tokenizer = running.forest.tokenizer
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def wait_until(condition: Callable[[], object], seconds: float, *, every: float = 0.01) -> bool:
    """Poll `condition` until it holds or `seconds` pass; whether it holds then."""
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(every)
    return bool(condition())


def chat_choices(reply, n: int, *, stream: bool) -> tuple[list[str], list[str | None]]:
    """Each of a chat reply's `n` choices as (its text, its finish reason), streamed or whole."""
    texts, finishes = [""] * n, [None] * n
    for choice in ([c for chunk in reply for c in chunk.choices] if stream else reply.choices):
        texts[choice.index] += (choice.delta.content or "") if stream else choice.message.content
        finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    return texts, finishes


# ---------------------------------------------------------------------- faults and error shapes
class Control:
    """What the served model does besides its forward: sleep before each one, or raise."""

    def __init__(self) -> None:
        self.delay = 0.0
        self.fail = False

    def reset(self) -> None:
        self.delay, self.fail = 0.0, False


def controlled_loader(folder: Path, control: Control):
    def load():
        model, tokenizer = load_model_and_tokenizer(str(folder))
        forward = model.forward

        @functools.wraps(forward)  # its signature stays: the engine checks it takes position_ids
        def controlled(*args, **kwargs):
            if control.delay:
                time.sleep(control.delay)
            if control.fail:
                raise RuntimeError("injected fault in the model's forward")
            out = forward(*args, **kwargs)
            out.logits[..., EOS] = -math.inf  # a request runs to its max_tokens
            return out

        model.forward = controlled
        return model, tokenizer

    return load


def assert_error_shape(response: httpx.Response, status: int, kind: str | None = None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    error = body["error"]
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
    if kind is not None:
        assert error["type"] == kind
    return error
