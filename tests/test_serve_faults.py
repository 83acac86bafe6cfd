"""`multidecode serve`'s errors and faults (issue 9, section 3), with the real `openai` client.

- every bad input is a 400 in OpenAI's error shape (never 422 or 500), an unknown model or route
  a 404, and the next good request succeeds;
- `--api-key` guards every route but /health (and the live page, which holds no data);
- the admission cap answers 503 with Retry-After while earlier requests hold it, and 400 for a
  request that could never fit;
- an engine error after a stream began is an error event, then `data: [DONE]`;
- clients that time out or close a stream have their branches pruned and their slots freed;
- SIGTERM drains a real `multidecode serve` process; a bad --model exits with a message;
- a property-based fuzz of the request schema finds no 500.

The served model is the tiny random Llama behind a `Control`: it can sleep before each forward
(so that requests run long enough to be cut off) or raise from one (an engine fault), and it
never emits its end-of-sequence token, so a request runs to its max_tokens.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serving import (
    MODEL,
    Control,
    assert_error_shape,
    controlled_loader,
    free_port,
    running_server,
    tiny_loader,
    wait_until,
)

from multidecode.runtime import Job, Limits
from multidecode.runtime.jobs import NOTHING
from multidecode.sampling_params import SamplingParams
from multidecode.serving.launch import ServerProcess

MULTIDECODE = Path(sys.executable).with_name("multidecode")


CONTROL = Control()


@pytest.fixture(scope="module")
def running(model_dir):
    with running_server(controlled_loader(model_dir, CONTROL)) as running:
        yield running


@pytest.fixture()
def server(running):
    """The shared server, idle, with its model back to normal after the test."""
    CONTROL.reset()
    try:
        yield running
    finally:
        CONTROL.reset()
        running.wait_idle()


def good_completion(client: openai.OpenAI) -> None:
    reply = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=3, temperature=0)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 3


def idle_cache(forest) -> bool:
    """Nothing running, and the cache holds the indexed prompt prefixes and nothing else."""
    return not forest.scheduler.works and forest.engine.forest.num_slots == len(forest.index)


def unindexed_slots(forest) -> int:
    """Cache slots beyond the indexed prompt prefixes: 0 on an idle server (the tests that check
    it against its value before they ran do not fail for an earlier test's leftovers)."""
    return forest.engine.forest.num_slots - len(forest.index)


# ---------------------------------------------------------------------- 1. bad input: 400 / 404
BAD_COMPLETIONS = {
    "speculate": (dict(extra_body={"speculate": "bogus"}), "speculate"),
    "temperature": (dict(temperature=-1), "temperature"),
    "top_p": (dict(top_p=0), "top_p"),
    "logprobs": (dict(logprobs=50), "logprobs"),
    "n": (dict(n=0), "n"),
    "empty prompt": (dict(prompt=""), "prompt"),
    "no prompt": (dict(prompt=[]), "prompt"),
    "window": (dict(prompt="The quick brown fox jumps over the lazy dog. " * 40), "prompt"),
    "window with max_tokens": (dict(max_tokens=250, prompt="The quick brown fox jumps over the lazy dog."),
                               "max_tokens"),
    "token id": (dict(prompt=[1, 99999]), "prompt"),
    "stop": (dict(stop=[""]), "stop"),
    "many branches": (dict(n=100000), "n"),
    "many prompts": (dict(prompt=["fox"] * 100, n=3), "n"),
    "many prompts, one each": (dict(prompt=["fox"] * 300), "prompt"),
    "many questions": (dict(extra_body={"questions": ["why?"] * 300}), "questions"),
    "window in a question": (dict(extra_body={"questions": ["why?", "The quick brown fox jumps over the lazy dog. " * 40]}),
                             "questions"),
    "window in the document": (dict(prompt="The quick brown fox jumps over the lazy dog. " * 40,
                                    extra_body={"questions": ["why?"]}), "prompt"),
    "temperature too small to divide by": (dict(temperature=1e-40), "temperature"),
    "unsupported": (dict(suffix="!"), "suffix"),
    "echo with logprobs": (dict(echo=True, logprobs=2), "echo"),
    "logit_bias": (dict(logit_bias={"99999": 5}), "logit_bias"),
}


@pytest.mark.parametrize("name", BAD_COMPLETIONS)
def test_bad_completion_parameters_raise_bad_request_and_the_next_request_succeeds(server, name):
    client = server.client()
    settings_, param = BAD_COMPLETIONS[name]
    request = dict(model=MODEL, prompt="The quick brown fox", max_tokens=3) | settings_
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(**request)
    error = assert_error_shape(caught.value.response, 400, "invalid_request_error")
    assert error["param"] == param, error
    good_completion(client)


@pytest.mark.parametrize("route, field, value", [
    ("/v1/completions", "n", "2"), ("/v1/completions", "max_tokens", "3"), ("/v1/completions", "max_tokens", 3.0),
    ("/v1/completions", "temperature", "0"), ("/v1/completions", "stream", "yes"), ("/v1/completions", "stream", 1),
    ("/v1/completions", "echo", "on"), ("/v1/completions", "max_tokens", True), ("/v1/completions", "seed", False), ("/v1/completions", "prompt", [1, "2"]), ("/v1/chat/completions", "logprobs", "true"),
    ("/v1/chat/completions", "stream_options", {"include_usage": 1})])
def test_a_value_of_the_wrong_json_type_is_a_400_naming_it(server, route, field, value):
    """As OpenAI's API: "n": "2", "stream": 1 or "max_tokens": 3.0 are refused (code invalid_type),
    not read as 2, true and 3 (a client's bug then answered as if it had meant them)."""
    body = ({"messages": [{"role": "user", "content": "hi"}], "stream": True} if "chat" in route
            else {"prompt": "The quick brown fox"})
    response = httpx.post(server.url + route, json={"model": MODEL, "max_tokens": 3, **body, field: value}, timeout=30)
    error = assert_error_shape(response, 400, "invalid_request_error")
    assert error["param"] == field, error
    if field != "prompt":  # the prompt's forms have a message of their own
        got = json.dumps(value["include_usage"] if isinstance(value, dict) else value)  # the nested field's own
        assert error["code"] == "invalid_type" and f"got {got}" in error["message"], error
    good_completion(server.client())

BAD_CHATS = {
    "empty messages": (dict(messages=[]), "messages"),
    "role": (dict(messages=[{"role": "wizard", "content": "hi"}]), "messages"),
    "content part": (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
                     "messages"),
    "window": (dict(messages=[{"role": "user", "content": "The quick brown fox jumps over the lazy dog. " * 40}]),
               "messages"),
    "top_logprobs": (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
    "questions with n": (dict(n=2, extra_body={"questions": ["why?"]}), "n"),
    "empty question": (dict(extra_body={"questions": [""]}), "questions"),
    "beam search stream": (dict(n=2, stream=True, extra_body={"use_beam_search": True}), "use_beam_search"),
    "beam search questions": (dict(extra_body={"use_beam_search": True, "questions": ["why?"]}),
                              "use_beam_search"),
    "schema": (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}),
               "response_format"),
    "unsatisfiable schema": (dict(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "strict": True, "schema": {"type": "integer", "minimum": 3, "maximum": 1}}}), "response_format"),
    "strict schema": (dict(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "strict": True, "schema": {"type": "string", "format": "weird"}}}), "response_format"),
    "format type": (dict(response_format={"type": "xml"}), "response_format"),
    "format without type": (dict(response_format={"json_schema": {"name": "x", "schema": {"type": "integer"}}}),
                            "response_format"),  # was answered unconstrained, its schema ignored
    "false schema": (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": False}}),
                     "response_format"),
    "streamed schema": (dict(stream=True, response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "required": 5}}}), "response_format"),
    "beam search format": (dict(n=2, response_format={"type": "json_object"}, extra_body={"use_beam_search": True}),
                           "response_format"),
}


def test_beam_search_with_questions_is_refused_for_its_questions(server):
    """It was refused as "use_beam_search takes one prompt", though one prompt was sent."""
    with pytest.raises(openai.BadRequestError) as caught:
        server.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a document"}],
                                                max_tokens=3, extra_body={"use_beam_search": True, "questions": ["why?"]})
    assert "does not take questions" in caught.value.response.json()["error"]["message"]


@pytest.mark.parametrize("name", BAD_CHATS)
def test_bad_chat_parameters_raise_bad_request_and_the_next_request_succeeds(server, name):
    client = server.client()
    settings_, param = BAD_CHATS[name]
    request = dict(model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=3) | settings_
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**request)
    error = assert_error_shape(caught.value.response, 400, "invalid_request_error")
    assert error["param"] == param, error
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=3)
    assert reply.choices[0].message.content is not None


@pytest.mark.parametrize(("body", "content_type", "code"), [
    (b'{"model": "tiny", "prompt": ', "application/json", "invalid_json"),
    (b"\xff\xfe\x00", "application/json", "invalid_json"),
    (b"[1, 2, 3]", "application/json", None),
    (b'{"model": "tiny", "prompt": "hi"}', "text/plain", "invalid_content_type"),
    (b'{"model": "tiny", "prompt": "hi"}', None, "invalid_content_type"),
    (b"", "application/json", "invalid_json"),
    (b"[" * 100000 + b"]" * 100000, "application/json", "invalid_json"),  # past Python's recursion limit
])
def test_a_body_that_is_not_a_json_object_is_a_400(server, body, content_type, code):
    headers = {"content-type": content_type} if content_type else {}
    for route in ("/v1/completions", "/v1/chat/completions"):
        response = httpx.post(server.url + route, content=body, headers=headers, timeout=10)
        assert assert_error_shape(response, 400, "invalid_request_error")["code"] == code
    good_completion(server.client())


def _nested(depth: int) -> str:
    """JSON text of objects nested `depth` deep (written as text: json.dumps would recurse too)."""
    return '{"a": ' * depth + "{}" + "}" * depth


@pytest.mark.parametrize(("field", "depth", "param"), [
    ("messages", 5000, None),  # json.loads gives up: a RecursionError, once a 500
    ("response_format", 5000, None),
    ("tools", 700, "messages"),  # read, but the chat template's rendering recurses into it
])
def test_a_field_nested_too_deep_in_a_valid_body_is_a_400(server, field, depth, param):
    deep = "<deep>"  # where the nested objects go, once the rest is JSON
    values = {"messages": [{"role": "user", "content": "hi", "extra": deep}],
              "response_format": {"type": "json_object", "extra": deep},
              "tools": [{"type": "function", "function": {"name": "f", "parameters": deep}}]}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "tool_choice": "required", field: values[field]}
    body = json.dumps(body).replace(json.dumps(deep), _nested(depth))
    response = httpx.post(server.url + "/v1/chat/completions", content=body.encode(), timeout=30,
                          headers={"content-type": "application/json"})
    error = assert_error_shape(response, 400, "invalid_request_error")
    assert error["param"] == param and "nested too deep" in error["message"], error
    good_completion(server.client())


def test_messages_the_chat_template_refuses_are_a_400_naming_messages():
    """Many chat templates raise on a role or an order they do not take (Gemma's on a system
    message, Mistral's on two user turns in a row): the client's to fix, not a server error."""
    from local_models import tiny_tokenizer

    from multidecode.serving.protocol import BadRequest, ChatBody, parse_body, to_job

    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not "
                               "supported') }}{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    body = parse_body(json.dumps({"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]}).encode(),
        "application/json", ChatBody)
    with pytest.raises(BadRequest, match="chat template cannot render these messages: System role not supported") as caught:
        to_job(body, tokenizer, vocab_size=len(tokenizer), max_positions=None)
    assert caught.value.param == "messages"


def test_a_body_past_the_size_limit_is_a_400_without_reading_it_all(server, monkeypatch):
    monkeypatch.setattr("multidecode.serving.app.MAX_BODY_BYTES", 1000)
    body = json.dumps({"model": MODEL, "prompt": "word " * 400, "max_tokens": 2}).encode()
    declared = httpx.post(server.url + "/v1/completions", content=body, timeout=10,
                          headers={"content-type": "application/json"})
    assert assert_error_shape(declared, 400, "invalid_request_error")["code"] == "request_too_large"

    def chunks():  # no Content-Length: the limit is checked as the body streams in
        for i in range(0, len(body), 256):
            yield body[i:i + 256]

    streamed = httpx.post(server.url + "/v1/completions", content=chunks(), timeout=10,
                          headers={"content-type": "application/json"})
    assert assert_error_shape(streamed, 400, "invalid_request_error")["code"] == "request_too_large"
    good_completion(server.client())


def test_an_unknown_model_is_a_404_and_an_unknown_route_too(server):
    client = server.client()
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="gpt-5", prompt="hello", max_tokens=2)
    error = assert_error_shape(caught.value.response, 404, "invalid_request_error")  # OpenAI's words
    assert "gpt-5" in error["message"] and (error["code"], error["param"]) == ("model_not_found", "model")
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-5", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert assert_error_shape(caught.value.response, 404)["code"] == "model_not_found"
    assert assert_error_shape(httpx.get(server.url + "/v1/nowhere", timeout=10), 404, "invalid_request_error")["code"] is None
    assert_error_shape(httpx.post(server.url + "/v1/embeddings", json={"model": MODEL}, timeout=10), 404)
    assert_error_shape(httpx.get(server.url + "/v1/completions", timeout=10), 405)
    good_completion(client)


def test_a_page_on_another_origin_may_call_the_api_as_the_origins_allow(model_dir):
    """A browser's chat front end on another origin could not call the server (no CORS: its
    preflight got a 405), as it calls OpenAI's, vLLM's or llama.cpp's; `--allowed-origin` names
    the pages that may, and the API key still guards the routes."""
    page = {"origin": "http://localhost:3000"}
    preflight = page | {"access-control-request-method": "POST",
                        "access-control-request-headers": "authorization,content-type"}
    with running_server(tiny_loader(model_dir), api_key="s3cret") as running:
        asked = httpx.options(running.url + "/v1/chat/completions", headers=preflight, timeout=10)
        assert asked.status_code == 200 and asked.headers["access-control-allow-origin"] == "*"
        assert "authorization" in asked.headers["access-control-allow-headers"].lower()
        listed = httpx.get(running.url + "/v1/models", headers=page | {"authorization": "Bearer s3cret"}, timeout=10)
        assert listed.status_code == 200 and listed.headers["access-control-allow-origin"] == "*"
        assert httpx.get(running.url + "/v1/models", headers=page, timeout=10).status_code == 401
    with running_server(tiny_loader(model_dir), allowed_origins=["http://localhost:3000"]) as running:
        assert httpx.options(running.url + "/v1/completions", headers=preflight, timeout=10).status_code == 200
        other = preflight | {"origin": "http://elsewhere.example"}
        assert "access-control-allow-origin" not in httpx.options(running.url + "/v1/completions", headers=other,
                                                                  timeout=10).headers
    with running_server(tiny_loader(model_dir), allowed_origins=()) as running:
        assert "access-control-allow-origin" not in httpx.get(running.url + "/v1/models", headers=page,
                                                              timeout=10).headers

# ---------------------------------------------------------------------- 2. the API key
@pytest.mark.parametrize("key", ["", "  "])
def test_an_empty_api_key_is_refused_before_anything_loads(key):
    """`--api-key "$KEY"` with KEY unset served a 401 to every request, whatever its key."""
    from click.testing import CliRunner

    from multidecode.cli import main

    result = CliRunner().invoke(main, ["serve", "--api-key", key, "--model", "no/such/model"])
    assert result.exit_code == 2 and "the API key is empty" in result.stderr, result.output
    assert "leave --api-key out" in result.stderr


@pytest.mark.parametrize("key", ["kéy", "tab\tkey"])
def test_an_api_key_no_client_can_send_is_refused_before_anything_loads(key):
    """A non-ASCII key was served: curl's UTF-8 got a 401, the openai client a UnicodeEncodeError."""
    from click.testing import CliRunner

    from multidecode.cli import main

    result = CliRunner().invoke(main, ["serve", "--api-key", key, "--model", "no/such/model"])
    assert result.exit_code == 2 and "cannot carry" in result.stderr and "printable ASCII" in result.stderr


def test_the_api_key_guards_every_route_but_health(model_dir):
    with running_server(controlled_loader(model_dir, Control()), api_key="s3cret") as running:
        good_completion(running.client())
        assert running.client().models.list().data[0].id == MODEL
        for key in ("wrong", "s3cret-but-longer"):
            with pytest.raises(openai.AuthenticationError) as caught:
                running.client(api_key=key).completions.create(model=MODEL, prompt="hello", max_tokens=2)
            assert assert_error_shape(caught.value.response, 401, "invalid_request_error")["code"] == "invalid_api_key"
            with pytest.raises(openai.AuthenticationError):
                running.client(api_key=key).models.list()
        routes = [("post", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}),
                  ("post", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
                  ("get", "/v1/models", None), ("get", f"/v1/models/{MODEL}", None), ("get", "/metrics", None)]
        for headers in ({}, {"authorization": "s3cret"}, {"authorization": "Basic s3cret"},
                        {"authorization": "Bearer wrong"}, {"authorization": "Bearer"}):
            for method, route, body in routes:
                response = httpx.request(method, running.url + route, json=body, headers=headers, timeout=10)
                assert assert_error_shape(response, 401, "invalid_request_error")["code"] == "invalid_api_key"
        assert httpx.get(running.url + "/health", timeout=10).status_code == 200
        assert httpx.get(running.url + "/", timeout=10).status_code == 200  # the page: no data, its calls need the key
        assert httpx.get(running.url + "/metrics", headers={"authorization": "Bearer s3cret"},
                         timeout=10).status_code == 200


# ---------------------------------------------------------------------- 3. the admission cap
def test_past_the_admission_cap_requests_get_503_with_retry_after(model_dir):
    control = Control()
    prompt = [5, 6, 7, 8]  # 4 tokens: a request reserves them once (its n copies share them) plus max_tokens per branch
    limits = Limits(max_live_tokens=600, max_branches=3)
    with running_server(controlled_loader(model_dir, control), limits=limits) as running:
        client = running.client()

        def create(n, max_tokens, **kwargs):
            return client.completions.create(model=MODEL, prompt=prompt, n=n, max_tokens=max_tokens, temperature=0,
                                             **kwargs)

        def refused(n, max_tokens):
            with pytest.raises(openai.InternalServerError) as caught:
                create(n, max_tokens)
            error = assert_error_shape(caught.value.response, 503)
            assert int(caught.value.response.headers["retry-after"]) >= 1
            return error

        for n, max_tokens, param in ((3, 200, "max_tokens"), (4, 1, "n"), (1, 300, "max_tokens")):
            with pytest.raises(openai.BadRequestError) as caught:  # could never fit: 604 tokens; 4 branches; the window
                create(n, max_tokens)
            error = assert_error_shape(caught.value.response, 400, "invalid_request_error")
            assert error["param"] == param, error
            if n == 3:  # over the token limit alone, which the message names (not the branches)
                assert "604 cache tokens, over this server's limit of 600" in error["message"], error
                assert "branches" not in error["message"], error

        control.delay = 0.02  # 200 steps: 4 s, far longer than the checks below
        first = create(2, 200, stream=True)  # 404 tokens, 2 branches
        next(iter(first))
        refused(1, 200)  # 608 tokens > 600
        second = create(1, 50, stream=True)  # 458 tokens, 3 branches
        next(iter(second))
        error = refused(1, 1)  # 4 branches > 3
        assert error["type"] == "server_overloaded" and "capacity" in error["message"]
        assert running.forest.counters.rejected == 2
        first.close()
        second.close()
        running.wait_idle()
        control.delay = 0.0
        assert idle_cache(running.forest)
        reply = create(2, 240)  # the reservations are released: nearly the whole cap fits again
        assert [c.finish_reason for c in reply.choices] == ["length"] * 2


# ---------------------------------------------------------------------- 4. an engine error mid-stream
def test_an_error_after_the_stream_began_is_an_error_event_then_done(server):
    leftover = unindexed_slots(server.forest)
    CONTROL.delay = 0.01
    client = server.client()
    stream = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=100, stream=True)
    chunks = iter(stream)
    assert next(chunks).choices[0].text is not None
    CONTROL.fail = True
    with pytest.raises(openai.APIError) as caught:
        for _ in chunks:
            pass
    assert "injected fault" in str(caught.value)

    # the same over the wire: the error in OpenAI's shape as the last event, then [DONE]
    CONTROL.fail = False
    body = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 100, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=10) as response:
        assert response.status_code == 200
        events = []
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 2:
                    CONTROL.fail = True
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])
    assert set(error) == {"error"} and error["error"]["type"] == "server_error"
    assert "injected fault" in error["error"]["message"]
    assert all("choices" in json.loads(e) for e in events[:-2])

    CONTROL.reset()
    server.wait_idle()
    assert not server.forest.scheduler.works and unindexed_slots(server.forest) == leftover  # the failed slots freed
    good_completion(client)


def test_an_engine_error_in_a_plain_request_is_a_500_and_the_server_goes_on(server):
    client = server.client()
    CONTROL.fail = True
    with pytest.raises(openai.InternalServerError) as caught:
        client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=5)
    assert "injected fault" in assert_error_shape(caught.value.response, 500, "server_error")["message"]
    CONTROL.fail = False
    for _ in range(3):  # the same client, its kept-alive connection
        good_completion(client)


# ---------------------------------------------------------------------- 5. disconnects
def test_fifty_timed_out_requests_leave_the_cache_as_it_was(server):
    forest = server.forest
    good_completion(server.client())
    server.wait_idle()
    counters = forest.counters
    idle_slots, cancelled, generated, admitted = (forest.engine.forest.num_slots, counters.cancelled, counters.generated,
                                                  counters.admitted)
    CONTROL.delay = 0.01  # 200 steps: 2 s at least, against a 0.5 s timeout

    async def impatient():
        client = server.async_client(timeout=0.5)
        requests = [client.completions.create(model=MODEL, prompt=f"Question {i}: what is the answer?", max_tokens=200,
                                              temperature=0 if i % 2 else 1, n=1 + i % 2) for i in range(50)]
        results = await asyncio.gather(*requests, return_exceptions=True)
        await client.close()
        return results

    results = asyncio.run(impatient())
    assert all(isinstance(r, openai.APITimeoutError) for r in results), results
    started = time.monotonic()
    reply = server.client(timeout=10).completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=4)
    assert reply.choices[0].finish_reason == "length" and time.monotonic() - started < 5
    server.wait_idle()
    # A request whose 0.5 s ran out before the server read it never reached the forest (a loaded
    # machine): count what did. Every request the forest admitted was cut off (the last one, admitted
    # after them, ran to its end); some may have been cancelled still waiting for admission.
    reached = counters.admitted - admitted - 1
    assert reached >= 1 and reached <= counters.cancelled - cancelled <= 50
    assert forest.counters.generated - generated < 75 * 200 / 2  # 75 branches cut off, not run to the end
    assert idle_cache(forest)
    assert forest.engine.forest.num_slots <= idle_slots + 50 * 12  # the new prompts' prefixes, no more


def test_a_plain_request_timed_out_while_tokens_flow_is_cancelled(server):
    forest = server.forest
    cancelled, generated, leftover = forest.counters.cancelled, forest.counters.generated, unindexed_slots(forest)
    CONTROL.delay = 0.01  # a token every ~10 ms, far more often than the server looks for a gone client
    with pytest.raises(openai.APITimeoutError):
        server.client(timeout=0.5).completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=240)
    wait_until(lambda: not forest.scheduler.works, 1.5, every=0.005)
    assert not forest.scheduler.works and forest.counters.cancelled == cancelled + 1
    assert forest.counters.generated - generated < 150
    server.wait_idle()
    assert unindexed_slots(forest) == leftover


def test_a_stream_closed_midway_leaves_the_forest_at_the_next_step(server):
    forest = server.forest
    leftover = unindexed_slots(forest)
    CONTROL.delay = 0.01
    client = server.client()
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}],
                                            max_tokens=200, n=3, stream=True, temperature=1, seed=7)
    chunks = iter(stream)
    for _ in range(6):
        next(chunks)
    assert len(forest.scheduler.works) == 1
    cancelled, steps = forest.counters.cancelled, forest.counters.steps
    stream.close()
    wait_until(lambda: not forest.scheduler.works, 5, every=0.005)
    assert not forest.scheduler.works and forest.counters.cancelled == cancelled + 1
    assert forest.counters.steps - steps < 100  # well before its 200 tokens
    CONTROL.delay = 0.0
    server.wait_idle()
    assert unindexed_slots(forest) == leftover
    good_completion(client)


def test_a_client_that_leaves_just_as_its_request_ends_releases_its_reservation_once(server):
    """The race the app cannot rule out: the engine has sent "done", and the client is gone
    before the handler reads it, so the handler cancels a job that already ended."""
    forest = server.forest
    ended = threading.Event()
    job = Job(prompts=[[5, 6, 7, 8]], max_new_tokens=2, sampling=[SamplingParams()],
              sink=lambda item: item[0] == "done" and ended.set())
    cancelled = forest.counters.cancelled
    forest.submit(job)
    assert ended.wait(10)
    forest.cancel(job)
    server.wait_idle()
    assert forest.counters.cancelled == cancelled
    assert (forest.admission.held, forest.admission.jobs) == (NOTHING, 0)  # released once: a second release
    # would let the cap be overrun


# ---------------------------------------------------------------------- 6. SIGTERM, a bad --model
@pytest.mark.slow
def test_sigterm_drains_the_running_requests_and_refuses_new_ones(model_dir):
    command = [str(MULTIDECODE), "serve", "--model", str(model_dir), "--port", "{port}", "--served-model-name", MODEL,
               "--drain-timeout", "30", "--log-level", "warning"]
    with ServerProcess("sigterm", command, env={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}) as server:
        server.wait_ready(120)
        url, process = server.url, server.process
        body = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 240, "n": 16, "temperature": 1,
                "seed": 3, "stream": True}
        events: list[str] = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    events.append(line[6:])
                    break
            process.send_signal(signal.SIGTERM)
            time.sleep(0.2)
            assert httpx.get(url + "/health", timeout=5).status_code == 503
            refused = httpx.post(url + "/v1/completions", json={**body, "stream": False}, timeout=5)
            assert_error_shape(refused, 503)
            assert int(refused.headers["retry-after"]) >= 1
            metrics = httpx.get(url + "/metrics", timeout=5).text
            assert "multidecode_running_requests 1.0" in metrics  # the first request runs on meanwhile
            events += [line[6:] for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        finished = [c for e in events[:-1] for c in json.loads(e)["choices"] if c["finish_reason"]]
        assert sorted(c["index"] for c in finished) == list(range(16))
        assert {c["finish_reason"] for c in finished} <= {"length", "stop"}
        assert process.wait(30) == 0, server.log_tail()


@pytest.mark.slow
def test_a_bad_model_exits_with_a_message_not_a_traceback(tmp_path):
    process = subprocess.run([str(MULTIDECODE), "serve", "--model", str(tmp_path / "no-such-model"),
                              "--port", str(free_port())], check=False, capture_output=True, text=True, timeout=120,
                             env={**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"})
    assert process.returncode not in (0, 1), process
    assert "error:" in process.stderr and "no-such-model" in process.stderr
    assert "Traceback" not in process.stderr and "File \"" not in process.stderr, process.stderr


# ---------------------------------------------------------------------- 7. fuzz the request schema
# Each field has values the server takes and values it must refuse; a body has up to two fields
# of the second kind (or the field left out where it is required), so that most requests get as
# far as the engine and every refusal is tried alone too. Odd combinations of good values (n with
# questions, beam search with a stream, ...) come up by themselves.
ABSENT = object()
TEXT = st.text(max_size=30)
WORDS = st.text(min_size=1, max_size=30)
GARBAGE = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(), TEXT,
                    st.lists(st.integers(-3, 3), max_size=3), st.dictionaries(TEXT, st.integers(), max_size=2))
NOT_FINITE = st.sampled_from([math.nan, math.inf, -math.inf])
TOKENS = st.lists(st.integers(0, 370), min_size=1, max_size=12)
MAX_TOKENS = st.one_of(st.integers(1, 4), st.just("3"))

COMMON = {  # field: (values taken, values refused)
    "model": (st.just(MODEL), st.one_of(st.just(ABSENT), st.sampled_from(["other", "", 5, None]), GARBAGE)),
    "temperature": (st.one_of(st.just(0), st.floats(0, 2)), st.one_of(NOT_FINITE, st.floats(2.01, 1e308),
                                                                    st.floats(max_value=-1e-9), st.just("hot"))),
    "top_p": (st.floats(0.01, 1), st.one_of(NOT_FINITE, st.just(0), st.floats(1.01, 1e300), st.just(-0.5))),
    "top_k": (st.one_of(st.integers(-1, 500), st.sampled_from([2**31, 2**64, 10**30, "5"])),
              st.one_of(st.integers(-2**70, -2), st.just(1.5), st.just("x"))),
    "min_p": (st.floats(0, 1), st.one_of(NOT_FINITE, st.just(-0.1), st.just(1.5))),
    "repetition_penalty": (st.one_of(st.floats(0.01, 100), st.sampled_from([0.01, 100])),
                           st.one_of(NOT_FINITE, st.floats(max_value=0.0099), st.floats(min_value=100.01))),
    "stop": (st.one_of(st.none(), WORDS, st.lists(WORDS, max_size=4)),
             st.one_of(st.just(""), st.just([""]), st.integers(), st.lists(st.integers(), min_size=1))),
    "seed": (st.one_of(st.none(), st.integers(0, 2**64 - 9)),  # as the library takes them: seed + i < 2**64
             st.one_of(st.integers(max_value=-1), st.integers(min_value=2**64), st.just(1.5), st.just("x"))),
    "n": (st.integers(1, 3), st.one_of(st.integers(max_value=0), st.sampled_from([257, 10**6, 2**80, 1.5, "x"]))),
    "stream": (st.booleans(), st.sampled_from(["maybe", [], {}, 5])),
    "stream_options": (st.one_of(st.none(), st.fixed_dictionaries({"include_usage": st.booleans()})),
                       st.one_of(st.just({"include_usage": "x"}), st.just("x"), st.integers())),
    "questions": (st.one_of(st.none(), st.lists(WORDS, min_size=1, max_size=3)),
                  st.one_of(st.just([]), st.just([""]), st.just(["  "]), st.just("q"), st.lists(st.integers(),
                                                                                               min_size=1))),
    "use_beam_search": (st.booleans(), st.sampled_from(["x", 5, []])),
    "speculate": (st.sampled_from([None, "lookup", "suffix", "lookahead", "auto", "none", "off"]),
                  st.one_of(st.sampled_from(["bogus", ""]), st.integers())),
    "frequency_penalty": (st.one_of(st.none(), st.floats(-2, 2)), st.one_of(NOT_FINITE, st.floats(2.01, 1e300),
                                                                          st.just(-2.5), st.just("x"))),
    "presence_penalty": (st.one_of(st.just(0.0), st.floats(-2, 2)), st.one_of(NOT_FINITE, st.floats(max_value=-2.01),
                                                                            st.just([1]))),
    "logit_bias": (st.one_of(st.none(), st.dictionaries(st.integers(0, 370).map(str), st.floats(-100, 100), max_size=3)),
                   st.one_of(st.just({"5": math.nan}), st.just({"5": 100.5}), st.just({"x": 1}), st.just({"-1": 1}),
                             st.just({"99999": 1}), st.just({" 5": 1}), st.integers())),
    "user": (TEXT, st.integers()),
    "trace": (st.booleans(), st.just("x")),
    "response_format": (st.one_of(st.none(), st.sampled_from([{"type": "text"}, {"type": "json_object"}, {
                            "type": "json_schema", "json_schema": {"name": "r", "schema": {
                                "type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}}}])),
                        st.one_of(st.integers(), st.sampled_from([{"type": "xml"}, {"type": "json_schema"}, {
                            "type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}]))),
    "an_unknown_key": (GARBAGE, st.nothing()),
}
COMPLETION = {
    "prompt": (st.one_of(WORDS, TOKENS, st.lists(WORDS, min_size=1, max_size=3), st.lists(TOKENS, min_size=1, max_size=3)),
               st.one_of(st.just(ABSENT), st.sampled_from(["", [], [[]], [""], [-1], [400], [10**30], ["a", [1]], None,
                                                           5, {}]), st.lists(st.integers(0, 9), min_size=300))),
    "max_tokens": (st.one_of(st.none(), MAX_TOKENS),
                   st.one_of(st.integers(max_value=0), st.sampled_from([300, 10**12, 2**80, 2.5, "x", []]))),
    "logprobs": (st.one_of(st.none(), st.integers(0, 20)), st.one_of(st.integers(min_value=21), st.integers(max_value=-1),
                                                                     st.just("x"))),
    "echo": (st.booleans(), st.just("x")),
    "suffix": (st.none(), WORDS),
    "best_of": (st.sampled_from([None, 1]), st.integers(2, 5)),
}
ROLES = st.sampled_from(["system", "developer", "user", "assistant"])
CONTENT = st.one_of(TEXT, st.none(), st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}),
                                              max_size=2))
MESSAGE = st.fixed_dictionaries({"role": ROLES, "content": CONTENT}, optional={"name": TEXT})
BAD_MESSAGE = st.one_of(st.fixed_dictionaries({"role": st.sampled_from(["tool", "function", "", "User", None]),
                                               "content": CONTENT}),
                        st.fixed_dictionaries({"content": CONTENT}),
                        st.fixed_dictionaries({"role": ROLES, "content": st.sampled_from([5, [5], [{"type": "image_url"}],
                                                                                          [{"type": "text"}]])}),
                        GARBAGE)
CHAT = {
    "messages": (st.lists(MESSAGE, min_size=1, max_size=3),
                 st.one_of(st.just(ABSENT), st.just([]), GARBAGE, st.just([{"role": "user", "content": "fox " * 300}]),
                           st.tuples(st.lists(MESSAGE, max_size=2), BAD_MESSAGE).map(lambda t: [*t[0], t[1]]))),
    "max_tokens": (MAX_TOKENS, st.one_of(st.integers(max_value=0), st.sampled_from([300, 2**80, 2.5, "x"]))),
    "max_completion_tokens": (st.one_of(st.none(), MAX_TOKENS), st.one_of(st.integers(max_value=0), st.just(300))),
    "logprobs": (st.booleans(), st.sampled_from([3, "x", []])),
    "top_logprobs": (st.one_of(st.none(), st.integers(0, 20)), st.one_of(st.integers(min_value=21), st.just(-1))),
    "tools": (st.one_of(st.none(), st.just([])), st.one_of(st.just([{"type": "function"}]), st.integers())),
}


def bodies(fields: dict) -> st.SearchStrategy:
    """Request bodies over `fields`: each field taken, left out (where it may be), or, for at most
    two of them, refused."""
    required = {"model", "prompt", "messages"}

    @st.composite
    def body(draw) -> dict:
        refused = draw(st.sets(st.sampled_from(sorted(fields)), max_size=2))
        out = {}
        for name, (taken, wrong) in fields.items():
            if name in refused:
                value = draw(wrong) if not wrong.is_empty else ABSENT
            elif name in required or draw(st.booleans()):
                value = draw(taken)
            else:
                value = ABSENT
            if value is not ABSENT:
                out[name] = value
        if out.get("max_tokens") is None and out.get("max_completion_tokens") is None:
            out["max_tokens"] = 2  # left unset, a chat runs to the model's window: slow, and tested elsewhere
        return out

    return body()


@pytest.fixture(scope="module")
def fuzz_client(running):
    with httpx.Client(base_url=running.url, timeout=30) as client:
        yield client


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1, "seed": 3}])
def test_a_complete_grammar_ends_with_eos_whatever_the_model_gives_it(server, fuzz_client, sampling):
    """Found by the fuzz test below: with logprobs (which end a branch one step later, to report
    the eos's own log-probability) a branch whose grammar was complete chose among logits where
    this model's eos is -inf: token 0 (greedy) or NaN (sampled), a 500. Its eos comes regardless,
    reported at OpenAI's floor of -9999 (-inf is no JSON number)."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"},
            "max_completion_tokens": 8, "logprobs": True, **sampling}
    response = fuzz_client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        json.loads(choice["message"]["content"])
    assert all(-9999 <= item["logprob"] <= 0 for item in choice["logprobs"]["content"])


@settings(max_examples=150, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(request=st.one_of(st.tuples(st.just("/v1/completions"), bodies(COMMON | COMPLETION)),
                         st.tuples(st.just("/v1/chat/completions"), bodies(COMMON | CHAT))))
def test_no_request_body_makes_a_server_error(running, fuzz_client, request):
    route, body = request
    response = fuzz_client.post(route, content=json.dumps(body, allow_nan=True),
                                headers={"content-type": "application/json"})
    assert response.status_code in (200, 400, 404), (response.status_code, response.text)
    if response.status_code != 200:
        assert_error_shape(response, response.status_code)
    elif response.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", response.text
        for event in map(json.loads, events[:-1]):
            assert "error" not in event, event
    else:
        assert response.json()["choices"], response.text


def test_a_request_past_a_window_short_of_the_models_own_says_why():
    """A model whose forest window stops short of its own (longrope's switch) is refused past it
    with the reason, as the Python API's refusal gives it, not a bare number the client cannot square
    with the model card."""
    from local_models import tiny_tokenizer

    from multidecode.serving.protocol import BadRequest, CompletionBody, parse_body, to_job

    tokenizer = tiny_tokenizer()
    note = " (its longrope rotary embedding switches at position 24)"
    for asked in ({"max_tokens": 30}, {}):
        body = parse_body(json.dumps({"model": MODEL, "prompt": "a b c d e f g h i j k l m n o p q r s t u v w x y z",
                                 **asked}).encode(), "application/json", CompletionBody)
        with pytest.raises(BadRequest, match="context window of 24 tokens.*longrope|window is 24 tokens.*longrope"):
            to_job(body, tokenizer, vocab_size=len(tokenizer), max_positions=24, window_note=note)


def test_questions_that_all_overflow_a_window_the_document_fits_are_named():
    """Where every question overflowed, the short document was blamed (param "prompt")."""
    from local_models import tiny_tokenizer

    from multidecode.serving.protocol import BadRequest, CompletionBody, parse_body, to_job

    tokenizer = tiny_tokenizer()
    long_question = "a b c d e f g h i j k l m n o p q r s t u v w x y z " * 2
    for questions, param in (([long_question, long_question[::-1]], "questions"), (["why?", "how?"], "prompt")):
        document = "The doc." if param == "questions" else long_question
        body = parse_body(json.dumps({"model": MODEL, "prompt": document, "questions": questions}).encode(),
                          "application/json", CompletionBody)
        with pytest.raises(BadRequest, match="context window is 24 tokens") as refused:
            to_job(body, tokenizer, vocab_size=len(tokenizer), max_positions=24, window_note="")
        assert refused.value.param == param, (questions, refused.value.param)

def test_refusals_caused_by_questions_name_the_question_and_a_tiny_temperature_says_what_to_send(server):
    """A question that overflows the window is named (not "the prompt", which is the short document);
    so is a list of questions past the branch cap; a temperature too small to divide logits by is
    refused as the temperature's, pointing at 0 (greedy), not at the library's do_sample."""
    long_question = "The quick brown fox jumps over the lazy dog. " * 40
    body = {"model": MODEL, "prompt": "The doc.", "max_tokens": 2, "questions": ["why?", long_question]}
    error = assert_error_shape(httpx.post(server.url + "/v1/completions", json=body, timeout=30), 400)
    assert error["param"] == "questions" and "the document with question 2 is" in error["message"], error
    error = assert_error_shape(httpx.post(server.url + "/v1/completions", json=body | {"questions": ["q"] * 300},
                                          timeout=30), 400)
    assert error["param"] == "questions" and "300 questions, each a branch" in error["message"], error
    error = assert_error_shape(httpx.post(server.url + "/v1/completions", json={
        "model": MODEL, "prompt": "hi", "max_tokens": 2, "temperature": 1e-40}, timeout=30), 400)
    assert error["param"] == "temperature" and "0 decodes greedily" in error["message"], error
    assert "do_sample" not in error["message"], error
