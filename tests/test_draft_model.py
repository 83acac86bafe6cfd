"""Draft-model speculation is exact: a draft identical to the target has every draft token
accepted, a random draft changes nothing, greedy output equals transformers' `generate` on every
architecture, and sampled output follows the target's softmax under the speculative-sampling rule
(a rule that trusts the draft fails the same check). The draft's own cache is rolled back with
the target's: after a run, each branch's draft path holds exactly its tokens."""

from __future__ import annotations

import copy

import pytest
import torch
from byte_tokenizer import ByteTokenizer
from eos_cases import pick_eos, truncate
from hash_lm import HashLM, LetterTokenizer
from speculation_cases import (
    BRANCHES,
    HASH_BRANCHES,
    HASH_PREFIX,
    NO_EOS,
    PREFIX,
    SAMPLE_PREFIX,
    STEPS,
    cut_at_stop,
    frequencies_pass,
    hash_expected,
    outputs,
    run,
    sampled_run,
    tiny_references,
    tiny_softmax,
    trusting_rule,
)
from tiny_models import combos, tiny_model

import multidecode
from multidecode.errors import InvalidArgument
from multidecode.proposers.draft import DraftModel
from multidecode.scheduler import CompactionPolicy
from multidecode.speculation import Speculation

OTHER = {"llama": "qwen2", "qwen2": "llama", "qwen2-hybrid": "gpt2", "mistral": "gpt_neox", "gemma3": "llama",
         "gpt2": "phi3", "phi3": "gpt2", "gpt_neox": "mistral"}
"""A draft for each target: another random tiny model with the same vocabulary."""


@pytest.mark.parametrize("arch, attn", combos())
def test_a_random_draft_model_is_exact_with_eos_and_compaction(arch, attn):
    """Greedy with a random (unrelated) draft equals generate, also with eos inside the run and
    finished branches compacted out at every step."""
    model = tiny_model(arch, attn)
    full = tiny_references(arch, attn)
    spec = Speculation(DraftModel(tiny_model(OTHER[arch], "sdpa"), confidence=0.0), budget=6)
    assert outputs(run(model, PREFIX, BRANCHES, speculate=spec, max_new_tokens=STEPS, eos=[NO_EOS])) == full
    eos = set(pick_eos(full, STEPS))
    forest = run(model, PREFIX, BRANCHES, speculate=spec, max_new_tokens=STEPS, eos=eos,
                 compaction=CompactionPolicy(every=1))
    assert outputs(forest) == truncate(full, eos)


@pytest.mark.parametrize("arch", ["llama", "qwen2-hybrid", "gemma3", "gpt2", "gpt_neox"])
def test_a_draft_identical_to_the_target_has_every_draft_token_accepted(arch):
    model = tiny_model(arch, "sdpa")
    spec = Speculation(DraftModel(tiny_model(arch, "eager"), confidence=0.0), budget=6)
    forest = run(model, PREFIX, BRANCHES, speculate=spec, max_new_tokens=STEPS, eos=[NO_EOS])
    assert outputs(forest) == tiny_references(arch, "sdpa")
    stats = forest.stats
    assert stats.drafted > 0 and stats.accepted == stats.drafted
    assert stats.forward_passes == -(-STEPS // 7)  # six drafts and one token of its own per step


def test_the_draft_cache_is_rolled_back_with_the_target():
    """Partly right drafts (a perturbed copy of the target): after every step each live branch's
    draft path holds exactly its tokens so far, and rejected draft nodes are gone."""
    model = tiny_model("llama", "sdpa")
    draft = _perturbed(model, 0.3)
    proposer = DraftModel(draft, width=2, sure=0.9, confidence=0.0)
    forest = multidecode.api.start_forest(
        model, PREFIX, BRANCHES, max_new_tokens=STEPS, eos_token_id=[NO_EOS],
        sampling=[multidecode.sampling_params.SamplingParams()] * len(BRANCHES), speculate=Speculation(proposer, budget=6))
    checked = 0
    for _ in forest.events:
        for b in forest.branches:
            key = b.context.scratch.get("draft")
            if key is None or b.output.finished:
                continue
            state = proposer._branches[key]
            engine_tokens = [proposer.engine.forest.tokens[n] for n in state.path]
            assert engine_tokens == b.context.tokens[: len(state.path)]
            checked += 1
    assert checked > 0
    assert outputs(forest) == tiny_references("llama", "sdpa")
    assert forest.stats.accepted > 0 and proposer.engine.stats.rolled_back > 0


def test_a_draft_with_another_vocabulary_is_refused():
    model = tiny_model("llama", "sdpa")
    small = copy.deepcopy(tiny_model("gpt2", "sdpa"))
    small.resize_token_embeddings(128)
    with pytest.raises(InvalidArgument, match="vocabulary"):
        run(model, PREFIX, BRANCHES, speculate=DraftModel(small), max_new_tokens=4)


# ---------------------------------------------------------------------- sampling
def _perturbed(model, scale: float):
    """A copy of `model` whose output layer is perturbed: a draft that is right often, not always."""
    other = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        head = other.get_output_embeddings().weight
        head += scale * head.std() * torch.randn(head.shape, generator=generator)
    return other


def _two_tokens(draws: int, first: int, spec) -> tuple[list[int], list[int], object]:
    """`draws` seeded 2-token samples drafted by `spec`: the first tokens, the second token of every
    sample whose first token was `first`, and the run's stats."""
    run_ = sampled_run(draws, 2, lambda _model: spec)
    out = outputs(run_)
    return [o[0] for o in out], [o[1] for o in out if o[0] == first], run_.stats


@pytest.mark.slow
@pytest.mark.xdist_group("sampling")
def test_sampled_draft_speculation_follows_the_softmax_and_a_trusting_rule_fails(monkeypatch):
    """3000 seeded two-token samples, each branch drafting three candidates drawn from a perturbed
    draft's q with its prompt: the first tokens follow softmax(logits / T) after the prompt; the
    second tokens after the likeliest first one follow the softmax after it. Control: a rule that
    takes the first candidate where p gives it 5% fails."""
    first_probs = tiny_softmax(SAMPLE_PREFIX)
    first = int(first_probs.argmax())
    second_probs = tiny_softmax(SAMPLE_PREFIX + [first])
    draft = _perturbed(tiny_model("llama", "sdpa"), 1.0)

    def spec():
        return Speculation(DraftModel(draft, width=3, sure=1.1, confidence=0.0), budget=3, against_q=True)

    firsts, seconds, stats = _two_tokens(3000, first, spec())
    assert stats.accepted > 300  # the rule against q was exercised, accepting and rejecting
    assert stats.accepted < stats.drafted / 2
    assert frequencies_pass(firsts, first_probs)
    assert len(seconds) > 200 and frequencies_pass(seconds, second_probs)

    monkeypatch.setattr("multidecode.verify.speculative_sample", trusting_rule)
    firsts, _, _ = _two_tokens(3000, first, spec())
    assert not frequencies_pass(firsts, first_probs)


def test_stop_strings_and_eos_inside_accepted_drafts_on_the_hash_model():
    """A draft identical to the target (the model-free hash LM): its drafts are accepted, so stop
    strings and eos land inside accepted drafts; the text is cut where sequential decoding cuts."""
    tokenizer = LetterTokenizer()
    full = hash_expected(HASH_PREFIX, HASH_BRANCHES, 40)
    stop = tokenizer.decode(full[0][6:8])
    forest = run(HashLM(), HASH_PREFIX, HASH_BRANCHES, speculate=Speculation(DraftModel(HashLM(), confidence=0.0),
                 budget=6), max_new_tokens=40, tokenizer=tokenizer, stop=[stop])
    assert [b.output.text for b in forest.branches] == cut_at_stop([tokenizer.decode(out) for out in full], stop)
    for b, out in zip(forest.branches, full):
        assert b.output.token_ids == out[: len(b.output.token_ids)]
    assert forest.branches[0].output.finish_reason == "stop"
    # every draft is right, so branches stop inside accepted drafts, in a few forwards
    assert forest.stats.accepted > 0 and forest.stats.forward_passes <= 40 // 7 + 2
    eos = {full[1][9]}
    forest = run(HashLM(), HASH_PREFIX, HASH_BRANCHES, speculate=Speculation(DraftModel(HashLM(), confidence=0.0),
                 budget=6), max_new_tokens=40, eos=eos)
    assert outputs(forest) == hash_expected(HASH_PREFIX, HASH_BRANCHES, 40, eos)


def test_the_decoder_drafts_with_its_draft_model():
    """`MultiDecoder(draft=...)` with speculate="draft" gives plain greedy's tokens; without a draft
    model "draft" is refused with a hint."""
    model = tiny_model("llama", "sdpa")
    decoder = multidecode.MultiDecoder(model, ByteTokenizer(), draft=_perturbed(model, 0.3))
    plain = decoder.generate([1, 40, 41, 42, 43], max_new_tokens=12, speculate=None, eos_token_id=[])
    drafted = decoder.generate([1, 40, 41, 42, 43], max_new_tokens=12, speculate="draft", eos_token_id=[])
    assert drafted.token_ids == plain.token_ids and drafted.stats["accepted"] > 0
    with pytest.raises(InvalidArgument, match="needs a draft model"):
        multidecode.MultiDecoder(model, ByteTokenizer()).generate([1, 40], max_new_tokens=2, speculate="draft")


def test_decode_refuses_draft_with_a_hint_it_can_follow():
    """`decode` has no `draft=`: its refusal of speculate="draft" names the spelling it takes
    (a `DraftModel`), and that spelling gives plain greedy's tokens."""
    model = tiny_model("llama", "sdpa")
    with pytest.raises(InvalidArgument, match="needs a draft model") as refused:
        multidecode.decode(model, [1, 40, 41], [[42], [43]], max_new_tokens=4, speculate="draft")
    assert "speculate=DraftModel(" in refused.value.hint
    plain = multidecode.decode(model, [1, 40, 41], [[42], [43]], max_new_tokens=6, eos_token_id=[])
    drafted = multidecode.decode(model, [1, 40, 41], [[42], [43]], max_new_tokens=6, eos_token_id=[],
                                 speculate=DraftModel(_perturbed(model, 0.3)))
    assert drafted == plain


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_seeded_samples_drafted_by_a_model_are_the_tokens_of_no_speculation_whatever_shares_the_forward(arch):
    """Candidates drawn from a draft's q were verified by the rule against q, which spends random
    draws on them: a seeded branch's tokens differed from the run without speculation (from the
    first token), and from its own run alone (a lone prompt drafts one chain, a forest siblings).
    By default a sampled branch now draws, then matches, as for every other draft; the rule
    against q stays for who asks it (`against_q=True`), reproducible run to run."""
    model = tiny_model(arch, "sdpa")
    decoder = multidecode.MultiDecoder(model, ByteTokenizer(), exact=False)
    prompts = [[1, 40, 50, 60], [1, 70, 80]]

    def sampled(chosen, speculate):
        run = decoder.start([prompts[i] for i in chosen], max_new_tokens=12, eos_token_id=[], speculate=speculate,
                            do_sample=True, seed=7, temperature=0.8)
        out: list[list[int]] = [[] for _ in chosen]
        for event in run.events:
            out[event.branch].append(event.token_id)
        return out

    def drafted():
        return Speculation(DraftModel(_perturbed(model, 0.3), width=3, confidence=0.0), budget=4)

    plain = sampled([0, 1], None)
    assert all(len(tokens) == 12 for tokens in plain)
    assert sampled([0, 1], drafted()) == plain
    assert sampled([0], drafted()) == plain[:1]  # alone: seed 7 is the first branch's in both
    against_q = [sampled([0, 1], Speculation(DraftModel(_perturbed(model, 0.3), width=3, confidence=0.0), budget=4,
                                             against_q=True)) for _ in range(2)]
    assert against_q[0] == against_q[1]  # reproducible, and not draw for draw the plain run's
