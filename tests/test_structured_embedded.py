"""Structured output on the real embedded model (SmolLM2-135M-Instruct at its own precision):
extraction from the support call with a schema per question, greedy and sampled, with and without
speculation; answers validate and equal the plain constrained loop."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from constraint_cases import allowed_texts, reference

import multidecode
from multidecode.constraints import Constraint

pytestmark = [pytest.mark.embedded, pytest.mark.xdist_group("embedded")]

DATA = Path(multidecode.__file__).parent / "data"
DOCUMENT = (DATA / "support_call.txt").read_text()
SHORT = DOCUMENT[: DOCUMENT.index("Priya: That is helpful")][:1500]  # a few hundred tokens: the loop re-reads it
CALLER = {"type": "object", "properties": {"caller": {"type": "string", "maxLength": 40}},
          "required": ["caller"], "additionalProperties": False}
RECORD = {
    "type": "object",
    "properties": {
        "customer": {"type": "string", "maxLength": 40},
        "issue": {"enum": ["internet", "billing", "hardware", "other"]},
        "solved": {"type": "boolean"},
    },
    "required": ["customer", "issue", "solved"],
    "additionalProperties": False,
}


@pytest.mark.slow
def test_extraction_with_a_schema_per_question_equals_the_constrained_loop(embedded_decoder):
    questions = ["Who is calling? Answer in JSON.", "Summarise the call as a JSON record."]
    schemas = [CALLER, RECORD]
    answers = embedded_decoder.ask(SHORT, questions, json_schema=schemas, max_new_tokens=40, speculate="auto")
    for answer, schema in zip(answers, schemas):
        assert answer.finish_reason == "stop", answer.text
        jsonschema.validate(json.loads(answer.text), schema)
        assert answer.token_ids == reference(embedded_decoder, answer.prompt_ids, Constraint.json_schema(schema),
                                             max_new_tokens=40)
    assert json.loads(answers[0].text)["caller"].strip()


def test_speculation_and_jump_forward_change_only_the_forwards(embedded_decoder):
    prompt = f"{SHORT}\n\nSummarise the call as a JSON record."
    plain = embedded_decoder.generate(prompt, constraint=Constraint.json_schema(RECORD, jump_forward=False),
                             max_new_tokens=60, speculate=None)
    fast = embedded_decoder.generate(prompt, json_schema=RECORD, max_new_tokens=60, speculate="auto")
    assert fast.token_ids == plain.token_ids and fast.finish_reason == "stop"
    jsonschema.validate(json.loads(fast.text), RECORD)
    assert fast.stats["forced"] > 0 and fast.stats["forward_passes"] < plain.stats["forward_passes"]


def test_sampled_records_all_validate(embedded_decoder):
    prompt = f"{SHORT}\n\nSummarise the call as a JSON record."
    completions = embedded_decoder.complete(prompt, n=6, json_schema=RECORD, max_new_tokens=60, seed=3, temperature=0.9,
                                   speculate="lookup")
    for completion in completions:
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), RECORD)
    assert len({c.text for c in completions}) > 1


def test_a_regex_digit_is_an_ascii_digit(embedded_decoder):
    r"""With Unicode's `\d` this model answered `\d{3}` with U+1FBF8 three times: its tokenizer
    has tokens for the bytes of such digits, and none may start the answer now."""
    assert sorted(allowed_texts(embedded_decoder, Constraint.regex(r"\d{3}"))) == list("0123456789")
    done = embedded_decoder.generate("Three digits:", regex=r"\d{3}", max_new_tokens=8, speculate=None)
    assert done.finish_reason == "stop" and done.text.isascii() and done.text.isdigit(), done.text
