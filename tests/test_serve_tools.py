"""Tool calls on the server, through the real `openai` client: `tool_choice` naming a function
(its arguments held to the function's `parameters`, equal to the constrained loop, streamed and
not) or "required" (a call of one of the tools); "none" answers in text; what is not offered
("auto") and what is malformed are 400s naming the parameter."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from constraint_cases import reference
from serving import MODEL, assert_error_shape, chat_prompt_ids

from multidecode.constraints import Constraint

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather.", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]




@pytest.mark.parametrize("stream", [False, True])
def test_a_named_function_is_called_with_arguments_of_its_schema(server, stream):
    reply = server.client().chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED,
                                                    max_tokens=60, temperature=0, stream=stream)
    if stream:
        chunks = [c for c in reply if c.choices]
        calls = [call for c in chunks for call in (c.choices[0].delta.tool_calls or [])]
        assert calls[0].function.name == "get_weather" and calls[0].id
        arguments = "".join(call.function.arguments or "" for call in calls)
        finish = chunks[-1].choices[0].finish_reason
        assert all(not c.choices[0].delta.content for c in chunks)
    else:
        message = reply.choices[0].message
        assert message.content is None and len(message.tool_calls) == 1
        call = message.tool_calls[0]
        assert call.type == "function" and call.function.name == "get_weather" and call.id
        arguments, finish = call.function.arguments, reply.choices[0].finish_reason
    assert finish == "tool_calls"
    jsonschema.validate(json.loads(arguments), WEATHER)
    expected = reference(server.forest, chat_prompt_ids(server, MESSAGES, TOOLS), Constraint.json_schema(WEATHER), max_new_tokens=60)
    assert arguments == server.forest.tokenizer.decode(expected, skip_special_tokens=True)


@pytest.mark.parametrize("stream", [False, True])
def test_required_calls_one_of_the_tools(server, stream):
    reply = server.client().chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                                    max_tokens=80, n=3, seed=5, stream=stream)
    calls = {}
    if stream:
        for chunk in reply:
            for choice in chunk.choices:
                for call in choice.delta.tool_calls or []:
                    calls[choice.index] = (call.function.name, call.function.arguments, None)
                if choice.finish_reason:  # in a chunk of its own, after the call's
                    calls[choice.index] = (*calls.get(choice.index, (None, None))[:2], choice.finish_reason)
    else:
        calls = {c.index: (c.message.tool_calls[0].function.name, c.message.tool_calls[0].function.arguments,
                           c.finish_reason) for c in reply.choices}
    assert sorted(calls) == [0, 1, 2]
    for name, arguments, finish in calls.values():
        if finish == "tool_calls":
            jsonschema.validate(json.loads(arguments), {"get_weather": WEATHER, "get_time": TIME}[name])


@pytest.mark.parametrize("tool_choice", [NAMED, "required"], ids=["named", "required"])
def test_the_openai_clients_stream_events_see_each_call_end(server, tool_choice):
    """The openai client's `.stream()` fires `tool_calls.function.arguments.done` (with the whole
    arguments) only where the finish reason comes in a chunk after the call's, as OpenAI sends it: a
    "required" call, sent whole with its reason, never had that event."""
    with server.client().chat.completions.stream(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
                                                 max_tokens=80, temperature=0) as stream:
        done = [e for e in stream if e.type == "tool_calls.function.arguments.done"]
        final = stream.get_final_completion()
    call = final.choices[0].message.tool_calls[0]
    assert final.choices[0].finish_reason == "tool_calls"
    assert [(e.name, e.arguments) for e in done] == [(call.function.name, call.function.arguments)]
    json.loads(call.function.arguments)

def test_tool_choice_none_answers_in_text(server):
    reply = server.client().chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                                    max_tokens=5, temperature=0)
    plain = server.client().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0)
    assert reply.choices[0].message.tool_calls is None
    assert reply.choices[0].message.content == plain.choices[0].message.content


@pytest.mark.parametrize(("extra", "param", "says"), [
    ({"tool_choice": "auto"}, "tool_choice", "name a function"),
    ({}, "tool_choice", "name a function"),  # OpenAI's default with tools is "auto"
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not among the tools"),
    ({"tool_choice": "required", "tools": [{"type": "function"}]}, "tools", "each tool must be"),
    ({"tool_choice": NAMED, "response_format": {"type": "json_object"}}, "response_format", "give one of them"),
    ({"tool_choice": NAMED, "tools": [{"type": "function", "function": {"name": "get_weather",
                                                                          "parameters": {"type": "nope"}}}]},
     "tools", "Invalid type"),
])
def test_what_is_not_offered_or_malformed_is_a_400(server, extra, param, says):
    with pytest.raises(openai.BadRequestError) as caught:
        server.client().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5,
                                                **{"tools": TOOLS, **extra})
    error = caught.value.response.json()["error"]
    assert error["param"] == param and says in error["message"]


@pytest.mark.parametrize("tools", [None, []])  # None: left out
@pytest.mark.parametrize("choice", ["required", NAMED])
def test_a_call_asked_for_without_tools_is_a_400(server, choice, tools):
    """Answered in text, the reply would pass for one that chose not to call (OpenAI refuses it too)."""
    # greedy: a sampled text-only reply (OpenAI's default temperature is 1) could draw eos first and be empty
    request = dict(model=MODEL, messages=MESSAGES, max_tokens=5, tool_choice=choice, temperature=0)
    with pytest.raises(openai.BadRequestError) as caught:
        server.client().chat.completions.create(**request, **({} if tools is None else {"tools": tools}))
    error = caught.value.response.json()["error"]
    assert error["param"] == "tool_choice" and "needs tools" in error["message"]
    for text_only in ("none", "auto"):  # no call asked for: text, as without tool_choice
        assert server.client().chat.completions.create(**request | {"tool_choice": text_only}).choices[0].message.content


def _whole_reply(server, tool_choice) -> tuple[list[int], str]:
    """A greedy call decoded to its end: its token ids and its text."""
    reply = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": MESSAGES, "tools": TOOLS, "tool_choice": tool_choice, "max_tokens": 80,
        "temperature": 0, "return_token_ids": True}).json()["choices"][0]
    assert reply["finish_reason"] == "tool_calls"
    return reply["token_ids"], reply["message"]["tool_calls"][0]["function"]


def _cut_calls(server, tool_choice, max_tokens: int, stream: bool) -> tuple[list[tuple[str, str]], str, object]:
    """The tool calls of a greedy call cut off at max_tokens (name, arguments), its finish reason
    and its content."""
    reply = server.client().chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
                                                    max_tokens=max_tokens, temperature=0, stream=stream)
    if not stream:
        message = reply.choices[0].message
        calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
        return calls, reply.choices[0].finish_reason, message.content
    calls, finish, content = {}, None, None
    for chunk in reply:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            content = (content or "") + (choice.delta.content or "") if choice.delta.content else content
            for call in choice.delta.tool_calls or []:
                name, arguments = calls.get(call.index, ("", ""))
                calls[call.index] = (name + (call.function.name or ""), arguments + (call.function.arguments or ""))
    return list(calls.values()), finish, content


@pytest.mark.parametrize("max_tokens", [80, 4], ids=["whole", "cut"])
@pytest.mark.parametrize("tool_choice", [NAMED, "required"], ids=["named", "required"])
def test_a_streamed_call_carries_every_token_id_and_logprob_of_the_reply(server, tool_choice, max_tokens):
    """A "required" call is sent when it ends: its stream carried the ids and logprobs of the last
    token only (1 of 19), as they were held back with the call."""
    body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "tool_choice": tool_choice, "temperature": 0,
            "max_tokens": max_tokens, "return_token_ids": True, "logprobs": True, "top_logprobs": 1}
    whole = httpx.post(server.url + "/v1/chat/completions", timeout=30, json=body).json()["choices"][0]
    ids, entries = [], []
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=30, json=body | {"stream": True}) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    ids += choice.get("token_ids", [])
                    entries += (choice["logprobs"] or {}).get("content") or []
    assert ids == whole["token_ids"] and len(ids) > 1
    assert entries == whole["logprobs"]["content"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_required_call_cut_off_by_max_tokens_has_the_name_and_the_arguments_so_far(server, stream):
    """Cut after each token in turn: no call until the function's name is whole, then that name and
    only the arguments decoded (never the {"name", "arguments"} object the reply is written in)."""
    ids, whole = _whole_reply(server, "required")
    tokenizer = server.forest.tokenizer
    opening = f'{{"name": "{whole["name"]}", "arguments": '
    assert tokenizer.decode(ids, skip_special_tokens=True) == f"{opening}{whole['arguments']}}}"
    for cut in range(1, len(ids)):
        decoded = tokenizer.decode(ids[:cut], skip_special_tokens=True)
        calls, finish, content = _cut_calls(server, "required", cut, stream)
        assert finish == "length" and not content, (cut, finish, content)
        if f'"name": "{whole["name"]}"' not in decoded:
            assert calls == [], (cut, decoded, calls)
        else:
            arguments = decoded[len(opening):][:len(whole["arguments"])]  # without the wrapper's closing brace
            assert calls == [(whole["name"], arguments)], (cut, decoded, calls)


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_call_cut_off_by_max_tokens_has_its_name_and_the_arguments_so_far(server, stream):
    ids, whole = _whole_reply(server, NAMED)
    tokenizer = server.forest.tokenizer
    for cut in (1, len(ids) // 2, len(ids) - 2):
        arguments = tokenizer.decode(ids[:cut], skip_special_tokens=True)
        assert whole["arguments"].startswith(arguments)
        calls, finish, content = _cut_calls(server, NAMED, cut, stream)
        assert finish == "length" and not content
        assert calls == [("get_weather", arguments)]


@pytest.mark.parametrize("choice", [{"type": "function", "name": "get_weather"}, "any", {"type": "function"},
                                    {"type": "function", "function": "get_weather"}, ["get_weather"]])
@pytest.mark.parametrize("tools", [TOOLS, None])
def test_a_malformed_tool_choice_is_told_the_shapes_taken(server, choice, tools):
    """A tool_choice of no shape this server reads (the Responses API's {"type", "name"}, "any")
    is not the "auto" it does not offer: the 400 says what to send, with tools or without."""
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 5, "tool_choice": choice}
    response = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                          json=body | ({"tools": tools} if tools else {}))
    error = assert_error_shape(response, 400, "invalid_request_error")
    assert error["param"] == "tool_choice", error
    message = error["message"]
    assert '{"type": "function", "function": {"name": ...}}' in message and '"required"' in message, message
    assert json.dumps(choice) in message and "needs tools" not in message, message


HISTORY = [*MESSAGES,
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"}]


def test_a_call_in_the_history_is_shown_to_a_template_that_does_not_render_calls(server):
    """The tiny model's template renders content alone: the assistant's call is written into its
    content as the JSON a "required" call is decoded in, so the model sees what it called, not
    an empty turn."""
    reply = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": HISTORY, "max_tokens": 2, "return_token_ids": True}).json()
    written = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
    expected = chat_prompt_ids(server, [*MESSAGES, {"role": "assistant", "content": written},
                                        {"role": "tool", "content": "18 degrees"}])
    assert reply["choices"][0]["prompt_token_ids"] == expected


def test_a_template_that_renders_calls_gets_them_and_the_tool_call_id(model_dir):
    """A template that renders `tool_calls` gets them (arguments as an object, as chat templates
    take them) and a tool result's `tool_call_id`, with the content as it came."""
    from local_models import tiny_tokenizer

    from multidecode.serving.protocol import ChatBody, parse_body, to_job

    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
        "{% for c in m.tool_calls or [] %}<call {{ c.id }}>{{ c.function.name }} {{ c.function.arguments | tojson }}"
        "{% endfor %}{% if m.tool_call_id %} [{{ m.tool_call_id }}]{% endif %}<|im_end|>\n{% endfor %}"
        "<|im_start|>assistant\n")
    body = parse_body(json.dumps({"model": MODEL, "messages": HISTORY, "max_tokens": 2}).encode(), "application/json",
                 ChatBody)
    job = to_job(body, tokenizer, vocab_size=len(tokenizer), max_positions=None)
    text = tokenizer.decode(job.prompts[0])
    assert '<call call_1>get_weather {"city": "Paris", "unit": "celsius"}<|im_end|>' in text, text
    assert "18 degrees [call_1]" in text and "assistant\n{" not in text, text


@pytest.mark.parametrize("calls", ["get_weather", [{"type": "function"}], [{"function": {"arguments": "{}"}}]])
def test_malformed_tool_calls_in_the_history_are_a_400(server, calls):
    messages = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": calls}]
    response = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                          json={"model": MODEL, "messages": messages, "max_tokens": 2})
    error = assert_error_shape(response, 400, "invalid_request_error")
    assert error["param"] == "messages" and "messages[1].tool_calls" in error["message"], error
