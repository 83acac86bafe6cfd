"""The forest's removal of rejected nodes, the engine's rollback, and the scheduler, without a model.

Forest tests use plain data. Scheduler tests run on `HashLM`, a model-free stand-in whose
next-token logits are a fixed function of the visible path, so results are checked against its
sequential rule in microseconds.
"""

from __future__ import annotations

import pytest
import torch
from hash_lm import HashLM, path_logits, reference

from multidecode.branches import BranchGroup, start
from multidecode.cost import CostCurve
from multidecode.engine import Engine
from multidecode.errors import InvalidArgument
from multidecode.forest import EVERYONE, ROOT, Forest, unchanged_prefix
from multidecode.proposers.lookup import PromptLookup
from multidecode.sampling_params import SamplingParams
from multidecode.scheduler import CompactionPolicy, Feed, Scheduler, Settled, Work
from multidecode.speculation import Speculation
from multidecode.stopping import StopRule
from multidecode.strategies.margins import prompt_logits

PROMPT = [5, 9, 14, 3, 5, 9, 14, 8]


# ---------------------------------------------------------------------- forest: removal
def test_removing_a_rejected_subtree_restores_child_counts_and_leaves():
    f = Forest()
    trunk = f.add_chain([1, 2, 3])
    f.place(trunk)
    drafts = f.add([7, 8, 9], [trunk[-1], -2, trunk[-1]])  # 7 -> 8, and 9 beside 7
    f.place(drafts)
    f.attention_rows(drafts)
    assert not f.is_leaf(trunk[-1]) and f.children_count(trunk[-1]) == 2
    f.remove([drafts[1], drafts[2]])  # keep 7 only
    assert f.children_count(trunk[-1]) == 1 and f.is_leaf(drafts[0])
    f.compact(torch.tensor([0, 1, 2, 3]))
    assert f.num_slots == 4 and f.slot_of[drafts[0]] == 3 and f.slot_of[drafts[1]] is None
    assert f.is_removed(drafts[1]) and not f.is_removed(drafts[0])


def test_rows_after_removal_see_the_accepted_path_only():
    f = Forest()
    trunk = f.add_chain([1, 2])
    f.place(trunk)
    drafts = f.add([5, 6, 7], [trunk[-1], trunk[-1], -3])  # 5, 6 siblings; 7 under 6
    f.place(drafts)
    f.attention_rows(drafts)
    f.remove([drafts[0]])  # reject 5; 6 and 7 stay
    f.compact(torch.tensor([0, 1, 3, 4]))
    new = f.add([9], [drafts[2]])
    f.place(new)
    row = f.attention_rows(new)[0]
    assert row.tolist() == [True, True, True, True, True]  # 1, 2, 6, 7 and itself, no gap left
    assert f.path_tokens(new[0]) == [1, 2, 6, 7, 9]


def test_removal_refuses_a_node_whose_children_stay():
    f = Forest()
    nodes = f.add_chain([1, 2, 3])
    f.place(nodes)
    with pytest.raises(ValueError, match="children"):
        f.remove([nodes[1]])
    f.remove([nodes[2]])
    with pytest.raises(ValueError, match="already removed"):
        f.remove([nodes[2]])


def test_a_removed_node_cannot_be_a_parent():
    f = Forest()
    nodes = f.add_chain([1, 2])
    f.place(nodes)
    f.remove([nodes[1]])
    with pytest.raises(ValueError, match="removed"):
        f.add([3], [nodes[1]])


@pytest.mark.parametrize("keep, first", [([0, 1, 2], 3), ([0, 1, 3], 2), ([1, 2], 0), ([], 0), ([0, 2, 5, 9], 1)])
def test_unchanged_prefix(keep, first):
    assert unchanged_prefix(keep) == first
    assert unchanged_prefix(torch.tensor(keep, dtype=torch.long)) == first


def test_compaction_plan_of_one_owner_keeps_every_other_owners_slots():
    f = Forest()
    a = f.add([1, 2, 3], [ROOT, -2, -3], owners=["a"] * 3)
    b = f.add([4, 5], [ROOT, -2], owners=["b"] * 2)
    f.place(a + b)
    f.attention_rows(a + b)
    assert f.compaction_plan([], owner="a").tolist() == [3, 4]  # all of a goes, all of b stays
    assert f.compaction_plan([a[1]], owner="a").tolist() == [0, 1, 3, 4]
    assert f.compaction_plan([a[1]], owner=EVERYONE).tolist() == [0, 1]


# ---------------------------------------------------------------------- engine: rollback moves only the tail
def test_drop_moves_only_the_accepted_tail_and_crops():
    engine = Engine(HashLM())
    prompt = engine.feed_chain(PROMPT).nodes
    keys_before = engine.cache.layers[0].keys.clone()
    nodes = engine.feed([10, 11, 12, 13], [prompt[-1], -2, prompt[-1], -4], logits_for=range(4)).nodes
    accepted_keys = engine.cache.layers[0].keys[:, :, [len(PROMPT) + 2, len(PROMPT) + 3]].clone()
    engine.drop(nodes[:2])  # reject 10 -> 11, keep 12 -> 13
    layer = engine.cache.layers[0]
    assert layer.length == len(PROMPT) + 2 == engine.forest.num_slots
    torch.testing.assert_close(layer.keys[:, :, : len(PROMPT)], keys_before)  # the prefix never moved
    torch.testing.assert_close(layer.keys[:, :, len(PROMPT):], accepted_keys)
    assert engine.forest.path_tokens(nodes[3]) == PROMPT + [12, 13]
    logits = engine.feed([20], [nodes[3]], logits_for=[0]).logits
    torch.testing.assert_close(logits[0], path_logits(PROMPT + [12, 13, 20]).float(), rtol=0, atol=0)
    assert engine.stats.rolled_back == 2


# ---------------------------------------------------------------------- scheduler
def group(prompt, max_new_tokens, speculation=None, n=1):
    return BranchGroup([], [list(prompt)] * n, rule=StopRule(max_new_tokens), sampling=[SamplingParams()] * n,
                       speculation=speculation)


def test_works_admitted_between_steps_share_forwards_and_stay_exact():
    """A second prompt joins a running forest three steps late; both equal their sequential
    decoding, and the steps they share are single forwards."""
    model = HashLM()
    scheduler = Scheduler(Engine(model))
    first = scheduler.admit(group(PROMPT, 12))
    for _ in range(3):
        scheduler.step()
    second = scheduler.admit(group([7, 7, 1, 30], 6))
    calls = model.calls
    while not scheduler.idle:
        scheduler.step()
    assert first.branches[0].output.token_ids == reference(PROMPT, 12)
    assert second.branches[0].output.token_ids == reference([7, 7, 1, 30], 6)
    assert model.calls - calls == 12 - 3  # 9 more steps for the first; the second rode along
    assert scheduler.idle


def test_compacting_one_owner_never_touches_another():
    """Two groups of branches on one engine; the first finishes, is retired, and its slots go; the
    second's cache is untouched until its own compaction and its output stays exact."""
    model = HashLM()
    scheduler = Scheduler(Engine(model), compaction=CompactionPolicy(every=1))
    short = scheduler.admit(BranchGroup(PROMPT, [[1], [2, 3]], rule=StopRule(3), sampling=[SamplingParams()] * 2))
    long = scheduler.admit(BranchGroup([4, 4, 6], [[8], [9, 9]], rule=StopRule(10), sampling=[SamplingParams()] * 2))
    scheduler.step()
    scheduler.step()
    scheduler.step()  # the short group is done
    assert short.done and not long.done
    owners = scheduler.engine.forest.slot_owners()
    assert short.owner in owners and short.owner != long.owner  # retired; its slots go before the next feed
    scheduler.step()
    owners = scheduler.engine.forest.slot_owners()
    assert short.owner not in owners and owners.count(long.owner) == scheduler.engine.forest.num_slots
    scheduler.run()
    assert [b.output.token_ids for b in long.branches] == [reference([4, 4, 6, 8], 10), reference([4, 4, 6, 9, 9], 10)]
    assert [b.output.token_ids for b in short.branches] == [reference(PROMPT + [1], 3), reference(PROMPT + [2, 3], 3)]


class _Refusing(BranchGroup):
    """A group whose own input is refused in the middle of a step (as a grammar llguidance's parser
    gives up on is): in its `phase` ("plan" or "settle") of its second step."""

    def __init__(self, phase: str, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.phase, self.steps_seen = phase, 0

    def plan(self):
        if self.phase == "plan" and self.steps_seen == 1:
            raise InvalidArgument("this work's own input is refused")
        return super().plan()

    def settle(self, fed, result):
        self.steps_seen += 1
        if self.phase == "settle" and self.steps_seen == 2:
            raise InvalidArgument("this work's own input is refused")
        return super().settle(fed, result)


@pytest.mark.parametrize("phase", ["plan", "settle"])
def test_a_work_refused_mid_decode_ends_alone_and_the_others_go_on(phase):
    """A `MultiDecodeError` from one work's plan or settle raised out of the shared step, so every
    work on the scheduler failed with it (another client's request, another batch line). That work
    ends alone (its `failure`, done, its slots freed); the others finish exact, and `run` raises it."""
    scheduler = Scheduler(Engine(HashLM()))
    bad = scheduler.admit(_Refusing(phase, PROMPT, [[1]], rule=StopRule(8), sampling=[SamplingParams()]))
    good = scheduler.admit(BranchGroup([4, 4, 6], [[8], [9, 9]], rule=StopRule(8), sampling=[SamplingParams()] * 2))
    scheduler.step()
    scheduler.step()
    assert bad.done and isinstance(bad.failure, InvalidArgument) and bad not in scheduler.works
    assert not good.done and good.failure is None
    scheduler.run(good)
    assert [b.output.token_ids for b in good.branches] == [reference([4, 4, 6, 8], 8), reference([4, 4, 6, 9, 9], 8)]
    assert bad.owner not in scheduler.engine.forest.slot_owners()
    again = Scheduler(Engine(HashLM()))
    again.admit(_Refusing(phase, PROMPT, [[1]], rule=StopRule(8), sampling=[SamplingParams()]))
    with pytest.raises(InvalidArgument, match="refused"):
        again.run()


class _Offer(Work):
    """Feeds one required node and a chain of optional ones with given chances; records what it got."""

    def __init__(self, parent, chances):
        self.parent, self.chances, self.got, self.done = parent, chances, None, False

    def plan(self):
        feed = Feed()
        at = feed.add(1, self.parent)
        for c in self.chances:
            at = feed.add(2, Feed.ref(at), chance=c)
        return feed

    def settle(self, fed, result):
        self.got, self.done = list(fed), True
        return Settled(rejected=list(result.nodes[1:]))

    def live(self):
        return []


@pytest.mark.parametrize("curve, expected", [
    ({1: 1.0, 64: 1.01}, [0, 1, 2, 3]),  # nearly free rows: every draft with a chance is fed
    ({1: 1.0, 2: 1.8, 64: 20.0}, [0]),  # a second row costs 80% more: drafts of 0.5 never pay
])
def test_optional_nodes_are_fed_only_where_they_pay(curve, expected):
    engine = Engine(HashLM())
    prompt = engine.feed_chain(PROMPT).nodes
    scheduler = Scheduler(engine, cost=CostCurve.from_relative(curve))
    work = scheduler.admit(_Offer(prompt[-1], [0.5, 0.4, 0.3]))
    scheduler.step()
    assert work.got == expected
    assert engine.forest.num_slots == len(PROMPT) + 1  # the rejected optional nodes were taken back
    assert scheduler.history[-1].offered == 3


def test_an_optional_node_is_never_fed_without_its_parent():
    engine = Engine(HashLM())
    prompt = engine.feed_chain(PROMPT).nodes
    # the child claims a higher chance than its parent; only what forms a subtree may go
    scheduler = Scheduler(engine, cost=CostCurve.from_relative({1: 1.0, 2: 1.9, 3: 1.95, 64: 30.0}))
    work = scheduler.admit(_Offer(prompt[-1], [0.05, 0.99]))
    scheduler.step()
    assert work.got == [0]


@pytest.mark.parametrize("repeat, forwards", [(1, 1), (10, 2)])
def test_prompt_logits_is_one_feed_for_many_prompts(repeat, forwards):
    """The prompts' common prefix once; a long one (80 tokens) runs plain on its own first, a short
    one goes with the tails in one forward."""
    model = HashLM()
    scheduler = Scheduler(Engine(model))
    prefix = PROMPT * repeat
    prompts = [prefix + [1], prefix + [2, 3], prefix]
    values, stats = prompt_logits(scheduler, prompts)
    for row, prompt in zip(values, prompts):
        torch.testing.assert_close(row, path_logits(prompt).float(), rtol=0, atol=0)
    assert stats["prefix_tokens"] == len(prefix) and stats["forward_passes"] == forwards


def test_start_prefills_before_returning_and_every_branch_speculates_in_the_same_forward():
    model = HashLM()
    scheduler = Scheduler(Engine(model), cost=CostCurve.from_relative({1: 1.0, 512: 1.1}))
    run = start(scheduler, PROMPT, [[5], [9, 14], []], max_new_tokens=20, sampling=[SamplingParams()] * 3,
                speculate=Speculation(PromptLookup(), budget=4))
    assert model.calls == 1 and run.stats.drafted > 0  # the prompts' forward carried drafts already
    run.finish()
    assert [b.output.token_ids for b in run.branches] == [reference(PROMPT + s, 20) for s in ([5], [9, 14], [])]
