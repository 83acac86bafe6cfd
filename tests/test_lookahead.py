"""Lookahead decoding as a proposer: its window is the paper's, its pool is used, and it is exact.

Model-free: the side tree's ancestor (visibility) matrix equals the paper's attention mask built
block by block; the window warms up, iterates and shifts as the reference implementation does;
the pool keeps the most recent n-grams per first token; candidates come from it within the
guesses and the budget; the cost rule picks the largest window a curve allows.

With models: greedy output equals transformers' `generate` on every tiny architecture with
eager and sdpa attention (eos and max_new_tokens inside accepted drafts, compaction every step);
a model-free copying model shows the pool at work (from the prompt, and from the Jacobi
trajectory alone), with eos and stop strings inside accepted drafts; four branches at once draft
and accept exactly as four single runs; seeded sampling is unchanged by lookahead.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from eos_cases import pick_eos, truncate
from hash_lm import HashLM, LetterTokenizer, logits_of, reference
from speculation_cases import (
    BRANCHES,
    HASH_BRANCHES,
    HASH_PREFIX,
    NO_EOS,
    PREFIX,
    STEPS,
    cut_at_stop,
    outputs,
    run,
    tiny_references,
)
from tiny_models import combos, tiny_model

from multidecode.cost import CostCurve
from multidecode.errors import InvalidArgument
from multidecode.proposers import UNDER_LEAF, BranchContext, DraftTree
from multidecode.proposers.lookahead import (
    HEAD,
    KIND_JACOBI,
    KIND_TEXT,
    PRIORS,
    Lookahead,
    NgramPool,
    jacobi_step,
    last_level_size,
    side_count,
    side_window,
)
from multidecode.sampling_params import SamplingParams
from multidecode.scheduler import CompactionPolicy
from multidecode.speculation import Speculation


def lookahead(budget: int | None = -1, **options) -> Speculation:
    """Lookahead at `budget` draft nodes (-1: every pooled guess; None: "auto", the cost model
    choosing among them)."""
    proposer = Lookahead(**options)
    if budget is None:
        return Speculation(proposer, None, proposer.candidate_nodes)
    return Speculation(proposer, proposer.candidate_nodes if budget == -1 else budget)


# ---------------------------------------------------------------------- a copying model
SCALE = 4096


class CopyLM(HashLM):
    """A model-free LM whose greedy continuation repeats the token `period` positions back on
    its visible path (a document being quoted), and hashes the path where there is none.

    Each cache slot holds token * 4096 + position, so a query finds, among the slots it may see,
    the one `period` - 1 positions before it, and gives its token a large logit (on top of a
    small hash of everything visible, so a wrong mask changes the logits)."""

    def __init__(self, period: int = 7) -> None:
        super().__init__()
        self.period = period

    def forward(self, input_ids, position_ids=None, attention_mask=None, past_key_values=None, use_cache=True,
                logits_to_keep=None, **kwargs):
        q = input_ids.shape[1]
        positions = position_ids[0].to(torch.float64)  # [q]
        own = input_ids[0].to(torch.float64) * SCALE + positions  # [q]
        keys, _ = past_key_values.update(own[None, None, :, None], own[None, None, :, None], 0)
        keys = keys[0, 0, :, 0]  # [past + q]
        past = keys.shape[0] - q
        if attention_mask is None:
            visible = torch.ones(q, past + q, dtype=torch.bool).tril(diagonal=past)
        else:
            if isinstance(attention_mask, dict):
                (attention_mask,) = attention_mask.values()
            visible = attention_mask[0, 0] == 0  # [q, past + q]
        key_tokens = torch.div(keys, SCALE, rounding_mode="floor")
        key_positions = keys - key_tokens * SCALE
        hit = visible & (key_positions[None, :] == (positions - (self.period - 1))[:, None])  # [q, past + q]
        logits = 0.1 * logits_of((visible.to(torch.float64) * keys[None, :]).sum(-1))  # [q, V]
        rows = hit.any(-1).nonzero().flatten()
        copied = (hit.to(torch.float64) * key_tokens[None, :]).sum(-1).long()  # [q]
        logits[rows, copied[rows]] += 10.0
        logits = logits[None]
        if logits_to_keep is not None and not isinstance(logits_to_keep, int):
            logits = logits[:, logits_to_keep]
        return _Logits(logits)


class _Logits:
    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits


def copy_reference(prompt: list[int], steps: int, period: int = 7, eos=frozenset()) -> list[int]:
    """CopyLM's sequential greedy rule, straight from a token list."""
    path, out = list(prompt), []
    for _ in range(steps):
        if len(path) >= period:
            token = path[-period]
        else:
            total = sum(t * SCALE + i for i, t in enumerate(path))
            token = int(logits_of(torch.tensor(float(total), dtype=torch.float64)).argmax())
        out.append(token)
        path.append(token)
        if token in eos:
            break
    return out


_crng = random.Random(3)
COPY_PREFIX = [_crng.randrange(3, 48) for _ in range(11)]
COPY_BRANCHES = [[], [5, 6], [7, 8, 9, 10, 11, 12, 13, 14, 15], [20]]


def copy_expected(steps, period=7, eos=frozenset()):
    return [copy_reference(COPY_PREFIX + b, steps, period, eos) for b in COPY_BRANCHES]


# ---------------------------------------------------------------------- the mask
def steady_window(window: int, ngram: int, start: int = 100) -> list[list[int | None]]:
    """A full window of distinct tokens: level 0 has W - 1 (after the newest token), the others W."""
    levels, token = [], start
    for level in range(ngram - 1):
        row = [HEAD] if level == 0 else []
        while len(row) < window:
            row.append(token)
            token += 1
        levels.append(row)
    return levels


def papers_mask(window: int, ngram: int, guesses: int) -> tuple[torch.Tensor, list[int]]:
    """The paper's attention mask (its figure for W=5, N=4, G=2 is also the reference's
    `media/mask.png`), built as it is drawn: rows and columns are the input token, level 0's W - 1 tokens, levels 1..N-2 of W
    tokens, then `guesses` candidates of N - 1 tokens. Everyone sees the input token; a window
    row in block b (block 0: the input and level 0), column j sees block 0's columns 1..j (a
    lower triangle) and the diagonal of blocks 1..b; each candidate block is a lower triangle.
    Also the position ids, relative to the input token."""
    size = (ngram - 1) * window + guesses * (ngram - 1)
    mask = torch.zeros(size, size, dtype=torch.bool)
    mask[:, 0] = True
    positions = [0] * size
    for block in range(ngram - 1):
        for j in range(window):
            row = block * window + j
            if row == 0:
                continue
            mask[row, 1 : j + 1] = True  # level 0, columns 1..j
            for b in range(1, block + 1):
                mask[row, b * window + j] = True  # the same column, one level each
            positions[row] = block + j
    base = (ngram - 1) * window
    for g in range(guesses):
        for k in range(ngram - 1):
            row = base + g * (ngram - 1) + k
            mask[row, base + g * (ngram - 1) : row + 1] = True
            positions[row] = k + 1
    return mask, positions


def visibility(draft: DraftTree) -> tuple[torch.Tensor, list[int]]:
    """Who sees whom in the forest, from parents only: node 0 is the branch's newest token, then
    the side nodes, then the candidates; a node sees itself and its ancestors. Also depths."""
    parents = [None] + [0 if p == UNDER_LEAF else 1 + p for p in draft.side_parents]
    side = len(parents)
    parents += [0 if p == UNDER_LEAF else side + p for p in draft.parents]
    seen = torch.zeros(len(parents), len(parents), dtype=torch.bool)
    depths = []
    for i in range(len(parents)):
        at, depth = i, 0
        while at is not None:
            seen[i, at] = True
            at = parents[at]
            depth += at is not None
        depths.append(depth)
    return seen, depths


@pytest.mark.parametrize("window, ngram, guesses", [(5, 4, 2), (7, 5, 7), (3, 3, 1), (4, 2, 3)])
def test_the_side_tree_reproduces_the_papers_mask(window, ngram, guesses):
    """A full window and `guesses` pooled n-grams (distinct first tokens, so the trie is
    separate chains): the forest's visibility equals the paper's mask, cell for cell, and the
    depths equal its position ids (W=5, N=4: orange 1-4, green 1-5, red 2-6, blue 1-3)."""
    proposer = Lookahead(window=window, ngram=ngram, guesses=guesses, pool_from_prompt=False)
    context = BranchContext([3, 4, 5, 6], 3)  # one generated token: not the prompt's step
    state = proposer.state(context)
    state.levels = steady_window(window, ngram)
    for g in range(guesses):
        state.pool.add(6, [10 * (g + 1) + k for k in range(ngram - 1)], KIND_JACOBI)
    draft = proposer.propose(context, budget=100)
    assert len(draft.side_tokens) == proposer.side_nodes and len(draft) == proposer.candidate_nodes
    seen, depths = visibility(draft)
    # our candidates come most recent first; the paper's blocks are in pool order
    order = list(range(1 + proposer.side_nodes))
    for g in reversed(range(guesses)):
        first = 1 + proposer.side_nodes + g * (ngram - 1)
        order += list(range(first, first + ngram - 1))
    expected, positions = papers_mask(window, ngram, guesses)
    assert torch.equal(seen[order][:, order], expected)
    assert [depths[i] for i in order] == positions
    if (window, ngram) == (5, 4):
        assert positions[1 : 5 + 5 + 5] == [1, 2, 3, 4, 1, 2, 3, 4, 5, 2, 3, 4, 5, 6]


def test_a_wrong_parent_breaks_the_mask_check():
    """The mask comparison can fail: level 1 hung one column to the left is caught."""
    draft = DraftTree()
    index = side_window(draft, steady_window(5, 4))
    draft.side_parents[index[1][2]] = index[0][1]  # level 1, column 2 under level 0, column 1
    expected, _ = papers_mask(5, 4, 0)
    assert not torch.equal(visibility(draft)[0], expected)


# ---------------------------------------------------------------------- the window, model-free
def bigram_outputs(levels, successor) -> list[int]:
    """What a target whose next token depends on the current token only gives at the side nodes
    of the window's last level."""
    draft = DraftTree()
    side_window(draft, levels)
    return [successor(t) for t in draft.side_tokens][side_count(levels) - last_level_size(levels) :]


def test_warm_up_grows_the_window_as_the_reference_does():
    """Level 0 starts with W + N - 3 guesses drawn from the branch's tokens (the same for the
    same tokens, the global RNG untouched); each warm-up step adds the last level's outputs as a
    level and shifts the window one column; after N - 2 steps it has N - 1 levels of W columns
    (level 0: the newest token and W - 1 guesses), and only then are n-grams collected."""
    window, ngram = 7, 5
    proposer = Lookahead(window=window, ngram=ngram)
    tokens = list(range(3, 40))
    before = random.getstate()
    levels = proposer._first_window(tokens)
    assert random.getstate() == before
    assert levels == proposer._first_window(list(tokens)) != proposer._first_window(tokens[::-1])
    assert levels[0][0] is HEAD and len(levels[0]) == window + ngram - 2 and set(levels[0][1:]) <= set(tokens)

    successor = lambda t: (t * 5 + 1) % 997
    for step in range(1, ngram - 1):
        outputs = bigram_outputs(levels, successor)
        grown, ngrams = jacobi_step(levels, 9, outputs, ngram)
        assert ngrams == []
        assert len(grown) == step + 1
        assert [len(level) for level in grown] == [window + ngram - 2 - step] * (step + 1)
        assert grown[-1] == [successor(t) for t in levels[-1][1:]]  # the last level's outputs, shifted
        assert grown[0] == [HEAD] + levels[0][2:]
        assert all(grown[l] == levels[l][1:] for l in range(1, len(levels)))
        levels = grown
    assert [len(level) for level in levels] == [window] * (ngram - 1)
    _, ngrams = jacobi_step(levels, 9, bigram_outputs(levels, successor), ngram)
    assert len(ngrams) == window


def test_a_full_window_yields_its_columns_and_drops_its_oldest_level():
    """Column j's n-gram is its tokens from level 0 up (the newest token in column 0) and its
    output; the next window is levels 1.. and the outputs, the newest token taking column 0. With
    a target whose next token depends on the current one only, every column past the first is a
    true n-gram of that target, warm-up included."""
    window, ngram = 4, 4
    levels = steady_window(window, ngram)
    last = list(range(500, 500 + window))
    shifted, ngrams = jacobi_step(levels, 7, last, ngram)
    assert ngrams == [(7, levels[1][0], levels[2][0], last[0])] + [
        (levels[0][j], levels[1][j], levels[2][j], last[j]) for j in range(1, window)]
    assert shifted == [[HEAD] + levels[1][1:], levels[2], last]
    with pytest.raises(ValueError):
        jacobi_step(levels, 7, last[:-1], ngram)

    successor = lambda t: (t * 3 + 2) % 101
    proposer = Lookahead(window=5, ngram=4)
    levels = proposer._first_window(list(range(3, 30)))
    collected = []
    for _ in range(6):
        levels, ngrams = jacobi_step(levels, 1, bigram_outputs(levels, successor), 4)
        collected += ngrams[1:]
    assert len(collected) == 4 * 4  # 2 warm-up steps, then 4 columns past the first in each step
    for ngram_ in collected:
        assert all(b == successor(a) for a, b in itertools.pairwise(ngram_))


def test_ngram_size_two_is_plain_jacobi_decoding():
    """N = 2: one level of W - 1 guesses after the newest token, replaced each step by its outputs
    (the guess after the newest token is the one after the next: the next is the target's own);
    2-grams from columns 1.. (the newest token's own output is no side node)."""
    levels = [[HEAD, 11, 12, 13]]
    shifted, ngrams = jacobi_step(levels, 5, [21, 22, 23], 2)
    assert ngrams == [(11, 21), (12, 22), (13, 23)] and shifted == [[HEAD, 21, 22, 23]]


def fake_logits(tokens: list[int], vocab: int = 600) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(tokens), vocab).float()


def test_observe_steps_the_window_whatever_was_accepted_and_only_when_it_was_fed():
    """Accepting several candidates or none updates the window alike (the reference keeps it);
    a step whose window was not fed (no side logits, or a draft cut down to one chain) leaves it
    as it was; release drops the branch's state."""
    states = []
    for accepted in ([], [0, 1]):
        proposer = Lookahead(window=4, ngram=3, pool_from_prompt=False)
        context = BranchContext([3, 4, 5, 6, 7], 4)
        proposer.state(context).pool.add(7, [8, 9], KIND_JACOBI)
        draft = proposer.propose(context, budget=8)
        assert draft.tokens == [8, 9]
        proposer.observe(context, draft, accepted, fake_logits([300 + i for i in range(len(draft.side_tokens))]))
        states.append(proposer.state(context).levels)
    assert states[0] == states[1]

    proposer = Lookahead(window=4, ngram=3)
    context = BranchContext([3, 4, 5, 6, 7], 4)
    for side_logits, cut in ((None, False), (fake_logits([1] * 20), True)):
        before = [list(level) for level in proposer.state(context).levels]
        draft = proposer.propose(context, budget=8)
        if cut:
            draft = draft.first_chain()
        proposer.observe(context, draft, [], side_logits)
        assert proposer.state(context).levels == before and proposer.state(context).steps == 0
    proposer.release(context)
    assert proposer.name not in context.scratch


# ---------------------------------------------------------------------- the pool and the candidates
def test_the_pool_keeps_the_most_recent_ngrams_per_first_token_and_a_bounded_number_of_keys():
    pool = NgramPool(per_key=3, max_keys=2)
    for rest in ([1, 2], [3, 4], [5, 6], [1, 2], [7, 8]):
        pool.add(10, rest, KIND_JACOBI)
    assert pool.get(10) == [((7, 8), KIND_JACOBI), ((1, 2), KIND_JACOBI), ((5, 6), KIND_JACOBI)]
    pool.add(10, [5, 6], KIND_TEXT)  # seen again, now from the text: most recent, with its new kind
    assert pool.get(10)[0] == ((5, 6), KIND_TEXT) and len(pool) == 3
    pool.add(11, [1, 1], KIND_JACOBI)
    pool.add(10, [9, 9], KIND_JACOBI)  # key 10 updated last: key 11 is the oldest
    pool.add(12, [2, 2], KIND_JACOBI)
    assert pool.keys() == [10, 12] and pool.get(11) == []


def test_candidates_are_the_pooled_ngrams_of_the_newest_token_within_guesses_and_budget():
    """At most G n-grams, most recent first, merged into a trie (shared starts share nodes), cut
    at the budget, with their source's kind and prior; the prompt's step drafts one chain and no
    window, so a lone branch and one among many draft alike."""
    proposer = Lookahead(window=3, ngram=4, guesses=3, pool_from_prompt=False)
    context = BranchContext([1, 2, 3, 9], 3)
    pool = proposer.state(context).pool
    for rest, kind in (([4, 4, 4], KIND_JACOBI), ([5, 6, 7], KIND_JACOBI), ([5, 6, 8], KIND_TEXT),
                       ([6, 1, 1], KIND_JACOBI)):
        pool.add(9, rest, kind)
    pool.add(8, [1, 2, 3], KIND_JACOBI)  # another key: never a candidate here
    draft = proposer.propose(context, budget=100)
    assert draft.tokens == [6, 1, 1, 5, 6, 8, 7]  # [4, 4, 4] was pushed out (G = 3); 5 and 6 shared
    assert draft.parents == [UNDER_LEAF, 0, 1, UNDER_LEAF, 3, 4, 4]
    assert draft.kinds == [KIND_JACOBI] * 3 + [KIND_TEXT] * 3 + [KIND_JACOBI]
    assert draft.priors == [PRIORS[k] for k in draft.kinds]
    assert len(draft.side_tokens) == side_count(proposer.state(context).levels)
    assert proposer.propose(context, budget=4).tokens == [6, 1, 1, 5]

    prompt_step = proposer.propose(BranchContext([1, 2, 3, 9], 4, scratch=context.scratch), budget=100)
    assert prompt_step.tokens == [6, 1, 1] and prompt_step.side_tokens == []


def test_pool_from_prompt_pools_the_prompt_then_the_output_as_it_comes():
    prompt = [3, 4, 5, 6, 3, 4, 7]
    on, off = Lookahead(ngram=3), Lookahead(ngram=3, pool_from_prompt=False)
    context = BranchContext(list(prompt), len(prompt))
    draft = on.propose(context, budget=8)
    assert draft.tokens == [] and on.state(context).pool.get(3) == [((4, 7), KIND_TEXT), ((4, 5), KIND_TEXT)]
    context.tokens += [9, 3]
    assert on.propose(context, budget=8).tokens == [4, 7, 5]
    assert on.state(context).pool.get(7) == [((9, 3), KIND_TEXT)]
    other = BranchContext(list(prompt) + [3], len(prompt))
    assert off.propose(other, budget=8).tokens == [] and len(off.state(other).pool) == 0


def test_the_window_is_held_back_near_the_models_last_position():
    proposer = Lookahead(window=4, ngram=3)
    proposer.check(HashLM(max_positions=20))
    context = BranchContext(list(range(3, 13)), 9)
    assert len(proposer.propose(context, budget=8).side_tokens) == 4  # the newest at 9, the deepest at 13
    context.tokens += [3] * 6
    assert len(proposer.propose(context, budget=8).side_tokens) == 4  # the deepest at 19: the last position
    context.tokens += [3]
    assert proposer.propose(context, budget=8).side_tokens == []


def test_options_are_checked():
    for bad in (dict(window=0), dict(ngram=1), dict(window=1, ngram=2), dict(guesses=0), dict(max_keys=0),
                dict(window="7")):
        with pytest.raises(InvalidArgument):  # a multidecode error with its hint, not a bare ValueError
            Lookahead(**bad)
    proposer = Lookahead()
    assert (proposer.window, proposer.ngram, proposer.guesses, proposer.pool_from_prompt) == (7, 5, 7, True)
    assert proposer.side_nodes == 27 and proposer.candidate_nodes == 28 and proposer.step_rows(8) == 36
    narrow = Lookahead(window=2, ngram=7)  # its warm-up feeds more than its full window
    levels, most = narrow._first_window([3, 4, 5]), 0
    for _ in range(6):
        most = max(most, side_count(levels))
        levels, _ = jacobi_step(levels, 3, [4] * last_level_size(levels), 7)
    assert side_count(levels) == 11 and narrow.side_nodes == most == 15


# ---------------------------------------------------------------------- the cost rule
def test_the_cost_rule_picks_the_largest_window_within_the_ratio():
    flat = CostCurve.from_relative({1: 1.0, 512: 1.02})
    chosen = Lookahead.from_cost(flat)
    assert (chosen.ngram, chosen.window, chosen.guesses) == (5, 16, 16)
    cpu = CostCurve.from_relative({1: 1.0, 2: 1.1, 4: 1.44, 8: 1.82, 64: 4.0})
    chosen = Lookahead.from_cost(cpu, pool_from_prompt=False)
    assert (chosen.ngram, chosen.window, chosen.guesses, chosen.pool_from_prompt) == (3, 1, 1, False)
    middle = CostCurve.from_relative({1: 1.0, 16: 1.05, 64: 1.25, 256: 3.0})
    for budget in (None, 8):
        chosen = Lookahead.from_cost(middle, budget=budget)
        assert chosen.ngram == 5 and 1 < chosen.window < 16
        assert middle.relative(chosen.step_rows(budget)) <= 1.3
        bigger = Lookahead(window=chosen.window + 1, ngram=5, guesses=chosen.window + 1)
        assert middle.relative(bigger.step_rows(budget)) > 1.3
    assert Lookahead.from_cost(middle, budget=8).window > Lookahead.from_cost(middle).window


# ---------------------------------------------------------------------- the copying model
@pytest.mark.parametrize("pool_from_prompt", [True, False])
def test_the_pool_is_used_on_a_repetitive_text(pool_from_prompt):
    """A quoting model: many tokens per forward, from the prompt's n-grams, or from the Jacobi
    trajectory alone; the output is the sequential rule's."""
    expected = copy_expected(60)
    forest = run(CopyLM(), COPY_PREFIX, COPY_BRANCHES, speculate=lookahead(pool_from_prompt=pool_from_prompt),
                 max_new_tokens=60)
    assert outputs(forest) == expected
    assert forest.stats.accepted > 100
    assert 60 / forest.stats.steps > 2  # tokens per forward, per branch


def test_eos_and_length_inside_accepted_drafts_with_compaction_on_the_copying_model():
    full = copy_expected(37)
    eos = set(pick_eos(full, 37))
    expected = copy_expected(37, eos=eos)
    for budget in (5, None):
        forest = run(CopyLM(), COPY_PREFIX, COPY_BRANCHES, speculate=lookahead(budget), max_new_tokens=37,
                     eos=eos, compaction=CompactionPolicy(every=1))
        assert outputs(forest) == expected
        assert forest.stats.accepted > 20 and forest.engine.stats.compactions > 0


def test_stop_strings_cut_inside_accepted_drafts():
    tokenizer = LetterTokenizer()
    full = copy_expected(40)
    stop = tokenizer.decode(full[0][25:27])
    forest = run(CopyLM(), COPY_PREFIX, COPY_BRANCHES, speculate=lookahead(), max_new_tokens=40,
                 tokenizer=tokenizer, stop=[stop])
    assert forest.stats.accepted > 20
    assert forest.branches[0].output.finish_reason == "stop"
    assert [b.output.text for b in forest.branches] == cut_at_stop([tokenizer.decode(out) for out in full], stop)
    for b, out in zip(forest.branches, full):
        assert b.output.token_ids == out[: len(b.output.token_ids)]


class Recording(Lookahead):
    """Lookahead that notes, per branch, its drafts' sizes and how many nodes were accepted."""

    def observe(self, context, draft, accepted, side_logits=None):
        context.scratch.setdefault("record", []).append((len(draft), len(draft.side_tokens), len(accepted)))
        super().observe(context, draft, accepted, side_logits)


def test_four_branches_at_once_equal_four_single_runs():
    """Token for token, and step for step the same drafts and acceptance per branch."""
    together = run(CopyLM(), COPY_PREFIX, COPY_BRANCHES, speculate=Speculation(Recording(), budget=12),
                   max_new_tokens=45)
    assert outputs(together) == copy_expected(45)
    assert together.stats.accepted > 50
    for b, branch in enumerate(COPY_BRANCHES):
        alone = run(CopyLM(), COPY_PREFIX, [branch], speculate=Speculation(Recording(), budget=12), max_new_tokens=45)
        assert outputs(alone) == [outputs(together)[b]]
        assert alone.branches[0].context.scratch["record"] == together.branches[b].context.scratch["record"]


@pytest.mark.parametrize("options", [dict(), dict(window=2, ngram=2, guesses=3), dict(window=3, ngram=7, budget=None)],
                         ids=["defaults", "jacobi-2-grams", "narrow-auto"])
def test_hash_model_greedy_equals_sequential(options):
    """The hash model (any change to what a node sees changes its logits): four branches, one
    empty, 40 tokens, equal to the sequential rule."""
    expected = [reference(HASH_PREFIX + b, 40) for b in HASH_BRANCHES]
    options = dict(options)
    budget = options.pop("budget", -1)
    forest = run(HashLM(), HASH_PREFIX, HASH_BRANCHES, speculate=lookahead(budget, **options), max_new_tokens=40)
    assert outputs(forest) == expected


def test_seeded_sampling_gives_the_same_tokens_with_and_without_lookahead():
    """One draw per emitted token from the branch's own generator, whatever was drafted."""
    sampling = [SamplingParams(do_sample=True, temperature=0.9, top_k=20, seed=100 + i) for i in range(4)]
    for model, prefix, branches in ((HashLM(), HASH_PREFIX, HASH_BRANCHES), (CopyLM(), COPY_PREFIX, COPY_BRANCHES)):
        plain = outputs(run(model, prefix, branches, speculate=None, max_new_tokens=30, sampling=sampling))
        forest = run(model, prefix, branches, speculate=lookahead(), max_new_tokens=30, sampling=sampling)
        assert outputs(forest) == plain
    assert forest.stats.accepted > 0  # the copying model's text is likely enough to be drawn


# ---------------------------------------------------------------------- tiny transformers models
@pytest.mark.parametrize("arch, attn", combos())
def test_greedy_equals_generate(arch, attn):
    """Four branches (one empty), 20 tokens past a sliding window of 6: generate's tokens, with
    the defaults and with a small window (N = 3), pool from the prompt or not."""
    model = tiny_model(arch, attn)
    expected = tiny_references(arch, attn)
    accepted = 0
    for spec in (lookahead(8), lookahead(window=3, ngram=3, guesses=2, pool_from_prompt=False)):
        forest = run(model, PREFIX, BRANCHES, speculate=spec, max_new_tokens=STEPS, eos=[NO_EOS])
        assert outputs(forest) == expected, spec.proposer
        accepted += forest.stats.accepted
    assert accepted > 0


@pytest.mark.parametrize("arch, attn", combos())
def test_eos_and_length_inside_drafts_with_compaction(arch, attn):
    """Branches stop at an eos at different steps (inside accepted drafts where lookahead caught
    the model's loops), the rest run to max_new_tokens; finished branches are compacted out at
    every step."""
    model = tiny_model(arch, attn)
    full = tiny_references(arch, attn)
    eos = set(pick_eos(full, STEPS))
    forest = run(model, PREFIX, BRANCHES, speculate=lookahead(), max_new_tokens=STEPS, eos=eos,
                 compaction=CompactionPolicy(every=1))
    assert outputs(forest) == truncate(full, eos)
    assert forest.engine.stats.compactions > 0

