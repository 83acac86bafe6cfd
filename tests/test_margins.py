"""Writing in the margins: chunking, exactness of every margin, relevance, the answer, the CLI,
the benchmark harness, and one check on the embedded model.

Text-level checks use the offline tiny model folder (a random tiny Llama with a byte-level BPE
tokenizer and a chat template), so every margin can be compared with `generate` from that chunk's
own whole prompt.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from click.testing import CliRunner
from local_models import tiny_tokenizer
from tiny_models import reference_generate

import multidecode
from multidecode.cli import main
from multidecode.errors import InvalidArgument, InvalidInput
from multidecode.prompts import render_prompt, tokenize_prompt
from multidecode.strategies import margins as wim

DOCUMENT = (
    "The quick brown fox jumps over the lazy dog. The dog is old and sleeps in the barn.\n\n"
    "Here is a document about support calls, routers, cables and tickets. The router is old. "
    "The cable is red and the ticket is open.\n\n"
    "Question: what is the answer? Answer in one short sentence. The fox and the dog are friends.\n\n"
    "A last line about routers."
)
QUESTION = "What colour is the cable?"


@pytest.fixture(scope="module")
def model_dir(model_dir_of):
    """The shared tiny model folder with a long context (512 positions), for whole documents and
    their margins."""
    return model_dir_of(512)


@pytest.fixture(scope="module")
def decoder(model_dir):
    return multidecode.load(str(model_dir))


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def alone(decoder, prompt_ids, max_new_tokens):
    return reference_generate(decoder.model, list(prompt_ids), max_new_tokens=max_new_tokens)


# ---------------------------------------------------------------------- chunking
def check_partition(document, chunks):
    """Spans in order, no overlap, each the chunk's text, only whitespace between and around them."""
    assert [c.index for c in chunks] == list(range(len(chunks)))
    at = 0
    for c in chunks:
        assert c.start >= at and c.end > c.start
        assert document[at:c.start].strip() == ""
        assert document[c.start:c.end] == c.text == c.text.strip()
        at = c.end
    assert document[at:].strip() == ""


@pytest.mark.parametrize("limit", [8, 20, 40, 1000])
def test_chunk_spans_cover_the_document_in_order(tokenizer, limit):
    chunks = wim.split_document(tokenizer, DOCUMENT, limit)
    check_partition(DOCUMENT, chunks)
    assert all(c.tokens <= limit for c in chunks)
    if limit == 1000:
        assert len(chunks) == 1 and chunks[0].text == DOCUMENT.strip()


def test_chunks_end_at_the_strongest_boundary(tokenizer):
    """Paragraphs that fit are never cut; a long paragraph is cut between sentences."""
    paragraphs = ["The router is old. " * 3, "The cable is red. " * 3, "The ticket is open. " * 3]
    document = "\n\n".join(p.strip() for p in paragraphs)
    size = max(len(tokenizer(p.strip(), add_special_tokens=False)["input_ids"]) for p in paragraphs)
    chunks = wim.split_document(tokenizer, document, size)
    assert [c.text for c in chunks] == [p.strip() for p in paragraphs]
    sentences = wim.split_document(tokenizer, paragraphs[0].strip(), math.ceil(size / 2))
    assert len(sentences) >= 2 and all(c.text.endswith(".") for c in sentences)
    check_partition(paragraphs[0].strip(), sentences)


def test_a_word_longer_than_a_chunk_is_cut(tokenizer):
    document = "short words here " + "x" * 300 + " and more"
    chunks = wim.split_document(tokenizer, document, 10)
    check_partition(document, chunks)
    assert max(c.tokens for c in chunks) <= 10 + 1


def test_a_list_of_chunks_is_used_as_given(tokenizer):
    document, chunks = wim.chunks_from_list(tokenizer, ["  first part ", "second\npart", "third"])
    assert document == "first part\n\nsecond\npart\n\nthird"
    assert [c.text for c in chunks] == ["first part", "second\npart", "third"]
    check_partition(document, chunks)


# ---------------------------------------------------------------------- exactness
@pytest.fixture(scope="module")
def result(decoder):
    calls = []

    def classify(question, notes):
        calls.append((question, list(notes)))
        return [1.0 if i % 2 == 0 else -1.0 for i in range(len(notes))]

    out = decoder.margins(DOCUMENT, QUESTION, chunk_tokens=30, max_margin_tokens=10, max_new_tokens=8,
                      classify=classify)
    return out, calls


def test_every_margin_equals_generation_from_its_own_prompt(decoder, result):
    out, _ = result
    assert len(out.margins) >= 3
    check_partition(out.document, [wim.Chunk(m.chunk_index, *m.span, m.chunk_text, 0) for m in out.margins])
    tok = decoder.tokenizer
    for m in out.margins:
        whole = render_prompt(tok, wim.MARGIN_TEMPLATE.format(chunk=m.chunk_text, question=QUESTION))
        assert m.prompt_ids == tokenize_prompt(tok, whole) == tok(whole, add_special_tokens=False)["input_ids"]
        assert m.token_ids == alone(decoder, m.prompt_ids, 10)
        assert m.text == tok.decode(m.token_ids, skip_special_tokens=True).strip()
    assert out.answer_token_ids == alone(decoder, out.answer_prompt_ids, 8)


def test_the_classifier_is_replaceable_and_feeds_the_answer(decoder, result):
    out, calls = result
    assert len(calls) == 1 and calls[0][0] == QUESTION
    asked = [m for m in out.margins if not wim.says_nothing(m.text)]
    assert calls[0][1] == [m.text for m in asked]
    assert [m.relevant for m in asked] == [i % 2 == 0 for i in range(len(asked))]
    assert [m.relevance_score for m in asked] == [1.0 if i % 2 == 0 else -1.0 for i in range(len(asked))]
    expected = wim.answer_prompt(decoder.tokenizer, QUESTION, [m.text for m in out.relevant])
    assert out.answer_prompt_ids == expected
    # the common start, the chunks (one pass, or one each), then one pass per further token
    assert out.stats["margins"]["forward_passes"] <= 1 + len(out.margins) + 9
    assert out.stats["relevance"] == {}  # a plain callable runs no model


def test_an_answer_over_too_many_relevant_notes_keeps_the_most_relevant_that_fit(model_dir_of):
    """Every margin's prompt fit, but the answer's, over every relevant note, did not: the whole
    call raised PromptTooLong after the margins were written, with a hint to split the document.
    The answer is now written from the most relevant notes that fit, and says which were left out."""
    decoder = multidecode.load(str(model_dir_of(256)))
    document = "\n\n".join(f"Part {i}. The quick brown fox jumps over the lazy dog near the routers and cables."
                             for i in range(12))

    def scores(question, notes):  # all relevant, the later chunks more so
        return [1.0 + i for i in range(len(notes))]

    out = decoder.margins(document, "Who called?", chunk_tokens=60, max_margin_tokens=40, max_new_tokens=8,
                          classify=scores)
    relevant, held = out.relevant, [m for m in out.margins if m.in_answer]
    assert out.left_out and held and len(held) + len(out.left_out) == len(relevant)
    assert min(m.relevance_score for m in held) > max(m.relevance_score for m in out.left_out)
    assert out.answer_prompt_ids == wim.answer_prompt(decoder.tokenizer, "Who called?", [m.text for m in held])
    assert len(out.answer_prompt_ids) + 8 - 1 <= 256 and out.stats["answer"]["notes"] == len(held)
    assert out.answer_token_ids == alone(decoder, out.answer_prompt_ids, 8)
    wider = [m for m in out.left_out if m.relevance_score == min(m.relevance_score for m in out.left_out)]
    assert len(wim.answer_prompt(decoder.tokenizer, "Who called?", [m.text for m in held + wider])) + 7 > 256

def test_chunks_do_not_see_each_other(decoder):
    chunks = ["The router is old and the light is red.", "The cable is red.", "The ticket is open."]
    changed = chunks[:2] + ["Something else entirely, about foxes and dogs."]
    keep_all = lambda question, notes: [True] * len(notes)
    a = decoder.margins(chunks, QUESTION, max_margin_tokens=8, max_new_tokens=2, classify=keep_all)
    b = decoder.margins(changed, QUESTION, max_margin_tokens=8, max_new_tokens=2, classify=keep_all)
    assert [m.token_ids for m in a.margins[:2]] == [m.token_ids for m in b.margins[:2]]
    assert a.margins[2].prompt_ids != b.margins[2].prompt_ids
    assert a.margins[2].token_ids == alone(decoder, a.margins[2].prompt_ids, 8)
    assert b.margins[2].token_ids == alone(decoder, b.margins[2].prompt_ids, 8)


def test_streaming_stages_give_the_same_result(decoder):
    run = wim.start(decoder.scheduler(), decoder.tokenizer, DOCUMENT, QUESTION, chunk_tokens=30, max_margin_tokens=6,
                    max_new_tokens=4, classify=lambda q, notes: [0.5] * len(notes))
    ids = [[] for _ in run.chunks]
    for event in run.events:
        ids[event.branch].append(event.token_id)
    verdicts = run.judge()
    answer = [e.token_id for e in run.answer_events()]
    out = run.result()
    assert [m.token_ids for m in out.margins] == ids
    assert [(m.relevant, m.relevance_score) for m in out.margins] == verdicts
    assert out.answer_token_ids == answer
    assert out == run.result()


# ---------------------------------------------------------------------- relevance
def test_the_default_classifier_reads_yes_and_no_logits(decoder):
    """Scores from one forest pass equal log P(yes) - log P(no) from each prompt run alone."""
    classifier = wim.YesNoClassifier(decoder)
    notes = ["The cable is red.", "Nothing about cables here, only foxes.", "The router is old."]
    scores = classifier(QUESTION, notes)
    assert classifier.last_stats["forward_passes"] == 2  # the common start, then every note at once
    for prompt, score in zip(classifier.prompts(QUESTION, notes), scores):
        with torch.inference_mode():
            logits = decoder.model(torch.tensor([prompt], device=decoder.model.device)).logits[0, -1].float().cpu()
        expected = torch.logsumexp(logits[classifier.yes_ids], 0) - torch.logsumexp(logits[classifier.no_ids], 0)
        assert score == pytest.approx(float(expected), abs=1e-4)
    assert classifier(QUESTION, []) == []


def test_yes_and_no_token_ids(decoder):
    tok = decoder.tokenizer
    classifier = wim.YesNoClassifier(decoder)
    assert classifier.yes_ids and classifier.no_ids and not set(classifier.yes_ids) & set(classifier.no_ids)
    assert tok("yes", add_special_tokens=False)["input_ids"][0] in classifier.yes_ids
    assert tok("No", add_special_tokens=False)["input_ids"][0] in classifier.no_ids


def test_notes_that_say_nothing_are_not_relevant():
    for note in ["Nothing relevant.", "", "  ", "None.", "N/A", "Not relevant.", "The part says nothing relevant."]:
        assert wim.says_nothing(note), note
    for note in ["The cable is red.", "None of the pumps started.", "Nothingness is a word."]:
        assert not wim.says_nothing(note), note


def test_threshold_and_bools(decoder):
    chunks = ["The router is old.", "The cable is red.", "The ticket is open."]
    out = decoder.margins(chunks, QUESTION, max_margin_tokens=3, max_new_tokens=1, threshold=0.5,
                      classify=lambda q, notes: [0.4, 0.6, True][: len(notes)])
    asked = [m for m in out.margins if m.relevance_score is not None]
    assert [m.relevant for m in asked] == [s > 0.5 for s in [0.4, 0.6, 1.0][: len(asked)]]


# ---------------------------------------------------------------------- bad input
@pytest.mark.parametrize("document, question, settings, error, needle", [
    ("", QUESTION, {}, InvalidInput, "document is empty"),
    ("  \n\n ", QUESTION, {}, InvalidInput, "document is empty"),
    (DOCUMENT, "", {}, InvalidInput, "question is empty"),
    (DOCUMENT, "   ", {}, InvalidInput, "question is empty"),
    ([], QUESTION, {}, InvalidInput, "no chunks"),
    (["one", "  "], QUESTION, {}, InvalidInput, "chunk 2 is empty"),
    (["one", 2], QUESTION, {}, InvalidInput, "chunk 2 is not text"),
    (42, QUESTION, {}, InvalidInput, "text or a list"),
    (DOCUMENT, QUESTION, {"chunk_tokens": 0}, InvalidArgument, "chunk_tokens"),
    (DOCUMENT, QUESTION, {"max_margin_tokens": 0}, InvalidArgument, "max_margin_tokens"),
    (DOCUMENT, QUESTION, {"max_new_tokens": -1}, InvalidArgument, "max_new_tokens"),
    (DOCUMENT, QUESTION, {"temperature": [0.5, 0.7]}, InvalidInput, "one value"),
    (DOCUMENT, QUESTION, {"classify": lambda q, notes: []}, InvalidArgument, "scores for"),
    (DOCUMENT, QUESTION, {"threshold": float("nan")}, InvalidArgument, "threshold must be a number"),  # all dropped
    (DOCUMENT, QUESTION, {"threshold": "0.5"}, InvalidArgument, "threshold must be a number"),
])
def test_bad_input_names_the_problem(decoder, document, question, settings, error, needle):
    with pytest.raises(error) as info:
        decoder.margins(document, question, **{"chunk_tokens": 30, "max_margin_tokens": 2, **settings})
    assert needle in str(info.value)


def test_a_seed_too_large_for_the_answer_is_refused_before_any_margin_is_written(decoder):
    """Margin i is seeded seed + i and the answer seed + n: a seed whose answer passed 2**64 - 1 was
    refused only once the margins had been written and judged, naming a seed nobody passed."""
    judged = []
    with pytest.raises(InvalidArgument, match=r"seed 18446744073709551614 gives the last of 3 branches"):
        decoder.margins(["One line.", "Another line."], QUESTION, seed=2**64 - 2, max_margin_tokens=2,
                        max_new_tokens=2, classify=lambda question, notes: judged.append(notes) or [1.0] * len(notes))
    assert not judged
    result = decoder.margins(["One line.", "Another line."], QUESTION, seed=2**64 - 3, max_margin_tokens=2,
                             max_new_tokens=2, classify=lambda question, notes: [1.0] * len(notes))
    assert len(result.margins) == 2 and result.answer_finish_reason in ("length", "stop")


def test_settings_the_window_cannot_hold_are_refused_before_any_margin_naming_the_one_to_lower(decoder, model_dir):
    """A margin past the window was refused as "max_new_tokens is 8000" (the margins' own setting,
    under the answer's name), a chunk past it with the advice to use margins, and an answer that no
    notes could fit only after every margin was written."""
    judged = []
    classify = lambda question, notes: judged.append(notes) or [1.0] * len(notes)
    with pytest.raises(multidecode.PromptTooLong) as caught:
        decoder.margins(DOCUMENT, QUESTION, chunk_tokens=30, max_margin_tokens=600, max_new_tokens=2, classify=classify)
    assert "max_margin_tokens is 600" in caught.value.message and "lower max_margin_tokens to" in caught.value.hint
    with pytest.raises(multidecode.PromptTooLong) as caught:
        decoder.margins(["A short chunk.", "The router is old. " * 150], QUESTION, max_margin_tokens=2,
                        max_new_tokens=2, classify=classify)
    assert "chunk 2's margin prompt" in caught.value.message and "lower chunk_tokens" in caught.value.hint and "multidecode margins" not in caught.value.hint
    with pytest.raises(multidecode.PromptTooLong) as caught:  # the question alone: no chunk size could help
        decoder.margins(["A short chunk."], "Why? " * 600, max_margin_tokens=2, max_new_tokens=2, classify=classify)
    assert "without its chunk" in caught.value.message and caught.value.hint == "shorten the question"
    with pytest.raises(multidecode.PromptTooLong) as caught:
        decoder.margins(DOCUMENT, QUESTION, chunk_tokens=30, max_margin_tokens=2, max_new_tokens=510, classify=classify)
    assert "the answer's prompt takes at least" in caught.value.message and "lower max_new_tokens" in caught.value.hint
    assert not judged
    result = invoke("--model", model_dir, "-d", "-", "-q", QUESTION, "--max-margin-tokens", 600,
                    stdin=DOCUMENT)
    assert result.exit_code == 2 and "--max-margin-tokens is 600" in result.stderr, result.stderr
    assert "lower --max-margin-tokens to" in result.stderr  # the hint in the command's words too


@pytest.mark.parametrize("settings, said", [
    (dict(margin_template="no placeholders"), "has no {chunk}, so the model would never see it"),
    (dict(margin_template="{chunk} {foo}"), "names {foo}, which it is not given"),
    (dict(margin_template='JSON {"a": 1} {chunk}'), 'names {"a"}'),
    (dict(margin_template="{chunk} }"), "is not a format string"),
    (dict(margin_template=None), "must be a string, got NoneType"),
    (dict(answer_template="{notes} {bogus}"), "answer_template names {bogus}"),
    (dict(answer_template="{question} only"), "has no {notes}"),
])
def test_templates_that_cannot_carry_their_text_are_refused(decoder, settings, said):
    """A margin template without {chunk} ran, writing every margin without the document; a stray
    field or a JSON brace was a KeyError from str.format, None an AttributeError."""
    with pytest.raises(InvalidArgument) as caught:
        decoder.margins(DOCUMENT, QUESTION, max_margin_tokens=2, max_new_tokens=2, **settings)
    assert said in caught.value.message and caught.value.hint
    assert decoder.margins(DOCUMENT, QUESTION, chunk_tokens=200, max_margin_tokens=2, max_new_tokens=2,
                           margin_template="{chunk}", answer_template="{notes}").answer is not None


def test_a_relevance_template_without_its_note_is_refused(decoder):
    from multidecode.strategies.margins import YesNoClassifier

    with pytest.raises(InvalidArgument, match="has no {note}"):
        YesNoClassifier(decoder, template="Is it relevant to {question}?")


# ---------------------------------------------------------------------- the command
def invoke(*args, stdin=None):
    return CliRunner().invoke(main, ["margins", *map(str, args)], input=stdin)


def test_cli_json(model_dir, tmp_path, decoder):
    path = tmp_path / "doc.txt"
    path.write_text(DOCUMENT)
    result = invoke("--model", model_dir, "-d", path, "-q", QUESTION, "--chunk-tokens", 30,
                    "--max-margin-tokens", 5, "--max-new-tokens", 4, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    expected = decoder.margins(DOCUMENT, QUESTION, chunk_tokens=30, max_margin_tokens=5, max_new_tokens=4)
    assert [m["token_ids"] for m in data["margins"]] == [m.token_ids for m in expected.margins]
    assert [tuple(m["span"]) for m in data["margins"]] == [m.span for m in expected.margins]
    assert [m["relevant"] for m in data["margins"]] == [m.relevant for m in expected.margins]
    assert data["answer_token_ids"] == expected.answer_token_ids
    assert data["question"] == QUESTION


def test_cli_human_output_and_stdin(model_dir):
    result = invoke("--model", model_dir, "-d", "-", "-q", QUESTION, "--chunk-tokens", 30,
                    "--max-margin-tokens", 3, "--max-new-tokens", 2, stdin=DOCUMENT)
    assert result.exit_code == 0, result.output
    assert "Relevance" in result.stdout and "Answer" in result.stdout
    assert result.stdout.count("chunk, characters") >= 3
    assert "margins" in result.stderr and "forward passes" in result.stderr
    chunks = [line for line in result.stdout.splitlines() if "chunk, characters" in line]
    assert any(line.endswith("cut at --max-margin-tokens") for line in chunks), chunks  # the notes' own limit
    assert not any("--max-new-tokens" in line for line in chunks)


def test_cli_counts_one_margin_in_the_singular(model_dir):
    result = invoke("--model", model_dir, "-d", "-", "-q", QUESTION, "--max-margin-tokens", 2, "--max-new-tokens", 2,
                    stdin="A short note.")
    assert result.exit_code == 0, result.output
    assert "1 margin (" in result.stderr and "1 margins" not in result.stderr, result.stderr


@pytest.mark.parametrize("args, needle", [
    (["-q", ""], "no question"),
    ([], "no question"),
    (["-q", QUESTION, "--chunk-tokens", 0], "--chunk-tokens"),
])
def test_cli_errors(model_dir, tmp_path, args, needle):
    path = tmp_path / "doc.txt"
    path.write_text(DOCUMENT)
    result = invoke("--model", model_dir, "-d", path, *args)
    assert result.exit_code == 2, result.output
    assert "error:" in result.stderr and needle in result.stderr and "Traceback" not in result.output


def test_cli_empty_document(model_dir):
    result = invoke("--model", model_dir, "-d", "-", "-q", QUESTION, stdin="  \n")
    assert result.exit_code == 2 and "document is empty" in result.stderr


# ---------------------------------------------------------------------- the benchmark harness
def test_benchmark_structure_and_plot(decoder, tmp_path):
    from multidecode.bench.margins import METHODS, run_margins_benchmark
    from multidecode.bench.results import plot as plot_margins

    messages = []
    result = run_margins_benchmark(decoder, document=DOCUMENT, question=QUESTION, chunks=3, chunk_tokens=30,
                                   max_new_tokens=4, repeats=2, budget_s=2.0, progress=messages.append)
    assert result["benchmark"] == "margins" and result["answers_identical"]
    assert set(result["methods"]) == set(METHODS)
    d = result["methods"]["multidecode"]
    assert d["forward_passes"] <= 1 + 3 + 3  # the common start, the chunks, one pass per further token
    assert result["methods"]["hf_sequential"]["forward_passes"] > d["forward_passes"]
    assert {r["name"][:3] for r in result["targets"]} == {"(d)"}
    expected = decoder.margins(DOCUMENT, QUESTION, chunk_tokens=30, max_margin_tokens=4, max_new_tokens=1,
                           classify=lambda q, notes: [0] * len(notes))
    assert [m["token_ids"] for m in result["margins"]] == [m.token_ids for m in expected.margins[:3]]
    json.dumps(result)
    path = plot_margins(result, tmp_path / "margins.png")
    assert path.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(InvalidArgument, match="chunks"):
        run_margins_benchmark(decoder, document=DOCUMENT, question=QUESTION, chunks=50, chunk_tokens=30, warmup=False)


# ---------------------------------------------------------------------- the embedded model
@pytest.mark.embedded
@pytest.mark.xdist_group("embedded")
def test_embedded_margins_equal_sequential_generation():
    from multidecode.bench.margins import meeting_minutes

    decoder = multidecode.load()
    document = meeting_minutes()
    document = document[: document.index("Helen Marsh: Thank you, Victor.")]  # ~700 tokens
    out = decoder.margins(document, "How many bacteriological samples were taken?", chunk_tokens=250,
                      max_margin_tokens=12, max_new_tokens=12)
    assert len(out.margins) >= 3
    for m in out.margins:
        assert m.token_ids == alone(decoder, m.prompt_ids, 12)
    assert out.answer_token_ids == alone(decoder, out.answer_prompt_ids, 12)
    assert out.stats["relevance"].get("forward_passes", 0) <= 2


@pytest.mark.parametrize("threshold", ["1000", "-1000"])
def test_an_answer_written_from_no_note_says_so(model_dir, threshold):
    """With no note judged relevant the answer is written from none (the document unseen), and only
    "(0 relevant)" said so: a note on stderr, and the JSON's count of the notes it was written from."""
    args = ["--model", model_dir, "-d", "-", "-q", QUESTION, "--chunk-tokens", 30, "--max-margin-tokens", 3,
            "--max-new-tokens", 2, "--threshold", threshold]
    human, data = invoke(*args, stdin=DOCUMENT), invoke(*args, "--json", stdin=DOCUMENT)
    assert human.exit_code == data.exit_code == 0, human.output
    used = json.loads(data.stdout)["notes_in_answer"]
    assert used == sum(m["in_answer"] for m in json.loads(data.stdout)["margins"])
    assert (used == 0) == (threshold == "1000")
    assert ("the answer was written from none" in human.stderr) == (used == 0), human.stderr
