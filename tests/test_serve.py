"""The OpenAI-compatible server, through the real `openai` client against a server on a loopback
port: streamed and whole answers agree, greedy answers equal plain generation and solo runs,
concurrent requests share forwards, prompts hit the prefix cache, and the extensions work."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import httpx
import openai
import pytest
import torch
from serving import MODEL, assert_error_shape, chat_prompt_ids, tiny_loader, wait_until

from multidecode.prompts import common_prefix_length
from multidecode.runtime import ForestRuntime, Job, Limits
from multidecode.sampling_params import SamplingParams
from multidecode.serving.protocol import openai_token, token_bytes

PROMPT = "The quick brown fox jumps over the lazy dog. Question: what is the answer?"
DOCUMENT = "Here is a document about support calls, routers, cables and tickets. " * 3


def _greedy_reference(running, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """What plain sequential decoding gives: transformers' own greedy generate."""
    return _greedy_reference_model(running.forest.model, running.forest.eos, prompt_ids, max_new_tokens)


def _greedy_reference_model(model, eos, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=sorted(eos), pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def _tokens(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


def _ids(running, text: str) -> list[int]:
    return _tokens(running.forest.tokenizer, text)


def test_health_models_and_metrics(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    metrics = httpx.get(server.url + "/metrics").text
    assert "multidecode_forward_passes_total" in metrics and "multidecode_cache_slots" in metrics


def test_one_model_by_its_id_and_health_by_head(server):
    """GET /v1/models/{id} is the model's object as the list has it (an unknown id a 404 in OpenAI's
    shape); HEAD /health and HEAD / answer as GET does, without a body (a load balancer's probe)."""
    model = server.client().models.retrieve(MODEL)
    listed = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]
    assert httpx.get(server.url + f"/v1/models/{MODEL}", timeout=10).json() == listed
    assert model.id == MODEL and model.object == "model"
    with pytest.raises(openai.NotFoundError) as caught:
        server.client().models.retrieve("gpt-5")
    error = assert_error_shape(caught.value.response, 404, "invalid_request_error")
    assert "gpt-5" in error["message"] and (error["code"], error["param"]) == ("model_not_found", "model")
    other = assert_error_shape(httpx.get(server.url + "/v1/models/org/other-model", timeout=10), 404)
    assert other["code"] == "model_not_found"
    for route in ("/health", "/"):  # the page too: uptime monitors probe with HEAD (it was a 405)
        head = httpx.head(server.url + route, timeout=10)
        assert head.status_code == 200 and head.content == b"", route


def test_greedy_completion_equals_transformers_generate_and_streaming_equals_whole(server):
    client = server.client()
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0, stream=True))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    expected = _greedy_reference(server, _ids(server, PROMPT), 20)
    text = server.forest.tokenizer.decode(expected, skip_special_tokens=True)
    assert whole.choices[0].text == text
    assert whole.usage.completion_tokens == len(expected)


def test_chat_streaming_equals_whole(server):
    client = server.client()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                            stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == whole.choices[0].message.content
    assert whole.choices[0].message.role == "assistant"


def test_n_choices_have_distinct_indices_and_the_same_seed_gives_the_same_text(server):
    client = server.client()
    first = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, n=3, seed=7, temperature=1.0)
    again = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, n=3, seed=7, temperature=1.0)
    assert sorted(c.index for c in first.choices) == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    # choice i samples with seed + i: the same as a single choice with that seed
    third = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, n=1, seed=9, temperature=1.0)
    assert third.choices[0].text == first.choices[2].text
    assert len({c.text for c in first.choices}) > 1  # the tiny model's sampled choices differ
    # the prompt counts once for n choices
    assert first.usage.prompt_tokens == len(_ids(server, PROMPT))


def test_each_prompt_of_a_request_counts_in_its_prompt_tokens(server):
    """OpenAI bills each prompt of a list, equal ones too (n copies of one prompt count once), and
    cached_tokens never claims more than that."""
    client = server.client()
    prompt = "Hello world, a prompt of its own for counting."
    one = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0).usage
    two = client.completions.create(model=MODEL, prompt=[prompt, prompt], max_tokens=2, temperature=0).usage
    assert one.prompt_tokens == len(_ids(server, prompt))
    assert two.prompt_tokens == 2 * one.prompt_tokens
    both_n = client.completions.create(model=MODEL, prompt=[prompt, prompt], n=3, max_tokens=2, temperature=0).usage
    assert both_n.prompt_tokens == 2 * one.prompt_tokens
    assert 0 < both_n.prompt_tokens_details.cached_tokens <= one.prompt_tokens  # found once, in the prefix cache


def test_stream_usage_chunk_ends_the_stream_and_adds_up(server):
    client = server.client()
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, n=2, seed=3, stream=True,
                                            stream_options={"include_usage": True}))
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    usage = last.usage
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    emitted = sum(1 for c in chunks[:-1] for _ in c.choices)
    assert usage.completion_tokens >= emitted - 2 and usage.completion_tokens > 0
    assert usage.prompt_tokens_details.cached_tokens <= usage.prompt_tokens


def test_a_repeated_prompt_hits_the_prefix_cache_and_gives_the_same_answer(server):
    client = server.client()
    prompt = "A prompt nobody sent before: routers, cables and tickets, in that order."
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens - 1
    assert second.choices[0].text == first.choices[0].text
    # a prompt that shares only a head hangs under it
    longer = client.completions.create(model=MODEL, prompt=prompt + " And then the fox.", max_tokens=12,
                                       temperature=0)
    assert longer.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 2
    expected = _greedy_reference(server, _ids(server, prompt + " And then the fox."), 12)
    assert longer.choices[0].text == server.forest.tokenizer.decode(expected, skip_special_tokens=True)


def test_sixteen_concurrent_streams_equal_solo_runs_and_share_forwards(server, caplog):
    prompts = [f"{DOCUMENT} Question {i}: what about item {i}?" for i in range(16)]

    async def one(client, prompt):
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True})
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
            else:
                usage = chunk
        return text, usage

    async def together():
        client = server.async_client()
        return await asyncio.gather(*(one(client, p) for p in prompts))

    solo = [server.client().completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0).choices[0].text
            for p in prompts]
    server.wait_idle()
    steps_before = server.forest.counters.steps
    with caplog.at_level(logging.DEBUG, logger="multidecode.runtime"):
        results = asyncio.run(together())
    assert [text for text, _ in results] == solo
    steps = server.forest.counters.steps - steps_before
    alone = sum(usage.model_extra["multidecode"]["steps"] for _, usage in results)
    assert steps < alone / 4, (steps, alone)
    shared = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert any(int(line.split(": ")[1].split(" requests")[0]) >= 8 for line in shared), shared[:5]


def test_questions_extension_answers_each_question_as_a_choice(server):
    client = server.client()
    questions = ["What is it about?", "Who calls?", "What breaks?"]
    reply = client.completions.create(model=MODEL, prompt=DOCUMENT, max_tokens=10, temperature=0,
                                      extra_body={"questions": questions})
    assert [c.index for c in reply.choices] == [0, 1, 2]
    from multidecode.prompts import question_message

    for question, choice in zip(questions, reply.choices):
        ids = _ids(server, question_message(DOCUMENT, question))
        alone = client.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0)
        assert choice.text == alone.choices[0].text


def test_questions_in_a_chat_keep_the_system_message_and_earlier_turns(server):
    """The last user message is the document; the system message and the turns before it were
    dropped without a word (a 200 answering as if they had never been sent)."""
    from multidecode.prompts import question_message

    client = server.client()
    earlier = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Hello."},
               {"role": "assistant", "content": "Hi."}]
    questions = ["Who calls?", "What breaks?"]
    reply = client.chat.completions.create(model=MODEL, messages=[*earlier, {"role": "user", "content": DOCUMENT}],
                                           max_tokens=8, temperature=0, extra_body={"questions": questions})
    for question, choice in zip(questions, reply.choices):
        alone = client.chat.completions.create(
            model=MODEL, messages=[*earlier, {"role": "user", "content": question_message(DOCUMENT, question)}],
            max_tokens=8, temperature=0)
        assert choice.message.content == alone.choices[0].message.content


def test_beam_search_extension_equals_transformers(server):
    client = server.client()
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, n=3,
                                      extra_body={"use_beam_search": True, "return_token_ids": True})
    ids = _ids(server, PROMPT)
    out = server.forest.model.generate(torch.tensor([ids]), num_beams=3, num_return_sequences=3, max_new_tokens=8,
                                       do_sample=False, eos_token_id=sorted(server.forest.eos), pad_token_id=0,
                                       early_stopping=False, length_penalty=1.0)
    tok = server.forest.tokenizer
    generated = [[t for t in row[len(ids):].tolist() if t != 0] for row in out]
    expected = [tok.decode(row, skip_special_tokens=True) for row in generated]
    assert [c.text for c in reply.choices] == expected
    # return_token_ids: each beam's own ids, and the one prompt's
    assert [c.model_extra["token_ids"] for c in reply.choices] == generated
    assert all(c.model_extra["prompt_token_ids"] == ids for c in reply.choices)


def test_logprobs_are_the_models_own(server):
    client = server.client()
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3)
    lp = reply.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    ids = _ids(server, PROMPT)
    with torch.no_grad():
        first = torch.log_softmax(server.forest.model(torch.tensor([ids])).logits[0, -1].float(), -1)
    assert lp.token_logprobs[0] == pytest.approx(float(first.max()), abs=1e-4)
    assert all(len(top) <= 3 for top in lp.top_logprobs)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) >= 1 and all(len(c.top_logprobs) == 2 for c in content)
    assert content[0].logprob == pytest.approx(content[0].top_logprobs[0].logprob, abs=1e-5)


@pytest.mark.parametrize("asked", [dict(logprobs=1, temperature=0, logit_bias={"7": 100}),
                                   dict(logprobs=0, temperature=1.5, seed=3)], ids=["biased", "sampled"])
def test_completions_top_logprobs_hold_the_chosen_token(server, asked):
    """As OpenAI's: the chosen token's log-probability is always in its entry (up to logprobs + 1), a
    chosen token outside the model's own top ones too (a bias, a draw)."""
    lp = server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, **asked).choices[0].logprobs
    assert len(lp.top_logprobs) == len(lp.tokens) == 6
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[token] == logprob and len(top) <= asked["logprobs"] + 1
    if asked["logprobs"] == 1:  # token 7 is chosen every step, ranked first by the model on none
        assert all(len(top) == 2 for top in lp.top_logprobs)


DRAGON = {"type": "json_schema", "json_schema": {"name": "dragon", "schema": {"enum": ["🐉 龍"]}}}
"""A reply forced to be '"🐉 龍"': the tiny tokenizer writes each of those characters' bytes as a
token of its own, none of them UTF-8 alone."""


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_of_tokens_that_are_parts_of_characters_carry_their_own_bytes(server, stream):
    """Chat: each token's `bytes` are its own, so that joined they are the content's UTF-8; a token
    that is part of a character is named "bytes:\\xNN". Completions: text_offset is a character
    offset into the text, never past its end: a character's tokens share the offset where it
    begins. Streamed, the same entries come chunk by chunk."""
    client = server.client()
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Reply with 🐉"}],
                                          max_tokens=16, temperature=0, logprobs=True, top_logprobs=2,
                                          response_format=DRAGON)
    content, choice = chat.choices[0].message.content, chat.choices[0]
    assert content == '"🐉 龍"' and choice.finish_reason == "stop"
    entries = choice.logprobs.content
    assert entries[-1].token == "<|im_end|>"  # the end of sequence, under its name, adds no text
    assert b"".join(bytes(e.bytes) for e in entries[:-1]) == content.encode()
    assert [e.token for e in entries[:2]] == ['"', "bytes:\\xf0"]
    for entry in entries:
        data = bytes(entry.bytes)
        assert entry.token == (data.decode() if _utf8(data) else "bytes:" + "".join(f"\\x{b:02x}" for b in data))
        assert all(bytes(top.bytes) and top.token for top in entry.top_logprobs)

    request = dict(model=MODEL, prompt="Reply with 🐉", max_tokens=16, temperature=0, logprobs=2,
                   extra_body={"response_format": DRAGON})
    if stream:
        chunks = [c.choices[0] for c in client.completions.create(**request, stream=True) if c.choices]
        text = "".join(c.text for c in chunks)
        logprobs = [c.logprobs for c in chunks if c.logprobs]
        tokens = [t for lp in logprobs for t in lp.tokens]
        offsets = [o for lp in logprobs for o in lp.text_offset]
    else:
        reply = client.completions.create(**request).choices[0]
        text, tokens, offsets = reply.text, reply.logprobs.tokens, reply.logprobs.text_offset
    assert text == '"🐉 龍"'
    assert offsets == sorted(offsets) and all(0 <= o <= len(text) for o in offsets)
    assert offsets[:6] == [0, 1, 1, 1, 1, 2]  # '"', the dragon's four bytes where it begins, then ' '
    for token, offset in zip(tokens, offsets):
        if not token.startswith("bytes:") and token != "<|im_end|>":  # whole characters: where they are
            assert text[offset:offset + len(token)] == token, (token, offset)


@pytest.mark.parametrize("stream", [False, True])
def test_text_offsets_do_not_move_while_a_stop_string_holds_text_back(server, stream):
    """A stop string that the text keeps starting to spell holds every token's text back until the
    end; each token's text_offset is still where its text begins, as without the stop string (they
    were the length of the text sent so far: all 0). One that matches leaves the offsets before it."""
    client = server.client()
    request = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=1)

    def offsets(**more) -> tuple[str, list[int]]:
        if not stream:
            reply = client.completions.create(**request, **more).choices[0]
            return reply.text, reply.logprobs.text_offset
        chunks = [c.choices[0] for c in client.completions.create(**request, **more, stream=True) if c.choices]
        return "".join(c.text for c in chunks), [o for c in chunks if c.logprobs for o in c.logprobs.text_offset]

    text, free = offsets()
    assert len(set(free)) > 2 and free == sorted(free), (text, free)  # tokens with text of their own
    assert offsets(stop=[text + "\x00"]) == (text, free)  # never matches: every token held until the last
    cut = free[3]
    assert offsets(stop=[text[cut:]])[0] == text[:cut] and offsets(stop=[text[cut:]])[1][:4] == free[:4]


def _utf8(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True


@pytest.mark.embedded
def test_the_embedded_tokenizers_token_bytes_rebuild_the_text():
    """The embedded model's byte-level tokenizer writes an emoji as tokens that hold parts of it
    (with the space before it in one): their bytes, joined, are the text's UTF-8."""
    from transformers import AutoTokenizer

    from multidecode.models.converted import embedded_copy

    tokenizer = AutoTokenizer.from_pretrained(embedded_copy())
    text = "Reply with only this emoji: 🐉 (龍)"
    pieces = [token_bytes(tokenizer, t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]
    assert b"".join(pieces) == text.encode()
    assert "bytes:\\x20\\xf0\\x9f" in [openai_token(p) for p in pieces]  # the space and the dragon's first bytes
    assert token_bytes(tokenizer, tokenizer.eos_token_id) == tokenizer.eos_token.encode()


def test_the_developer_role_is_the_system_one(server):
    """OpenAI reads a developer message as a system one; chat templates know only "system"."""
    user = {"role": "user", "content": "hello there"}
    reply = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
        "model": MODEL, "max_tokens": 2, "return_token_ids": True,
        "messages": [{"role": "developer", "content": "Be brief."}, user]}).json()
    system = chat_prompt_ids(server, [{"role": "system", "content": "Be brief."}, user])
    assert reply["choices"][0]["prompt_token_ids"] == system


def test_speculation_never_changes_the_answer(server):
    client = server.client()
    prompt = "cables and tickets, cables and tickets, cables and tickets, cables and"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
    for mode in ("lookup", "suffix"):
        drafted = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                            extra_body={"speculate": mode})
        assert drafted.choices[0].text == plain.choices[0].text
        assert drafted.model_extra["multidecode"]["speculate"] == mode
    for mode in ("eagle", "mtp"):  # a learned head loads once, when the server starts, never per request
        with pytest.raises(openai.BadRequestError, match="did not load one"):
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, extra_body={"speculate": mode})


def test_waiting_requests_that_share_an_uncached_prefix_let_one_go_first(model_dir):
    """Two jobs waiting in one round with a long common head: one computes it, the other waits a
    step and hangs under it (cached tokens > 0), and both answers equal plain generation."""
    model, tokenizer = tiny_loader(model_dir)()
    forest = ForestRuntime(model, tokenizer, limits=Limits(defer_tokens=8))
    head = _tokens(tokenizer, DOCUMENT * 2)
    prompts = [head + _tokens(tokenizer, " First?"), head + _tokens(tokenizer, " Second?")]
    outputs: list[list] = [[], []]
    jobs = [forest.submit(Job(prompts=[p], max_new_tokens=6, sampling=[SamplingParams()], sink=out.append))
            for p, out in zip(prompts, outputs)]
    forest.start()  # both jobs wait in the first round
    try:
        wait_until(lambda: not forest.busy, 30)
    finally:
        forest.stop()
    assert sorted(job.cached_tokens for job in jobs) == [0, common_prefix_length(prompts)]
    for prompt, out in zip(prompts, outputs):
        assert out[-1][0] == "done"
        tokens = [item[1].token_id for item in out if item[0] == "token"]
        assert tokens == _greedy_reference_model(model, forest.eos, prompt, 6)


def test_an_idle_engine_gathers_the_jobs_sent_together(model_dir):
    """Limits.gather: an idle engine waits until `gather` jobs wait, so jobs that reach it one by
    one still start in one step; fewer than that start once `gather_s` has passed."""
    model, tokenizer = tiny_loader(model_dir)()
    forest = ForestRuntime(model, tokenizer, limits=Limits(gather=3, gather_s=60)).start()
    try:
        jobs = []
        for text in (PROMPT, DOCUMENT, "Tickets, cables and routers: which failed first?"):  # no common head
            jobs.append(forest.submit(Job(prompts=[_tokens(tokenizer, text)], max_new_tokens=4,
                                          sampling=[SamplingParams()], sink=lambda item: None)))
            time.sleep(0.2)  # each answered in a few steps: without gathering, one after another
        assert wait_until(lambda: not forest.busy, 60)
        assert forest.counters.steps == max(job.steps for job in jobs)  # one round: all from the first step
    finally:
        forest.stop()
    forest = ForestRuntime(model, tokenizer, limits=Limits(gather=3, gather_s=0.3)).start()
    try:
        started = time.monotonic()
        forest.submit(Job(prompts=[_tokens(tokenizer, PROMPT)], max_new_tokens=2, sampling=[SamplingParams()],
                          sink=lambda item: None))
        assert wait_until(lambda: not forest.busy, 60)
        assert forest.counters.admitted == 1 and time.monotonic() - started >= 0.3
    finally:
        forest.stop()


def test_the_cache_goes_back_to_the_prefix_index_when_idle(server):
    client = server.client()
    for i in range(3):
        client.completions.create(model=MODEL, prompt=f"{PROMPT} {i}", max_tokens=8, n=2, seed=i)
    server.wait_idle()
    forest = server.forest
    assert forest.engine.forest.num_slots == len(forest.index)
    assert not forest.scheduler.works
    # every indexed path is a real path of the forest: what a later request hangs under
    for leaf in forest.index.leaves():
        path = forest.engine.forest.path(leaf)
        assert forest.index.match(forest.engine.forest.path_tokens(leaf)) == (len(path), leaf)


def test_an_idle_server_renumbers_its_forest_and_still_hits_the_cache(server, monkeypatch):
    """Finished requests leave nodes behind as history; an idle server starts a fresh forest of
    what is cached (here as soon as there is any history), and the prefix index follows it."""
    monkeypatch.setattr("multidecode.runtime.forest_runtime.RENUMBER_FACTOR", 0)
    client = server.client()
    prompt = "Renumbering: routers and cables, then tickets."
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, n=2, seed=1)
    server.wait_idle()
    forest = server.forest.engine.forest
    assert len(forest) == forest.num_slots == len(server.forest.index)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, n=2, seed=1)
    assert again.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens - 1
    assert [c.text for c in again.choices] == [c.text for c in first.choices]


def test_a_prompt_and_its_tokens_fill_the_window_as_the_library_fills_it(server):
    """A prompt of P tokens takes P + max_tokens - 1 positions (the last new token is never fed
    back), as the library counts them: the server refused the last token that fits, one short of
    the same command run locally."""
    window = server.forest.model.config.max_position_embeddings
    prompt = [5 + i % 200 for i in range(window - 6)]
    fits = window - len(prompt) + 1
    for speculate in (None, "lookup"):
        reply = server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=fits, temperature=0,
                                                   extra_body={"speculate": speculate, "return_token_ids": True})
        expected = _greedy_reference(server, prompt, fits)
        assert reply.choices[0].model_extra["token_ids"] == expected, speculate
    with pytest.raises(openai.BadRequestError, match="context window"):
        server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=fits + 1, temperature=0)


def test_the_traces_texts_join_into_the_prompt(server, model_dir):
    """The live page's forest showed a character split over tokens as U+FFFD pieces ("Caf� 日��"):
    each traced node decoded alone. Along the prompt's path the traced texts now join into the
    prompt, and no node shows a piece of a character."""
    from transformers import AutoTokenizer

    prompt = "Café 日本語 🎉, ok"
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": True, "trace": True}) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    nodes = {n: (parent, text) for e in events if e.get("object") == "multidecode.trace"
             for n, parent, text, kind in e["nodes"] if kind == "prompt"}
    path, node = [], max(nodes)  # the prompt's last token
    while node in nodes:
        path.append(nodes[node][1])
        node = nodes[node][0]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert not any("\ufffd" in text for text in path), path
    assert "".join(reversed(path)) == tokenizer.decode(tokenizer(prompt)["input_ids"]), path
    assert len(tokenizer("日", add_special_tokens=False)["input_ids"]) > 1  # split over tokens: the case tested
