"""A streaming client of the OpenAI protocol that records when each token came: what the serve
benchmark drives servers with (its loads and warm-ups), `multidecode serve` or any other. It needs
the openai package (`pip install openai`), which the server itself does not."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from ..errors import InvalidArgument


@dataclass
class StreamedRequest:
    """One request as the client saw it (times from `time.perf_counter`); `arrival`: when it was
    due, in seconds after its load started."""

    index: int
    arrival: float
    sent: float = 0.0
    token_times: list[float] = field(default_factory=list)
    end: float = 0.0
    text: str = ""
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    error: str | None = None

    @property
    def tokens(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else len(self.token_times)


def openai_module():
    """The openai package, or an error saying how to install it."""
    try:
        import openai
    except ImportError:
        raise InvalidArgument("bench serve drives the servers with the openai client, which is not installed",
                              "pip install openai") from None
    return openai


async def stream_completion(client, model: str, prompt: str, outcome: StreamedRequest, max_tokens: int) -> None:
    """One streamed greedy completion, recorded in `outcome`; an error is recorded, not raised."""
    import httpx
    import openai

    outcome.sent = time.perf_counter()
    try:
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                 stream=True, stream_options={"include_usage": True})
        async for chunk in stream:
            now = time.perf_counter()
            for choice in chunk.choices or ():
                if choice.text:
                    outcome.token_times.append(now)
                    outcome.text += choice.text
            if chunk.usage is not None:
                outcome.completion_tokens = chunk.usage.completion_tokens
                details = getattr(chunk.usage, "prompt_tokens_details", None)
                outcome.cached_tokens = getattr(details, "cached_tokens", None)
    except (openai.APIError, httpx.HTTPError, OSError) as error:
        outcome.error = f"{type(error).__name__}: {error}"[:300]
    outcome.end = time.perf_counter()


def drive(url: str, timeout_s: float, send: Callable[[object, float], Awaitable[list[StreamedRequest]]]
          ) -> tuple[list[StreamedRequest], float]:
    """Run `send(client, start)` on a fresh `AsyncOpenAI` client of the server at `url` (no retries):
    the requests it returns, and `start`, when it began."""
    openai = openai_module()

    async def run() -> tuple[list[StreamedRequest], float]:
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=timeout_s) as client:
            start = time.perf_counter()
            return await send(client, start), start

    return asyncio.run(run())


__all__ = ["StreamedRequest", "drive", "openai_module", "stream_completion"]
