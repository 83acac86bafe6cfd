"""Proposers: where draft tokens come from, for speculative decoding inside every branch.

Speculative decoding (Leviathan et al., 2023, arXiv 2211.17192; Chen et al., 2023, arXiv
2302.01318) guesses several next tokens cheaply and has the target model check them all in one
forward; token-tree verification (SpecInfer, Miao et al., 2024, arXiv 2305.09781) checks several
alternative guesses at once as a tree. Here every guess is a **draft tree** hung under a branch's
newest token, fed in the same forward as every other branch's tokens and drafts, and verified
against the target's own choices (`verify`).

A proposer is two methods:

- `propose(context, budget) -> DraftTree`: at most `budget` draft nodes continuing
  `context.tokens` (the branch's whole root-to-leaf path: prompt, then output so far);
- `observe(context, draft, accepted)`: which of those nodes the target accepted, to learn from.

`context.scratch` is a dict a proposer may keep per-branch state in (an n-gram index, say); it
lives as long as the branch. Proposers never touch the model or the cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

UNDER_LEAF = -1
"""`DraftTree.parents` value of a node that hangs directly under the branch's newest token."""


@dataclass
class BranchContext:
    """What a proposer sees of one branch: its tokens so far and a place for its own state.

    tokens: the root-to-leaf path (prompt, then every token generated so far; the last one is the
    token the draft continues). prompt_length: how many of them are the prompt.
    """

    tokens: list[int]
    prompt_length: int
    scratch: dict = field(default_factory=dict)


@dataclass
class DraftTree:
    """Draft nodes under a branch's newest token, parents before children.

    tokens[i]: the guessed token; parents[i]: `UNDER_LEAF` or the index of an earlier node.
    kinds[i]: the proposer's label for how node i was guessed (for prompt lookup, the length of
    the n-gram match); acceptance is tracked per kind. priors[i]: the proposer's guess at the
    chance that node i is accepted once its parent is, used until acceptance has been seen.
    Siblings carry distinct tokens.
    """

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    kinds: list[int] = field(default_factory=list)
    priors: list[float] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, token: int, parent: int = UNDER_LEAF, *, kind: int = 0, prior: float = 0.5) -> int:
        """Append a node; returns its index."""
        if not UNDER_LEAF <= parent < len(self.tokens):
            raise ValueError(f"parent {parent} is not an earlier node")
        self.tokens.append(int(token))
        self.parents.append(parent)
        self.kinds.append(kind)
        self.priors.append(prior)
        return len(self.tokens) - 1

    def child(self, parent: int, token: int) -> int | None:
        """The node under `parent` that guesses `token`, if any."""
        for i, (t, p) in enumerate(zip(self.tokens, self.parents)):
            if p == parent and t == token:
                return i
        return None

    def add_path(self, tokens: Sequence[int], *, kind: int = 0, prior: float = 0.5, budget: int | None = None) -> None:
        """Merge a guessed continuation into the tree (shared starts become shared nodes), adding
        at most `budget` new nodes in all."""
        at = UNDER_LEAF
        for token in tokens:
            found = self.child(at, token)
            if found is None:
                if budget is not None and len(self) >= budget:
                    return
                found = self.add(token, at, kind=kind, prior=prior)
            at = found

    def depths(self) -> list[int]:
        """Depth of each node below the branch's newest token (children of it: 1)."""
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p == UNDER_LEAF else out[p] + 1)
        return out

    def ranks(self) -> list[int]:
        """Each node's place among its siblings (0: the first guess under its parent)."""
        seen: dict[int, int] = {}
        out = []
        for p in self.parents:
            out.append(seen.get(p, 0))
            seen[p] = out[-1] + 1
        return out

    def keep(self, indices: Sequence[int]) -> DraftTree:
        """The subtree of `indices` (each with its parent among them), renumbered in order."""
        new_index: dict[int, int] = {UNDER_LEAF: UNDER_LEAF}
        out = DraftTree()
        for i in sorted(indices):
            if self.parents[i] not in new_index:
                raise ValueError(f"node {i} is kept without its parent {self.parents[i]}")
            new_index[i] = out.add(self.tokens[i], new_index[self.parents[i]], kind=self.kinds[i],
                                   prior=self.priors[i])
        return out

    def first_chain(self) -> DraftTree:
        """The path that follows each node's first child: the proposer's main guess, as a chain."""
        kept, at = [], UNDER_LEAF
        while (child := next((i for i, p in enumerate(self.parents) if p == at), None)) is not None:
            kept.append(child)
            at = child
        return self.keep(kept)

    def truncate(self, budget: int, max_depth: int | None = None) -> DraftTree:
        """At most `budget` nodes, none deeper than `max_depth`: the first ones in order."""
        depths = self.depths()
        kept = [i for i in range(len(self)) if max_depth is None or depths[i] <= max_depth][:max(budget, 0)]
        return self.keep(kept) if len(kept) < len(self) else self


class Proposer:
    """Base class of draft proposers (see the module notes). Subclasses set `name`."""

    name = "proposer"

    def propose(self, context: BranchContext, budget: int) -> DraftTree:
        raise NotImplementedError

    def observe(self, context: BranchContext, draft: DraftTree, accepted: Sequence[int]) -> None:
        """`accepted`: indices of the draft nodes the target accepted, root first. Default: nothing."""
