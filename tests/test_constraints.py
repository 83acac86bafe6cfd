"""Structured output: constraints compiled and refused, masks, pruned drafts, jump-forward, and
constrained decoding against the plain constrained loop (the model on the whole sequence, mask,
choose), greedy and sampled, alone and in forests, with and without speculation.

The model is the offline tiny model folder (a random Llama with a byte-level BPE tokenizer) on the
exact kernels, so a forest's logits equal the whole sequence's bit for bit and outputs can be
compared token for token. The reference masks with llguidance's own `compute_bitmask`, not with
`constraints.mask_logits`.
"""

from __future__ import annotations

import json
import random
import re

import jsonschema
import numpy as np
import pytest
import torch
from constraint_cases import allowed, allowed_texts, check_output, eos_of, prompt_of, reference
from scipy.stats import chisquare
from speculation_cases import FLAT

import multidecode
from multidecode import branches
from multidecode.constraints import (
    BEST_EFFORT_HINT,
    Constraint,
    allowed_nodes,
    ascii_digits,
    compile_constraint,
    constraint_of,
    mask_logits,
    per_branch,
)
from multidecode.errors import InvalidArgument, InvalidInput
from multidecode.proposers import BranchContext, DraftTree, Proposer
from multidecode.speculation import Speculation

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "light blue"]},
        "tags": {"type": "array", "items": {"enum": ["a", "bc"]}, "maxItems": 2},
    },
    "required": ["name", "ok", "color", "tags"],
    "additionalProperties": False,
}
REGEX = r"[a-c]{2,5}@(x|yz)\.com"
LARK = 'start: "(" item ("," item)* ")"\nitem: /[0-9]{1,2}/'
GBNF = 'root ::= "[" [a-z]+ "]"'
CONSTRAINTS = {
    "schema": Constraint.json_schema(SCHEMA),
    "object": Constraint.json_object(),
    "regex": Constraint.regex(REGEX),
    "lark": Constraint.grammar(LARK),
    "gbnf": Constraint.grammar(GBNF),
}
PROMPTS = ["hello there", "Here is a document about support calls.", "what is the answer?"]


@pytest.fixture(scope="module")
def decoder(model_dir):
    return multidecode.load(str(model_dir), device="cpu", exact=True)


# ---------------------------------------------------------------------- the constraint value
@pytest.mark.parametrize("make, message", [
    (lambda: Constraint.json_schema({"type": "nonsense"}), "JSON schema cannot be compiled: Invalid type"),
    (lambda: Constraint.json_schema("{not json"), "not valid JSON"),
    (lambda: Constraint.json_schema([1, 2]), "must be a JSON object"),
    (lambda: Constraint.json_schema({"type": "integer", "minimum": 5, "maximum": 3}), "Unsatisfiable"),
    (lambda: Constraint.json_schema({"type": "string", "format": "weird"}), "Unknown format"),
    (lambda: Constraint.regex("(abc"), "unclosed group"),
    (lambda: Constraint.regex(""), "non-empty"),
    (lambda: Constraint.grammar('start: "a" b'), "unknown name"),
    (lambda: Constraint.grammar("root ::= foo"), "not found"),
    (lambda: Constraint("xml", "<a/>"), "unknown constraint kind"),
])
def test_bad_constraints_are_refused_when_made(make, message):
    with pytest.raises(InvalidArgument, match=message) as caught:
        make()
    assert caught.value.hint is not None


@pytest.mark.parametrize("make, reason, hint", [
    (lambda: Constraint.json_schema({"type": "string", "pattern": "(a"}), "unclosed group", '"pattern"'),
    (lambda: Constraint.json_schema({"type": "string", "pattern": "(?=a)a"}), "look-around", '"pattern"'),
    (lambda: Constraint.json_schema({"type": "string", "maxLength": 10**12}), "decimal literal", '"maxLength"'),
    (lambda: Constraint.json_schema({"enum": [f"v{i}" for i in range(100_000)]}), "too big", '"enum" values'),
    (lambda: Constraint.json_schema({"type": "integer", "multipleOf": 0}), "multiple of", '"multipleOf"'),
    (lambda: Constraint.json_schema({"type": "object", "properties": {}, "required": ["a"],
                                     "additionalProperties": False}), "required property", '"properties"'),
    (lambda: Constraint.json_schema({"allOf": [{"type": "integer"}, {"type": "string"}]}), "incompatible types",
     '"allOf"'),
    (lambda: Constraint.regex("(a"), "unclosed group", "Rust regex syntax"),
], ids=["pattern", "look-around", "maxLength", "enum", "multipleOf", "required", "allOf", "regex"])
def test_a_refusal_gets_the_fix_for_its_reason(make, reason, hint):
    """Each of these got a hint for another problem: "give a JSON Schema object" to a JSON Schema
    object, "loosen the bounds" to a required property the schema leaves out. A regex's message
    showed llguidance's position in its own grammar (`at 1(8)`) and the regex as rewritten."""
    with pytest.raises(InvalidArgument, match=re.escape(reason)) as caught:
        make()
    assert hint in caught.value.hint and "JSON Schema object" not in caught.value.hint
    assert "at 1(" not in caught.value.message and "invalid regex" not in caught.value.message


def nested(depth: int) -> dict:
    """A schema of `depth` objects, each the one property of the object above it."""
    schema = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"inner": schema}}
    return schema


BIG = "1" + "0" * 399  # a 400-digit integer, beyond a double's range
UNREADABLE = {  # schemas llguidance's reader refuses with a plain ValueError: (schema, message, hint)
    "properties 64 deep": (nested(64), "recursion limit exceeded", '"$defs"'),
    "properties 200 deep": (nested(200), "recursion limit exceeded", '"$ref"'),
    "NaN": ({"type": "number", "minimum": float("nan")}, "NaN or Infinity", "finite number"),
    "Infinity": ({"type": "number", "maximum": float("inf")}, "NaN or Infinity", "finite number"),
    "NaN in JSON text": ('{"type": "number", "maximum": NaN}', "NaN or Infinity", "finite number"),
    "1e400 in JSON text": ('{"type": "number", "maximum": 1e400}', "NaN or Infinity", "finite number"),
    "a 400-digit integer": ({"type": "integer", "maximum": int(BIG)}, "number out of range", "double's range"),
    "a 400-digit literal": (f'{{"type": "integer", "minimum": -{BIG}}}', "number out of range", "double's range"),
    "a lone surrogate": ({"type": "string", "const": "\ud800"}, "lone surrogate", "\\ud800"),
    "a lone surrogate key": ('{"properties": {"\\udc00": {}}}', "lone surrogate", "\\ud800"),
}


@pytest.mark.parametrize("name", UNREADABLE)
def test_schemas_the_engine_cannot_read_are_invalid_arguments(name):
    """Not llguidance's bare ValueError (a traceback on the command line, a 500 on the server, a
    batch job stopped): an InvalidArgument naming what is wrong, with the fix."""
    schema, message, hint = UNREADABLE[name]
    with pytest.raises(InvalidArgument, match=re.escape(message)) as caught:
        Constraint.json_schema(schema)
    assert hint in caught.value.hint and "line 1 column" not in caught.value.message


@pytest.mark.parametrize("text, hint", [
    ('{"type": "number", "maximum": NaN}', 'give a JSON Schema object'),
    ('{"const": "\\ud800"}', "lone surrogate"),
    (json.dumps(nested(64)), '"$defs"'),
])
def test_schema_text_the_engine_cannot_read_is_an_invalid_argument_when_made_directly(text, hint):
    """A Constraint made from its text, past `Constraint.json_schema`'s own checks, is refused
    the same way (the one place that converts catches what llguidance raises)."""
    with pytest.raises(InvalidArgument, match="JSON schema cannot be read") as caught:
        Constraint("json_schema", text)
    assert hint in caught.value.hint


@pytest.mark.parametrize("schema, hint", [
    ({"type": "array", "uniqueItems": True}, BEST_EFFORT_HINT),
    ({"type": "string", "format": "weird"}, BEST_EFFORT_HINT),
    ({"type": "string", "minLength": 5, "maxLength": 2}, "loosen the bounds (minLength/maxLength"),
    ({"type": "nonsense"}, "give a JSON Schema object"),
])
def test_a_refused_schema_gets_the_hint_for_its_problem(schema, hint):
    with pytest.raises(InvalidArgument) as caught:
        Constraint.json_schema(schema)
    assert caught.value.hint.startswith(hint)
    assert "--no-strict" in BEST_EFFORT_HINT and "strict=False" in BEST_EFFORT_HINT


def test_regex_digits_are_ascii_digits():
    r"""`\d` is [0-9] and `\D` [^0-9], outside a class and inside one (Rust nests classes); an
    escaped backslash before a "d" is left alone, and so is every other escape."""
    assert ascii_digits(r"\d{3}-\D+") == "[0-9]{3}-[^0-9]+"
    assert ascii_digits(r"\\d") == r"\\d"  # a backslash, then the letter d
    assert ascii_digits(r"\\\d") == r"\\[0-9]"  # a backslash, then a digit
    assert ascii_digits(r"[a\d_]") == "[a[0-9]_]"
    assert ascii_digits(r"[^\D]") == "[^[^0-9]]"
    assert ascii_digits(r"\p{Nd}\.\w[\]]\\") == r"\p{Nd}\.\w[\]]\\"
    assert Constraint.regex(r"\d{3}").text == r"\d{3}"  # the user's pattern, as given


@pytest.mark.parametrize("pattern", ["\\", "a\\", "a\\\\\\"])
def test_a_regex_ending_in_a_lone_backslash_is_refused(pattern):
    """llguidance reads a trailing lone backslash as nothing ("a\\" as "a"): refused instead."""
    with pytest.raises(InvalidArgument, match="ends in a lone backslash"):
        Constraint.regex(pattern)
    assert Constraint.regex(pattern + "\\").text == pattern + "\\"  # an escaped backslash is fine


@pytest.mark.parametrize("pattern", [r"\d{3}", r"[x\d]{3}", r"[^\D]+"])
def test_a_regex_digit_allows_only_ascii_digits(decoder, pattern):
    """The byte-level tokenizer has a token for each byte: with Unicode's \\d the lead bytes of
    Arabic-Indic or fullwidth digits would be allowed too."""
    texts = allowed_texts(decoder, Constraint.regex(pattern))
    assert texts and all(text.isascii() and (text.isdigit() or text == "x") for text in texts), texts
    assert any(not text.isascii() for text in allowed_texts(decoder, Constraint.regex(r"\D")))
    done = decoder.generate(PROMPTS[0], regex=r"\d{3}", chat=False, max_new_tokens=8, speculate=None)
    assert re.fullmatch("[0-9]{3}", done.text), done.text


def test_strict_false_ignores_what_cannot_be_enforced():
    assert Constraint.json_schema({"type": "string", "format": "weird"}, strict=False).kind == "json_schema"


def test_one_way_to_name_a_constraint():
    assert constraint_of() is None
    assert constraint_of(regex="a+") == Constraint.regex("a+")
    assert constraint_of(json_schema='{"type": "object"}') == Constraint.json_schema({"type": "object"})
    assert constraint_of(grammar=[GBNF, None]) == [Constraint.grammar(GBNF), None]
    with pytest.raises(InvalidArgument, match="both given"):
        constraint_of(regex="a", json_schema={})
    with pytest.raises(InvalidArgument, match="must be a multidecode Constraint"):
        constraint_of(constraint="a+")
    with pytest.raises(InvalidInput, match="2 constraints for 3 branches"):
        per_branch(3, [None, None])


def test_a_constraint_needs_an_eos_and_a_fast_tokenizer(decoder):
    prompt = prompt_of(decoder, "hi")
    with pytest.raises(InvalidArgument, match="end-of-sequence"):
        multidecode.decode(decoder.model, prompt, [[]], max_new_tokens=4, eos_token_id=[],
                           tokenizer=decoder.tokenizer, constraint=Constraint.regex("a+"))
    with pytest.raises(InvalidArgument, match="needs the model's tokenizer"):
        multidecode.decode(decoder.model, prompt, [[]], max_new_tokens=4, constraint=Constraint.regex("a+"))


@pytest.mark.parametrize("kind, text", [
    ("regex", "[a&&b]"), ("regex", r"[^\s\S]"), ("regex", "a[a&&b]"), ("grammar", 'start: a\na: a "x"\n'),
])
def test_a_constraint_that_matches_no_text_is_refused_when_compiled(decoder, kind, text):
    """llguidance reads these, but no output can match them: unchecked, a branch would end at
    once with an empty output and "stop"."""
    constraint = getattr(Constraint, kind)(text)
    with pytest.raises(InvalidArgument, match="matches no text at all") as caught:
        decoder.generate("hi", constraint=constraint, max_new_tokens=4)
    assert caught.value.hint
    decoder.generate("hi", regex="a|[a&&b]", max_new_tokens=4)  # a language with one word is not empty


SELF_REQUIRING = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"], "additionalProperties": False}


@pytest.mark.parametrize("constraint", [
    Constraint.grammar('root ::= "a" root\n'), Constraint.grammar('start: "a" start\n'),
    Constraint.json_schema(SELF_REQUIRING),
], ids=["gbnf", "lark", "schema"])
def test_a_constraint_that_forces_text_without_end_is_refused_when_compiled(decoder, constraint):
    """A rule that always calls itself again at its end forces "aaa..." without end: llguidance's
    parser ran out of items in the first step's forced tokens, and decoding failed with a
    RuntimeError ("token ... was chosen against its grammar"), a traceback on the command line and
    an "unexpected error" per line in a batch. It is refused before decoding, with the engine's
    reason; a recursion that may end runs."""
    with pytest.raises(InvalidArgument, match="cannot be followed.*Too many items") as caught:
        decoder.generate("hi", constraint=constraint, max_new_tokens=4)
    assert "a way to end" in caught.value.hint
    decoder.generate("hi", grammar='root ::= "a" root | "a"\n', max_new_tokens=4)
    optional = {**SELF_REQUIRING, "required": []}
    decoder.generate("hi", json_schema=optional, max_new_tokens=4)


@pytest.mark.parametrize("make, cause, hint", [
    (lambda eos: Constraint.regex("(a{1000}){1000}"), "too large for its lexer", "make it smaller"),
    (lambda eos: Constraint.regex("(x|y)" + re.escape(eos)), "special token's text", "special tokens' text"),
    (lambda eos: Constraint.json_schema({"enum": ["x" + eos, "y" + eos]}), "special token's text", "special tokens"),
], ids=["lexer", "special token regex", "special token enum"])
def test_a_constraint_the_engine_gives_up_on_is_told_why(decoder, make, cause, hint):
    """Every give-up was blamed on a recursion without end ("give the recursion a way to end"),
    also a regex too large for llguidance's lexer and the text of a special token (`<|im_end|>`,
    which the tokenizer reads as the one special token the grammar cannot take)."""
    with pytest.raises(InvalidArgument, match="cannot be followed") as caught:
        decoder.generate("hi", constraint=make(decoder.tokenizer.eos_token), max_new_tokens=6)
    assert cause in caught.value.message and hint in caught.value.hint
    assert "recursion" not in caught.value.hint


@pytest.mark.parametrize("schema", [True, "true"])
def test_a_boolean_schema_true_is_any_value_and_false_none(schema):
    assert json.loads(Constraint.json_schema(schema).text) == {}
    with pytest.raises(InvalidArgument, match="false, which no value satisfies"):
        Constraint.json_schema(False if schema is True else "false")


# ---------------------------------------------------------------------- what a result says it matched
INTEGER = {"type": "integer", "minimum": 1000000}


def test_an_output_cut_short_has_no_parsed_value_even_where_its_text_parses(decoder):
    """A number cut at max_new_tokens may have gone on: "100" parses, and breaks the schema."""
    cut = decoder.generate(PROMPTS[0], json_schema=INTEGER, max_new_tokens=2)
    assert cut.finish_reason == "length" and cut.matched is False and cut.parsed is None
    whole = decoder.generate(PROMPTS[0], json_schema=INTEGER, max_new_tokens=40)
    if whole.finish_reason == "stop":
        assert whole.matched is True and whole.parsed == json.loads(whole.text) >= 1000000
    free = decoder.generate(PROMPTS[0], max_new_tokens=2)
    assert free.matched is None and free.parsed is None


def test_an_output_cut_by_a_stop_string_has_not_matched(decoder):
    def cuts(text: str) -> list[int]:  # where a stop string (the rest of the text) first cuts it to a number
        return [k for k in range(1, len(text)) if text.find(text[k:]) == k and re.fullmatch("-?[0-9]+", text[:k])]

    outputs = [(p, decoder.generate(p, json_schema={"type": "integer"}, max_new_tokens=12)) for p in PROMPTS]
    prompt, whole, at = next((p, w, cuts(w.text)[0]) for p, w in outputs if cuts(w.text))
    cut = decoder.generate(prompt, json_schema={"type": "integer"}, max_new_tokens=12, stop=[whole.text[at:]])
    assert cut.text == whole.text[:at] and cut.finish_reason == "stop"
    assert cut.matched is False and cut.parsed is None  # what is left parses: not the output's value


def test_a_whole_value_whose_eos_was_cut_at_max_new_tokens_has_matched(decoder):
    """The grammar was complete (only the eos could follow), so the value is whole and valid."""
    whole = decoder.generate(PROMPTS[0], json_schema=SCHEMA, max_new_tokens=80)
    assert whole.finish_reason == "stop" and whole.token_ids[-1] == eos_of(decoder)
    short = decoder.generate(PROMPTS[0], json_schema=SCHEMA, max_new_tokens=len(whole.token_ids) - 1)
    assert short.finish_reason == "length" and short.token_ids == whole.token_ids[:-1]
    assert short.matched is True and short.parsed == whole.parsed and jsonschema.validate(short.parsed, SCHEMA) is None


def test_vote_under_a_constraint_votes_on_the_whole_value(decoder):
    from multidecode.strategies.vote import INSTRUCTION, vote_prompt

    voted = decoder.vote("Which color?", n=6, json_schema=SCHEMA, max_new_tokens=120, seed=2)
    for trace in voted.traces:
        expected = json.dumps(trace.parsed, sort_keys=True, ensure_ascii=False) if trace.matched else None
        assert trace.answer == expected
    assert sum(voted.counts.values()) == sum(t.matched for t in voted.traces) >= 1
    assert vote_prompt("Which color?", constrained=True) == "Which color?"
    assert vote_prompt("Which color?").endswith(INSTRUCTION)
    picked = decoder.vote("Which color?", n=6, json_schema=SCHEMA, max_new_tokens=120, seed=2,
                          extract=lambda text: json.loads(text)["color"] if text.endswith("}") else None)
    assert set(picked.counts) <= {"red", "green", "light blue"}


# ---------------------------------------------------------------------- masks and drafts
def test_masks_of_many_rows_equal_each_rows_own(decoder):
    """One vectorised fill equals llguidance's mask row by row; free rows are left alone."""
    vocab = decoder.model.get_input_embeddings().num_embeddings
    states = []
    for name, text in [("schema", '{"name": "ab'), ("regex", "ab"), ("lark", "(1,"), ("object", "")]:
        state = compile_constraint(CONSTRAINTS[name], decoder.tokenizer, vocab_size=vocab, eos_id=2).start()
        for token in decoder.tokenizer(text, add_special_tokens=False)["input_ids"]:
            state.consume(token)
        states += [state, None]
    scores = torch.randn(len(states), vocab)
    masked = mask_logits(scores, states)
    for row, state in enumerate(states):
        if state is None:
            assert torch.equal(masked[row], scores[row])
            continue
        assert torch.equal(masked[row], scores[row].masked_fill(~allowed(state.matcher, vocab), -float("inf")))
    # every row constrained, the logits wider than the grammar's vocabulary: the extra columns forbidden
    held = [s for s in states if s is not None]
    wide = torch.randn(len(held), vocab + 7)
    masked = mask_logits(wide, held)
    assert torch.equal(masked[:, :vocab], mask_logits(wide[:, :vocab], held))
    assert torch.isinf(masked[:, vocab:]).all()


def test_forbidden_draft_nodes_go_with_their_subtrees(decoder):
    tok = decoder.tokenizer
    vocab = decoder.model.get_input_embeddings().num_embeddings
    state = compile_constraint(Constraint.regex("ab(c|d)e"), tok, vocab_size=vocab, eos_id=2).start()
    a, b, c, d, e, x = (tok(ch, add_special_tokens=False)["input_ids"][0] for ch in "abcdex")
    state.consume(a)
    #          0  1  2  3  4  5  6
    tokens = [b, x, c, d, e, e, c]
    parents = [-1, -1, 0, 0, 2, 1, 3]  # node 5 under the forbidden x; node 6 a forbidden c after d
    assert allowed_nodes(state, tokens, parents) == [0, 2, 3, 4]
    # drawn in order under the head: x is forbidden, so b's later siblings go too (none here)
    assert allowed_nodes(state, [x, b], [-1, -1], drawn=[-1]) == []
    assert allowed_nodes(state, [b, x, b], [-1, 0, 0], drawn=[0]) == [0]


def test_forced_tokens_come_first_and_a_guess_of_them_merges():
    draft = DraftTree()
    first = draft.add(7)
    draft.add(8, first)
    draft.add(9)
    merged = branches.with_forced(draft, [7, 8, 5])
    assert merged.tokens == [7, 8, 5, 9] and merged.parents == [-1, 0, 1, -1]
    assert merged.kinds[:3] == [branches.FORCED] * 3
    drawn = DraftTree(dists={-1: torch.ones(10) / 10})
    drawn.add(3)
    assert branches.with_forced(drawn, [7]).tokens == [7]  # draws are never mixed with forced tokens


# ---------------------------------------------------------------------- exactness
@pytest.mark.parametrize("name", list(CONSTRAINTS))
@pytest.mark.parametrize("speculate", [None, "lookup", "auto"])
def test_greedy_equals_the_constrained_loop(decoder, name, speculate):
    constraint = CONSTRAINTS[name]
    prompt = prompt_of(decoder, PROMPTS[0])
    completion = decoder.generate(prompt, constraint=constraint, max_new_tokens=60, speculate=speculate)
    assert completion.token_ids == reference(decoder, prompt, constraint, max_new_tokens=60)
    check_output(constraint, completion.text, completion.finish_reason)


def test_greedy_without_jump_forward_is_the_same_in_more_forwards(decoder):
    prompt = prompt_of(decoder, PROMPTS[1])
    jumping = decoder.generate(prompt, json_schema=SCHEMA, max_new_tokens=80, speculate=None)
    plain = decoder.generate(prompt, constraint=Constraint.json_schema(SCHEMA, jump_forward=False),
                             max_new_tokens=80, speculate=None)
    assert jumping.token_ids == plain.token_ids and jumping.finish_reason == "stop"
    assert jumping.stats["forced"] > 0 and plain.stats["forced"] == 0
    assert jumping.stats["forward_passes"] * 2 < plain.stats["forward_passes"]


def test_ask_with_a_constraint_per_question_equals_each_alone(decoder):
    questions = ["name?", "email?", "list?", "free?"]
    constraints = [CONSTRAINTS["schema"], CONSTRAINTS["regex"], CONSTRAINTS["lark"], None]
    answers = decoder.ask("A document about routers.", questions, constraint=constraints, max_new_tokens=50,
                          speculate="lookup")
    for answer, constraint in zip(answers, constraints):
        if constraint is None:
            assert answer.token_ids == decoder.generate(answer.prompt_ids, max_new_tokens=50, speculate=None).token_ids
            continue
        assert answer.token_ids == reference(decoder, answer.prompt_ids, constraint, max_new_tokens=50)
        check_output(constraint, answer.text, answer.finish_reason)


@pytest.mark.parametrize("speculate", [None, "lookup"])
def test_sampled_completions_equal_the_seeded_constrained_loop(decoder, speculate):
    prompt = prompt_of(decoder, PROMPTS[2])
    completions = decoder.complete(prompt, n=3, json_schema=SCHEMA, max_new_tokens=70, seed=11, temperature=0.8,
                                   speculate=speculate)
    for i, completion in enumerate(completions):
        assert completion.token_ids == reference(decoder, prompt, CONSTRAINTS["schema"], max_new_tokens=70,
                                                 seed=11 + i, temperature=0.8)
        check_output(CONSTRAINTS["schema"], completion.text, completion.finish_reason)
    assert len({tuple(c.token_ids) for c in completions}) > 1


def test_warped_samples_stay_inside_the_grammar(decoder):
    """top-k, top-p and min-p act on the masked scores: every draw is allowed, even where fewer
    tokens are allowed than top-k keeps."""
    prompt = prompt_of(decoder, PROMPTS[1])
    for settings in (dict(top_k=3), dict(top_k=200, top_p=0.9), dict(min_p=0.2, temperature=1.5)):
        for completion in decoder.complete(prompt, n=4, regex=REGEX, max_new_tokens=20, seed=2, **settings):
            assert completion.finish_reason == "length" or re.fullmatch(REGEX, completion.text), completion.text


def test_first_token_frequencies_follow_the_masked_softmax(decoder):
    """Draws of the first token, one branch per seed in one forest, against the model's softmax
    over the tokens the grammar allows (chi-square)."""
    prompt = prompt_of(decoder, PROMPTS[0])
    constraint = Constraint.regex("[a-z]{3}")
    outs = decoder.complete(prompt, n=3000, max_new_tokens=1, seed=5, constraint=constraint)
    vocab = decoder.model.get_input_embeddings().num_embeddings
    counts = np.bincount([c.token_ids[0] for c in outs], minlength=vocab)
    state = compile_constraint(constraint, decoder.tokenizer, vocab_size=vocab, eos_id=2).start()
    with torch.inference_mode():
        logits = decoder.model(torch.tensor([prompt])).logits[0, -1:].float()
    probs = mask_logits(logits, [state]).softmax(-1)[0].double().numpy()
    assert counts[probs == 0].sum() == 0
    assert (probs > 0).sum() > 10
    expected = probs * counts.sum()
    big = expected >= 5  # cells expected below 5 pooled into one
    observed, expected = np.append(counts[big], counts[~big].sum()), np.append(expected[big], expected[~big].sum())
    assert chisquare(observed, expected * observed.sum() / expected.sum()).pvalue > 1e-3


def test_decode_takes_a_constraint_per_branch(decoder):
    prefix = prompt_of(decoder, "Question:")
    tails = [decoder.tokenizer(" one", add_special_tokens=False)["input_ids"], []]
    constraints = [CONSTRAINTS["gbnf"], CONSTRAINTS["regex"]]
    outs = multidecode.decode(decoder.model, prefix, tails, max_new_tokens=30, tokenizer=decoder.tokenizer,
                              constraint=constraints, speculate="lookup")
    for tail, out, constraint in zip(tails, outs, constraints):
        assert out == reference(decoder, prefix + tail, constraint, max_new_tokens=30)


def test_running_out_of_tokens_ends_with_length_and_a_valid_prefix(decoder):
    prompt = prompt_of(decoder, PROMPTS[0])
    completion = decoder.generate(prompt, json_schema=SCHEMA, max_new_tokens=7)
    assert completion.finish_reason == "length" and len(completion.token_ids) == 7
    assert completion.token_ids == reference(decoder, prompt, CONSTRAINTS["schema"], max_new_tokens=7)


# ---------------------------------------------------------------------- drafts the grammar forbids
class Noisy(Proposer):
    """Drafts the reference continuation (so drafts are accepted), with a random sibling under
    every node (mostly tokens the grammar forbids); records every draft it is shown as fed."""

    name = "noisy"

    def __init__(self, references: dict[tuple[int, ...], list[int]], vocab: int) -> None:
        self.references, self.vocab, self.rng = references, vocab, random.Random(3)
        self.fed: list[tuple[list[int], DraftTree]] = []  # (output before the draft, the draft fed)

    def propose(self, context: BranchContext, budget: int) -> DraftTree:
        out = context.tokens[context.prompt_length:]
        reference = self.references[tuple(context.tokens[: context.prompt_length])]
        draft, at = DraftTree(), -1
        for token in reference[len(out): len(out) + 3] if reference[: len(out)] == out else []:
            draft.add(self.rng.randrange(3, self.vocab), at)
            at = draft.add(token, at)
        context.scratch["noisy"] = list(out)
        return draft

    def observe(self, context, draft, accepted, side_logits=None) -> None:
        self.fed.append((context.scratch["noisy"], draft))


def forbidden_fed(decoder, constraint: Constraint, fed) -> int:
    """How many fed draft nodes the grammar forbids after the output they were drafted on."""
    vocab = decoder.model.get_input_embeddings().num_embeddings
    bad = 0
    for out, draft in fed:
        state = compile_constraint(constraint, decoder.tokenizer, vocab_size=vocab, eos_id=eos_of(decoder)).start()
        for token in out:
            state.consume(token)
        bad += len(draft) - len(allowed_nodes(state, draft.tokens, draft.parents))
    return bad


@pytest.mark.parametrize("auto", [False, True])
def test_no_forbidden_draft_is_fed_and_the_output_is_unchanged(decoder, auto):
    """The mutant check: with `branches.pruned` returning the draft whole, this fails."""
    constraint = CONSTRAINTS["schema"]
    prompts = [prompt_of(decoder, p) for p in PROMPTS]
    expected = [reference(decoder, p, constraint, max_new_tokens=60) for p in prompts]
    vocab = decoder.model.get_input_embeddings().num_embeddings
    proposer = Noisy({tuple(p): e for p, e in zip(prompts, expected)}, vocab)
    spec = Speculation(proposer, None if auto else 6)
    run = multidecode.api.start_forest(decoder.model, [], prompts, max_new_tokens=60, tokenizer=decoder.tokenizer,
                                       sampling=[multidecode.SamplingParams()] * 3, constraint=constraint,
                                       speculate=spec, cost=FLAT).finish()
    assert [b.output.token_ids for b in run.branches] == expected
    assert proposer.fed and sum(len(d) for _, d in proposer.fed) > 0
    assert forbidden_fed(decoder, constraint, proposer.fed) == 0
    assert run.stats.accepted > run.stats.forced  # the proposer's own drafts were accepted too


def test_the_forbidden_draft_check_can_fail(decoder, monkeypatch):
    """The same run with pruning switched off feeds forbidden drafts, and the check sees them
    (while the output stays right: verification masks every node)."""
    monkeypatch.setattr(branches, "pruned", lambda draft, grammar: draft)
    constraint = CONSTRAINTS["schema"]
    prompt = prompt_of(decoder, PROMPTS[0])
    expected = reference(decoder, prompt, constraint, max_new_tokens=60)
    proposer = Noisy({tuple(prompt): expected}, decoder.model.get_input_embeddings().num_embeddings)
    run = multidecode.api.start_forest(decoder.model, prompt, [[]], max_new_tokens=60, tokenizer=decoder.tokenizer,
                                       sampling=[multidecode.SamplingParams()], constraint=constraint,
                                       speculate=Speculation(proposer, 6), cost=FLAT).finish()
    assert run.branches[0].output.token_ids == expected
    assert forbidden_fed(decoder, constraint, proposer.fed) > 0


# ---------------------------------------------------------------------- the command line and the batch job
def invoke(*args):
    from click.testing import CliRunner

    from multidecode.cli import main

    return CliRunner().invoke(main, [str(a) for a in args])


def test_cli_generate_and_complete_with_a_json_schema(decoder, model_dir, tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    result = invoke("generate", "--model", model_dir, "-p", PROMPTS[0], "--no-chat", "--json-schema", schema,
                    "--max-new-tokens", 80, "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["finish_reason"] == "stop" and out["parsed"] == json.loads(out["text"])
    jsonschema.validate(out["parsed"], SCHEMA)
    assert out["token_ids"] == reference(decoder, prompt_of(decoder, PROMPTS[0]), CONSTRAINTS["schema"],
                                         max_new_tokens=80)
    result = invoke("complete", "--model", model_dir, "-p", PROMPTS[0], "-n", 2, "--seed", 3, "--regex", REGEX,
                    "--max-new-tokens", 20, "--json")
    assert result.exit_code == 0, result.output
    assert all(c["finish_reason"] == "length" or re.fullmatch(REGEX, c["text"]) for c in json.loads(result.stdout))


@pytest.mark.parametrize("args, needle", [
    (["--regex", "(abc"], "regular expression cannot be compiled"),
    (["--json-schema", "SCHEMA"], "JSON schema cannot be compiled"),
    (["--json-schema", "MISSING"], "does not exist"),
    (["--grammar", "GRAMMAR"], "grammar cannot be read"),
    (["--regex", "a", "--grammar", "GRAMMAR"], "--regex and --grammar were both given"),
    (["--grammar", 'root ::= "yes"'], "write the grammar to a file"),  # its text given for its path
    (["--json-schema", '{"type": "integer"}'], "write the JSON schema to a file"),
])
def test_cli_bad_constraints_exit_2_before_loading(tmp_path, args, needle):
    (tmp_path / "schema.json").write_text('{"type": "nope"}')
    (tmp_path / "grammar.gbnf").write_text("root ::= missing")
    files = {"SCHEMA": tmp_path / "schema.json", "GRAMMAR": tmp_path / "grammar.gbnf", "MISSING": tmp_path / "x"}
    result = invoke("generate", "--model", tmp_path / "no-model", "-p", "hi", *[files.get(a, a) for a in args])
    assert result.exit_code == 2, result.output
    assert needle in result.stderr and "hint:" in result.stderr and "Traceback" not in result.output


def test_batch_records_carry_the_parsed_object_and_a_bad_line_schema_is_its_error(decoder, model_dir, tmp_path):
    from batch_files import by_id, records, write_lines

    line_schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                   "additionalProperties": False}
    rows = [{"id": "a", "document": "The router drops the line.", "questions": ["who?", "when?"]},
            {"id": "b", "document": "The cable was cut.", "questions": ["ok?"], "json_schema": line_schema},
            {"id": "c", "document": "The modem is red.", "questions": ["why?"], "json_schema": {"type": "nope"}},
            {"id": "d", "document": "The modem is red.", "questions": ["why?"], "json_schema": "x"}]
    source, out = write_lines(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    result = invoke("batch", source, "--output", out, "--model", model_dir, "--max-new-tokens", 80,
                    "--json-schema", schema)
    assert result.exit_code == 0, result.output
    got = by_id(records(out))
    for key, used in (("a", SCHEMA), ("b", line_schema)):
        assert got[key]["error"] is None
        for answer in got[key]["answers"]:
            assert answer["finish_reason"] == "stop", answer
            assert answer["parsed"] == json.loads(answer["answer"])
            jsonschema.validate(answer["parsed"], used)
    assert got["c"]["error"]["type"] == "InvalidArgument" and "Invalid type" in got["c"]["error"]["message"]
    assert got["d"]["error"]["type"] == "InvalidInput" and '"json_schema" must be a JSON object' in got["d"]["error"]["message"]
    expected = decoder.ask(rows[1]["document"], rows[1]["questions"], max_new_tokens=80, json_schema=line_schema)
    assert got["b"]["answers"][0]["answer"] == expected[0].text


def test_a_line_whose_schema_the_engine_cannot_read_fails_alone(model_dir, tmp_path):
    """A line's schema too deep, with NaN, or with a lone surrogate is that line's error; the
    lines around it are answered. A line may ask for best effort ("json_schema_strict": false)."""
    from batch_files import by_id, records, write_lines

    fine = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
            "additionalProperties": False}
    weird = {"type": "object", "properties": {"when": {"type": "string", "format": "weird", "maxLength": 5}},
             "required": ["when"], "additionalProperties": False}
    line = {"document": "The cable was cut.", "questions": ["ok?"]}
    rows = [{"id": "deep", **line, "json_schema": nested(70)},
            {"id": "fine", **line, "json_schema": fine},
            {"id": "nan", **line, "json_schema": {"type": "number", "maximum": float("nan")}},  # written as NaN
            {"id": "surrogate", **line, "json_schema": {"const": "\ud800"}},
            {"id": "weird", **line, "json_schema": weird},
            {"id": "best effort", **line, "json_schema": weird, "json_schema_strict": False},
            {"id": "strict alone", **line, "json_schema_strict": False},
            {"id": "strict text", **line, "json_schema": fine, "json_schema_strict": "no"},
            {"id": "true", **line, "json_schema": True},  # any JSON value, as in Python (it was refused)
            {"id": "false", **line, "json_schema": False}]
    source, out = write_lines(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    result = invoke("batch", source, "--output", out, "--model", model_dir, "--max-new-tokens", 40)
    assert result.exit_code == 0, result.output
    got = by_id(records(out))
    assert len(got) == len(rows)
    failed = {key: got[key]["error"] for key in got if got[key]["error"] is not None}
    assert sorted(failed) == ["deep", "false", "nan", "strict alone", "strict text", "surrogate", "weird"]
    assert "the JSON schema is false" in failed["false"]["message"]
    assert failed["deep"]["type"] == "InvalidArgument" and "recursion limit" in failed["deep"]["message"]
    assert "NaN or Infinity" in failed["nan"]["message"] and "lone surrogate" in failed["surrogate"]["message"]
    assert "Unknown format" in failed["weird"]["message"] and '"json_schema_strict": false' in failed["weird"]["hint"]
    assert '"json_schema_strict" but no "json_schema"' in failed["strict alone"]["message"]
    assert '"json_schema_strict" must be true or false' in failed["strict text"]["message"]
    for key, schema in (("fine", fine), ("best effort", weird)):
        answer, = got[key]["answers"]
        assert answer["finish_reason"] == "stop", answer
        jsonschema.validate(answer["parsed"], schema)


def test_cli_notes_outputs_cut_before_their_grammar_was_complete(model_dir, tmp_path):
    schema, document = tmp_path / "schema.json", tmp_path / "document.txt"
    schema.write_text(json.dumps(SCHEMA))
    document.write_text(PROMPTS[1])
    for command in (["complete", "-p", PROMPTS[0], "-n", 2, "--seed", 1], ["ask", "-d", document, "-q", "a?", "-q", "b?"],
                    ["vote", "-q", "Which?", "-n", 2, "--seed", 1]):
        for budget, noted in ((3, True), (200, False)):
            result = invoke(*command, "--model", model_dir, "--json-schema", schema, "--max-new-tokens", budget)
            assert result.exit_code == 0, result.output
            said = "2 of 2 outputs reached --max-new-tokens before their grammar was complete" in result.stderr
            assert said == noted, (command, budget, result.stderr)
