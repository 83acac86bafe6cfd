"""Draft-model speculation: a smaller causal LM with the same tokenizer guesses ahead.

Speculative decoding (Leviathan et al., 2023, arXiv 2211.17192; Chen et al., 2023, arXiv
2302.01318) lets a cheap **draft model** propose the next tokens and the target check them in
one forward; SpecInfer (Miao et al., 2024, arXiv 2305.09781) and Sequoia (Chen et al., 2024,
arXiv 2402.12374) grow the guesses into a tree. The draft model here is any causal LM sharing the
target's tokenizer, including the target itself with layers skipped (`self_draft`).

Terms. The draft runs on its own `Engine`, so its KV cache is a **forest** too: every branch's
tokens sit in it (a prefix shared by branches is stored once), each branch's **path** being the
draft nodes of its tokens so far. One **round** is one draft forward for every branch at once:
the first round feeds each branch's tokens the draft has not seen (its newest ones) and yields
the draft's distribution q after them; each later round feeds the draft nodes worth growing and
yields q under each of them.

The tree is **adaptive**: under a node whose best guess has q >= `sure`, one child (a chain);
otherwise up to `width` children with q >= `min_prob`. A child is grown further only while its
path probability (the product of q along its path) stays at or above `confidence`, so the draft
stops where its confidence falls instead of at a fixed k. For a greedy branch the children are
the most likely tokens; for a sampled branch they are drawn from q (warped by the branch's own
temperature, top-k, top-p and min-p) without replacement, and q goes with the draft
(`DraftTree.dists`) so that verification uses the speculative-sampling rule (`verify`).

**Rollback.** After verification, the draft nodes of the accepted tokens stay (their keys are the
draft's keys for exactly those tokens at those positions) and join the branch's path; every
other draft node is taken back (`Engine.drop`) before the next round. The target's own extra
token is fed to the draft at the next first round.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..engine import Engine
from ..errors import InvalidArgument
from ..forest import ROOT
from ..prompts import common_prefix_length
from ..scheduler import Feed
from .base import UNDER_LEAF, BranchContext, DraftTree, Proposer
from .drafting import add_candidates, draft_distribution, draft_generator, vocabulary_size


@dataclass
class _Branch:
    """What the draft holds for one branch."""

    key: int
    path: list[int] = field(default_factory=list)  # draft node of each of the branch's tokens cached so far
    grown: dict[tuple[int, ...], int] = field(default_factory=dict)  # last step's tree: token path -> draft node
    generator: torch.Generator | None = None


def check_same_tokenizer(target, draft) -> None:
    """Refuse a draft whose tokenizer maps text to other ids than the target's: its guesses would
    be other tokens, so nearly nothing would be accepted (the output would still be exact)."""
    if target.get_vocab() != draft.get_vocab():
        ours, theirs = target.get_vocab(), draft.get_vocab()
        differ = next((t for t in ours if theirs.get(t) != ours[t]), None) or next(t for t in theirs if t not in ours)
        raise InvalidArgument(
            f"the draft model's tokenizer differs from the target's ({len(theirs)} vs {len(ours)} tokens; "
            f"{differ!r} is {theirs.get(differ)} in the draft, {ours.get(differ)} in the target)",
            "use a draft from the target's model family (the same tokenizer), or --draft-skip-layers")


class DraftModel(Proposer):
    """Drafts a tree with `model` (see the module notes).

    width: the most children under one node; sure: a node whose best guess has at least this q
    gets that child only; min_prob: the least q of a further sibling; confidence: the least path
    probability of a node that is grown further; max_depth: the deepest draft.
    """

    name = "draft"

    def __init__(self, model, *, width: int = 3, sure: float = 0.8, min_prob: float = 0.1,
                 confidence: float = 0.3, max_depth: int = 8) -> None:
        if width < 1 or max_depth < 1:
            raise InvalidArgument("a draft model needs width >= 1 and max_depth >= 1")
        self.model = model
        self.engine = Engine(model)
        self.width, self.sure, self.min_prob = width, sure, min_prob
        self.confidence, self.max_depth = confidence, max_depth
        self._branches: dict[int, _Branch] = {}
        self._next_key = 0
        self._rejected: list[int] = []  # draft nodes to take back before the next round
        self._released = 0

    # ------------------------------------------------------------------ hooks
    def check(self, model) -> None:
        target, draft = vocabulary_size(model), vocabulary_size(self.model)
        if target != draft:
            raise InvalidArgument(
                f"the draft model's vocabulary has {draft} tokens but the target's has {target}",
                "use a draft model with the target's tokenizer (the same model family), or a self-draft "
                "(--draft-skip-layers)")

    def observe(self, context: BranchContext, draft: DraftTree, accepted: Sequence[int],
                side_logits: torch.Tensor | None = None) -> None:
        state = self._state(context)
        prefix: tuple[int, ...] = ()
        for i in accepted:
            prefix += (draft.tokens[i],)
            node = state.grown.get(prefix)
            if node is None:
                break
            state.path.append(node)
        self._reject_grown(state, keep=set(state.path))

    def release(self, context: BranchContext) -> None:
        state = self._branches.pop(context.scratch.pop("draft", -1), None)
        if state is not None:
            self._reject_grown(state)
            self._released += 1

    # ------------------------------------------------------------------ proposing
    def propose(self, context: BranchContext, budget: int) -> DraftTree:
        return self.propose_many([context], budget)[0]

    def propose_many(self, contexts: Sequence[BranchContext], budget: int) -> list[DraftTree]:
        states = [self._state(c) for c in contexts]
        for state in states:  # a tree nobody observed (no candidate was fed): none of it was accepted
            self._reject_grown(state)
        self._tidy()
        trees = [DraftTree() for _ in contexts]
        if budget < 1:
            return trees
        q_rows = self._catch_up(contexts, states)  # [branches, vocab] logits after each branch's tokens
        # frontier: (branch, candidate index or UNDER_LEAF, token path, path probability)
        frontier = [(b, UNDER_LEAF, (), 1.0) for b in range(len(contexts))]
        for depth in range(1, self.max_depth + 1):
            grow = []
            for (b, parent, path, prob), logits in zip(frontier, q_rows):
                for child, token, q in self._children(contexts[b], states[b], trees[b], parent, logits, budget):
                    if prob * q >= self.confidence and depth < self.max_depth:
                        grow.append((b, child, path + (token,), prob * q))
            if not grow:
                break
            q_rows = self._feed_grown(states, grow)
            frontier = grow
        return trees

    def _children(self, context: BranchContext, state: _Branch, tree: DraftTree, parent: int,
                  logits: torch.Tensor, budget: int) -> list[tuple[int, int, float]]:
        """Add the candidates under `parent` from the draft's logits there ([vocab]); returns
        (candidate index, token, q of it) for each."""
        q = draft_distribution(logits, None, logits.shape[-1], context.sampling)  # [vocab]
        count = 1 if float(q.max()) >= self.sure else self.width
        return add_candidates(tree, parent, q, min(count, budget - len(tree)), state.generator, min_prob=self.min_prob)

    # ------------------------------------------------------------------ the draft's engine
    def _state(self, context: BranchContext) -> _Branch:
        key = context.scratch.get("draft")
        if key is None:
            key = context.scratch["draft"] = self._next_key
            self._next_key += 1
            self._branches[key] = _Branch(key, generator=draft_generator(context.sampling))
        return self._branches[key]

    def _reject_grown(self, state: _Branch, keep: set[int] = frozenset()) -> None:
        """Queue the branch's last tree for taking back, but the nodes in `keep`."""
        self._rejected += [n for n in state.grown.values() if n not in keep]
        state.grown = {}

    def _tidy(self) -> None:
        """Take back last step's rejected draft nodes; drop finished branches' paths now and then."""
        if self._rejected:
            self.engine.drop(self._rejected)
            self._rejected = []
        if self._released >= 4 or (self._released and not self._branches):
            self.engine.compact([s.path[-1] for s in self._branches.values() if s.path])
            self._released = 0

    def _catch_up(self, contexts: Sequence[BranchContext], states: Sequence[_Branch]) -> torch.Tensor:
        """Feed each branch's tokens the draft has not cached (new branches' common prefix once);
        returns the draft's logits after each branch's newest token ([branches, vocab])."""
        feed = Feed()
        owners: list[list[int]] = []  # per fed node: the branches whose path it joins
        new = [b for b, s in enumerate(states) if not s.path]
        shared = common_prefix_length([contexts[b].tokens for b in new], leave=1) if new else 0
        prefix_end = ROOT
        for token in contexts[new[0]].tokens[:shared] if new else ():
            prefix_end = Feed.ref(feed.add(token, prefix_end, logits=False))
            owners.append(new)
        for b, (context, state) in enumerate(zip(contexts, states)):
            at, start = (state.path[-1], len(state.path)) if state.path else (prefix_end, shared)
            for token in context.tokens[start:]:
                at = Feed.ref(feed.add(token, at, logits=False))
                owners.append([b])
            feed.logits[-1] = True  # the head is always new to the draft
        result = self.engine.feed(feed.tokens, feed.parents,
                                  logits_for=[i for i, wanted in enumerate(feed.logits) if wanted])
        for node, branches in zip(result.nodes, owners):
            for b in branches:
                states[b].path.append(node)
        return result.logits

    def _feed_grown(self, states: Sequence[_Branch], grow: list[tuple[int, int, tuple[int, ...], float]]) -> torch.Tensor:
        """Feed the candidates chosen to grow (their parents are fed already); returns their logits."""
        tokens, parents = [], []
        for b, _, path, _ in grow:
            state = states[b]
            parents.append(state.grown[path[:-1]] if len(path) > 1 else state.path[-1])
            tokens.append(path[-1])
        result = self.engine.feed(tokens, parents, logits_for=range(len(tokens)))
        for node, (b, _, path, _) in zip(result.nodes, grow):
            states[b].grown[path] = node
        return result.logits
