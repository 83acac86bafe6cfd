"""Prompt lookup: drafts copied from earlier in the branch's own tokens.

Prompt lookup decoding (Saxena, 2023, github.com/apoorvumang/prompt-lookup-decoding) rests on one
observation: summaries, edits and answers about a document copy long stretches of their input.
When the last n tokens of a branch occurred before, whatever followed them then is a good guess
for what follows now. The search runs over the branch's whole root-to-leaf path (document,
question and the answer so far), so an answer that repeats itself is caught too.

Terms: an **n-gram match** is an earlier occurrence of the branch's last n tokens; its
**continuation** is the tokens after it. The longest n (from `max_ngram` down to `min_ngram`) with
any match wins; its `max_matches` most recent matches are merged into one draft tree, so matches
that agree share nodes and matches that disagree become sibling candidates.

The index from each n-gram to where it occurred is built incrementally in the branch's scratch
space: each step costs the new tokens, not the whole path.
"""

from __future__ import annotations

from collections import defaultdict

from . import BranchContext, DraftTree, Proposer

PRIORS = {1: 0.15, 2: 0.3, 3: 0.45}
"""A guess at how often a draft token is accepted once its parent is, by match length, used only
until acceptance has been observed (the scheduler learns the real rates as it goes)."""


class PromptLookup(Proposer):
    """Drafts from n-gram matches in the branch's own tokens.

    max_ngram, min_ngram: the longest and shortest match tried (longest first).
    max_matches: the most recent matches merged into one tree (1 gives a single chain).
    """

    name = "lookup"

    def __init__(self, *, max_ngram: int = 3, min_ngram: int = 1, max_matches: int = 3) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        if max_matches < 1:
            raise ValueError("max_matches must be at least 1")
        self.max_ngram, self.min_ngram, self.max_matches = max_ngram, min_ngram, max_matches

    def propose(self, context: BranchContext, budget: int) -> DraftTree:
        draft = DraftTree()
        if budget < 1:
            return draft
        tokens = context.tokens
        index = self._index(context)
        end = len(tokens)
        for n in range(min(self.max_ngram, end - 1), self.min_ngram - 1, -1):
            # starts of continuations after earlier occurrences of the last n tokens, newest first
            starts = [s for s in reversed(index[n].get(tuple(tokens[end - n:]), ())) if s < end]
            if not starts:
                continue
            prior = PRIORS.get(n, max(PRIORS.values()))
            for start in starts[: self.max_matches]:
                draft.add_path(tokens[start : start + budget], kind=n, prior=prior, budget=budget)
            break
        return draft

    def _index(self, context: BranchContext) -> dict[int, dict[tuple[int, ...], list[int]]]:
        """n -> n-gram -> continuation starts, brought up to date with the branch's tokens."""
        tokens = context.tokens
        done, index = context.scratch.get("lookup", (0, None))
        if index is None or done > len(tokens):
            done, index = 0, {n: defaultdict(list) for n in range(1, self.max_ngram + 1)}
        for end in range(done + 1, len(tokens) + 1):  # the n-grams ending at token end - 1
            for n in range(1, min(self.max_ngram, end) + 1):
                index[n][tuple(tokens[end - n : end])].append(end)
        context.scratch["lookup"] = (len(tokens), index)
        return index
