"""`Mixture`: several proposers' drafts merged into one tree ("auto"), each member seeing its own
view afterwards; sized lookahead joins only where the cost curve makes its window nearly free."""

from __future__ import annotations

import torch

from multidecode.cost import CostCurve
from multidecode.proposers import UNDER_LEAF, BranchContext, DraftTree, Proposer
from multidecode.proposers.lookahead import Lookahead
from multidecode.proposers.mixture import KIND_STRIDE, Mixture, best_first

GPU_LIKE = CostCurve.from_relative({1: 1.0, 2: 1.01, 64: 1.05, 512: 1.3, 4096: 4.0})
CPU_LIKE = CostCurve.from_relative({1: 1.0, 2: 1.04, 4: 1.44, 16: 2.08, 64: 4.07, 512: 25.0})


class Fixed(Proposer):
    """Proposes fixed paths (and side nodes), and records what it observes."""

    def __init__(self, paths, prior=0.5, sides=(), dists=None) -> None:
        self.paths, self.prior, self.sides, self.dists = paths, prior, sides, dists or {}
        self.seen = []

    def propose(self, context, budget):
        draft = DraftTree()
        for path in self.paths:
            draft.add_path(path, kind=1, prior=self.prior)
        for token in self.sides:
            draft.add_side(token)
        draft.dists = dict(self.dists)
        return draft

    def observe(self, context, draft, accepted, side_logits=None):
        self.seen.append(([draft.tokens[i] for i in accepted], None if side_logits is None else side_logits.tolist()))


def test_members_share_nodes_and_keep_their_own_kinds():
    a, b = Fixed([[5, 6, 7]], prior=0.9), Fixed([[5, 8], [9]], prior=0.4, sides=[30, 31])
    (tree,) = Mixture([a, b]).propose_many([BranchContext([1, 2, 3], 3)], budget=8)
    paths = {}
    for i, (token, parent) in enumerate(zip(tree.tokens, tree.parents)):
        paths[i] = (paths[parent] if parent != UNDER_LEAF else ()) + (token,)
    assert sorted(paths.values()) == [(5,), (5, 6), (5, 6, 7), (5, 8), (9,)]  # 5 is shared
    assert tree.kinds[tree.tokens.index(6)] == 1 and tree.kinds[tree.tokens.index(8)] == KIND_STRIDE + 1
    assert tree.side_tokens == [30, 31]


def test_best_first_orders_by_path_prior_with_parents_first():
    tree = DraftTree()
    low = tree.add(3, prior=0.2)
    tree.add(4, low, prior=1.0)
    high = tree.add(5, prior=0.9)
    tree.add(6, high, prior=0.9)
    ordered = best_first(tree)
    assert ordered.tokens == [5, 6, 3, 4]
    assert all(p < i for i, p in enumerate(ordered.parents))


def test_each_member_observes_its_own_path_and_side_logits():
    a, b = Fixed([[5, 6, 7]], sides=[40]), Fixed([[5, 8]], sides=[30, 31])
    mixture = Mixture([a, b])
    context = BranchContext([1, 2, 3], 3)
    (tree,) = mixture.propose_many([context], budget=8)
    accepted = [tree.tokens.index(5), tree.tokens.index(6)]
    side = torch.arange(3, dtype=torch.float32)[:, None]  # [3 side nodes, 1]
    mixture.observe(context, tree, accepted, side_logits=side)
    assert a.seen == [([5, 6], [[0.0]])]
    assert b.seen == [([5], [[1.0], [2.0]])]


def test_draft_distributions_stay_only_where_one_member_proposed():
    q = torch.full((50,), 1 / 50)
    a = Fixed([[5, 6]], dists={UNDER_LEAF: q, 0: q})
    b = Fixed([[9]])
    (tree,) = Mixture([a, b]).propose_many([BranchContext([1], 1)], budget=8)
    assert list(tree.dists) == [tree.tokens.index(5)]  # under the head both proposed; under 5 only a


def test_lookahead_joins_only_where_its_window_is_nearly_free():
    mixture = Mixture([Fixed([[5]])], lookahead=True)
    mixture.fit(GPU_LIKE, branches=1, budget=16)
    assert any(isinstance(m, Lookahead) for m in mixture.members)
    mixture.fit(CPU_LIKE, branches=1, budget=16)
    assert not any(isinstance(m, Lookahead) for m in mixture.members)
    mixture.fit(GPU_LIKE, branches=64, budget=16)  # 64 branches' windows are not free there either
    assert not any(isinstance(m, Lookahead) for m in mixture.members)


class ByBranch(Fixed):
    """Proposes a fixed path only for branches whose last token is in `for_last`, and counts what it is asked."""

    def __init__(self, paths, for_last) -> None:
        super().__init__(paths)
        self.for_last, self.asked = set(for_last), []

    def propose(self, context, budget):
        self.asked.append(context.tokens[-1])
        return super().propose(context, budget) if context.tokens[-1] in self.for_last else DraftTree()


def test_a_fallback_is_asked_only_where_the_others_have_no_guess():
    """Branch ending in 3 gets the member's draft; branch ending in 4 nothing from it, so the
    fallback (a learned head, say) is asked for that branch alone, and both observe their views."""
    member, fallback = ByBranch([[5, 6]], for_last=[3]), ByBranch([[7, 8]], for_last=[3, 4])
    mixture = Mixture([member], fallbacks=[fallback])
    contexts = [BranchContext([1, 2, 3], 3), BranchContext([1, 2, 4], 3)]
    trees = mixture.propose_many(contexts, budget=8)
    assert fallback.asked == [4]
    assert trees[0].tokens == [5, 6] and trees[1].tokens == [7, 8]
    assert trees[1].kinds[0] == KIND_STRIDE + 1  # the fallback's own kinds, for its acceptance
    mixture.observe(contexts[1], trees[1], [0])
    assert fallback.seen[-1][0] == [7] and member.seen[-1][0] == []
