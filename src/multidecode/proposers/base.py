"""The proposer interface: `Proposer`, the `BranchContext` it sees and the `DraftTree` it returns.

Speculative decoding (Leviathan et al., 2023, arXiv 2211.17192; Chen et al., 2023, arXiv
2302.01318) guesses several next tokens cheaply and has the target model check them all in one
forward; token-tree verification (SpecInfer, Miao et al., 2024, arXiv 2305.09781) checks several
alternative guesses at once as a tree. Here every guess is a **draft tree** hung under a branch's
newest token, fed in the same forward as every other branch's tokens and drafts, and verified
against the target's own choices (`verify`).

A proposer is two methods:

- `propose(context, budget) -> DraftTree`: at most `budget` draft nodes continuing
  `context.tokens` (the branch's whole root-to-leaf path: prompt, then output so far);
- `observe(context, draft, accepted, side_logits)`: which of those nodes the target accepted, to
  learn from, and the target's logits at the draft's side nodes.

and three optional ones: `propose_many` (every live branch's draft at once, for a proposer that
runs a model of its own and batches its forwards), `check(model)` (refuse a target it cannot
serve) and `release(context)` (a branch finished: free what was kept for it).

Terms. **Candidate** nodes are guesses of the branch's next tokens: verified, and kept where the
target agrees. **Side** nodes (`DraftTree.add_side`) are fed in the same forward for their logits
only, as lookahead decoding's Jacobi window is; they are never candidates and are always taken
back. A **draft distribution** (`DraftTree.dists[p]`) says the candidates under node p were drawn
from a known distribution q, in sibling order, without replacement; where the `Speculation` asks
for it (`against_q`), a sampled branch then verifies them by the speculative-sampling rule against q
(`verify`), which accepts more than matching a draw (by default it draws, then matches).

`context.scratch` is a dict a proposer may keep per-branch state in (an n-gram index, say); it
lives as long as the branch. Proposers never touch the target model or its cache (a draft-model
proposer runs its own model on its own engine).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..sampling_params import SamplingParams

UNDER_LEAF = -1
"""`DraftTree.parents` value of a node that hangs directly under the branch's newest token."""


@dataclass
class BranchContext:
    """What a proposer sees of one branch: its tokens so far and a place for its own state.

    tokens: the root-to-leaf path (prompt, then every token generated so far; the last one is the
    token the draft continues). prompt_length: how many of them are the prompt. sampling: how the
    branch chooses its tokens (a draft model drafts the same way). features: for a proposer that
    reads the target's hidden states (`Proposer.layers`), those layers' states at the nodes the
    last step settled on the branch's path, [nodes, layers, hidden size] in the model's dtype; the last row is
    at the node whose logits chose the newest token. None before the first step; after it, for a
    proposer that `reads_prompt`, the prompt nodes fed on the branch's path come first. feature_layers:
    the layers `features` holds, in order (a mixture feeds the union of what its members read;
    empty: just the layers the proposer reads).
    """

    tokens: list[int]
    prompt_length: int
    scratch: dict = field(default_factory=dict)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    features: torch.Tensor | None = None
    feature_layers: tuple[int, ...] = ()

    def features_of(self, layers: Sequence[int]) -> torch.Tensor:
        """[nodes, len(layers), hidden size]: the states of `layers` (each among `feature_layers`)."""
        if not self.feature_layers or tuple(layers) == self.feature_layers:
            return self.features
        return self.features[:, [self.feature_layers.index(layer) for layer in layers]]


@dataclass
class DraftTree:
    """Draft nodes under a branch's newest token, parents before children.

    tokens[i]: the guessed token; parents[i]: `UNDER_LEAF` or the index of an earlier node.
    kinds[i]: the proposer's label for how node i was guessed (for prompt lookup, the length of
    the n-gram match); acceptance is tracked per kind. priors[i]: the proposer's guess at the
    chance that node i is accepted once its parent is, used until acceptance has been seen.
    Siblings carry distinct tokens.

    dists[p]: the distribution ([vocab] float32, on the CPU) the candidates under node p
    (`UNDER_LEAF`: under the branch's newest token) were drawn from, in sibling order, each without
    the ones before it. side_tokens/side_parents: side nodes (see the module notes), parents
    `UNDER_LEAF` or an earlier side node.
    """

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    kinds: list[int] = field(default_factory=list)
    priors: list[float] = field(default_factory=list)
    dists: dict[int, torch.Tensor] = field(default_factory=dict)
    side_tokens: list[int] = field(default_factory=list)
    side_parents: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    def problem(self) -> str | None:
        """What makes this not a draft tree (for one built by hand rather than by `add`), or None:
        every node needs a whole-number token, a kind and a prior, and a parent that is
        `UNDER_LEAF` or an earlier node (side nodes: an earlier side node)."""
        nodes, sides = len(self.tokens), len(self.side_tokens)
        if not len(self.parents) == len(self.kinds) == len(self.priors) == nodes or len(self.side_parents) != sides:
            return (f"its lists differ in length ({nodes} tokens, {len(self.parents)} parents, {len(self.kinds)} "
                    f"kinds, {len(self.priors)} priors; {sides} side tokens, {len(self.side_parents)} side parents)")
        bad = next((t for t in self.tokens + self.side_tokens if isinstance(t, bool) or not isinstance(t, int)), None)
        if bad is not None:
            return f"token {bad!r} is not a whole-number id"
        for what, parents in (("node", self.parents), ("side node", self.side_parents)):
            for i, parent in enumerate(parents):
                if not (isinstance(parent, int) and UNDER_LEAF <= parent < i):
                    return f"{what} {i}'s parent {parent!r} is neither UNDER_LEAF ({UNDER_LEAF}) nor an earlier {what}"
        return None

    def add(self, token: int, parent: int = UNDER_LEAF, *, kind: int = 0, prior: float = 0.5) -> int:
        """Append a node; returns its index."""
        if not UNDER_LEAF <= parent < len(self.tokens):
            raise ValueError(f"parent {parent} is not an earlier node")
        self.tokens.append(int(token))
        self.parents.append(parent)
        self.kinds.append(kind)
        self.priors.append(prior)
        return len(self.tokens) - 1

    def add_side(self, token: int, parent: int = UNDER_LEAF) -> int:
        """Append a side node; returns its index among the side nodes."""
        if not UNDER_LEAF <= parent < len(self.side_tokens):
            raise ValueError(f"side parent {parent} is not an earlier side node")
        self.side_tokens.append(int(token))
        self.side_parents.append(parent)
        return len(self.side_tokens) - 1

    def siblings(self, parent: int) -> list[int]:
        """The candidates under `parent`, in order."""
        return [i for i, p in enumerate(self.parents) if p == parent]

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

    def keep(self, indices: Sequence[int], *, side: bool = True) -> DraftTree:
        """The subtree of candidates `indices` (each with its parent among them), renumbered in
        order, with the side nodes unless `side` is False. A kept node's siblings must be a first
        run of its proposed siblings wherever they were drawn from a distribution (dropping an
        earlier draw would break the rule that verifies them)."""
        new_index: dict[int, int] = {UNDER_LEAF: UNDER_LEAF}
        out = DraftTree()
        for i in sorted(indices):
            if self.parents[i] not in new_index:
                raise ValueError(f"node {i} is kept without its parent {self.parents[i]}")
            new_index[i] = out.add(self.tokens[i], new_index[self.parents[i]], kind=self.kinds[i],
                                   prior=self.priors[i])
        out.dists = {new_index[p]: q for p, q in self.dists.items() if p in new_index}
        if side:
            out.side_tokens, out.side_parents = list(self.side_tokens), list(self.side_parents)
        return out

    def first_chain(self) -> DraftTree:
        """The path that follows each node's first child: the proposer's main guess, as a chain
        (no side nodes)."""
        kept, at = [], UNDER_LEAF
        while (child := next((i for i, p in enumerate(self.parents) if p == at), None)) is not None:
            kept.append(child)
            at = child
        return self.keep(kept, side=False)

    def truncate(self, budget: int, max_depth: int | None = None) -> DraftTree:
        """At most `budget` candidates, none deeper than `max_depth`: the first ones in order
        (side nodes are the proposer's own cost and stay)."""
        depths = self.depths()
        kept = [i for i in range(len(self)) if max_depth is None or depths[i] <= max_depth][:max(budget, 0)]
        return self.keep(kept) if len(kept) < len(self) else self


class Proposer:
    """Base class of draft proposers (see the module notes). Subclasses set `name`."""

    name = "proposer"
    default_budget: int | None = None
    """The draft budget a named mode runs this proposer at (None: `speculation.DEFAULT_BUDGET`)."""
    layers: tuple[int, ...] = ()
    """The target's layers whose hidden states this proposer reads (`BranchContext.features`),
    numbered as `Engine.feed` numbers them; none for a proposer that reads only tokens."""
    reads_prompt: bool = False
    """Whether its first `BranchContext.features` hold the states of the whole prompt fed (a head
    trained with the prompt in its context), not only of the node after it."""

    def propose(self, context: BranchContext, budget: int) -> DraftTree:
        raise NotImplementedError

    def propose_many(self, contexts: Sequence[BranchContext], budget: int) -> list[DraftTree]:
        """Every live branch's draft for this step, in order. Default: `propose` for each."""
        return [self.propose(context, budget) for context in contexts]

    def observe(self, context: BranchContext, draft: DraftTree, accepted: Sequence[int],
                side_logits: torch.Tensor | None = None) -> None:
        """`accepted`: indices of the draft's candidates the target accepted, root first.
        side_logits: [side nodes, vocab] float32, the target's logits at the side nodes (None when
        there were none, or they were not fed). Default: nothing."""

    def check(self, model) -> None:
        """Raise `errors.InvalidArgument` if this proposer cannot draft for `model`. Default: it can."""

    def release(self, context: BranchContext) -> None:
        """The branch of `context` finished: drop what was kept for it. Default: nothing."""
