"""Checks on the real embedded model (SmolLM2-135M-Instruct), offline.

`load()` reads the GGUF in the wheel at its own precision (4-bit codes, the embedding 8-bit),
straight from the file; its float32 copy in the user cache (about 20 s to convert, once) serves
`precision="float32"`. These tests run on one xdist worker, which loads each once.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import multidecode
from multidecode.prompts import question_message, render_prompt, share_prefix, tokenize_prompt

pytestmark = [pytest.mark.embedded, pytest.mark.xdist_group("embedded")]

DATA = Path(multidecode.__file__).parent / "data"
DOCUMENT = (DATA / "support_call.txt").read_text()
QUESTIONS = (DATA / "support_call_questions.txt").read_text().splitlines()
SHORT = DOCUMENT[: DOCUMENT.index("Priya: That is helpful")]  # ~400 tokens: enough for the cheaper checks


def generate_alone(decoder, prompt_ids, max_new_tokens):
    with torch.inference_mode():
        out = decoder.model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                                     do_sample=False, max_new_tokens=max_new_tokens)
    return out[0, len(prompt_ids):].tolist()


def test_ask_equals_sequential_generation(embedded_decoder):
    """Every answer is what greedy generation from its own whole prompt gives when run alone."""
    questions = QUESTIONS[:4]
    answers = embedded_decoder.ask(DOCUMENT, questions, max_new_tokens=24)
    assert [a.question for a in answers] == questions
    for answer in answers:
        assert answer.token_ids == generate_alone(embedded_decoder, answer.prompt_ids, 24)
        text = embedded_decoder.tokenizer.decode(answer.token_ids, skip_special_tokens=True)
        assert answer.text == text
    assert any(a.finish_reason == "stop" for a in answers)


def test_the_embedded_model_answers_from_the_document(embedded_decoder):
    """A sanity check of the demo: the model reads the document (not an exactness claim)."""
    name, ticket = embedded_decoder.ask(DOCUMENT, [QUESTIONS[0], QUESTIONS[7]], max_new_tokens=20)
    assert "Okafor" in name.text
    assert "48213" in ticket.text


def test_the_default_precision_keeps_the_files_codes_within_a_quarter_of_its_bytes(embedded_decoder):
    memory = embedded_decoder.memory()
    assert memory["precision"] == "int4" and "4-bit codes" in memory["reason"]
    assert memory["formats"]["Q4_1 kept as 4-bit codes"] == 210 and memory["formats"]["Q8_0 kept as 8-bit codes"] == 1
    assert memory["weights_bytes"] <= 1.25 * memory["file_tensor_bytes"]


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_the_float_precisions_answer_from_the_document_too(precision):
    floats = multidecode.load(precision=precision)
    assert floats.memory()["precision"] == precision
    (name,) = floats.ask(DOCUMENT, [QUESTIONS[0]], max_new_tokens=20)
    assert "Okafor" in name.text


def test_prompt_ids_are_the_whole_prompt_tokenized(embedded_decoder):
    """Splitting never changes ids: prefix + suffix is exactly the tokenization of the whole prompt,
    and the shared prefix holds the whole document (so it is stored once)."""
    tok = embedded_decoder.tokenizer
    cases = [
        (DOCUMENT, QUESTIONS),
        ("The meeting is at 10 a.m. in room 4", ["When?", "Where is it?", "Who will be there?"]),
        ("A list: see", ["ing is believing?", "ing what?"]),  # questions that continue the last word
    ]
    for document, questions in cases:
        whole = [render_prompt(tok, question_message(document, q)) for q in questions]
        shared = share_prefix([tokenize_prompt(tok, text) for text in whole])
        for text, suffix in zip(whole, shared.suffix_ids):
            assert shared.prefix_ids + suffix == tok(text, add_special_tokens=False)["input_ids"]
        doc_end = whole[0].index(document.strip()) + len(document.strip())
        prefix_text = tok.decode(shared.prefix_ids)
        assert len(prefix_text) >= doc_end - 8  # the document lies (almost) entirely in the shared prefix
    # Why parts are never tokenized separately: a split inside a word changes the ids.
    assert tok("see", add_special_tokens=False)["input_ids"] + tok("ing", add_special_tokens=False)["input_ids"] != \
        tok("seeing", add_special_tokens=False)["input_ids"]


def test_stream_events_rebuild_the_answers(embedded_decoder):
    questions = QUESTIONS[:3]
    events = list(embedded_decoder.stream(SHORT, questions, max_new_tokens=16))
    answers = embedded_decoder.ask(SHORT, questions, max_new_tokens=16)
    for i, answer in enumerate(answers):
        mine = [e for e in events if e.branch == i]
        assert [e.token_id for e in mine] == answer.token_ids
        assert "".join(e.text for e in mine) == answer.text
        assert [e.finish_reason for e in mine[:-1]] == [None] * (len(mine) - 1)
        assert mine[-1].finish_reason == answer.finish_reason


def test_stop_strings_cut_the_text(embedded_decoder):
    answers = embedded_decoder.ask(SHORT, QUESTIONS[:2], max_new_tokens=24, stop=[" is"])
    for answer in answers:
        assert " is" not in answer.text
        assert answer.finish_reason == "stop"


def test_seeded_sampling_is_reproducible(embedded_decoder):
    first = embedded_decoder.ask(SHORT, QUESTIONS[:2], max_new_tokens=8, temperature=0.8, seed=7)
    again = embedded_decoder.ask(SHORT, QUESTIONS[:2], max_new_tokens=8, temperature=0.8, seed=7)
    assert [a.token_ids for a in first] == [a.token_ids for a in again]


def test_the_console_script_answers_in_json(tmp_path):
    """The installed `multidecode` entry point, as a user runs it."""
    script = Path(sys.executable).parent / "multidecode"
    doc = tmp_path / "doc.txt"
    doc.write_text(DOCUMENT)
    result = subprocess.run(
        [str(script), "ask", "--document", str(doc), "-q", QUESTIONS[7], "--max-new-tokens", "16", "--json"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "NO_COLOR": "1"}, check=False,
    )
    assert result.returncode == 0, result.stderr
    import json

    (answer,) = json.loads(result.stdout)
    assert "48213" in answer["answer"]
