"""Lookahead decoding: drafts from n-grams that the target model's own Jacobi iterations produce.

Lookahead decoding (Fu, Bailis, Stoica and Zhang, 2024, "Break the Sequential Dependency of LLM
Inference Using Lookahead Decoding", arXiv 2402.02057) needs no draft model and no data store.
Each step feeds, beside the branch's newest token, two things in the same forward:

- the **lookahead branch**: a 2-D **window** of guessed future tokens, refined by one Jacobi
  iteration per step. The window has N - 1 **levels** (N: the n-gram size) and W **columns** (W:
  the window size). Level 0 is the oldest guess: a chain of W - 1 tokens after the branch's newest
  token, which is itself column 0 of level 0. Each later level holds W tokens, the token of level
  l in column j guessing the position l + j after the newest token. The target's arg-max at each
  token of the last level is the next level; the level before is dropped, so every step is one
  Jacobi iteration over the whole window. Column j's tokens, read from level 0 up, plus that new
  output form an **n-gram** (N tokens) that the model itself proposed;
- the **verification branch**: up to G (`guesses`) n-grams from the **n-gram pool** whose first
  token is the branch's newest token; their N - 1 later tokens are guesses of the branch's next
  tokens, merged into one draft tree and verified like any draft (`verify`).

The pool is keyed by an n-gram's first token and keeps, per key, the G most recent distinct
continuations (an older one is dropped when a new one comes; one seen again becomes the most
recent), for at most `max_keys` keys (the least recently updated key goes first).

How it maps onto a forest. The window's tokens are **side nodes** of the step's `DraftTree`
(`DraftTree.add_side`): fed for their logits only, never verified, always taken back, so they
never change what is generated. The paper's attention mask becomes the forest's ancestor rule:

- level 0, column j (j >= 1) hangs under level 0, column j - 1 (column 0 is the branch's newest
  token, `UNDER_LEAF`): level 0 is a chain;
- level l >= 1, column j hangs under level l - 1, column j (level 1, column 0 under the newest
  token).

So the token of level l, column j sits at depth l + j below the newest token and sees the
branch's whole path, the level-0 tokens of columns 1..j and the earlier levels of its own column:
exactly the rows of the paper's attention mask (its figure for W = 5, N = 4 and two guesses, also
`media/mask.png` in the reference repository), whose position ids are these depths. The pool's
candidates hang under the newest token as a trie: a candidate token sees the path and the
candidate tokens before it, as in the mask's verification block (shared starts share a node).

Warm-up, as the reference implementation does it. Level 0 starts as W + N - 3 tokens drawn from
the branch's tokens (a fixed pseudo-random choice seeded by those tokens, so runs repeat and the
global RNG is untouched). While the window has fewer than N - 1 levels, each step adds the last
level's outputs as a new level and shifts every level one column left (the newest token moved one
position on, so the window's first column has passed); after N - 2 such steps the window has
N - 1 levels of W columns, and n-grams are collected from then on.

Accepted drafts. After a step the window is updated the same way whether the target accepted none
of the guesses or several: as in the reference implementation, the window is kept and its guesses
now stand for positions further on. Jacobi iteration only needs them to be plausible tokens, and
n-grams are keyed by their content, not their position.

Where this differs from the reference implementation (which decodes one sequence):

- the prompt's step drafts one chain (the newest pooled n-gram) and no window, because a lone
  prompt's step is fed as one chain anyway: a branch then drafts, step for step, the same whether
  or not other branches run beside it; the warm-up starts at the second step;
- pooled n-grams are verified during the warm-up too (the reference waits for a full window);
- a window that would reach past the model's last position (`check` reads it) is not fed that
  step, and is kept;
- outputs equal to an eos id are not replaced in the window (a proposer does not know the eos ids;
  the reference's sampler does this against float16 trouble, which exact float32 runs do not have).

`pool_from_prompt` (the reference's POOL_FROM_PROMPT) also puts every n-gram of the branch's own
tokens into the pool: the prompt's at the first step, then the generated text's as it comes. It is
on by default here, unlike in the reference: this library's workloads are answers about a
document, summaries and edits, which copy their input, and a copied n-gram is verified for free
beside the Jacobi ones (lookahead then also finds what prompt lookup finds from a one-token
match), at the cost of indexing the prompt once per branch (about a millisecond per thousand
tokens). Turn it off to see what the Jacobi trajectory alone yields.

Sampling: the window's outputs are arg-maxes of the target's raw logits whatever the branch's
sampling, so a draft depends only on the branch's tokens and the window's state; verification
then draws the branch's tokens as always (draw, then match), which keeps sampled output exact.
"""

from __future__ import annotations

import random
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import InvalidArgument, is_int
from ..models.vetting import max_positions
from .base import UNDER_LEAF, BranchContext, DraftTree, Proposer

KIND_JACOBI = 0
"""`DraftTree.kinds` of a candidate from the lookahead branch's Jacobi trajectory."""

KIND_TEXT = 1
"""`DraftTree.kinds` of a candidate copied from the branch's own tokens (`pool_from_prompt`)."""

PRIORS = {KIND_JACOBI: 0.25, KIND_TEXT: 0.15}
"""A guess at how often a candidate token is accepted once its parent is, by kind, used only until
acceptance has been observed. A Jacobi n-gram was produced by the target itself from a nearby
context; a copied one matches on a single token, as prompt lookup's weakest match does."""

HEAD = None
"""Placeholder for the branch's newest token in column 0 of level 0 (it is not a side node)."""


class NgramPool:
    """N-grams keyed by their first token: per key, at most `per_key` distinct continuations (the
    n-gram's later tokens), most recent last, each with the kind of its latest source; at most
    `max_keys` keys, the least recently updated dropped first."""

    def __init__(self, per_key: int, max_keys: int) -> None:
        self.per_key, self.max_keys = per_key, max_keys
        self._entries: OrderedDict[int, dict[tuple[int, ...], int]] = OrderedDict()

    def add(self, key: int, continuation: Sequence[int], kind: int) -> None:
        continuation = tuple(int(t) for t in continuation)
        entries = self._entries.get(key)
        if entries is None:
            entries = self._entries[key] = {}
            if len(self._entries) > self.max_keys:
                self._entries.popitem(last=False)
        else:
            self._entries.move_to_end(key)
            entries.pop(continuation, None)  # seen again: it becomes the most recent
        entries[continuation] = kind
        if len(entries) > self.per_key:
            del entries[next(iter(entries))]

    def get(self, key: int) -> list[tuple[tuple[int, ...], int]]:
        """(continuation, kind) of `key`, most recent first."""
        entries = self._entries.get(key)
        return list(reversed(entries.items())) if entries else []

    def __len__(self) -> int:
        return sum(len(e) for e in self._entries.values())

    def keys(self) -> list[int]:
        return list(self._entries)


@dataclass
class _State:
    """One branch's lookahead state, in its `context.scratch`.

    levels[l][j]: the token of level l, column j (levels[0][0] is `HEAD`). fed: the window and the
    newest token of the last proposal that carried the lookahead branch, until it is observed.
    text_start: the first n-gram start in the branch's tokens not yet put into the pool.
    """

    levels: list[list[int | None]]
    pool: NgramPool
    text_start: int = 0
    fed: tuple[list[list[int | None]], int] | None = None
    steps: int = 0  # Jacobi iterations done
    collected: int = 0  # n-grams collected from the window


def window_problem(window: int, ngram: int, guesses: int) -> str | None:
    """What is wrong with a lookahead window W, n-gram size N and guesses G (whole numbers), or
    None: the one rule `Lookahead` and the settings parsed before any model loads both apply."""
    if window < 1 or ngram < 2 or guesses < 1:
        return f"need W >= 1, N >= 2 and G >= 1 (window, n-gram size, guesses), got W={window}, N={ngram}, G={guesses}"
    if window == 1 and ngram == 2:
        return "W=1 with N=2 leaves no lookahead window (only the newest token): widen the window or lengthen the n-grams"
    return None


class Lookahead(Proposer):
    """Lookahead decoding as a proposer (see the module notes).

    window: W, the window's columns; ngram: N, the n-gram size (the window has N - 1 levels);
    guesses: G, the most pooled n-grams verified per step (and kept per first token).
    pool_from_prompt: also pool the n-grams of the branch's own tokens (prompt and output).
    max_keys: the most first tokens a branch's pool keeps.

    A step feeds (N - 1) * W - 1 side nodes and at most G * (N - 1) candidates (fewer where
    n-grams share a start, or where the draft budget is smaller).
    """

    name = "lookahead"

    def __init__(self, *, window: int = 7, ngram: int = 5, guesses: int = 7, pool_from_prompt: bool = True,
                 max_keys: int = 4096) -> None:
        given = {"window": window, "ngram": ngram, "guesses": guesses, "max_keys": max_keys}
        if not all(map(is_int, given.values())):
            raise InvalidArgument(f"Lookahead takes whole numbers, got {given}", "e.g. Lookahead(window=7, ngram=5, guesses=7)")
        problem = window_problem(window, ngram, guesses)
        if problem is not None:
            raise InvalidArgument(f"Lookahead(window={window}, ngram={ngram}, guesses={guesses}): {problem}",
                                  "the defaults are window=7, ngram=5, guesses=7")
        if max_keys < 1:
            raise InvalidArgument(f"max_keys must be at least 1, got {max_keys}")
        self.window, self.ngram, self.guesses = window, ngram, guesses
        self.pool_from_prompt, self.max_keys = pool_from_prompt, max_keys
        self._max_positions: int | None = None

    def __repr__(self) -> str:
        return (f"Lookahead(window={self.window}, ngram={self.ngram}, guesses={self.guesses}, "
                f"pool_from_prompt={self.pool_from_prompt})")

    # ------------------------------------------------------------------ sizes and the cost rule
    @property
    def side_nodes(self) -> int:
        """The most side nodes a step feeds: (N - 1) * W - 1 for a full window (a warming-up
        window, s steps in, has s + 1 levels of W + N - 2 - s columns: more only where N > W + 1)."""
        return max((s + 1) * (self.window + self.ngram - 2 - s) for s in range(self.ngram - 1)) - 1

    @property
    def candidate_nodes(self) -> int:
        """The most candidates a step can propose: G n-grams of N - 1 tokens (a draft budget of
        this size verifies every pooled guess)."""
        return self.guesses * (self.ngram - 1)

    @property
    def default_budget(self) -> int:
        """Every pooled guess verified: the candidates' most."""
        return self.candidate_nodes

    def step_rows(self, budget: int | None = None) -> int:
        """Rows a branch feeds in one step at most: its newest token, the window and the
        candidates (no more than `budget` of them)."""
        candidates = self.candidate_nodes if budget is None else min(self.candidate_nodes, budget)
        return 1 + self.side_nodes + candidates

    @classmethod
    def from_cost(cls, curve, *, max_ratio: float = 1.3, context: int = 0, budget: int | None = None,
                  max_window: int = 16, **options) -> Lookahead:
        """The largest lookahead whose steps cost at most `max_ratio` times a one-token step.

        curve: a `cost.CostCurve` (forward time by tokens fed and context length); context: the
        cached tokens to read it at; budget: the draft budget the proposer will run under (it
        caps the candidates fed). The rule: G = W (the paper's setting) and N = 5 (the paper's
        default) with W the largest, up to `max_window`, for which
        `curve.relative(step_rows, context) <= max_ratio`; where not even W = 1 fits, N = 4,
        then N = 3. If nothing fits, the smallest lookahead (N = 3, W = G = 1: 4 rows) is
        returned: on such hardware every extra row costs time and prompt lookup ("auto") serves
        better. A GPU's flat curve gives W = max_window at N = 5; a CPU where 64 rows cost 4x
        gives the smallest. options: other constructor arguments.
        """
        for ngram in (5, 4, 3):
            best = None
            for window in range(1, max_window + 1):
                rows = cls(window=window, ngram=ngram, guesses=window, **options).step_rows(budget)
                if curve.relative(rows, context) <= max_ratio:
                    best = window
            if best is not None:
                return cls(window=best, ngram=ngram, guesses=best, **options)
        return cls(window=1, ngram=3, guesses=1, **options)

    # ------------------------------------------------------------------ the proposer
    def check(self, model) -> None:
        config = getattr(model, "config", None)
        self._max_positions = max_positions(config) if config is not None else None

    def release(self, context: BranchContext) -> None:
        context.scratch.pop(self.name, None)

    def state(self, context: BranchContext) -> _State:
        """The branch's window and pool, made at its first step."""
        state = context.scratch.get(self.name)
        if state is None:
            state = _State(self._first_window(context.tokens), NgramPool(self.guesses, self.max_keys))
            context.scratch[self.name] = state
        return state

    def _first_window(self, tokens: Sequence[int]) -> list[list[int | None]]:
        """Level 0 of W + N - 2 columns (the newest token, then W + N - 3 tokens drawn from the
        branch's own tokens by a generator seeded with them)."""
        rng = random.Random(zlib.crc32(np.asarray(tokens, dtype=np.int64).tobytes()))
        pick = list(tokens) or [0]
        return [[HEAD] + [pick[rng.randrange(len(pick))] for _ in range(self.window + self.ngram - 3)]]

    def propose(self, context: BranchContext, budget: int) -> DraftTree:
        state = self.state(context)
        if self.pool_from_prompt:
            self._pool_text(state, context.tokens)
        draft = DraftTree()
        head = context.tokens[-1]
        # The prompt's step drafts one chain and no window: a lone prompt's step is one chain
        # anyway, so a branch drafts the same whether or not other branches run beside it.
        prompt_step = len(context.tokens) <= context.prompt_length
        if budget >= 1:
            for continuation, kind in state.pool.get(head)[: 1 if prompt_step else self.guesses]:
                draft.add_path(continuation, kind=kind, prior=PRIORS[kind], budget=budget)
        levels = state.levels
        deepest = len(levels[0]) - 1 + len(levels) - 1  # level l, column j sits at depth l + j
        if prompt_step:
            state.fed = None
        elif self._max_positions is None or len(context.tokens) - 1 + deepest < self._max_positions:
            side_window(draft, levels)
            state.fed = (levels, head)
        else:
            state.fed = None  # the window would run past the model's positions: not this step
        return draft

    def observe(self, context: BranchContext, draft: DraftTree, accepted: Sequence[int],
                side_logits: torch.Tensor | None = None) -> None:
        state = context.scratch.get(self.name)
        if state is None or state.fed is None:
            return
        levels, head = state.fed
        state.fed = None
        count = side_count(levels)
        if (side_logits is None or levels is not state.levels or len(draft.side_tokens) != count
                or side_logits.shape[0] != count):
            return  # the window was not fed (a draft cut down to one chain has no side nodes)
        outputs = side_logits[count - last_level_size(levels) :].argmax(dim=-1).tolist()
        state.levels, ngrams = jacobi_step(levels, head, outputs, self.ngram)
        state.steps += 1
        for ngram in ngrams:
            state.pool.add(ngram[0], ngram[1:], KIND_JACOBI)
        state.collected += len(ngrams)

    def _pool_text(self, state: _State, tokens: Sequence[int]) -> None:
        """Put the n-grams of the branch's tokens not yet seen into the pool, oldest first."""
        n = self.ngram
        for start in range(state.text_start, len(tokens) - n + 1):
            state.pool.add(tokens[start], tokens[start + 1 : start + n], KIND_TEXT)
        state.text_start = max(state.text_start, len(tokens) - n + 1)


# ---------------------------------------------------------------------- the window, model-free
def side_count(levels: Sequence[Sequence[int | None]]) -> int:
    """Side nodes of a window: every token but the newest one (level 0, column 0)."""
    return sum(len(level) for level in levels) - 1


def last_level_size(levels: Sequence[Sequence[int | None]]) -> int:
    """Side nodes in the window's last level (the last ones `side_window` adds)."""
    return len(levels[-1]) - (len(levels) == 1)


def side_window(draft: DraftTree, levels: Sequence[Sequence[int | None]]) -> list[list[int | None]]:
    """Add the window's tokens to `draft` as side nodes, level by level, each column left to
    right: level 0's chain under the newest token, then each later level's token under the same
    column's token of the level before. Returns each token's side-node index (None for the newest
    token)."""
    index: list[list[int | None]] = []
    for l, level in enumerate(levels):
        row: list[int | None] = []
        for j, token in enumerate(level):
            if l == 0 and j == 0:
                row.append(None)  # the newest token itself
                continue
            parent = row[j - 1] if l == 0 else index[l - 1][j]
            row.append(draft.add_side(token, UNDER_LEAF if parent is None else parent))
        index.append(row)
    return index


def jacobi_step(levels: list[list[int | None]], head: int, outputs: Sequence[int],
                ngram: int) -> tuple[list[list[int | None]], list[tuple[int, ...]]]:
    """One Jacobi iteration of the window, given the target's arg-max at each side node of its
    last level, by column. Returns the next window and the n-grams collected (none while warming
    up).

    The last level's outputs are the new level. While the window has fewer than N - 1 levels, it
    grows by that level and shifts one column left (its first column has passed). Once full, the
    n-gram of column j is its tokens from level 0 up plus its output (column 0 starts with the
    newest token), the oldest level is dropped, and the next level 0 takes the newest token's
    place in column 0.
    """
    top = len(levels) - 1
    if len(outputs) != last_level_size(levels):
        raise ValueError(f"{len(outputs)} outputs for a last level of {last_level_size(levels)} side nodes")
    new = ([HEAD] if top == 0 else []) + list(outputs)  # the new level, by column (the newest token's output is no side node)
    if len(levels) < ngram - 1:  # warming up
        grown = [level[1:] for level in levels] + [new[1:]]
        grown[0] = [HEAD] + grown[0][1:]
        return grown, []
    ngrams = []
    for j in range(len(levels[0])):
        if new[j] is None:
            continue
        column = [head if j == 0 else levels[0][j]] + [levels[l][j] for l in range(1, len(levels))] + [new[j]]
        ngrams.append(tuple(int(t) for t in column))
    shifted = levels[1:] + [new]
    shifted[0] = [HEAD] + shifted[0][1:]
    return shifted, ngrams
