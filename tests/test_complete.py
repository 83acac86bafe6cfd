"""Parallel completions and self-consistency: reproducible seeds, honest sampling, the vote.

Text-level tests use the offline tiny model folder (a random model with a real tokenizer);
distribution tests use a tiny random Llama on token ids, whose next-token distribution is spread
out enough for a chi-square test to have power.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from scipy.stats import chisquare
from tiny_models import tiny_model
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import multidecode
from multidecode.cli import main
from multidecode.errors import InvalidArgument
from multidecode.strategies.vote import extract_answer, normalize, tally

PROMPT = [5, 17, 42, 99, 7, 3, 150, 23]


@pytest.fixture(scope="module")
def text_decoder(model_dir):
    return multidecode.load(str(model_dir), device="cpu")


@pytest.fixture(scope="module")
def id_decoder():
    """A tiny Llama over token ids (no tokenizer needed for id prompts)."""
    return multidecode.MultiDecoder(tiny_model("llama"), None)


def first_token_probs(model, warpers) -> torch.Tensor:
    with torch.inference_mode():
        logits = model(torch.tensor([PROMPT])).logits[0, -1:].float()
    for warp in warpers:
        logits = warp(None, logits)
    return logits.softmax(-1)[0]


# ---------------------------------------------------------------------- reproducibility
def test_each_completion_equals_the_single_run_with_its_seed(text_decoder):
    together = text_decoder.complete("Tell me about cables.", n=4, max_new_tokens=10, temperature=0.9, seed=100)
    assert [c.seed for c in together] == [100, 101, 102, 103]
    assert len({tuple(c.token_ids) for c in together}) > 1  # they really differ
    for c in together:
        (alone,) = text_decoder.complete("Tell me about cables.", n=1, max_new_tokens=10, temperature=0.9, seed=c.seed)
        assert alone.token_ids == c.token_ids and alone.text == c.text


def test_without_a_seed_the_reported_seeds_still_reproduce(id_decoder):
    first = id_decoder.complete(PROMPT, n=3, max_new_tokens=6)
    assert all(c.seed is not None for c in first)
    for c in first:
        (again,) = id_decoder.complete(PROMPT, n=1, max_new_tokens=6, seed=c.seed)
        assert again.token_ids == c.token_ids


def test_settings_per_branch(id_decoder):
    """Lists give each branch its own settings, and each branch equals its own single run."""
    settings = dict(temperature=[0.5, 1.0, 1.5], top_k=[None, 5, 50], top_p=[0.9, None, 1.0], min_p=[None, 0.05, None])
    together = id_decoder.complete(PROMPT, n=3, max_new_tokens=8, seed=[11, 22, 33], **settings)
    for i, c in enumerate(together):
        single = {k: v[i] for k, v in settings.items() if v[i] is not None}
        (alone,) = id_decoder.complete(PROMPT, n=1, max_new_tokens=8, seed=[11, 22, 33][i], **single)
        assert alone.token_ids == c.token_ids


def test_greedy_completions_equal_generate(id_decoder):
    model = id_decoder.model
    with torch.inference_mode():
        ref = model.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=12, eos_token_id=None)
    outs = id_decoder.complete(PROMPT, n=3, max_new_tokens=12, do_sample=False)
    for c in outs:
        assert c.token_ids == ref[0, len(PROMPT):].tolist()[: len(c.token_ids)]
        assert c.seed is None


def test_repetition_penalty_equals_transformers_end_to_end(id_decoder):
    """Greedy with a repetition penalty (prompt tokens included) matches generate's."""
    model = id_decoder.model
    with torch.inference_mode():
        ref = model.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=16, repetition_penalty=1.8)
    (ours,) = id_decoder.complete(PROMPT, n=1, max_new_tokens=16, do_sample=False, repetition_penalty=1.8)
    assert ours.token_ids == ref[0, len(PROMPT):].tolist()[: len(ours.token_ids)]
    (plain,) = id_decoder.complete(PROMPT, n=1, max_new_tokens=16, do_sample=False)
    assert plain.token_ids != ours.token_ids  # the penalty matters here, so the test can fail


# ---------------------------------------------------------------------- the distribution
DRAWS = 4000


def draw_first_tokens(decoder, **settings) -> np.ndarray:
    """DRAWS one-token completions of PROMPT, all branches of one forest, seeded."""
    outs = decoder.complete(PROMPT, n=DRAWS, max_new_tokens=1, seed=2024, **settings)
    return np.bincount([c.token_ids[0] for c in outs], minlength=decoder.model.config.vocab_size)


def chi_square_p(counts: np.ndarray, probs: torch.Tensor) -> float:
    """Chi-square p-value of counts against probs, pooling cells expected below 5."""
    expected = probs.double().numpy() * counts.sum()
    assert counts[expected == 0].sum() == 0, "drew a token the warpers remove"
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


@pytest.mark.parametrize(
    "settings, warpers",
    [
        ({"temperature": 1.0}, []),
        ({"temperature": 0.7, "top_k": 20}, [TemperatureLogitsWarper(0.7), TopKLogitsWarper(20)]),
        ({"temperature": 1.3, "top_p": 0.8}, [TemperatureLogitsWarper(1.3), TopPLogitsWarper(0.8)]),
    ],
    ids=["plain", "temperature+top_k", "temperature+top_p"],
)
def test_first_token_frequencies_match_the_models_softmax(id_decoder, settings, warpers):
    counts = draw_first_tokens(id_decoder, **settings)
    assert chi_square_p(counts, first_token_probs(id_decoder.model, warpers)) > 1e-3


def test_the_chi_square_test_can_fail(id_decoder):
    """Draws at temperature 0.7 are rejected against the temperature-1 distribution."""
    counts = draw_first_tokens(id_decoder, temperature=0.7)
    assert chi_square_p(counts, first_token_probs(id_decoder.model, [])) < 1e-6


def test_min_p_draws_stay_in_transformers_allowed_set(id_decoder):
    allowed = first_token_probs(id_decoder.model, [MinPLogitsWarper(0.3)]) > 0
    counts = draw_first_tokens(id_decoder, min_p=0.3)
    assert counts[~allowed.numpy()].sum() == 0
    assert (counts[allowed.numpy()] > 0).mean() > 0.8  # and it samples across that set


# ---------------------------------------------------------------------- the vote
@pytest.mark.parametrize(
    "trace, answer",
    [
        ("First 3 + 4 = 7.\nAnswer: 7", "7"),
        ("so the total is 1,250.00 dollars", "1250"),
        ("Paris is the capital.\nAnswer: **Paris**.", "paris"),
        ("The answer is: $42", "42"),
        ("I think it is blue", "i think it is blue"),
        ("", None),
        ("So, the final answer is: Answer: 51.", "51"),  # the last "answer:" on the line introduces it
        ("Answer: 51 apples", "51"),  # one number with its unit: the number
        ("Answer: $1,200 a month", "1200"),
        ("Answer: x = 5", "x = 5"),  # words before the number: kept as text
        ("Answer: 3 apples and 4 pears", "3 apples and 4 pears"),
        ("Answer:\n51", "51"),
        ("Answer: 2,3", "2,3"),  # a list, not the number 23
        ("Answer: 1,5", "1,5"),
        ("the total is 1,234,567.", "1234567"),
        ("Answer: 12,3456", "12,3456"),  # no group of three: not one number
        ("Answer: -1,000.5", "-1000.5"),
        ("Answer: .5", "0.5"),  # a decimal from its point: not 5
        ("so it is -.25", "-0.25"),
        # the typographic minus sign kept (it voted for 51); a range's en dash is no sign
        ("Answer: \u221251", "-51"), ("The result is \u221212.", "-12"), ("pages 10\u201320", "20"),
        ("Answer: 51 (since 17*3=51)", "51"), ("Answer: 3 * 17 = 51", "51"),  # a remark, the working: not the answer
        ("Answer: f(x)", "f(x)"), ("Answer: y = 2x", "y = 2x"),
        ("Answer: $\\boxed{51}$", "51"), ("\\boxed{51}", "51"), ("Answer: \\boxed{Paris}", "paris"),
        ("Answer: -0", "0"), ("Answer: 007", "7"), ("Answer: 1,200.0", "1200"),  # one spelling per value
        ("Answer: The answer is Paris", "paris"), ("Answer: $x = 5$", "x = 5"),
        ("Let me think.\nAnswer:", None),  # a bare mark at the end: no answer, not the word "answer"
    ],
)
def test_the_default_extractor(trace, answer):
    assert extract_answer(trace) == answer


def test_normalize_makes_equal_answers_equal():
    assert normalize("3.50") == normalize("3.5") == "3.5"
    assert normalize(".5") == normalize("0.50") == normalize("**0.5**.") == "0.5"
    assert normalize(" Yes. ") == normalize("yes") == "yes"


def test_tally_counts_and_breaks_ties_by_first_appearance():
    done = [multidecode.Completion(i, text, [], "stop", i, []) for i, text in
            enumerate(["Answer: 5", "Answer: 7", "Answer: 7", "no idea", "Answer: 5"])]
    result = tally("q", done)
    assert result.counts == {"5": 2, "7": 2, "no idea": 1}
    assert result.answer == "5" and result.agreement == pytest.approx(0.4)
    assert result.tied == ["5", "7"]  # no majority, and the result says so


def test_a_majority_is_not_a_tie():
    done = [multidecode.Completion(i, text, [], "stop", i, []) for i, text in
            enumerate(["Answer: 5", "Answer: 7", "So the answer is: Answer: 7"])]
    result = tally("q", done)
    assert result.answer == "7" and result.tied == [] and result.is_majority


def test_the_most_common_answer_of_a_minority_is_not_called_a_majority(monkeypatch):
    """The command called 1 of 4 traces a "Majority answer: 50 (25% of traces)" (the others found none;
    here 2 of 5 say 50, the rest one answer each)."""
    from multidecode.cli import decoding

    done = [multidecode.Completion(i, text, [], "stop", i, []) for i, text in
            enumerate(["Answer: 50", "Answer: 7", "Answer: 50", "Answer: 8", "Answer: 9"])]
    result = tally("q", done)
    assert result.answer == "50" and not result.is_majority
    lines = []
    monkeypatch.setattr(decoding.stdout, "print", lambda *a, **k: lines.append(str(a[0]) if a else ""))
    decoding.show_vote(result, 5)
    assert "Most common answer (no majority): [bold]50[/bold] (2 of 5 traces, 40%)" in lines


def test_a_trace_cut_at_max_new_tokens_votes_only_with_its_answer_line():
    """Its last number is any it was working with ("17 * 3" restated gives 3): only an
    'Answer:' line it reached counts; a finished trace keeps the fallbacks."""
    texts = ["To find 17 * 3 we multiply", "Answer: 51 and then", "To find 17 * 3 we multiply"]
    done = [multidecode.Completion(i, text, [], reason, i, []) for i, (text, reason) in
            enumerate(zip(texts, ["length", "length", "stop"]))]
    result = tally("What is 17 * 3?", done)
    assert [t.answer for t in result.traces] == [None, "51", "3"]
    assert result.counts == {"51": 1, "3": 1}
    assert extract_answer("17 * 3 is\nAnswer:\n51", marked_only=True) == "51"  # its answer on the next line
    assert extract_answer("To find 17 * 3\nAnswer:", marked_only=True) is None  # cut right after the mark


def test_a_decimal_written_from_its_point_votes_with_its_equals():
    """".5" was read as 5, so three traces that said one half outvoted by one that said 5."""
    texts = ["So half of 1 is 0.5\nAnswer: 0.5", "Answer: .5", "Answer: .5", "Answer: 5"]
    result = tally("What is 1/2 as a decimal?", [multidecode.Completion(i, text, [], "stop", i, [])
                                                  for i, text in enumerate(texts)])
    assert (result.answer, result.counts) == ("0.5", {"0.5": 3, "5": 1})


def test_vote_runs_n_traces_with_a_replaceable_extractor(text_decoder):
    result = text_decoder.vote("What is two plus two?", n=5, max_new_tokens=6, seed=3,
                               extract=lambda text: "even" if len(text) % 2 == 0 else "odd")
    assert len(result.traces) == 5 and sum(result.counts.values()) == 5
    assert result.answer in ("even", "odd")
    assert [t.seed for t in result.traces] == [3, 4, 5, 6, 7]


def test_an_extractor_that_is_no_function_or_returns_no_vote_is_refused(text_decoder):
    """An `extract` that cannot be called is refused before any trace is decoded; one that returns
    what cannot be counted (a dict) is refused naming what it returned, not a TypeError inside Counter."""
    with pytest.raises(InvalidArgument, match="extract must be a function"):
        text_decoder.vote("What is two plus two?", n=2, max_new_tokens=2, extract=5)
    done = [multidecode.Completion(i, text, [], "stop", i, []) for i, text in enumerate(['{"a": 1}', '{"a": 1}'])]
    with pytest.raises(InvalidArgument, match="extract returned a dict"):
        tally("q", done, extract=json.loads)
    assert tally("q", done, extract=lambda text: json.loads(text)["a"]).counts == {1: 2}


def test_logprobs_are_the_models_own_and_do_not_depend_on_what_shares_the_forward(id_decoder):
    """generate(logprobs=k): each token's log-probability is log_softmax of the logits transformers'
    `generate` computes for it (through the same kernels), the k likeliest are those logits' top
    k; completion i of n (seeded) carries the numbers it carries alone, and speculation changes none."""
    from multidecode.exact import exact_kernels

    model, prompt = id_decoder.model, [1, 40, 41, 42, 43, 40, 41]
    done = id_decoder.generate(prompt, max_new_tokens=8, eos_token_id=[], speculate=None, logprobs=3)
    with exact_kernels(model), torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
    assert done.token_ids == out.sequences[0, len(prompt):].tolist()
    rows = torch.log_softmax(torch.cat(out.logits).float(), dim=-1)  # [steps, vocab]
    assert done.logprobs == rows.gather(1, torch.tensor(done.token_ids)[:, None])[:, 0].tolist()
    assert [[i for i, _ in top] for top in done.top_logprobs] == rows.topk(3).indices.tolist()
    assert done.logprob == pytest.approx(sum(done.logprobs))
    assert id_decoder.generate(prompt, max_new_tokens=8, eos_token_id=[], speculate="lookup", logprobs=3) == done
    assert id_decoder.generate(prompt, max_new_tokens=8, eos_token_id=[]).logprobs is None
    many = id_decoder.complete(prompt, n=3, max_new_tokens=6, seed=5, eos_token_id=[], logprobs=2)
    for c in many:
        alone = id_decoder.complete(prompt, n=1, max_new_tokens=6, seed=5 + c.index, eos_token_id=[], logprobs=2)[0]
        assert (c.token_ids, c.logprobs, c.top_logprobs) == (alone.token_ids, alone.logprobs, alone.top_logprobs)


# ---------------------------------------------------------------------- the CLI
def test_cli_complete_json_and_seeds(model_dir):
    args = ["complete", "--model", str(model_dir), "-p", "Tell me about cables.", "--n", "3",
            "--max-new-tokens", "5", "--seed", "9", "--json"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert [r["seed"] for r in rows] == [9, 10, 11]
    assert len({r["prompt_tokens"] for r in rows}) == 1 and rows[0]["prompt_tokens"] > 0
    single = CliRunner().invoke(main, args[:5] + ["--n", "1", "--max-new-tokens", "5", "--seed", "10", "--json"])
    assert json.loads(single.stdout)[0]["token_ids"] == rows[1]["token_ids"]


def test_cli_complete_streams_text(model_dir):
    result = CliRunner().invoke(main, ["complete", "--model", str(model_dir), "-p", "Hi", "--n", "2",
                                       "--max-new-tokens", "3", "--seed", "1"])
    assert result.exit_code == 0, result.output
    assert "completion 1 (seed 1)" in result.stdout and "completion 2 (seed 2)" in result.stdout


def test_cli_complete_needs_exactly_one_prompt(model_dir, tmp_path):
    result = CliRunner().invoke(main, ["complete", "--model", str(model_dir)])
    assert result.exit_code == 2 and "--prompt" in result.stderr
    prompt = tmp_path / "p.txt"
    prompt.write_text("hello")
    both = CliRunner().invoke(main, ["complete", "--model", str(model_dir), "-p", "x", "--prompt-file", str(prompt)])
    assert both.exit_code == 2


def test_cli_vote_json(model_dir):
    result = CliRunner().invoke(main, ["vote", "--model", str(model_dir), "-q", "What is 2 + 2?", "--n", "3",
                                       "--max-new-tokens", "4", "--seed", "5", "--json"])
    assert result.exit_code == 0, result.output
    row = json.loads(result.stdout)
    assert len(row["traces"]) == 3 and sum(row["counts"].values()) <= 3
    assert all(isinstance(t["token_ids"], list) for t in row["traces"]) and isinstance(row["tied"], list)


def test_cli_temperature_zero_is_greedy(model_dir):
    """--temperature 0 means greedy, as on the server and in the library."""
    base = ["--model", str(model_dir), "-p", "Tell me about cables.", "--max-new-tokens", "5", "--json"]
    greedy = CliRunner().invoke(main, ["complete", *base, "--n", "2", "--greedy"])
    zero = CliRunner().invoke(main, ["complete", *base, "--n", "2", "--temperature", "0"])
    assert zero.exit_code == 0, zero.output
    assert [r["token_ids"] for r in json.loads(zero.stdout)] == [r["token_ids"] for r in json.loads(greedy.stdout)]
    assert [r["seed"] for r in json.loads(zero.stdout)] == [None, None]
    both = CliRunner().invoke(main, ["complete", *base, "--n", "2", "--greedy", "--temperature", "0"])
    assert both.exit_code == 0 and both.stdout == greedy.stdout, both.output
    plain = CliRunner().invoke(main, ["generate", *base])
    generated = CliRunner().invoke(main, ["generate", *base, "--temperature", "0", "--top-k", "3"])
    assert generated.exit_code == 0, generated.output
    assert json.loads(generated.stdout)["token_ids"] == json.loads(plain.stdout)["token_ids"]


@pytest.mark.parametrize("prompt", [123, None, ["hi"], [1.5, 2.0], [[1, 2]], b"hi"])
def test_a_prompt_that_is_neither_text_nor_token_ids_is_refused(text_decoder, prompt):
    with pytest.raises(multidecode.InvalidInput, match="a prompt that is not text must be a sequence of token ids"):
        text_decoder.generate(prompt, max_new_tokens=2)


@pytest.mark.parametrize("call", ["generate", "complete", "vote"])
def test_max_new_tokens_of_the_wrong_type_is_refused(text_decoder, call):
    with pytest.raises(multidecode.InvalidArgument, match="max_new_tokens must be a positive integer"):
        getattr(text_decoder, call)("hi", max_new_tokens="4")


def test_a_tensor_of_ids_is_a_prompt(text_decoder):
    import numpy as np
    import torch

    ids = [5, 6, 7]
    expected = text_decoder.generate(ids, max_new_tokens=3)
    assert text_decoder.generate(torch.tensor(ids), max_new_tokens=3) == expected
    assert text_decoder.generate(np.array(ids), max_new_tokens=3) == expected


def test_cli_complete_logprobs_need_json(model_dir):
    result = CliRunner().invoke(main, ["complete", "--model", str(model_dir), "-p", "Hi", "--logprobs"])
    assert result.exit_code == 2 and "--logprobs adds to the JSON output" in result.stderr


def test_cli_generate_says_the_seed_it_drew(model_dir):
    """A sampled `generate` without --json never showed the seed it drew, so its text could not be
    had again; --seed with that seed gives it."""
    import re

    base = ["generate", "--model", str(model_dir), "-p", "Tell me about cables.", "--max-new-tokens", "6"]
    drawn = CliRunner().invoke(main, [*base, "--temperature", "0.9"])
    assert drawn.exit_code == 0, drawn.output
    (seed,) = re.findall(r", seed (\d+)", drawn.stderr)
    again = CliRunner().invoke(main, [*base, "--temperature", "0.9", "--seed", seed])
    assert again.stdout == drawn.stdout
    greedy = CliRunner().invoke(main, base)
    assert "seed" not in greedy.stderr


def test_cli_vote_at_temperature_zero_says_every_trace_is_the_same(model_dir):
    """`vote --temperature 0 --n 2` gave identical traces and "100% agreement" without a word."""
    base = ["vote", "--model", str(model_dir), "-q", "What is 2 + 3?", "--max-new-tokens", "4", "--json"]
    greedy = CliRunner().invoke(main, [*base, "--n", "2", "--temperature", "0"])
    assert greedy.exit_code == 0 and "every trace will be the same" in greedy.stderr, greedy.output
    assert len({t["text"] for t in json.loads(greedy.stdout)["traces"]}) == 1
    sampled = CliRunner().invoke(main, [*base, "--n", "2"])
    assert sampled.exit_code == 0 and "every trace" not in sampled.stderr


def test_a_question_too_long_to_vote_on_names_the_question(text_decoder):
    """Its hint was the document's ("shorten the document (or prompt), or split it into chunks: margins")."""
    from multidecode.models.vetting import max_positions

    limit = max_positions(text_decoder.model.config)
    with pytest.raises(multidecode.PromptTooLong) as caught:
        text_decoder.vote("Why? " * limit, n=2, max_new_tokens=4)
    assert caught.value.hint.startswith("shorten the question") and "margins" not in caught.value.hint
    with pytest.raises(multidecode.PromptTooLong) as caught:
        text_decoder.vote("Why?", n=2, max_new_tokens=limit)
    assert caught.value.hint.startswith(f"lower max_new_tokens to {caught.value.fits}, or shorten the question")


def test_one_trace_is_said_in_the_singular_and_a_greedy_trace_without_a_seed(model_dir):
    """`vote -n 1` said "1 traces", and --show-traces of greedy traces "(seed None)"."""
    from click.testing import CliRunner

    from multidecode.cli import main

    result = CliRunner().invoke(main, ["vote", "--model", str(model_dir), "-q", "What is 2 + 2?", "-n", "1",
                                       "--max-new-tokens", "4", "--temperature", "0", "--show-traces"])
    assert result.exit_code == 0, result.output
    assert "1 trace\n" in result.stdout and "1 traces" not in result.stdout and "seed None" not in result.stdout
