"""Structured output on the server, through the real `openai` client: `response_format` in both of
OpenAI's forms, streamed and not, n > 1; choices parse, validate and equal the constrained loop
(greedy); a bad format is a 400 (the fault tests refuse the rest)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from constraint_cases import reference
from serving import MODEL, chat_choices, chat_prompt_ids, tiny_loader, wait_until

from multidecode.constraints import Constraint
from multidecode.errors import InvalidArgument
from multidecode.runtime import ForestRuntime, Job, Limits
from multidecode.sampling_params import SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 5}, "urgent": {"type": "boolean"},
                   "kind": {"enum": ["call", "mail"]}},
    "required": ["name", "urgent", "kind"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "ticket", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": "Give me the ticket as JSON."}]




@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_choices_validate_and_equal_the_constrained_loop(server, stream):
    client = server.client()
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=60, temperature=0,
                                           response_format=FORMAT, stream=stream)
    if stream:
        chunks = [c for c in reply if c.choices]
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        text, finish = reply.choices[0].message.content, reply.choices[0].finish_reason
    assert finish == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)
    expected = reference(server.forest, chat_prompt_ids(server, MESSAGES), Constraint.json_schema(SCHEMA), max_new_tokens=60)
    assert text == server.forest.tokenizer.decode(expected, skip_special_tokens=True)


@pytest.mark.parametrize("stream", [False, True])
def test_n_sampled_json_objects_each_parse(server, stream):
    client = server.client()
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=80, n=3, seed=4,
                                           response_format={"type": "json_object"}, stream=stream)
    texts, finishes = chat_choices(reply, 3, stream=stream)
    for text, finish in zip(texts, finishes):
        assert text.startswith("{")
        if finish == "stop":
            assert isinstance(json.loads(text), dict)
    assert "stop" in finishes


def test_completions_take_a_response_format_too(server):
    reply = server.client().completions.create(model=MODEL, prompt="The ticket:", max_tokens=60, n=2, seed=1,
                                               extra_body={"response_format": FORMAT})
    for choice in reply.choices:
        if choice.finish_reason == "stop":
            jsonschema.validate(json.loads(choice.text), SCHEMA)


def test_structured_output_beside_free_requests_in_one_forest(server):
    """A constrained and a free request at once: each gets what it gets alone."""
    import concurrent.futures

    client = server.client()

    def constrained():
        return client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=60, temperature=0,
                                              response_format=FORMAT).choices[0].message.content

    def free():
        return client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20,
                                              temperature=0).choices[0].message.content

    alone = constrained(), free()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        together = [f.result() for f in [pool.submit(constrained), pool.submit(free)]]
    assert tuple(together) == alone


def test_a_grammar_the_parser_gives_up_on_mid_decode_fails_its_own_job_alone(model_dir):
    """`root ::= [xy] tail` passes the check before decoding (nothing is forced before the choice),
    and llguidance's parser gives up once x or y is chosen (the tail forces "aaa..." without end).
    That raised in the shared step and failed every job in the forest: another client's free request
    got a 400 about a grammar it never sent, and a batch job's other lines failed with it. The job
    fails alone with the engine's reason, and the free job sharing its steps gets its tokens alone."""
    model, tokenizer = tiny_loader(model_dir)()
    prompt = tokenizer("Pick x or y.")["input_ids"]
    bad = Constraint.grammar('root ::= [xy] tail\ntail ::= "a" tail\n')

    def run(constraints: list) -> list[list]:
        outputs: list[list] = [[] for _ in constraints]
        forest = ForestRuntime(model, tokenizer, limits=Limits(gather=len(constraints), gather_s=60)).start()
        try:
            for constraint, out in zip(constraints, outputs):
                forest.submit(Job(prompts=[prompt], max_new_tokens=8, sampling=[SamplingParams()],
                                  constraint=constraint, sink=out.append))
            assert wait_until(lambda: not forest.busy, 60)
        finally:
            forest.stop()
        return outputs

    (alone,) = run([None])
    free, refused = run([None, bad])
    assert free[-1][0] == "done" and [item for item in free if item[0] == "token"] == \
        [item for item in alone if item[0] == "token"]
    assert refused[-1][0] == "error" and isinstance(refused[-1][1], InvalidArgument)
    assert "cannot be followed" in str(refused[-1][1])


def test_the_boolean_schema_true_is_any_json_value_as_in_python(server):
    """`Constraint.json_schema(True)` is any JSON value (docs/structured.md); the server refused it
    ("schema is not an object")."""
    reply = server.client().chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "any", "schema": True}})
    expected = reference(server.forest, chat_prompt_ids(server, MESSAGES), Constraint.json_schema(True), max_new_tokens=40)
    assert reply.choices[0].message.content == server.forest.tokenizer.decode(expected, skip_special_tokens=True)


def test_a_bad_schema_is_a_400_in_openais_shape(server):
    with pytest.raises(openai.BadRequestError) as caught:
        server.client().chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=5,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}})
    error = caught.value.response.json()["error"]
    assert error["param"] == "response_format" and error["code"] == "invalid_json_schema"
    assert "Invalid type" in error["message"]


def test_a_schema_refused_for_a_keyword_says_how_to_ask_for_best_effort(server):
    """The 400's message carries the fix (a client sees no hint field); with strict false it runs."""
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True, "maxItems": 2}
    with pytest.raises(openai.BadRequestError) as caught:
        server.client().chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=5,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}})
    assert '"strict": false' in caught.value.response.json()["error"]["message"]
    server.client().chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": False}})
