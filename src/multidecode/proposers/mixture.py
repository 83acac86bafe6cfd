"""Several proposers drafting into one tree, so that the cost model can choose among them.

"auto" speculation (`speculation`) does not know in advance which proposer suits a workload:
prompt lookup pays on edits and summaries, the suffix store on work that repeats earlier
requests, lookahead where the model's own Jacobi iterations guess well. A `Mixture` asks each
member for its draft and merges them into one tree per branch: members that guess the same
tokens share nodes, members that disagree become sibling candidates. Each node keeps the
member's label for how it was guessed, offset per member (`kind = member * KIND_STRIDE + kind`),
so `cost.AcceptanceTracker` learns each member's acceptance apart, and the cost model keeps only
the nodes that pay, wherever they came from.

**Fallbacks** are members asked only for the branches the others gave no candidate this step:
a learned head (Medusa, EAGLE) costs a few small forwards whether or not its nodes are kept, so
where prompt lookup or the suffix store already guess (an edit, repeated work) it is not run,
and where they have nothing (open-ended text) it is.

A member's candidates are merged in the member's own order. Draft distributions (`dists`) stay
only where a single member proposed under a node (a sibling from another member is not a draw
from q). Side nodes of every member are kept, each member's apart. After verification each member
observes its own view: the accepted path in its own indices, and the logits of its own side nodes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .base import UNDER_LEAF, BranchContext, DraftTree, Proposer
from .lookahead import Lookahead

KIND_STRIDE = 100
"""Member m's node kinds are m * KIND_STRIDE + the member's own kind."""


class Mixture(Proposer):
    """The merged drafts of `members` (see the module notes).

    lookahead: also consider lookahead decoding, sized to the hardware by `fit` (the window is
    fed every step whatever it yields, so it joins only where its rows cost next to nothing).
    """

    name = "mixture"

    def __init__(self, members: Sequence[Proposer], name: str = "mixture", *, lookahead: bool = False,
                 fallbacks: Sequence[Proposer] = ()) -> None:
        if not members:
            raise ValueError("a Mixture needs at least one member")
        self.base = list(members)
        self.fallbacks = list(fallbacks)
        self.members = self.base + self.fallbacks
        self.name = name
        self.lookahead = lookahead
        # what the learned members read, fed for them all (each picks its own: `BranchContext.features_of`)
        self.layers = tuple(sorted({layer for m in [*members, *fallbacks] for layer in m.layers}))
        self.reads_prompt = any(m.reads_prompt for m in [*members, *fallbacks])

    def fit(self, curve, branches: int, budget: int, max_ratio: float = 1.3) -> None:
        """Size the lookahead member to the cost curve: the largest window `Lookahead.from_cost`
        allows one branch, kept only if it fits that rule at all (not its smallest fallback) and
        all `branches`' windows added to a full-budget step cost at most `max_ratio` times the
        step without them; otherwise no lookahead (as on a CPU, where every row costs)."""
        self.members = self.base + self.fallbacks
        if not self.lookahead:
            return
        candidate = Lookahead.from_cost(curve, max_ratio=max_ratio, budget=budget)
        alone = curve.relative(candidate.step_rows(budget), 0)  # above max_ratio: from_cost's smallest fallback
        without = branches * (1 + budget)
        added = curve.relative(without + branches * candidate.side_nodes, 0) / curve.relative(without, 0)
        if alone <= max_ratio and added <= max_ratio:
            self.members = [*self.base, candidate, *self.fallbacks]

    def check(self, model) -> None:
        for member in self.members:
            member.check(model)

    def release(self, context: BranchContext) -> None:
        for member in self.members:
            member.release(context)

    def propose(self, context: BranchContext, budget: int) -> DraftTree:
        return self.propose_many([context], budget)[0]

    def propose_many(self, contexts: Sequence[BranchContext], budget: int) -> list[DraftTree]:
        first = len(self.members) - len(self.fallbacks)
        per_member = [member.propose_many(contexts, budget) for member in self.members[:first]]
        bare = [b for b in range(len(contexts)) if not any(len(drafts[b]) for drafts in per_member)]
        for fallback in self.fallbacks:  # only for the branches nobody else guessed for
            asked = fallback.propose_many([contexts[b] for b in bare], budget) if bare else []
            drafts = [DraftTree() for _ in contexts]
            for b, draft in zip(bare, asked):
                drafts[b] = draft
            per_member.append(drafts)
        merged = []
        for b, context in enumerate(contexts):
            tree = DraftTree()
            sides: list[range] = []  # per member: its side nodes' rows among the merged ones
            owner: dict[int, int] = {}  # merged parent -> the one member that proposed under it (-1: several)
            for m, drafts in enumerate(per_member):
                draft = drafts[b]
                index_of = {UNDER_LEAF: UNDER_LEAF}
                for i, (token, parent) in enumerate(zip(draft.tokens, draft.parents)):
                    at = index_of[parent]
                    found = tree.child(at, token)
                    if found is None:
                        found = tree.add(token, at, kind=m * KIND_STRIDE + draft.kinds[i], prior=draft.priors[i])
                    index_of[i] = found
                    owner[at] = m if owner.get(at, m) == m else -1
                for parent, q in draft.dists.items():
                    if parent in index_of:
                        tree.dists[index_of[parent]] = q
                first_side = len(tree.side_tokens)
                for token, parent in zip(draft.side_tokens, draft.side_parents):
                    tree.add_side(token, UNDER_LEAF if parent == UNDER_LEAF else first_side + parent)
                sides.append(range(first_side, len(tree.side_tokens)))
            tree.dists = {p: q for p, q in tree.dists.items() if owner.get(p) not in (-1, None)}
            if not tree.dists:
                tree = best_first(tree)
            context.scratch["mixture"] = (per_member, b, sides)
            merged.append(tree)
        return merged

    def observe(self, context: BranchContext, draft: DraftTree, accepted: Sequence[int],
                side_logits: torch.Tensor | None = None) -> None:
        per_member, b, sides = context.scratch.pop("mixture")
        tokens = [draft.tokens[i] for i in accepted]
        for m, (member, side_rows) in enumerate(zip(self.members, sides)):
            own = per_member[m][b]
            # The member's accepted path: follow the accepted tokens down its own tree.
            path, at = [], UNDER_LEAF
            for token in tokens:
                at = own.child(at, token)
                if at is None:
                    break
                path.append(at)
            logits = None
            if side_logits is not None and len(side_rows):
                logits = side_logits[side_rows.start : side_rows.stop]
            member.observe(context, own, path, side_logits=logits)


def best_first(tree: DraftTree) -> DraftTree:
    """The same tree with its candidates ordered by path prior (the product of priors from the
    branch's head down), best first and parents before children, so that a budget that keeps
    the first nodes keeps the likeliest ones whichever member guessed them."""
    score: list[float] = []
    for parent, prior in zip(tree.parents, tree.priors):
        score.append(min(prior, 1.0) * (1.0 if parent == UNDER_LEAF else score[parent]))
    depths = tree.depths()
    order = sorted(range(len(tree)), key=lambda i: (-score[i], depths[i], i))
    new_index = {UNDER_LEAF: UNDER_LEAF}
    out = DraftTree(side_tokens=list(tree.side_tokens), side_parents=list(tree.side_parents))
    for i in order:
        new_index[i] = out.add(tree.tokens[i], new_index[tree.parents[i]], kind=tree.kinds[i], prior=tree.priors[i])
    return out
