"""The cost model, acceptance tracking, the draft budget, prompt lookup and draft trees: plain data,
plus one measurement on a tiny model."""

from __future__ import annotations

import itertools
import json
import os

import pytest
import torch
from hash_lm import HashLM
from tiny_models import tiny_model

from multidecode import cost
from multidecode.cost import AcceptanceTracker, CostCurve, choose_draft_count, cost_curve, measure_cost
from multidecode.errors import InvalidArgument
from multidecode.proposers import UNDER_LEAF, BranchContext, DraftTree
from multidecode.proposers.lookup import PromptLookup
from multidecode.speculation import AUTO_MAX_DRAFT, DEFAULT_BUDGET, Speculation, build_speculation


# ---------------------------------------------------------------------- the cost curve
def test_curve_interpolates_and_extrapolates():
    curve = CostCurve((1, 2, 8), (100, 1000), ((1.0, 1.7, 2.0), (2.0, 3.0, 5.0)))
    assert curve.time(1, 100) == 1.0 and curve.time(8, 1000) == 5.0
    assert curve.time(5, 100) == pytest.approx(1.85)  # between 2 and 8
    assert curve.time(14, 100) == pytest.approx(2.3)  # past the end, on the last slope
    assert curve.time(1, 550) == pytest.approx(1.5)  # between the two contexts
    assert curve.relative(2, 100) == pytest.approx(1.7)
    assert CostCurve.from_dict(json.loads(json.dumps(curve.as_dict()))) == curve


def test_the_budget_follows_the_cost_of_rows():
    chances = [0.9, 0.8, 0.5, 0.2, 0.05]
    gpu = CostCurve.from_relative({1: 1.0, 64: 1.05})
    # a CPU where one row takes a matrix-vector path (measured on one such machine: 2 rows 1.73x)
    cpu_single = CostCurve.from_relative({1: 1.0, 2: 1.73, 8: 1.79, 16: 2.21, 64: 3.79})
    assert choose_draft_count(gpu, required=1, expected=1, chances=chances) == 5
    # one branch there: 2 rows cost 1.73x, but 2 to 8 rows cost alike, so once a draft pays,
    # the cheap rows after it do too: 2.45 more tokens for 1.77x
    assert choose_draft_count(cpu_single, required=1, expected=1, chances=chances) == 5
    assert choose_draft_count(cpu_single, required=1, expected=1, chances=[0.8, 0.1]) == 2
    assert choose_draft_count(cpu_single, required=1, expected=1, chances=[0.6, 0.1]) == 0
    assert choose_draft_count(cpu_single, required=1, expected=1, chances=[0.3, 0.2]) == 0
    # eight branches already pay for the wide matrix product: drafts ride along
    assert choose_draft_count(cpu_single, required=8, expected=8, chances=[0.6, 0.5]) == 2
    assert choose_draft_count(cpu_single, required=1, expected=1, chances=[]) == 0


# ---------------------------------------------------------------------- acceptance
def _chain(tokens, kind=3):
    draft = DraftTree()
    parent = UNDER_LEAF
    for t in tokens:
        parent = draft.add(t, parent, kind=kind, prior=0.5)
    return draft


def test_the_tracker_learns_from_proposals_that_were_never_fed():
    """A branch whose drafts always come true: rates climb from the prior without a single draft
    fed; one whose drafts never do: they fall."""
    tracker = AcceptanceTracker()
    good, bad = [], []
    for step in range(12):
        tracker.record_proposal(0, len(good), _chain([step, step + 1, step + 2]))
        tracker.record_proposal(1, len(bad), _chain([99, 98]))
        good.append(step)
        bad.append(step)
        tracker.score_proposals(0, good, False)
        tracker.score_proposals(1, bad, False)
    assert tracker.rate(0, (3, False), 0.5) > 0.8
    assert tracker.rate(1, (3, False), 0.5) < 0.2
    chances = tracker.node_chances(0, _chain([1, 2, 3]))
    assert chances[0] > chances[1] > chances[2] > 0.4


def test_a_branch_without_history_borrows_the_groups_rates():
    tracker = AcceptanceTracker()
    out = []
    for step in range(10):
        tracker.record_proposal(0, len(out), _chain([step]))
        out.append(step)
        tracker.score_proposals(0, out, False)
    assert tracker.rate(5, (3, False), 0.1) > 0.7  # branch 5 has seen nothing yet


def test_siblings_are_alternatives_with_their_own_rate():
    draft = DraftTree()
    draft.add(1, kind=2)
    draft.add(2, kind=2)
    assert draft.ranks() == [0, 1]
    tracker = AcceptanceTracker()
    tracker.record_proposal(0, 0, draft)
    tracker.score_proposals(0, [2], False)  # the alternative came true
    assert tracker.pooled[(2, True)].accepted == 1 and tracker.pooled[(2, False)].tried == 1


# ---------------------------------------------------------------------- measuring, and keeping it on disk
def test_measure_cost_on_a_tiny_model_is_monotone():
    curve = measure_cost(tiny_model("llama", "sdpa"), sizes=(1, 2, 4, 8), contexts=(16, 64), repeats=1)
    assert curve.sizes == (1, 2, 4, 8) and curve.contexts == (16, 64)
    for row in curve.seconds:
        assert all(b >= a > 0 for a, b in itertools.pairwise(row))


def test_the_curve_is_measured_once_and_kept(tmp_path, monkeypatch):
    model = HashLM()
    monkeypatch.setattr(cost, "_CURVES", {})
    monkeypatch.setenv("MULTIDECODE_COSTS", str(tmp_path / "elsewhere"))
    assert cost.costs_dir() == tmp_path / "elsewhere"
    first = cost_curve(model, folder=tmp_path)
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1 and first.key in files[0].name
    monkeypatch.setattr(cost, "_CURVES", {})
    monkeypatch.setattr(cost, "measure_cost", lambda *a, **k: pytest.fail("measured again"))
    assert cost_curve(model, folder=tmp_path) == first
    assert cost_curve(HashLM(max_positions=999), folder=tmp_path, measure=False) is None  # another model
    assert cost.device_name(torch.device("cpu")).endswith(f"x{os.cpu_count()}")  # the CPU's model and cores


# ---------------------------------------------------------------------- prompt lookup
def test_lookup_continues_the_longest_match_newest_first():
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 4, 6, 7, 0, 3, 4]
    draft = PromptLookup(max_matches=2).propose(BranchContext(tokens, 5), budget=6)
    # "3 4" matched, newest first: ... 3 4 | 6 7 0 3 4  and  ... 3 4 | 5 9 2 3 4 -> siblings 6 and 5
    assert draft.tokens[:5] == [6, 7, 0, 3, 4] and draft.parents[:5] == [-1, 0, 1, 2, 3]
    assert draft.tokens[5] == 5 and draft.parents[5] == -1
    assert set(draft.kinds) == {2}


def test_lookup_prefers_longer_matches_and_respects_the_budget():
    tokens = [8, 1, 2, 3, 50, 51, 9, 2, 3, 60, 61, 1, 2, 3]
    draft = PromptLookup().propose(BranchContext(tokens, 3), budget=2)
    assert draft.tokens == [50, 51] and draft.kinds == [3, 3]  # the 3-gram "1 2 3", not the 2-gram "2 3"
    assert len(PromptLookup().propose(BranchContext([1, 2, 3, 4], 2), budget=5)) == 0  # nothing repeats


def test_the_incremental_index_equals_a_fresh_one():
    lookup = PromptLookup()
    context = BranchContext([3, 1, 4, 1, 5], 5)
    for token in [9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2, 7, 9, 5]:
        context.tokens.append(token)
        incremental = lookup.propose(context, budget=4)
        fresh = lookup.propose(BranchContext(list(context.tokens), 5), budget=4)
        assert (incremental.tokens, incremental.parents) == (fresh.tokens, fresh.parents)


def test_draft_tree_keep_and_truncate():
    draft = DraftTree()
    a = draft.add(1)
    b = draft.add(2, a)
    draft.add(3, b)
    draft.add(4)
    assert draft.depths() == [1, 2, 3, 1]
    assert draft.truncate(10, max_depth=2).tokens == [1, 2, 4]
    assert draft.truncate(2).tokens == [1, 2]
    with pytest.raises(ValueError):
        draft.keep([1])  # without its parent
    draft.add_path([1, 2, 9])  # merges into the existing 1 -> 2
    assert draft.tokens[-1] == 9 and draft.parents[-1] == b


# ---------------------------------------------------------------------- speculate= values
def test_resolve_speculation_settings():
    import torch

    assert build_speculation(None, torch.float32) is None
    assert build_speculation("lookup", torch.float32).budget == DEFAULT_BUDGET
    auto = build_speculation("auto", torch.float32)
    assert auto.auto and auto.size == AUTO_MAX_DRAFT and auto.name == "auto"
    assert build_speculation("lookup", torch.float32, budget=3).budget == 3
    assert build_speculation(PromptLookup(), torch.float32).proposer.name == "lookup"
    assert build_speculation("auto", torch.bfloat16) is None  # auto does not speculate where it cannot be exact
    with pytest.raises(InvalidArgument, match="cannot be exact in bfloat16"):
        build_speculation("lookup", torch.bfloat16)
    with pytest.raises(InvalidArgument, match="unknown speculation mode 'hydra'"):
        build_speculation("hydra", torch.float32)
    with pytest.raises(InvalidArgument, match="positive integer"):
        build_speculation("lookup", torch.float32, budget=0)
    with pytest.raises(InvalidArgument, match="positive integer"):
        Speculation(PromptLookup(), budget=-2)
    with pytest.raises(InvalidArgument, match="needs a Proposer"):
        Speculation("lookup")
