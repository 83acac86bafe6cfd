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

The search is vectorised: the branch's tokens sit in a numpy buffer in its scratch space (grown
as tokens come), and the earlier occurrences of the last n tokens are found by comparing n shifted
views of it. That costs microseconds for a 1,500-token document, where an index of every n-gram
would take milliseconds per branch to build.
"""

from __future__ import annotations

import numpy as np

from ..errors import InvalidArgument, check_positive, is_int
from .base import BranchContext, DraftTree, Proposer

PRIORS = {1: 0.1, 2: 0.25, 3: 0.45}
"""A guess at how often a draft token is accepted once its parent is, by match length, used only
until acceptance has been observed (the scheduler learns the real rates as it goes)."""


class PromptLookup(Proposer):
    """Drafts from n-gram matches in the branch's own tokens.

    max_ngram, min_ngram: the longest and shortest match tried (longest first).
    max_matches: the most recent matches merged into one tree (1 gives a single chain).
    """

    name = "lookup"

    def __init__(self, *, max_ngram: int = 3, min_ngram: int = 1, max_matches: int = 3) -> None:
        if not (is_int(min_ngram) and is_int(max_ngram) and 1 <= min_ngram <= max_ngram):
            raise InvalidArgument(f"PromptLookup needs 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram!r}, "
                                  f"max_ngram={max_ngram!r}", "the defaults are min_ngram=1, max_ngram=3")
        check_positive("max_matches", max_matches)
        self.max_ngram, self.min_ngram, self.max_matches = max_ngram, min_ngram, max_matches

    def propose(self, context: BranchContext, budget: int) -> DraftTree:
        draft = DraftTree()
        if budget < 1:
            return draft
        tokens = self._tokens(context)  # [end] int64
        end = len(tokens)
        for n in range(min(self.max_ngram, end - 1), self.min_ngram - 1, -1):
            # hit[i]: tokens[i : i + n] equals the last n tokens, for i + n < end (something follows)
            hit = np.ones(end - n, dtype=bool)
            for j in range(n):
                hit &= tokens[j : end - n + j] == tokens[end - n + j]
            starts = np.flatnonzero(hit)[::-1] + n  # where each match's continuation begins, newest first
            if not len(starts):
                continue
            prior = PRIORS.get(n, max(PRIORS.values()))
            for start in starts[: self.max_matches].tolist():
                draft.add_path(tokens[start : start + budget].tolist(), kind=n, prior=prior, budget=budget)
            break
        return draft

    @staticmethod
    def _tokens(context: BranchContext) -> np.ndarray:
        """The branch's tokens as a numpy array, kept in its scratch space and extended as it grows."""
        tokens = context.tokens
        buffer, filled = context.scratch.get("lookup", (None, 0))
        if buffer is None or filled > len(tokens) or len(buffer) < len(tokens):
            grown = np.empty(max(2 * len(tokens), 64), dtype=np.int64)
            if buffer is not None and filled <= len(tokens):
                grown[:filled] = buffer[:filled]
            else:
                filled = 0
            buffer = grown
        buffer[filled : len(tokens)] = tokens[filled:]
        context.scratch["lookup"] = (buffer, len(tokens))
        return buffer[: len(tokens)]
