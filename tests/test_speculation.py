"""Speculation is exact: draft trees verified inside every branch never change what is generated.

The oracle is plain sequential decoding. With any proposer (prompt lookup, "auto", one that
proposes garbage, one that knows the answer) greedy output equals transformers' `generate` on
every tiny architecture with eager and sdpa attention, and equals the model-free `HashLM`'s
sequential rule; seeded sampling gives the same tokens with and without speculation, and its
token frequencies follow the model's softmax. Mutants (an off-by-one accept, a rollback that
leaves a slot behind) make these comparisons fail.
"""

from __future__ import annotations

import random
import re

import numpy as np
import pytest
import torch
from eos_cases import pick_eos, truncate
from hash_lm import HashLM, LetterTokenizer, path_logits
from speculation_cases import (
    BASE,
    BRANCHES,
    FLAT,
    HASH_BRANCHES,
    HASH_PREFIX,
    NO_EOS,
    PREFIX,
    SAMPLE_PREFIX,
    STEPS,
    T,
    cut_at_stop,
    frequencies_pass,
    hash_expected,
    outputs,
    run,
    tiny_references,
    tiny_softmax,
)
from tiny_models import VOCAB, combos, reference_generate, tiny_model

import multidecode
from multidecode import verify
from multidecode.api import start_forest
from multidecode.cache import SlotLayer
from multidecode.cost import CostCurve
from multidecode.engine import Engine
from multidecode.errors import InvalidArgument
from multidecode.proposers import BranchContext, DraftTree, Proposer
from multidecode.sampling_params import SamplingParams
from multidecode.scheduler import CompactionPolicy
from multidecode.speculation import Speculation, build_speculation


# ---------------------------------------------------------------------- test proposers
class Oracle(Proposer):
    """Proposes the target's own continuation (known in advance), plus a wrong sibling at each
    level when `siblings` is set, so the tree is not a chain."""

    name = "oracle"

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], *, siblings: bool = False,
                 vocab: int = VOCAB) -> None:
        self.continuations, self.siblings, self.vocab = continuations, siblings, vocab

    def propose(self, context: BranchContext, budget: int) -> DraftTree:
        tokens = context.tokens
        prompt = tuple(tokens[: context.prompt_length])
        done = tokens[context.prompt_length :]
        future = self.continuations[prompt][len(done) :]
        draft = DraftTree()
        parent = -1
        for token in future:
            if len(draft) >= budget:
                break
            if self.siblings and len(draft) + 1 < budget:
                draft.add(3 + (token - 2) % (self.vocab - 3), parent)  # a wrong guess first (never eos or pad)
            parent = draft.add(token, parent)
        return draft


def test_a_proposer_without_propose_is_refused_when_given():
    """It was taken as speculate= and failed at the first step with a bare NotImplementedError."""
    class Unfinished(Proposer):
        name = "unfinished"

    with pytest.raises(InvalidArgument, match="Unfinished defines no propose method") as caught:
        build_speculation(Unfinished(), torch.float32)
    assert "propose(context, budget)" in caught.value.hint


class Handmade(Proposer):
    """Returns the same tree, built by hand, every step."""

    name = "handmade"

    def __init__(self, draft: DraftTree) -> None:
        self.draft = draft

    def propose(self, context: BranchContext, budget: int) -> DraftTree:
        return self.draft


@pytest.mark.parametrize("draft, needle", [
    (DraftTree(tokens=[5], parents=[-1], kinds=[0], priors=[0.5]), None),  # well formed: decodes
    (DraftTree(tokens=[5, 6], parents=[1, -1], kinds=[0, 0], priors=[0.5, 0.5]),
     "node 0's parent 1 is neither UNDER_LEAF (-1) nor an earlier node"),  # was an IndexError in depths()
    (DraftTree(tokens=[5, 6], parents=[-1], kinds=[0, 0], priors=[0.5, 0.5]), "its lists differ in length"),
    (DraftTree(tokens=[5], parents=[-1]), "0 kinds, 0 priors"),
    (DraftTree(tokens=[5.5], parents=[-1], kinds=[0], priors=[0.5]), "token 5.5 is not a whole-number id"),
    (DraftTree(side_tokens=[4, 5], side_parents=[-1, 2]), "side node 1's parent 2"),
    (DraftTree(tokens=[VOCAB], parents=[-1], kinds=[0], priors=[0.5]), f"outside the model's vocabulary of {VOCAB}"),
])
def test_a_malformed_draft_is_refused_naming_its_proposer(draft, needle):
    """A tree built by hand is checked like one built by `add`: a parent that is not an earlier
    node, lists of different lengths, a token that is no id, or one outside the vocabulary."""
    model = tiny_model("llama", "sdpa")
    if needle is None:
        assert multidecode.decode(model, [1, 2, 3], [[4]], max_new_tokens=3, speculate=Handmade(draft)) == \
            multidecode.decode(model, [1, 2, 3], [[4]], max_new_tokens=3)
        return
    assert draft.problem() is not None or "vocabulary" in needle
    with pytest.raises(InvalidArgument, match=re.escape(needle)) as caught:
        multidecode.decode(model, [1, 2, 3], [[4]], max_new_tokens=3, speculate=Handmade(draft))
    assert "'handmade'" in caught.value.message


class Garbage(Proposer):
    """Random trees: several children per node, random tokens; next to nothing gets accepted."""

    name = "garbage"

    def __init__(self, vocab: int, seed: int = 0) -> None:
        self.vocab, self.rng = vocab, random.Random(seed)

    def propose(self, context: BranchContext, budget: int) -> DraftTree:
        draft = DraftTree()
        while len(draft) < budget:
            parent = self.rng.choice([-1, *range(len(draft))])
            token = self.rng.randrange(self.vocab)
            if draft.child(parent, token) is None:
                draft.add(token, parent)
        return draft


def speculations(vocab: int, continuations) -> dict[str, object]:
    return {
        "lookup": "lookup",
        "auto": "auto",
        "garbage": Speculation(Garbage(vocab), budget=6),
        "oracle": Speculation(Oracle(continuations, vocab=vocab), budget=4),
        "oracle-tree": Speculation(Oracle(continuations, siblings=True, vocab=vocab), budget=7),
    }


MODES = ["lookup", "auto", "garbage", "oracle", "oracle-tree"]


# ---------------------------------------------------------------------- model-free: HashLM
@pytest.mark.parametrize("mode", MODES)
def test_hash_model_greedy_equals_sequential(mode):
    """Four branches (one empty), 40 tokens: every mode gives the sequential rule's tokens."""
    expected = hash_expected(HASH_PREFIX, HASH_BRANCHES, 40)
    conts = {tuple(HASH_PREFIX + b): e for b, e in zip(HASH_BRANCHES, expected)}
    forest = run(HashLM(), HASH_PREFIX, HASH_BRANCHES, speculate=speculations(48, conts)[mode], max_new_tokens=40)
    assert outputs(forest) == expected
    if mode.startswith("oracle"):
        assert forest.stats.accepted > 0 and forest.stats.steps < 40


@pytest.mark.parametrize("mode", MODES)
def test_hash_model_eos_inside_drafts_and_compaction_every_step(mode):
    """An eos that some branches reach mid-run (inside an accepted draft with the oracle), the
    rest running to max_new_tokens, finished branches compacted out at every step."""
    full = hash_expected(HASH_PREFIX, HASH_BRANCHES, 40)
    eos = {full[1][5], full[2][9]}
    expected = hash_expected(HASH_PREFIX, HASH_BRANCHES, 40, eos)
    assert len({len(e) for e in expected}) > 1
    conts = {tuple(HASH_PREFIX + b): e for b, e in zip(HASH_BRANCHES, expected)}
    forest = run(HashLM(), HASH_PREFIX, HASH_BRANCHES, speculate=speculations(48, conts)[mode], max_new_tokens=40,
                 eos=eos, compaction=CompactionPolicy(every=1))
    assert outputs(forest) == expected
    assert forest.engine.stats.compactions > 0
    assert [b.output.finish_reason for b in forest.branches] == [
        "stop" if e[-1] in eos else "length" for e in expected]


@pytest.mark.parametrize("mode", MODES)
def test_hash_model_stop_strings_cut_inside_drafts(mode):
    """Stop strings end a branch where sequential decoding would, even mid-draft; the text is cut
    before the stop string and the ids keep every token generated up to it."""
    tokenizer = LetterTokenizer()
    full = hash_expected(HASH_PREFIX, HASH_BRANCHES, 40)
    stop = tokenizer.decode(full[0][6:8])
    expected_text = cut_at_stop([tokenizer.decode(out) for out in full], stop)
    conts = {tuple(HASH_PREFIX + b): e for b, e in zip(HASH_BRANCHES, full)}
    forest = run(HashLM(), HASH_PREFIX, HASH_BRANCHES, speculate=speculations(48, conts)[mode], max_new_tokens=40,
                 tokenizer=tokenizer, stop=[stop])
    assert [b.output.text for b in forest.branches] == expected_text
    for b, out in zip(forest.branches, full):
        ids = b.output.token_ids
        assert ids == out[: len(ids)]
        assert b.output.finish_reason == ("stop" if stop in tokenizer.decode(out) else "length")
    assert forest.branches[0].output.finish_reason == "stop"


@pytest.mark.parametrize("budget", [1, 3, 8])
def test_the_oracle_is_accepted_in_full_and_the_forward_count_is_predicted(budget):
    """A proposer that knows the continuation: every draft token is accepted, and N new tokens
    take ceil(N / (budget + 1)) forwards (the prompt's forward carries a draft too)."""
    steps = 30
    expected = hash_expected(HASH_PREFIX, [[]], steps)
    conts = {tuple(HASH_PREFIX): expected[0]}
    forest = run(HashLM(), HASH_PREFIX, [[]], speculate=Speculation(Oracle(conts), budget=budget),
                 max_new_tokens=steps)
    assert outputs(forest) == expected
    assert forest.stats.drafted == forest.stats.accepted
    assert forest.engine.stats.forward_passes == -(-steps // (budget + 1))
    assert forest.stats.acceptance == 1.0


@pytest.mark.parametrize("budget", [4, 40])
def test_a_draft_that_guesses_the_eos_a_branch_ends_on_is_accepted(budget):
    """The oracle's drafts, every one right, the last an eos: each counts as accepted (a right
    guess of the token a branch ends on was counted, and drawn by `explain`, as rejected)."""
    full = hash_expected(HASH_PREFIX, [[]], 30)[0]
    end = next(i for i in range(6, 30) if full[i] not in full[:i])  # an eos first generated there
    eos = {full[end]}
    expected = hash_expected(HASH_PREFIX, [[]], 30, eos)
    assert expected[0] == full[:end + 1]
    forest = run(HashLM(), HASH_PREFIX, [[]], speculate=Speculation(Oracle({tuple(HASH_PREFIX): expected[0]}),
                                                                   budget=budget), max_new_tokens=30, eos=eos)
    assert outputs(forest) == expected
    assert forest.stats.drafted == forest.stats.accepted > 0

def test_garbage_is_rejected_and_leaves_no_trace():
    """Every garbage draft node is taken back: the cache ends holding exactly the prompt and each
    branch's fed tokens, as without speculation."""
    spec = Speculation(Garbage(48, seed=3), budget=8)
    plain = run(HashLM(), HASH_PREFIX, HASH_BRANCHES, speculate=None, max_new_tokens=25)
    forest = run(HashLM(), HASH_PREFIX, HASH_BRANCHES, speculate=spec, max_new_tokens=25)
    assert outputs(forest) == outputs(plain)
    assert forest.stats.drafted > 100
    assert forest.engine.stats.rolled_back == forest.stats.drafted - forest.stats.accepted
    assert forest.engine.forest.num_slots == plain.engine.forest.num_slots
    kept = sorted(forest.engine.forest.tokens[n] for n in forest.engine.forest.node_at_slot)
    assert kept == sorted(plain.engine.forest.tokens[n] for n in plain.engine.forest.node_at_slot)


def test_seeded_sampling_gives_the_same_tokens_with_and_without_speculation():
    """One draw per emitted token from the branch's own generator: a seeded run is the same run
    whatever speculates beside or inside it."""
    sampling = [SamplingParams(do_sample=True, temperature=0.9, top_k=20, seed=100 + i) for i in range(4)]
    plain = outputs(run(HashLM(), HASH_PREFIX, HASH_BRANCHES, speculate=None, max_new_tokens=30, sampling=sampling))
    conts = {tuple(HASH_PREFIX + b): o for b, o in zip(HASH_BRANCHES, plain)}
    for speculate in ("lookup", "auto", Speculation(Oracle(conts, siblings=True, vocab=48), budget=5)):
        assert outputs(run(HashLM(), HASH_PREFIX, HASH_BRANCHES, speculate=speculate, max_new_tokens=30,
                           sampling=sampling)) == plain
    other = [SamplingParams(do_sample=True, temperature=0.9, top_k=20, seed=900 + i) for i in range(4)]
    assert outputs(run(HashLM(), HASH_PREFIX, HASH_BRANCHES, speculate="lookup", max_new_tokens=30,
                       sampling=other)) != plain


def test_logits_after_a_rollback_equal_a_fresh_run_over_the_accepted_tokens():
    """Feed a draft tree, take some of it back, then feed a token: its logits equal those of a
    fresh engine that only ever saw the accepted path."""
    model = HashLM()
    engine = Engine(model)
    prefix = engine.feed_chain(HASH_PREFIX).nodes
    head = prefix[-1]
    # a tree under the prefix: two chains of 3 and a lone node
    nodes = engine.feed([11, 12, 13, 21, 22, 23, 31], [head, -2, -3, head, -5, -6, head], logits_for=range(7)).nodes
    engine.drop([nodes[2], *nodes[3:]])  # keep 11, 12 only
    logits = engine.feed([40], [nodes[1]], logits_for=[0]).logits
    torch.testing.assert_close(logits[0], path_logits(HASH_PREFIX + [11, 12, 40]).float(), rtol=0, atol=0)
    assert engine.forest.num_slots == len(HASH_PREFIX) + 3
    fresh = Engine(HashLM())
    expected = fresh.feed_chain(HASH_PREFIX + [11, 12, 40]).logits
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)


@pytest.mark.parametrize("arch", ["llama", "gemma3", "gpt2"])
def test_rollback_on_real_architectures_equals_a_fresh_run(arch):
    """On real models (grouped-query heads, a sliding window shorter than the run, learned
    positions): feed a tree, take part of it back, feed on; the logits equal those of a fresh
    engine that saw only the accepted path."""
    model = tiny_model(arch, "sdpa")
    engine = Engine(model)
    prefix = engine.feed_chain(PREFIX).nodes
    nodes = engine.feed([11, 12, 13, 21, 22, 31], [prefix[-1], -2, -3, prefix[-1], -5, prefix[-1]],
                        logits_for=range(6)).nodes
    engine.drop([nodes[2], *nodes[3:]])  # keep 11, 12
    logits = engine.feed([40, 41], [nodes[1], -2], logits_for=[0, 1]).logits
    fresh = Engine(model)
    expected = fresh.feed(PREFIX + [11, 12, 40, 41], [-1] + [-(i + 2) for i in range(len(PREFIX) + 3)],
                          logits_for=[len(PREFIX) + 2, len(PREFIX) + 3]).logits
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------- tiny transformers models
@pytest.mark.parametrize("arch, attn", combos())
def test_every_mode_equals_generate(arch, attn):
    """Every mode, three branches (one empty), 20 tokens past a window of 6: generate's tokens."""
    model = tiny_model(arch, attn)
    expected = tiny_references(arch, attn)
    conts = {tuple(PREFIX + b): e for b, e in zip(BRANCHES, expected)}
    specs = speculations(VOCAB, conts)
    for mode in MODES:
        forest = run(model, PREFIX, BRANCHES, speculate=specs[mode], max_new_tokens=STEPS, eos=[NO_EOS])
        assert outputs(forest) == expected, mode
        if mode.startswith("oracle"):
            assert forest.stats.accepted >= STEPS, mode


@pytest.mark.parametrize("arch, attn", combos())
def test_eos_and_length_inside_accepted_drafts_with_compaction(arch, attn):
    """The oracle's drafts run into an eos (branches stop mid-draft, at different steps) and into
    max_new_tokens; finished branches are compacted out at every step; the rest stay exact."""
    model = tiny_model(arch, attn)
    full = tiny_references(arch, attn)
    eos = set(pick_eos(full, STEPS))
    expected = truncate(full, eos)
    conts = {tuple(PREFIX + b): e for b, e in zip(BRANCHES, expected)}
    for spec in (Speculation(Oracle(conts), budget=5), Speculation(Oracle(conts, siblings=True), budget=9), "lookup"):
        forest = run(model, PREFIX, BRANCHES, speculate=spec, max_new_tokens=STEPS, eos=eos,
                     compaction=CompactionPolicy(every=1))
        assert outputs(forest) == expected
        assert forest.engine.stats.compactions > 0


def test_lookup_on_a_shared_document_drafts_in_every_branch():
    """Several branches under one prefix each carry their own draft subtree, in one forward."""
    model = tiny_model("llama", "sdpa")
    branches = [BASE[:2], BASE[:3], BASE[1:4], []]
    expected = tiny_references("llama", "sdpa", branches, 16)
    forest = start_forest(model, PREFIX, branches, max_new_tokens=16, eos_token_id=[NO_EOS],
                          sampling=[SamplingParams()] * 4, speculate="lookup")
    shared_steps = 0
    while not forest.group.done:
        calls = forest.engine.stats.forward_passes
        forest.step()
        if len(forest.group._drafts) >= 2:
            assert forest.engine.stats.forward_passes == calls + 1  # all of them in one forward
            shared_steps += 1
    assert outputs(forest) == expected
    assert shared_steps >= 3


def test_works_sharing_a_scheduler_stay_exact_with_rollbacks_and_compaction_every_step():
    """Two groups on one scheduler, one drafting garbage (rollbacks every step), both compacted at
    every step: each owner's compaction and rollback leave the other's output exact, and each
    run counts the forwards of the steps it took part in."""
    from multidecode.branches import start
    from multidecode.scheduler import new_scheduler

    model = tiny_model("llama", "sdpa")
    scheduler = new_scheduler(model, compaction=CompactionPolicy(every=1), cost=FLAT)
    first = start(scheduler, PREFIX, BRANCHES[:2], max_new_tokens=STEPS, eos_token_id=[NO_EOS],
                  sampling=[SamplingParams()] * 2, speculate=Speculation(Garbage(VOCAB, seed=9), budget=5))
    second = start(scheduler, PREFIX[:5], [[9], []], max_new_tokens=12, eos_token_id=[NO_EOS],
                   sampling=[SamplingParams()] * 2, speculate="lookup")
    scheduler.run()
    assert outputs(first) == tiny_references("llama", "sdpa", BRANCHES[:2])
    assert outputs(second) == [reference_generate(model, PREFIX[:5] + b, max_new_tokens=12, eos_token_id=NO_EOS)
                               for b in ([9], [])]
    assert first.stats.forward_passes == scheduler.engine.stats.forward_passes  # it was in every step
    assert 0 < second.stats.forward_passes < first.stats.forward_passes
    assert scheduler.engine.stats.rolled_back > 0 and scheduler.engine.stats.compactions > 0


def test_auto_stops_speculating_where_drafts_do_not_pay():
    """Garbage drafts on a curve where a row costs real time: "auto" learns from the first few
    steps that they never come true and stops feeding them; the output stays exact."""
    steep = CostCurve.from_relative({1: 1.0, 2: 1.3, 8: 2.0, 64: 6.0})
    forest = run(HashLM(), HASH_PREFIX, [[]], speculate=Speculation(Garbage(48, seed=2), budget=None),
                 max_new_tokens=60, cost=steep)
    budgets = forest.stats.draft_budgets
    assert outputs(forest) == hash_expected(HASH_PREFIX, [[]], 60)
    assert sum(budgets[:10]) > 0 and sum(budgets[-30:]) == 0


# ---------------------------------------------------------------------- sampling: chi-square
def _two_tokens(draws: int, first: int, speculate) -> tuple[list[int], list[int]]:
    """`draws` seeded 2-token samples at temperature T; the first tokens, and the second token of
    every sample whose first token was `first`."""
    model = tiny_model("llama", "sdpa")
    out = multidecode.decode(model, SAMPLE_PREFIX, [[]] * draws, max_new_tokens=2, eos_token_id=NO_EOS,
                             do_sample=True, temperature=T, seed=0, speculate=speculate)
    return [o[0] for o in out], [o[1] for o in out if o[0] == first]


class Fixed(Proposer):
    """Drafts, with the prompt, a fixed tree for the first two tokens: `first` with `second` under
    it, and `sibling` beside `first`."""

    name = "fixed"

    def __init__(self, first: int, second: int, sibling: int) -> None:
        self.first, self.second, self.sibling = first, second, sibling

    def propose(self, context: BranchContext, budget: int) -> DraftTree:
        draft = DraftTree()
        if len(context.tokens) == context.prompt_length:
            top = draft.add(self.first)
            draft.add(self.sibling)
            draft.add(self.second, top)
        return draft


def _lenient_walk(logits, heads, children, samplers, emit, drawn=None):
    """A verifier that is not distribution-exact (the control): a draft token the target gives at
    least 10% is taken without a draw; otherwise the target draws as usual."""
    paths = []
    for b, head in enumerate(heads):
        row, path = head, [head]
        while True:
            probs = torch.softmax(logits[row] / T, -1)
            likely = [(token, child) for token, child in children[b].get(row, {}).items() if probs[token] >= 0.1]
            if likely:
                token, child = likely[0]
            else:
                token = verify.choose_tokens(logits[row][None], [samplers[b]])[0]
                child = children[b].get(row, {}).get(token)
            if not emit(b, token, row) or child is None:
                break
            row = child
            path.append(row)
        paths.append(path)
    return paths


@pytest.mark.slow
@pytest.mark.xdist_group("sampling")
def test_sampled_tokens_after_speculation_follow_the_softmax_and_a_lenient_verifier_fails(monkeypatch):
    """3000 seeded samples of two tokens, each drafted by a fixed tree fed with the prompt (the
    likeliest first token with a child, and a sibling): the first token follows softmax(logits/T)
    after the prompt, and the second, where the first matched the draft, follows the softmax after
    prompt + that token (read from the draft node's own logits). Control: a verifier that takes any
    draft token the target gives 10% or more fails the first test."""
    first_probs = tiny_softmax(SAMPLE_PREFIX)
    order = np.argsort(-first_probs)
    first = int(order[0])
    assert first_probs[first] >= 0.1
    second_probs = tiny_softmax(SAMPLE_PREFIX + [first])
    spec = Speculation(Fixed(first, int(second_probs.argmax()), int(order[1])), budget=3)
    firsts, seconds = _two_tokens(3000, first, spec)
    assert frequencies_pass(firsts, first_probs)
    assert len(seconds) > 200 and frequencies_pass(seconds, second_probs)

    monkeypatch.setattr("multidecode.branches.walk", _lenient_walk)
    firsts, _ = _two_tokens(3000, first, spec)
    assert not frequencies_pass(firsts, first_probs)


# ---------------------------------------------------------------------- mutants
def _off_by_one_walk(logits, heads, children, samplers, emit, drawn=None):
    """Mutant: on a mismatch, the first draft child is accepted anyway (an off-by-one accept)."""
    paths = verify.walk(logits, heads, children, samplers, emit, drawn)
    for b, path in enumerate(paths):
        kids = children[b].get(path[-1], {})
        if kids:
            path.append(next(iter(kids.values())))
    return paths


def _crop_only(self, keep, first=0):
    """Mutant: the cache drops the last slots instead of moving the accepted ones down, so a
    rejected slot is left behind where an accepted one should be."""
    self.length = keep.numel()
    self._refresh_views()


@pytest.mark.parametrize("mutant", ["off-by-one accept", "rollback leaves a slot behind"])
def test_mutants_make_the_oracle_fail(monkeypatch, mutant):
    """Garbage drafts (rejected but for the odd lucky token) and the oracle with a wrong sibling
    fed before each right guess (so accepted slots sit after rejected ones and must move down):
    exact as written, wrong with either mutant."""
    model = tiny_model("llama", "sdpa")
    expected = tiny_references("llama", "sdpa")
    conts = {tuple(PREFIX + b): e for b, e in zip(BRANCHES, expected)}
    specs = [Speculation(Garbage(VOCAB, seed=5), budget=7), Speculation(Oracle(conts, siblings=True), budget=7)]
    for spec in specs:
        assert outputs(run(model, PREFIX, BRANCHES, speculate=spec, max_new_tokens=STEPS, eos=[NO_EOS])) == expected
    if mutant == "off-by-one accept":
        monkeypatch.setattr("multidecode.branches.walk", _off_by_one_walk)
    else:
        monkeypatch.setattr(SlotLayer, "compact", _crop_only)
    assert any(outputs(run(model, PREFIX, BRANCHES, speculate=spec, max_new_tokens=STEPS, eos=[NO_EOS])) != expected
               for spec in specs)
