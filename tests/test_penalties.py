"""Presence, frequency and repetition penalties and logit bias: per branch, exact in a forest.

The oracle is `penalty_reference.reference`, a plain sequential loop that applies the definitions
by hand and takes the arg-max. A forest of branches
with different settings, with and without speculation (prompt lookup, and a drafter that knows
the answer so that whole drafts are accepted under the penalties), gives its tokens exactly.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from click.testing import CliRunner
from penalty_reference import reference
from speculation_cases import outputs, run
from tiny_models import NO_EOS, VOCAB, tiny_model

import multidecode
from multidecode.api import decode
from multidecode.batch import run_batch
from multidecode.cli import main
from multidecode.errors import InvalidArgument, InvalidInput
from multidecode.proposers import BranchContext, DraftTree, Proposer
from multidecode.sampling import BranchSampler, choose_tokens, process_logits
from multidecode.sampling_params import SamplingParams, per_branch_sampling
from multidecode.speculation import Speculation

PREFIX = [17, 33, 95, 4, 250, 61, 78, 140, 17, 33]
BRANCHES = [[], [5, 6], [200], [17, 33, 95]]
STEPS = 16
SETTINGS = [  # one per branch: each penalty alone, all of them together, and a bias
    SamplingParams(presence_penalty=1.5),
    SamplingParams(frequency_penalty=0.7, logit_bias={7: 2.5, 9: -1.0}),
    SamplingParams(repetition_penalty=1.3, presence_penalty=-0.4, frequency_penalty=1.1),
    SamplingParams(logit_bias={100: 3.0}, frequency_penalty=2.0),
]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def expected(model):
    return [reference(model, PREFIX + b, p, STEPS) for b, p in zip(BRANCHES, SETTINGS)]


class Oracle(Proposer):
    """Drafts the known continuation of each branch with a wrong sibling at every level."""

    name = "oracle"

    def __init__(self, continuations: dict[tuple[int, ...], list[int]]) -> None:
        self.continuations = continuations

    def propose(self, context: BranchContext, budget: int) -> DraftTree:
        future = self.continuations[tuple(context.tokens[: context.prompt_length])]
        draft, parent = DraftTree(), -1
        for token in future[len(context.tokens) - context.prompt_length:]:
            if len(draft) + 2 > budget:
                break
            draft.add(3 + (token + 1) % (VOCAB - 3), parent)  # a wrong guess first
            parent = draft.add(token, parent)
        return draft


# ---------------------------------------------------------------------- exactness
def test_penalties_change_greedy_output(model, expected):
    """The cases mean something: every setting moves its branch off plain greedy decoding."""
    plain = [reference(model, PREFIX + b, SamplingParams(), STEPS) for b in BRANCHES]
    assert all(e != p for e, p in zip(expected, plain))


@pytest.mark.parametrize("mode", ["none", "lookup", "oracle"])
def test_greedy_forest_with_penalties_equals_the_sequential_loop(model, expected, mode):
    conts = {tuple(PREFIX + b): e for b, e in zip(BRANCHES, expected)}
    speculate = {"none": None, "lookup": "lookup", "oracle": Speculation(Oracle(conts), budget=6)}[mode]
    forest = run(model, PREFIX, BRANCHES, speculate=speculate, max_new_tokens=STEPS, eos=[NO_EOS], sampling=SETTINGS)
    assert outputs(forest) == expected
    if mode == "oracle":
        assert forest.stats.accepted >= STEPS  # whole drafts went through under the penalties


def test_a_branch_does_not_depend_on_its_neighbours(model, expected):
    for i, (branch, params) in enumerate(zip(BRANCHES, SETTINGS)):
        alone = run(model, PREFIX, [branch], speculate="lookup", max_new_tokens=STEPS, eos=[NO_EOS], sampling=[params])
        assert outputs(alone) == [expected[i]]


def test_seeded_sampling_with_penalties_is_the_same_with_and_without_speculation(model):
    sampling = [SamplingParams(do_sample=True, temperature=0.8, top_k=30, seed=40 + i, presence_penalty=0.8,
                               frequency_penalty=0.5, logit_bias={11: 1.5}) for i in range(len(BRANCHES))]
    plain = outputs(run(model, PREFIX, BRANCHES, speculate=None, max_new_tokens=STEPS, eos=[NO_EOS], sampling=sampling))
    conts = {tuple(PREFIX + b): o for b, o in zip(BRANCHES, plain)}
    for speculate in ("lookup", Speculation(Oracle(conts), budget=6)):
        assert outputs(run(model, PREFIX, BRANCHES, speculate=speculate, max_new_tokens=STEPS, eos=[NO_EOS],
                           sampling=sampling)) == plain
    (alone,) = outputs(run(model, PREFIX, BRANCHES[2:3], speculate=None, max_new_tokens=STEPS, eos=[NO_EOS],
                           sampling=sampling[2:3]))
    assert alone == plain[2]


def test_a_large_bias_forces_or_bans_a_token(model):
    forced = decode(model, PREFIX, [[], [5]], max_new_tokens=6, logit_bias={42: 100})
    assert forced == [[42] * 6, [42] * 6]
    free = decode(model, PREFIX, [[]], max_new_tokens=6)[0]
    banned = decode(model, PREFIX, [[]], max_new_tokens=6, logit_bias={free[0]: -100})[0]
    assert banned[0] != free[0]
    forced_when_sampled = decode(model, PREFIX, [[]], max_new_tokens=6, do_sample=True, seed=3, logit_bias={42: 100})
    assert forced_when_sampled == [[42] * 6]


def test_decode_takes_settings_per_branch(model, expected):
    """decode's keywords: a list gives each branch its own setting (None: none)."""
    got = decode(model, PREFIX, BRANCHES[:2], max_new_tokens=STEPS, eos_token_id=NO_EOS,
                 presence_penalty=[1.5, None], frequency_penalty=[None, 0.7], logit_bias=[None, {7: 2.5, 9: -1.0}])
    assert got == expected[:2]


def test_complete_and_ask_keywords(model, expected):
    decoder = multidecode.MultiDecoder(model, None)
    (done,) = decoder.complete(PREFIX + BRANCHES[2], n=1, max_new_tokens=STEPS, do_sample=False, eos_token_id=NO_EOS,
                               repetition_penalty=1.3, presence_penalty=-0.4, frequency_penalty=1.1)
    assert done.token_ids == expected[2]
    both = decoder.complete(PREFIX + BRANCHES[0], n=2, max_new_tokens=STEPS, do_sample=False, eos_token_id=NO_EOS,
                            presence_penalty=[1.5, None])
    assert both[0].token_ids == expected[0]
    assert both[1].token_ids == reference(model, PREFIX, SamplingParams(), STEPS)


# ---------------------------------------------------------------------- the processors
def test_processors_follow_the_definitions_in_order():
    """Repetition penalty (prompt and output), then presence and frequency (output only), then bias."""
    logits = torch.randn(2, 20, generator=torch.Generator().manual_seed(0)) * 3
    params = [SamplingParams(repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.25, logit_bias={3: 4.0}),
              SamplingParams(do_sample=True, seed=1)]
    samplers = [BranchSampler(p, context=[1, 2]) for p in params]
    for token in (2, 2, 5):
        samplers[0].observe(token)
    ours = process_logits(logits.clone(), samplers)
    row = logits[0].clone()
    for t in (1, 2, 5):
        row[t] = row[t] * 1.5 if row[t] < 0 else row[t] / 1.5
    row[2] -= 0.5 + 0.25 * 2
    row[5] -= 0.5 + 0.25 * 1
    row[3] += 4.0
    torch.testing.assert_close(ours[0], row, rtol=0, atol=1e-6)
    torch.testing.assert_close(ours[1], logits[1], rtol=0, atol=0)  # a row without them is untouched


def test_prompt_tokens_do_not_count_for_presence():
    logits = torch.zeros(1, 10)
    logits[0, 4] = 1.0
    sampler = BranchSampler(SamplingParams(presence_penalty=2.0), context=[4, 4, 4])
    assert choose_tokens(logits, [sampler]) == [4]  # in the prompt only: no penalty
    assert choose_tokens(logits, [sampler]) != [4]  # generated once: penalized by 2


def test_per_branch_sampling_spreads_the_new_settings():
    params = per_branch_sampling(3, dict(presence_penalty=[0.5, None, -1], frequency_penalty=0.2,
                                         logit_bias=[{1: 2}, None, {2: -3}]))
    assert [p.presence_penalty for p in params] == [0.5, None, -1]
    assert [p.frequency_penalty for p in params] == [0.2] * 3
    assert [p.logit_bias for p in params] == [((1, 2.0),), None, ((2, -3.0),)]
    assert not any(p.do_sample for p in params)  # penalties alone never turn sampling on
    assert all(p.logit_bias == ((4, 1.0),) for p in per_branch_sampling(2, dict(logit_bias={4: 1})))
    hash(params[0])  # params stay hashable with a bias


@pytest.mark.parametrize("kwargs", [
    dict(presence_penalty=2.5), dict(frequency_penalty=-2.01), dict(presence_penalty=math.nan),
    dict(frequency_penalty="1"), dict(logit_bias={5: 101}), dict(logit_bias={5: math.inf}), dict(logit_bias={-1: 1}),
    dict(logit_bias={"5": 1}), dict(logit_bias={5: True}), dict(logit_bias=[1, 2]), dict(logit_bias=5),
])
def test_bad_values_are_refused(kwargs):
    with pytest.raises(InvalidArgument):
        SamplingParams(**kwargs)


def test_a_bias_outside_the_vocabulary_is_refused(model):
    with pytest.raises(InvalidArgument, match="vocabulary"):
        decode(model, PREFIX, [[]], max_new_tokens=2, logit_bias={VOCAB: 1.0})
    with pytest.raises(InvalidInput):
        per_branch_sampling(2, dict(logit_bias=[{1: 1}]))


# ---------------------------------------------------------------------- the CLI
def test_cli_options_reach_every_branch(model_dir):
    """--presence-penalty, --frequency-penalty and --logit-bias on the text model: the same
    tokens as the library with the same settings; a forced token fills the completion."""
    decoder = multidecode.load(str(model_dir), device="cpu")
    token = decoder.tokenizer(" cable", add_special_tokens=False)["input_ids"][-1]
    base = ["--model", str(model_dir), "-p", "Tell me about cables.", "--max-new-tokens", "8"]
    flags = ["--presence-penalty", "1.5", "--frequency-penalty", "0.5", "--logit-bias", f"{token}=3",
             "--logit-bias", "5=-100"]
    result = CliRunner().invoke(main, ["generate", *base, *flags, "--speculate", "lookup", "--json"])
    assert result.exit_code == 0, result.output
    row = json.loads(result.stdout.strip().splitlines()[-1])
    expected = decoder.generate("Tell me about cables.", max_new_tokens=8, speculate=None, presence_penalty=1.5,
                                frequency_penalty=0.5, logit_bias={token: 3, 5: -100})
    assert row["token_ids"] == expected.token_ids
    assert expected.token_ids != decoder.generate("Tell me about cables.", max_new_tokens=8, speculate=None).token_ids
    forced = CliRunner().invoke(main, ["complete", *base, "--n", "2", "--greedy", "--logit-bias", f"{token}=100",
                                       "--json"])
    assert forced.exit_code == 0, forced.output
    assert [r["token_ids"] for r in json.loads(forced.stdout)] == [[token] * 8] * 2
    echoed = CliRunner().invoke(main, ["generate", *base, "--echo", "--json"])
    assert json.loads(echoed.stdout.strip().splitlines()[-1])["text"].startswith("Tell me about cables.")


@pytest.mark.parametrize("extra, message", [
    (["--presence-penalty", "3"], "--presence-penalty must be in [-2, 2]"),
    (["--frequency-penalty", "-2.5"], "--frequency-penalty must be in [-2, 2]"),
    (["--logit-bias", "5"], "is not TOKEN=BIAS"),
    (["--logit-bias", "x=1"], "is not TOKEN=BIAS"),
    (["--logit-bias", "5=101"], "[-100, 100]"),
])
def test_cli_bad_values_exit_2_before_loading(model_dir, extra, message):
    for command in (["generate", "-p", "hi"], ["ask", "--document", "-", "-q", "Why?"], ["complete", "-p", "hi"]):
        result = CliRunner().invoke(main, [*command, "--model", str(model_dir), *extra], input="A document.")
        assert result.exit_code == 2, (command, result.output)
        assert message in result.output and "Traceback" not in result.output


def test_cli_a_bias_outside_the_vocabulary_exits_2(model_dir):
    result = CliRunner().invoke(main, ["generate", "--model", str(model_dir), "-p", "hi", "--logit-bias", "99999=1"])
    assert result.exit_code == 2 and "vocabulary" in result.output, result.output


# ---------------------------------------------------------------------- batch lines
def test_a_batch_line_carries_its_own_sampling_over_the_jobs(model_dir, tmp_path):
    decoder = multidecode.load(str(model_dir), device="cpu")
    token = decoder.tokenizer(" cable", add_special_tokens=False)["input_ids"][-1]
    doc = "The router drops the line every evening."
    rows = [{"id": "job", "document": doc, "questions": ["why?", "when?"]},
            {"id": "forced", "document": doc, "questions": ["why?"], "sampling": {"logit_bias": {str(token): 100}}},
            {"id": "each", "document": doc, "questions": ["why?", "when?"],
             "sampling": {"presence_penalty": [None, 2.0], "logit_bias": [None, {"5": -100}]}},
            {"id": "bad", "document": doc, "questions": ["why?"], "sampling": {"presence_penalty": 3}},
            {"id": "bad key", "document": doc, "questions": ["why?"], "sampling": {"logit_bias": {"x": 1}}},
            {"id": "not an object", "document": doc, "questions": ["why?"], "sampling": [1]}]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    out = tmp_path / "out.jsonl"
    run_batch(decoder, source, out, max_new_tokens=6, frequency_penalty=0.5)
    got = {r["id"]: r for r in map(json.loads, out.read_text(encoding="utf-8").splitlines())}

    def answers(key):
        return [a["answer"] for a in got[key]["answers"]]

    assert answers("job") == [a.text for a in decoder.ask(doc, ["why?", "when?"], max_new_tokens=6,
                                                            frequency_penalty=0.5)]
    assert answers("forced") == [decoder.tokenizer.decode([token] * 6)]
    each = decoder.ask(doc, ["why?", "when?"], max_new_tokens=6, frequency_penalty=0.5,
                       presence_penalty=[None, 2.0], logit_bias=[None, {5: -100}])
    assert answers("each") == [a.text for a in each]
    for key, words in [("bad", "presence_penalty must be in [-2, 2]"), ("bad key", "token ids"),
                       ("not an object", '"sampling" must be an object')]:
        assert got[key]["answers"] == [] and words in got[key]["error"]["message"], got[key]
