"""What the server refuses rather than answer a request other than the one it was sent, and how it
says so (QA's findings):

- other servers' ways of asking for structured output (vLLM's `guided_*` and `structured_outputs`,
  llama.cpp's `grammar`, `json_schema` and `response_format` json_object with a "schema", SGLang's
  `regex` and `ebnf`) are 400s naming the field and what to send instead, never a 200 of
  unconstrained text;
- a `response_format` json_schema without its name or its schema is a 400 naming the field;
- a seed is taken up to 2**64 - 1, as the library and the command line take it;
- a 401 says whether no API key came or the one sent is not accepted, and so does the command's
  client (`serving.remote`);
- what OpenAI's own clients send: null for a default, a function's `strict`, the deprecated
  `functions`; a lone surrogate anywhere is a 400 naming where, never a 500.
"""

from __future__ import annotations

import json

import httpx
import pytest
from serving import MODEL, assert_error_shape, running_server, tiny_loader

from multidecode.serving import remote

SCHEMA = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"], "additionalProperties": False}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}
COMPLETION = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 3}


def post(server, body: dict, route: str = "/v1/chat/completions") -> httpx.Response:
    return httpx.post(server.url + route, json=body, timeout=30)


def refused(server, body: dict, param: str, route: str = "/v1/chat/completions") -> str:
    """The 400's message, once its shape and `param` are checked."""
    error = assert_error_shape(post(server, body, route), 400, "invalid_request_error")
    assert error["param"] == param, error
    return error["message"]


# ---------------------------------------------------------------------- other servers' structured output
OTHER_SERVERS = {  # field: (a value a client of that server sends, what the message must point to)
    "guided_json": (SCHEMA, "response_format"),
    "guided_regex": ("[0-9]+", "--regex"),
    "guided_grammar": ('root ::= "yes" | "no"', "--grammar"),
    "guided_choice": (["yes", "no"], "enum"),
    "guided_decoding_backend": ("xgrammar", "response_format"),
    "guided_whitespace_pattern": (" ", "leave it out"),
    "structured_outputs": ({"json": SCHEMA}, "response_format"),
    "grammar": ('root ::= "yes" | "no"', "--grammar"),
    "json_schema": (SCHEMA, "response_format"),
    "regex": ("[0-9]+", "--regex"),
    "ebnf": ('root ::= "yes" | "no"', "--grammar"),
    "functions": ([{"name": "f", "parameters": SCHEMA}], "tools"),  # OpenAI's deprecated forms
    "function_call": ({"name": "f"}, "tool_choice"),
}


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("field", OTHER_SERVERS)
def test_other_servers_structured_output_fields_are_refused_with_what_to_send(server, field, route):
    value, points_to = OTHER_SERVERS[field]
    body = (CHAT if route.endswith("chat/completions") else COMPLETION) | {field: value}
    message = refused(server, body, field, route)
    assert points_to in message and "not read by this server" in message, message
    assert post(server, body | {field: None}, route).status_code == 200  # left empty: nothing asked for


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_a_misspelt_parameter_is_refused_naming_the_one_meant(server, route):
    """"max_token" was passed over (16 tokens, the default, came back) and "temprature": 0 sampled
    at 1, each a 200; a name this close to one the server reads is a typo. Other clients'
    extensions the server does not read are passed over still."""
    body = CHAT if route.endswith("chat/completions") else COMPLETION
    for typo, meant in (("max_token", "max_tokens"), ("temprature", "temperature"), ("stream_option", "stream_options")):
        message = refused(server, body | {typo: 1}, typo, route)
        assert f"did you mean {meant!r}" in message, message
    assert post(server, body | {"min_tokens": 2, "store": False}, route).status_code == 200


@pytest.mark.parametrize(("prompt", "kind"), [(5, "a number"), ({"a": 1}, "an object"),
                                             ([[1, 2], "hi"], "a list of lists and strings")])
def test_a_prompt_of_no_form_the_server_takes_is_named_with_the_forms_it_takes(server, prompt, kind):
    """It was "prompt.str: Input should be a valid string", though lists are taken too."""
    message = refused(server, COMPLETION | {"prompt": prompt}, "prompt", "/v1/completions")
    assert message == f"prompt must be a string, a list of strings, a list of token ids, or a list of lists of token ids, got {kind}"


def test_llama_cpps_json_object_with_a_schema_is_refused(server):
    message = refused(server, CHAT | {"response_format": {"type": "json_object", "schema": SCHEMA}}, "response_format")
    assert "json_schema" in message and "llama.cpp" in message


# ---------------------------------------------------------------------- response_format json_schema
@pytest.mark.parametrize(("json_schema", "names"), [
    ({"name": "x"}, "json_schema.schema"),
    ({"name": "x", "strict": True}, "json_schema.schema"),
    ({"name": "x", "schema": None}, "json_schema.schema"),
    ({"name": "x", "schema": "{}"}, "json_schema.schema"),
    ({"schema": SCHEMA}, "json_schema.name"),
    ({"name": "", "schema": SCHEMA}, "json_schema.name"),
    ({"name": 5, "schema": SCHEMA}, "json_schema.name"),
])
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_a_json_schema_without_its_name_or_its_schema_is_refused(server, json_schema, names, route):
    body = (CHAT if route.endswith("chat/completions") else COMPLETION)
    message = refused(server, body | {"response_format": {"type": "json_schema", "json_schema": json_schema}},
                      "response_format", route)
    assert names in message, message


def test_a_named_json_schema_is_taken(server):
    reply = post(server, CHAT | {"max_tokens": 20, "temperature": 0, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}})
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"].startswith('{"a": ')


# ---------------------------------------------------------------------- seeds
def test_a_seed_up_to_two_to_the_64_is_taken_as_the_library_takes_it(server):
    def text(seed: int, n: int = 1) -> list[str]:
        reply = post(server, COMPLETION | {"max_tokens": 8, "seed": seed, "n": n, "temperature": 1}, "/v1/completions")
        assert reply.status_code == 200, reply.text
        return [c["text"] for c in sorted(reply.json()["choices"], key=lambda c: c["index"])]

    top = 2**64 - 1
    assert text(top) == text(top)
    assert text(top - 1, n=2)[1] == text(top)[0]  # choice i uses seed + i
    assert "2**64" in refused(server, COMPLETION | {"seed": top, "n": 2}, "seed", "/v1/completions")
    assert str(2**64) in refused(server, COMPLETION | {"seed": 2**64}, "seed", "/v1/completions")  # whole digits
    refused(server, CHAT | {"seed": -1}, "seed")


# ---------------------------------------------------------------------- the API key
def test_a_401_says_whether_the_key_is_missing_or_not_accepted(model_dir):
    with running_server(tiny_loader(model_dir), api_key="s3cret") as running:
        route = running.url + "/v1/models"
        for headers in ({}, {"authorization": "s3cret"}, {"authorization": "Basic s3cret"},
                        {"authorization": "Bearer"}):
            message = assert_error_shape(httpx.get(route, headers=headers, timeout=10), 401)["message"]
            assert "needs an API key" in message and "not accepted" not in message, (headers, message)
        for key in ("wrong", "s3cret-but-longer", "S3CRET"):
            reply = httpx.get(route, headers={"authorization": f"Bearer {key}"}, timeout=10)
            message = assert_error_shape(reply, 401, "invalid_request_error")["message"]
            assert "not accepted" in message and "needs an API key" not in message, (key, message)
        assert httpx.get(route, headers={"authorization": "bearer s3cret"}, timeout=10).status_code == 200

        with pytest.raises(remote.Refused) as caught:
            remote.served_model(running.url, api_key="wrong")
        assert caught.value.status == 401 and "rejected the API key sent" in caught.value.message
        with pytest.raises(remote.Refused) as caught:
            remote.served_model(running.url)
        assert "none was sent" in caught.value.message and "rejected" not in caught.value.message
        assert remote.served_model(running.url, api_key="s3cret").id == MODEL


# ---------------------------------------------------------------------- beam search
@pytest.mark.parametrize(("extra", "param"), [
    ({"stop": ["fox"]}, "stop"),
    ({"stop": "fox"}, "stop"),
    ({"temperature": 0.7}, "temperature"),
    ({"top_p": 0.5}, "top_p"),
    ({"top_k": 5}, "top_k"),
    ({"min_p": 0.1}, "min_p"),
    ({"speculate": "lookup"}, "speculate"),
])
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_beam_search_refuses_what_it_would_not_honour(server, extra, param, route):
    """Beams end on eos or max_tokens and are scored by the model's own log-probabilities: a stop
    string or a sampling setting would be passed over, and the beams returned as if it had been
    honoured."""
    body = (CHAT if route.endswith("chat/completions") else COMPLETION) | {"n": 2, "use_beam_search": True}
    message = refused(server, body | extra, param, route)
    assert param in message and "use_beam_search" in message, message
    for neutral in ({"temperature": 0}, {"temperature": 1}, {"top_k": -1}, {"stop": []}, {"speculate": "off"},
                    {"seed": 3}):
        assert post(server, body | neutral, route).status_code == 200, neutral


# ---------------------------------------------------------------------- booleans are no numbers
@pytest.mark.parametrize(("route", "field", "value"), [
    ("/v1/completions", "max_tokens", True),
    ("/v1/completions", "n", True),
    ("/v1/completions", "seed", False),
    ("/v1/completions", "logprobs", True),
    ("/v1/completions", "top_k", True),
    ("/v1/completions", "temperature", True),
    ("/v1/completions", "logit_bias", {"5": True}),
    ("/v1/completions", "prompt", [True, 5]),
    ("/v1/chat/completions", "max_completion_tokens", True),
    ("/v1/chat/completions", "top_logprobs", False),
])
def test_a_boolean_is_not_taken_for_a_number(server, route, field, value):
    """pydantic reads true as 1: `"max_tokens": true` would be answered as max_tokens 1."""
    body = CHAT if route.endswith("chat/completions") else COMPLETION
    message = refused(server, body | {field: value}, field, route)
    assert field in message, message
    if field != "prompt":  # one of the prompt's shapes is text: pydantic names that one
        assert "a number is expected, got true" in message or "got false" in message, message


# ---------------------------------------------------------------------- what OpenAI's clients send
@pytest.mark.parametrize(("route", "fields"), [
    ("/v1/chat/completions", {"temperature": None, "top_p": None, "n": None, "stream": None, "logprobs": None,
                              "top_logprobs": None, "stream_options": None, "tools": None, "seed": None}),
    ("/v1/completions", {"temperature": None, "n": None, "echo": None, "logprobs": None, "top_p": None}),
])
def test_null_asks_for_the_default(server, route, fields):
    """OpenAI's optional parameters are nullable, and its Python client sends null for a None a
    caller passes: `temperature: null` was a 400 ("Input should be a valid number")."""
    body = (CHAT if route.endswith("chat/completions") else COMPLETION) | {"temperature": 0, "max_tokens": 4}
    plain = post(server, body, route)
    nulls = post(server, body | fields | {"temperature": 0}, route)
    assert plain.status_code == nulls.status_code == 200, nulls.text
    choices = [reply.json()["choices"] for reply in (plain, nulls)]
    assert choices[0] == choices[1]
    refused(server, body | {"model": None}, "model", route)  # a required field's null is still refused


@pytest.mark.parametrize(("route", "body", "param"), [
    ("/v1/chat/completions", CHAT | {"messages": [{"role": "user", "content": "hi \ud800 there"}]}, "messages"),
    ("/v1/chat/completions", CHAT | {"messages": [{"role": "user", "content": [{"type": "text", "text": "x\ud83d"}]}]},
     "messages"),
    ("/v1/chat/completions", CHAT | {"questions": ["q\udc00"]}, "questions"),
    ("/v1/completions", COMPLETION | {"prompt": "hi \udc00"}, "prompt"),
    ("/v1/completions", COMPLETION | {"prompt": ["fine", "hi \ud800"], "stream": True}, "prompt"),
    ("/v1/completions", COMPLETION | {"stop": ["\ud800"]}, "stop"),
])
def test_a_lone_surrogate_in_any_text_is_a_400_naming_where(server, route, body, param):
    """JSON's escapes can send half of a surrogate pair, which is no character: the tokenizer
    failed on it, a 500 ("TextEncodeInput must be Union[...]")."""
    sent = httpx.post(server.url + route, content=json.dumps(body), headers={"content-type": "application/json"},
                      timeout=30)  # json.dumps escapes the half pair as \\udXXX, as a client's JSON does
    error = assert_error_shape(sent, 400, "invalid_request_error")
    assert "lone surrogate" in error["message"] and error["param"] == param, error


@pytest.mark.parametrize(("content", "param"), [
    (json.dumps(CHAT | {"x\ud800": 1}), "x\\ud800"),  # in a key: named escaped, or the 400 itself was a 500
    (json.dumps(CHAT | {"messages": [{"role": "user", "content": "hi", "n\udc00ame": "x"}]}), "messages"),
    (json.dumps(CHAT | {"messages": [{"role": "user", "content": "hi"}], "\ud800.x": 1}), "\\ud800.x"),
    (json.dumps(CHAT).encode().replace(b'"hello"', b'"hel\xed\xa0\x80lo"'), "messages"),  # as bytes, no escape
])
def test_a_lone_surrogate_in_a_key_or_in_raw_bytes_is_a_400_too(server, content, param):
    sent = httpx.post(server.url + "/v1/chat/completions", content=content,
                      headers={"content-type": "application/json"}, timeout=30)
    error = assert_error_shape(sent, 400, "invalid_request_error")
    assert "lone surrogate" in error["message"] and error["param"] == param, error


def test_what_openai_refuses_is_refused_and_named(server):
    assert "stream is true" in refused(server, CHAT | {"stream_options": {"include_usage": True}}, "stream_options")
    assert "logprobs: true" in refused(server, CHAT | {"top_logprobs": 3}, "top_logprobs")
    message = refused(server, CHAT | {"max_completion_tokens": 9000}, "max_completion_tokens")
    assert "max_completion_tokens (9000)" in message, message
    message = refused(server, COMPLETION | {"prompt": ["Once upon", "Once upon"], "n": 2, "use_beam_search": True},
                      "use_beam_search", "/v1/completions")  # two prompts, equal or not: one was dropped
    assert "one prompt" in message


def test_a_tools_strict_is_honoured_as_response_formats_is(server):
    """A function's `strict` (OpenAI's default: false) was passed over: keywords the engine cannot
    enforce were refused whatever it said, with a hint to send strict false."""
    parameters = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"},
                                                            "uniqueItems": True, "maxItems": 2}}, "required": ["tags"]}

    def body(strict):
        function = {"name": "send", "parameters": parameters} | ({} if strict is None else {"strict": strict})
        return CHAT | {"max_tokens": 24, "temperature": 0, "tools": [{"type": "function", "function": function}],
                       "tool_choice": {"type": "function", "function": {"name": "send"}}}

    for strict in (None, False):
        reply = post(server, body(strict))
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "send"
    message = refused(server, body(True), "tools")
    assert "uniqueItems" in message and '"strict": false' in message, message
    refused(server, body("yes"), "tools")
    refused(server, body(1), "tools")  # 1 is no boolean
    mixed = body(False) | {"tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "send", "parameters": parameters, "strict": False}},
        {"type": "function", "function": {"name": "stop", "parameters": {"type": "object"}, "strict": True}}]}
    message = refused(server, mixed, "tools")  # held to one schema, strict: the hint is not "send strict false"
    assert "same strict" in message and "stop asks strict" in message, message


def test_completions_take_max_completion_tokens_as_chat_does(server):
    """Chat's newer name for max_tokens is not passed over by completions (a client that sends it
    would get the default 16 tokens, more than it asked for): it counts there too, before max_tokens."""
    def reply(**limits) -> dict:
        body = {k: v for k, v in COMPLETION.items() if k != "max_tokens"} | limits
        sent = httpx.post(server.url + "/v1/completions", json=body | {"temperature": 0, "logit_bias": {"0": -100}},
                          timeout=60)
        assert sent.status_code == 200, sent.text
        return sent.json()

    two = reply(max_tokens=2)
    assert two["usage"]["completion_tokens"] == 2
    for limits in ({"max_completion_tokens": 2}, {"max_completion_tokens": 2, "max_tokens": 7}):
        got = reply(**limits)
        assert got["choices"][0]["text"] == two["choices"][0]["text"], limits
        assert got["usage"]["completion_tokens"] == 2, limits  # (cached prompt tokens differ: the prefix cache)
    message = refused(server, COMPLETION | {"max_completion_tokens": 9000}, "max_completion_tokens", "/v1/completions")
    assert "max_completion_tokens (9000)" in message, message
