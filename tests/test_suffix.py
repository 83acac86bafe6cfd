"""Suffix decoding: the suffix trie counts what it should, stays within its caps, and drafts well;
speculating with it never changes what is generated.

Model-free first: the trie's counts equal brute-force substring counts of the stored sequences
after any mix of growing, forgetting and evicting; the caps hold, least recently used out;
drafts grow with the match length, leave out rare continuations, and on a second pass over the
same text draft the first pass's continuation in full. Then exactness: on every tiny
architecture with eager and sdpa attention, greedy output equals transformers' `generate` with
a fresh store and with a store that has seen the answers (eos and max_new_tokens inside accepted
drafts), and a workload run twice through one store gives the same tokens in far fewer forwards.
"""

from __future__ import annotations

import functools
import itertools
import random
from collections import Counter

import pytest
from eos_cases import pick_eos, truncate
from hash_lm import HashLM, LetterTokenizer
from speculation_cases import (
    BRANCHES,
    HASH_BRANCHES,
    HASH_PREFIX,
    NO_EOS,
    PREFIX,
    STEPS,
    cut_at_stop,
    hash_expected,
    outputs,
    run,
    tiny_references,
)
from tiny_models import combos, tiny_model

from multidecode.proposers import UNDER_LEAF, BranchContext, DraftTree
from multidecode.proposers.suffix import TRIE_ROOT, SuffixProposer, SuffixStore, shared_store
from multidecode.scheduler import CompactionPolicy
from multidecode.speculation import Speculation


# ---------------------------------------------------------------------- helpers
def substring_counts(sequences, depth: int) -> Counter:
    """Brute force: every substring of at most `depth` tokens of each sequence, with its count."""
    counts: Counter = Counter()
    for s in sequences:
        for i in range(len(s)):
            for k in range(1, min(depth, len(s) - i) + 1):
                counts[tuple(s[i : i + k])] += 1
    return counts


def trie(store: SuffixStore) -> dict[tuple[int, ...], int]:
    """path -> node id of every node below the root."""
    out, stack = {}, [((), TRIE_ROOT)]
    while stack:
        path, node = stack.pop()
        for token, child in store.children(node):
            out[path + (token,)] = child
            stack.append((path + (token,), child))
    return out


def check(store: SuffixStore, sequences) -> None:
    """The store holds exactly `sequences`: counts, continuation totals, node and token counts."""
    nodes = trie(store)
    expected = substring_counts(sequences, store.max_depth)
    assert {path: store._count[n] for path, n in nodes.items()} == expected
    for node in [TRIE_ROOT, *nodes.values()]:
        assert store._cont[node] == sum(store._count[c] for _, c in store.children(node))
    assert store.nodes == len(expected)
    assert store.tokens == sum(len(s) for s in sequences)


def stored(store: SuffixStore) -> list[list[int]]:
    return [list(r.tokens) for r in store._sequences.values()]


def generate(proposer, prompt, target, budget: int = 8) -> tuple[int, int, list[DraftTree]]:
    """Decode `target` after `prompt` as the scheduler would, with a perfect verifier: each step
    accepts the draft's longest path that agrees with the target, then one token more. Returns
    (steps, accepted draft tokens, the drafts)."""
    context = BranchContext(list(prompt), len(prompt))
    steps = accepted = done = 0
    drafts = []
    while done < len(target):
        draft = proposer.propose(context, budget)
        drafts.append(draft)
        path, at = [], UNDER_LEAF
        while done + len(path) < len(target) - 1:
            at = draft.child(at, target[done + len(path)])
            if at is None:
                break
            path.append(at)
        context.tokens += [draft.tokens[i] for i in path] + [target[done + len(path)]]
        done += len(path) + 1
        proposer.observe(context, draft, path)
        steps, accepted = steps + 1, accepted + len(path)
    assert context.tokens == list(prompt) + list(target)
    return steps, accepted, drafts


def occurs_in(sequences, pattern: tuple[int, ...]) -> bool:
    return any(s[i : i + len(pattern)] == pattern for s in sequences for i in range(len(s) - len(pattern) + 1))


def novel(rng: random.Random, n: int, low: int = 1000, high: int = 10**6) -> list[int]:
    """n tokens unlikely to repeat anything."""
    return [rng.randrange(low, high) for _ in range(n)]


# ---------------------------------------------------------------------- the trie
def test_counts_are_the_substring_counts_of_the_stored_sequences():
    """Three sequences over four tokens, grown in interleaved chunks of random size: every node's
    count is its substring's count, each node's continuation total is its children's sum."""
    rng = random.Random(1)
    store = SuffixStore(max_depth=5)
    ids = [store.start() for _ in range(3)]
    seqs: list[list[int]] = [[], [], []]
    for _ in range(40):
        i = rng.randrange(3)
        chunk = [rng.randrange(4) for _ in range(rng.randrange(0, 5))]
        store.extend(ids[i], chunk)
        seqs[i] += chunk
        check(store, seqs)
    assert store.count([0]) == sum(s.count(0) for s in seqs)
    assert sum(store.continuations([1]).values()) == sum(1 for s in seqs for a, _ in itertools.pairwise(s) if a == 1)


def test_forgetting_takes_back_exactly_one_sequence_and_reuses_its_nodes():
    rng = random.Random(2)
    store = SuffixStore(max_depth=6)
    seqs = {store.add(s): s for s in ([rng.randrange(5) for _ in range(rng.randrange(1, 30))] for _ in range(6))}
    check(store, seqs.values())
    allocated = store._top
    for seq in rng.sample(sorted(seqs), len(seqs)):
        store.forget(seq)
        del seqs[seq]
        check(store, seqs.values())
    assert store.nodes == store.tokens == 0 and not store._more and not list(store.children(TRIE_ROOT))
    assert len(store._free) == allocated - 1
    store.add([rng.randrange(5) for _ in range(20)])
    assert store._top == allocated  # freed ids were reused


def test_the_node_cap_removes_least_recently_used_sequences():
    """Sequences of novel tokens, 74 nodes each at depth 4, under a cap of 200 nodes: never more
    than 200, oldest out first, and a sequence touched (a draft from it accepted) stays."""
    rng = random.Random(3)
    store = SuffixStore(max_depth=4, max_nodes=200)
    seqs = {}
    for _ in range(6):
        s = novel(rng, 20)
        seqs[store.add(s)] = s
        assert store.nodes <= 200
    assert sorted(store._sequences) == [4, 5] and store.evicted == 4
    check(store, [seqs[4], seqs[5]])
    store.touch(4)
    store.add(novel(rng, 20))
    assert sorted(store._sequences) == [4, 6]
    store.touch(123)  # a sequence long gone: nothing


def test_the_token_cap_holds_for_repeated_text():
    """Repeated text adds tokens but no nodes: the token cap still bounds the store."""
    store = SuffixStore(max_depth=4, max_tokens=50)
    text = [7, 8, 9] * 5
    for _ in range(10):
        store.add(text)
        assert store.tokens <= 50
    assert len(store) == 3
    check(store, stored(store))


def test_a_sequence_alone_over_the_cap_loses_its_oldest_occurrences():
    """One long sequence of novel tokens under a small node cap: it is cut from the front, its
    recent text stays matchable, and the counts are those of what is left."""
    rng = random.Random(4)
    store = SuffixStore(max_depth=4, max_nodes=100)
    proposer = SuffixProposer(store=store, max_match=3)
    text = novel(rng, 30)
    context = BranchContext(list(text), 30)
    for _ in range(20):
        proposer.propose(context, 1)
        context.tokens += text[:10]  # text repeats: its start follows
        assert store.nodes <= 100
        check(store, stored(store))
    assert len(store) == 1 and store.tokens < len(context.tokens)
    assert proposer.propose(context, 1).tokens == [text[0]]  # what followed text[7:10] lately


# ---------------------------------------------------------------------- drafts
def test_the_draft_grows_with_the_match_length():
    """After one novel stretch of 60 tokens, a context matching its last m tokens before
    position 20 drafts the next min(budget, alpha * m) tokens, as one chain."""
    rng = random.Random(5)
    store = SuffixStore()
    history = novel(rng, 60)
    store.add(history)
    for alpha, budget in ((1.0, 8), (0.5, 8), (2.0, 16)):
        proposer = SuffixProposer(store=store, alpha=alpha)
        sizes = []
        for m in (1, 2, 3, 4, 6, 8, 12):
            context = BranchContext([5] + history[20 - m : 20], m + 1)
            draft = proposer.propose(context, budget)
            size = min(budget, max(1, int(alpha * m)))
            assert draft.tokens == history[20 : 20 + size]
            assert draft.parents == list(range(-1, size - 1))
            assert draft.kinds == [min(m, 8)] * size
            sizes.append(len(draft))
        assert sizes == sorted(sizes) and sizes[0] < sizes[-1]


def test_rare_continuations_are_pruned():
    """After [10, 11, 12]: 20 (then 21) nine times, 30 (then 31) once. Best first: 20, 21; 30
    only when its frequency (0.1) passes min_probability and its path score min_score."""
    store = SuffixStore()
    for _ in range(9):
        store.add([10, 11, 12, 20, 21])
    store.add([10, 11, 12, 30, 31])

    def draft(**kw):
        return SuffixProposer(store=store, **kw).propose(BranchContext([99, 10, 11, 12], 4), 8)

    assert draft(min_probability=0.2).tokens == [20, 21]
    tree = draft(min_probability=0.05, min_score=0.05)
    assert tree.tokens == [20, 21, 30] and tree.parents == [-1, 0, -1]
    assert tree.priors[0] == pytest.approx(9 / 11) and tree.priors[2] == pytest.approx(1 / 11)
    assert draft(min_probability=0.05, min_score=0.2).tokens == [20, 21]


def test_path_scores_fall_along_the_path_and_ties_go_to_the_most_recent():
    """After [10, 11, 12] came 20, then 21 23 (five times) or 22 24 (five times, later): best
    first by path score (20: 1, the rest 0.5), the later continuation first on a tie; a path
    score floor of 0.6 keeps 20 alone."""
    store = SuffixStore()
    for tail in ([21, 23],) * 5 + ([22, 24],) * 5:
        store.add([10, 11, 12, 20, *tail])

    def draft(**kw):
        return SuffixProposer(store=store, alpha=3.0, **kw).propose(BranchContext([99, 10, 11, 12], 4), 8)

    tree = draft(min_score=0.0)
    assert tree.tokens == [20, 22, 24, 21, 23] and tree.parents == [-1, 0, 1, 0, 3]
    assert tree.ranks() == [0, 0, 0, 1, 0]
    assert draft(min_score=0.6).tokens == [20]


def test_drafts_are_trees_of_continuations_that_occurred_after_the_longest_match():
    """Random histories over 6 tokens and random contexts: each draft has at most `budget` nodes,
    parents first, distinct siblings, the best continuation first; the match is the longest
    (up to D - budget) suffix that was followed before, and every draft path followed it."""
    rng = random.Random(6)
    depth, budget = 10, 4
    matched = 0
    for _ in range(30):
        store = SuffixStore(max_depth=depth)
        proposer = SuffixProposer(store=store, min_probability=0.0, min_score=0.0, alpha=2.0)
        history = [[rng.randrange(6) for _ in range(rng.randrange(5, 40))] for _ in range(3)]
        for s in history:
            store.add(s)
        context = BranchContext([rng.randrange(6) for _ in range(rng.randrange(1, 15))], 1)
        draft = proposer.propose(context, budget)
        text = [tuple(s) for s in (*history, context.tokens)]
        occurs = functools.partial(occurs_in, text)
        tokens = context.tokens
        match = next((m for m in range(min(depth - budget, len(tokens)), 0, -1)
                      if any(occurs(tuple(tokens[-m:]) + (t,)) for t in range(6))), 0)
        if not match:
            assert len(draft) == 0
            continue
        matched += 1
        assert 0 < len(draft) <= min(budget, 2 * match)
        assert draft.kinds == [min(match, 8)] * len(draft)
        paths: list[tuple[int, ...]] = []
        for i, (token, parent) in enumerate(zip(draft.tokens, draft.parents)):
            assert parent < i
            paths.append((paths[parent] if parent >= 0 else ()) + (token,))
            assert occurs(tuple(tokens[-match:]) + paths[-1])
            assert 0 < draft.priors[i] < 1
        assert len(set(paths)) == len(paths)
        follow = store.continuations(tokens[-match:])
        assert draft.tokens[0] in [t for t, c in follow.items() if c == max(follow.values())]
    assert matched >= 20


def test_a_second_pass_drafts_the_first_pass_continuation_in_full():
    """A first pass over novel text drafts next to nothing; a second pass with the same prompt
    drafts all of it: its first draft is the first 8 tokens, and every step is accepted in full."""
    rng = random.Random(7)
    proposer = SuffixProposer(store=SuffixStore())
    prompt, target = novel(rng, 12), novel(rng, 60)
    steps, accepted, _ = generate(proposer, prompt, target)
    assert accepted == 0 and steps == 60
    steps, accepted, drafts = generate(proposer, prompt, target)
    assert drafts[0].tokens == target[:8] and drafts[0].parents == list(range(-1, 7))
    assert steps == -(-60 // 9) and accepted == 60 - steps


def test_parallel_branches_draft_from_each_other():
    """Two branches of one prompt: once one has produced tokens, the other drafts them."""
    rng = random.Random(8)
    proposer = SuffixProposer(store=SuffixStore())
    prompt = novel(rng, 10)
    first, second = BranchContext(list(prompt), 10), BranchContext(list(prompt), 10)
    assert len(proposer.propose(first, 8)) == 0 and len(proposer.propose(second, 8)) == 0
    output = novel(rng, 8)
    first.tokens += output
    proposer.propose(first, 8)
    assert proposer.propose(second, 8).tokens == output


def test_an_accepted_draft_keeps_its_source_sequence():
    """A draft taken from sequence A and accepted makes A recently used: the next eviction takes
    B, which was stored after A; without the acceptance it takes A."""
    rng = random.Random(9)
    for accept in (True, False):
        store = SuffixStore()
        a, b = novel(rng, 10), novel(rng, 10)
        seq_a, seq_b = store.add(a), store.add(b)
        proposer = SuffixProposer(store=store)
        context = BranchContext([3] + a[:4], 5)
        draft = proposer.propose(context, 3)
        assert draft.tokens == a[4:7]
        taken = [0, 1] if accept else []
        context.tokens += [draft.tokens[i] for i in taken] + [a[4 + len(taken)]]
        proposer.observe(context, draft, taken)
        store.max_tokens = store.tokens + 5
        store.add(novel(rng, 10))
        assert (seq_a in store, seq_b in store) == ((True, False) if accept else (False, True))


def test_a_branch_whose_sequence_was_evicted_starts_again_from_its_last_tokens():
    rng = random.Random(10)
    store = SuffixStore(max_depth=4, max_tokens=60)
    proposer = SuffixProposer(store=store, max_match=3)
    text = novel(rng, 6)
    context = BranchContext(text * 2, 12)
    assert proposer.propose(context, 1).tokens == [text[0]]
    old = context.scratch["suffix"].seq
    for _ in range(3):
        store.add(novel(rng, 20))
    assert old not in store
    context.tokens += text[:2]
    assert proposer.propose(context, 1).tokens == []  # only its last 4 tokens are stored now
    assert context.scratch["suffix"].seq in store and store.count(text[:2]) == 1
    check(store, stored(store))


def test_a_context_that_changed_under_the_proposer_is_stored_afresh():
    store = SuffixStore()
    proposer = SuffixProposer(store=store)
    context = BranchContext([1, 2, 3, 1, 2], 5)
    assert proposer.propose(context, 4).tokens == [3, 1]  # a match of 2: 2 nodes
    context.tokens[:] = [7, 8]
    assert proposer.propose(context, 4).tokens == []
    assert store.count([7, 8]) == 1 and len(store) == 2


def test_arguments_are_checked_and_the_shared_store_is_one_per_key():
    for kw in (dict(alpha=0), dict(min_probability=1.5), dict(min_score=-1), dict(max_match=0)):
        with pytest.raises(ValueError):
            SuffixProposer(store=SuffixStore(), **kw)
    with pytest.raises(ValueError):
        SuffixStore(max_depth=1)
    with pytest.raises(ValueError):
        SuffixStore(max_nodes=0)
    assert shared_store() is shared_store() is SuffixProposer().store
    assert shared_store("other") is not shared_store()
    assert SuffixProposer.name == "suffix"
    assert len(SuffixProposer(store=SuffixStore()).propose(BranchContext([1, 2], 2), 0)) == 0


# ---------------------------------------------------------------------- exactness: HashLM
def seeded(prompts, answers) -> SuffixStore:
    """A store that has seen each prompt followed by its answer."""
    store = SuffixStore()
    for prompt, answer in zip(prompts, answers):
        store.add(prompt + answer)
    return store


def suffix(store: SuffixStore, budget: int = 8) -> Speculation:
    return Speculation(SuffixProposer(store=store), budget=budget)


HASH_PROMPTS = [HASH_PREFIX + b for b in HASH_BRANCHES]


def test_hash_model_stop_strings_cut_inside_drafts():
    """A store that saw the answers drafts through the stop string; each branch ends where
    sequential decoding would, text cut before the stop string."""
    tokenizer = LetterTokenizer()
    full = hash_expected(HASH_PREFIX, HASH_BRANCHES, 40)
    stop = tokenizer.decode(full[0][6:8])
    expected_text = cut_at_stop([tokenizer.decode(out) for out in full], stop)
    for store in (SuffixStore(), seeded(HASH_PROMPTS, full)):
        forest = run(HashLM(), HASH_PREFIX, HASH_BRANCHES, speculate=suffix(store), max_new_tokens=40,
                     tokenizer=tokenizer, stop=[stop])
        assert [b.output.text for b in forest.branches] == expected_text
        for b, out in zip(forest.branches, full):
            assert b.output.token_ids == out[: len(b.output.token_ids)]
    assert forest.branches[0].output.finish_reason == "stop" and forest.stats.steps <= 8


def test_hash_model_eos_inside_drafts_with_compaction_every_step():
    full = hash_expected(HASH_PREFIX, HASH_BRANCHES, 40)
    eos = {full[1][5], full[2][9]}
    expected = hash_expected(HASH_PREFIX, HASH_BRANCHES, 40, eos)
    assert len({len(e) for e in expected}) > 1
    for store in (SuffixStore(), seeded(HASH_PROMPTS, expected)):
        forest = run(HashLM(), HASH_PREFIX, HASH_BRANCHES, speculate=suffix(store), max_new_tokens=40, eos=eos,
                     compaction=CompactionPolicy(every=1))
        assert outputs(forest) == expected
    assert forest.stats.steps <= 8  # 40 without drafts


def test_a_workload_run_twice_through_one_store_is_far_faster_the_second_time():
    """The same four branches twice, one store: the same tokens, and the second run, drafting
    from the first's outputs, emits several tokens per forward."""
    store = SuffixStore()
    expected = hash_expected(HASH_PREFIX, HASH_BRANCHES, 60)
    first = run(HashLM(), HASH_PREFIX, HASH_BRANCHES, speculate=suffix(store), max_new_tokens=60)
    second = run(HashLM(), HASH_PREFIX, HASH_BRANCHES, speculate=suffix(store), max_new_tokens=60)
    assert outputs(first) == outputs(second) == expected
    assert second.stats.accepted > 3 * max(first.stats.accepted, 1)
    assert second.stats.tokens_per_forward > 2 * first.stats.tokens_per_forward
    assert second.stats.tokens_per_forward > 5


# ---------------------------------------------------------------------- exactness: tiny transformers models
@pytest.mark.parametrize("arch, attn", combos())
def test_suffix_equals_generate(arch, attn):
    """On every architecture: a fresh store (drafts from the prompts, mostly rejected), a store
    that saw the answers (branches stop at eos and at max_new_tokens inside accepted drafts,
    compacted every step), and the same workload again through the first store: generate's
    tokens every time."""
    model = tiny_model(arch, attn)
    full = tiny_references(arch, attn)
    eos = set(pick_eos(full, STEPS))
    expected = truncate(full, eos)
    prompts = [PREFIX + b for b in BRANCHES]
    fresh = SuffixStore()
    steps = []
    for store in (fresh, seeded(prompts, expected), fresh):
        forest = run(model, PREFIX, BRANCHES, speculate=suffix(store), max_new_tokens=STEPS, eos=eos,
                     compaction=CompactionPolicy(every=1))
        assert outputs(forest) == expected
        steps.append(forest.stats.steps)
    assert steps[1] <= 5 and steps[2] < steps[0]  # 20 tokens at up to 9 a step; the second pass drafts the first
    forest = run(model, PREFIX, BRANCHES, speculate=suffix(seeded(prompts, full)), max_new_tokens=STEPS,
                 eos=[NO_EOS])
    assert outputs(forest) == full and forest.stats.steps <= 5
