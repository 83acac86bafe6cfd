"""OpenAI's sampling extras on the server, through the real `openai` client: presence and frequency
penalties and logit_bias give what sequential decoding with the definitions gives (whole and
streamed, per choice, chat too), a large bias forces a token, `echo` starts a completion with its
prompt, and bad values are a 400 naming the parameter."""

from __future__ import annotations

import openai
import pytest
import torch
from penalty_reference import reference
from serving import MODEL

from multidecode.sampling_params import SamplingParams

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"
SETTINGS = dict(presence_penalty=1.2, frequency_penalty=0.6, logit_bias={"40": 2.0, "41": -3.0})


def expected_text(server, prompt_ids: list[int], max_tokens: int, **settings) -> str:
    bias = {int(k): v for k, v in settings.pop("logit_bias", {}).items()}
    tokens = reference(server.forest.model, prompt_ids, SamplingParams(logit_bias=bias, **settings), max_tokens,
                       eos=server.forest.eos)
    return server.forest.tokenizer.decode(tokens, skip_special_tokens=True)


def prompt_ids(server, text: str) -> list[int]:
    return list(server.forest.tokenizer(text, add_special_tokens=True)["input_ids"])


def test_penalties_and_bias_equal_the_sequential_definitions(server):
    client = server.client()
    want = expected_text(server, prompt_ids(server, PROMPT), 20, **SETTINGS)
    assert want != expected_text(server, prompt_ids(server, PROMPT), 20)  # the settings change the answer
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0, n=2, **SETTINGS)
    assert [c.text for c in whole.choices] == [want, want]
    chunks = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0, stream=True,
                                       extra_body={"speculate": "lookup"}, **SETTINGS)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want


def test_chat_takes_them_too(server):
    client = server.client()
    messages = [{"role": "user", "content": "tell me about foxes and dogs"}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                           presence_penalty=2, frequency_penalty=2)
    tokenizer = server.forest.tokenizer
    ids = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = list(tokenizer(ids, add_special_tokens=False)["input_ids"])
    assert reply.choices[0].message.content == expected_text(server, ids, 12, presence_penalty=2.0,
                                                             frequency_penalty=2.0)
    assert reply.choices[0].message.content != plain.choices[0].message.content


def test_a_large_bias_forces_a_token_in_sampled_choices(server):
    client = server.client()
    tokenizer = server.forest.tokenizer
    token = prompt_ids(server, " fox")[-1]
    reply = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, n=3, seed=1,
                                      logit_bias={str(token): 100})
    assert [c.text for c in reply.choices] == [tokenizer.decode([token] * 5)] * 3


def test_echo_starts_each_choice_with_its_prompt(server):
    client = server.client()
    prompts = ["The quick brown fox", "Hello there"]
    plain = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0)
    echoed = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0, echo=True, n=2)
    assert [c.text for c in echoed.choices] == [p + c.text for p, c in zip(prompts, plain.choices) for _ in range(2)]
    chunks = client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=6, temperature=0, echo=True,
                                       stream=True)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == prompts[0] + plain.choices[0].text
    ids = prompt_ids(server, prompts[1])
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0, echo=True)
    assert by_ids.choices[0].text == server.forest.tokenizer.decode(ids) + plain.choices[1].text
    beams = client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=4, n=2, echo=True,
                                      extra_body={"use_beam_search": True})
    assert all(c.text.startswith(prompts[0]) and len(c.text) > len(prompts[0]) for c in beams.choices)


BAD = {
    "presence_penalty": dict(presence_penalty=2.5),
    "frequency_penalty": dict(frequency_penalty=-2.01),
    "logit_bias": dict(logit_bias={"fox": 1}),
    "logit_bias vocabulary": dict(logit_bias={"99999999": 1}),
    "logit_bias range": dict(logit_bias={"5": 101}),
    "echo with logprobs": dict(echo=True, logprobs=1),
    "echo with questions": dict(echo=True, extra_body={"questions": ["why?"]}),
    "beam search with a penalty": dict(n=2, presence_penalty=1, extra_body={"use_beam_search": True}),
}


@pytest.mark.parametrize("name", BAD)
def test_bad_values_are_a_400_naming_the_parameter(server, name):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, **BAD[name])
    param = caught.value.body["param"]
    assert param == name.split()[0] or (name.startswith("beam") and param == "presence_penalty"), caught.value.body


def test_tied_top_logprobs_come_in_the_order_greedy_picks_them():
    """`torch.topk` left ties in any order: a greedy reply's token (the lowest id among the best)
    was listed second in its own top_logprobs. Ties now come by id, the boundary's too."""
    from multidecode.branches import token_logprobs

    row = torch.tensor([0.0, 5.0, 1.0, 5.0, 5.0, 1.0])
    best = int(row.argmax())
    chosen, top = token_logprobs(row, best, 2)
    assert [t for t, _ in top] == [1, 3] and top[0] == (best, chosen)
    assert [t for t, _ in token_logprobs(row, best, 4)[1]] == [1, 3, 4, 2]  # the tie at the 4th: the lower id
    assert token_logprobs(row, best, 0)[1] == ()
