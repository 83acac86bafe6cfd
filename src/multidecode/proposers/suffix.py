"""Suffix decoding: drafts from everything this process has seen, prompts and outputs alike.

SuffixDecoding (Oliaro et al., 2024, arXiv 2411.04975) drafts without a draft model: it keeps a
suffix structure over earlier prompts and outputs, finds the longest recent stretch of the
current sequence that occurred before, and drafts a tree of what followed it then, weighted by
how often. Agentic and repeated workloads (the same tool calls, the same summaries, a second
pass over the same requests) repeat long stretches of earlier outputs, so long drafts come true.
Here the history is every branch of every run that used the same `SuffixStore` (by default one
per process, `shared_store()`), so parallel branches and later requests draft from each other.

Terms:

- **suffix trie** (`SuffixStore`): a trie of every substring of at most `max_depth` (D) tokens of
  the stored sequences. Each sequence adds, at each of its positions, the path of the D tokens
  starting there (fewer near its end); a node counts the **occurrences** (start positions) that
  passed it, and how many of those went on to a child.
- **match length** m: the length of the longest suffix of the branch's tokens whose trie node has
  a child, i.e. that occurred before and was followed by something.
- **continuation**: a path under that node: tokens that followed an earlier occurrence.
- **conditional frequency** of a node: its count over the number of occurrences that went on from
  its parent (how often, after this context, that token came next); a node's **path score** is
  the product of the conditional frequencies from the match down to it, the empirical chance
  that the whole path comes true.

A draft (`SuffixProposer`) is grown best first by path score from the matched node: at most
`alpha * m` nodes (capped by the budget), no node whose conditional frequency is below
`min_probability`, none whose path score is below `min_score`. Longer matches are more
specific, so they earn bigger drafts; rare continuations are pruned. Ties go to the continuation
seen most recently.

Why a depth-limited trie and not a full suffix tree: a suffix tree is linear in size, but its
online construction (Ukkonen's suffix links and edge splits) over many sequences that grow in
turns, with per-node counts and eviction of whole sequences, is intricate. A trie cut at depth D
is simple and its costs are plain: each new token extends the D suffixes that end at it, O(D)
dictionary steps, and those D nodes (kept per sequence as its "active" suffix nodes) are exactly
the trie nodes of the branch's last 1..D tokens, so the match is found by scanning them from the
longest down, O(D), without walking from the root. The price is memory, up to D nodes per token
of novel text (repeated text adds none), hence the node cap; and a match of length m leaves at
most D - m tokens of continuation below it, so matches are capped at D - budget (`max_match`).

Bounded memory, least recently used out: the store caps its trie nodes and its stored tokens.
Past either cap it removes whole sequences, least recently used first ("used": extended, or a
draft taken from it accepted; a node remembers the last sequence that passed it, and an
accepted draft touches that one), taking back the counts of each of their occurrences and
deleting the nodes that reach zero. A sequence that alone exceeds a cap loses its oldest
occurrences instead. A branch whose sequence was removed starts a new one from its last D tokens.

Costs, measured on this project's CPU with D = 32 and a 2,000-token history: a step's propose
(store the step's 1-3 new tokens, match, draft up to 8 nodes) takes 0.03-0.04 ms (median; 0.1
ms at the 99th percentile); a branch's first propose stores its whole prompt, about 18 us a
token of novel text (32 new nodes) and 7-10 us a token of repeated text, so 25-40 ms for a
2,000-token prompt. A node is five 8-byte array slots (about 50 bytes with the dicts of nodes
that branch), so the default cap of 2,000,000 nodes is about 100 MB; nodes are not Python
objects, so the store adds nothing to the garbage collector's passes.

The store is plain Python and not thread-safe: one process's decoding loop uses it. Drafts are
token ids as stored: a store must only be shared by models with one tokenizer.
"""

from __future__ import annotations

import heapq
from array import array
from collections import OrderedDict
from collections.abc import Hashable, Iterator, Sequence
from itertools import count

from .base import UNDER_LEAF, BranchContext, DraftTree, Proposer

MAX_DEPTH = 32
"""Default trie depth D: the longest substring counted."""

MAX_NODES = 2_000_000
"""Default cap on trie nodes (about 50 bytes each)."""

MAX_TOKENS = 1_000_000
"""Default cap on stored tokens (8 bytes each; repeated text adds tokens but no nodes)."""

MAX_KIND = 8
"""Draft nodes are labelled (`DraftTree.kinds`) with min(match length, MAX_KIND)."""

TRIE_ROOT = 0
"""The trie root's node id."""


class _Sequence:
    """A stored sequence: its tokens since its oldest stored occurrence, and the trie nodes of
    its last 1..D tokens (active[k - 1]: the node of its last k tokens)."""

    __slots__ = ("active", "tokens")

    def __init__(self) -> None:
        self.tokens = array("q")
        self.active: list[int] = []


class SuffixStore:
    """A depth-limited suffix trie over token sequences, with counts, bounded in size.

    max_depth: D, the longest substring counted (and the longest match plus continuation).
    max_nodes, max_tokens: caps on trie nodes and stored tokens; past either, whole sequences
        go, least recently used first (see the module notes).

    Sequences grow in turns: `start()` gives a new id, `extend(seq, tokens)` appends to it.

    Nodes are integer ids into flat arrays, not Python objects: millions of small objects would
    cost ~2x the memory and make every full pass of Python's garbage collector walk them all
    (pauses of 0.1 s per 200,000 nodes were measured). A node's first child sits inline
    (`_tok`, `_kid`), further ones in `_more[node]`, a dict of ints, so the usual node with one
    child costs no dict.
    """

    def __init__(self, *, max_depth: int = MAX_DEPTH, max_nodes: int = MAX_NODES,
                 max_tokens: int = MAX_TOKENS) -> None:
        if max_depth < 2:
            raise ValueError("max_depth must be at least 2 (a match and one token after it)")
        if max_nodes < 1 or max_tokens < 1:
            raise ValueError("max_nodes and max_tokens must be positive")
        self.max_depth, self.max_nodes, self.max_tokens = max_depth, max_nodes, max_tokens
        # per node id: occurrences that passed it; how many of those went on to a child (the sum
        # of its children's counts); the last sequence that passed it; its inline child's token
        # and id (-1: none). Ids below _top are in use or in _free, ready for reuse (zero counts,
        # no children); the arrays grow in blocks, set up as free nodes are.
        self._count, self._cont, self._seq = array("q", [0]), array("q", [0]), array("q", [-1])
        self._tok, self._kid = array("q", [-1]), array("q", [-1])
        self._top = 1
        self._more: dict[int, dict[int, int]] = {}  # node -> token -> child, past the inline child
        self._free: list[int] = []  # ids of deleted nodes, for reuse
        self.nodes = 0  # trie nodes, the root not counted
        self.tokens = 0  # stored tokens, over all sequences
        self.evicted = 0  # sequences removed to keep within the caps
        self._sequences: OrderedDict[int, _Sequence] = OrderedDict()  # least recently used first
        self._ids = count()

    def __len__(self) -> int:
        """The number of stored sequences."""
        return len(self._sequences)

    def __contains__(self, seq: int) -> bool:
        return seq in self._sequences

    # ------------------------------------------------------------------ sequences
    def start(self) -> int:
        """A new, empty sequence; returns its id (ids grow: a larger id is a newer sequence)."""
        seq = next(self._ids)
        self._sequences[seq] = _Sequence()
        return seq

    def add(self, tokens: Sequence[int]) -> int:
        """A new sequence holding `tokens`; returns its id."""
        seq = self.start()
        self.extend(seq, tokens)
        return seq

    def extend(self, seq: int, tokens: Sequence[int]) -> None:
        """Append `tokens` to sequence `seq` (O(D) per token), then keep within the caps. Raises
        KeyError if `seq` was removed."""
        record = self._sequences[seq]
        if not len(tokens):
            return
        depth = self.max_depth
        counts, conts, seqs, toks, kids, more, free = (self._count, self._cont, self._seq, self._tok, self._kid,
                                                       self._more, self._free)
        active, created = record.active, 0
        for token in tokens:
            grown = []
            for parent in (TRIE_ROOT, *active[: depth - 1]):
                if toks[parent] == token:
                    node = kids[parent]
                else:
                    children = more.get(parent)
                    node = -1 if children is None else children.get(token, -1)
                    if node < 0:  # a new node
                        if free:
                            node = free.pop()
                        else:
                            node = self._top
                            self._top += 1
                            if node == len(counts):
                                self._grow()
                        if kids[parent] < 0:
                            toks[parent], kids[parent] = token, node
                        elif children is None:
                            more[parent] = {token: node}
                        else:
                            children[token] = node
                        created += 1
                counts[node] += 1
                seqs[node] = seq
                conts[parent] += 1
                grown.append(node)
            active = grown
        record.active = active
        record.tokens.extend(tokens)
        self.nodes += created
        self.tokens += len(tokens)
        self._sequences.move_to_end(seq)
        self._keep_within_caps(seq)

    def _grow(self) -> None:
        block = max(1024, len(self._count) // 4)
        zeros, none = array("q", [0]) * block, array("q", [-1]) * block
        self._count.extend(zeros)
        self._cont.extend(zeros)
        self._seq.extend(none)
        self._tok.extend(none)
        self._kid.extend(none)

    def touch(self, seq: int) -> None:
        """Mark `seq` as just used (a draft from it was accepted); nothing if it is gone."""
        if seq in self._sequences:
            self._sequences.move_to_end(seq)

    def forget(self, seq: int) -> None:
        """Remove sequence `seq`: every count its occurrences added, and the nodes left at zero."""
        record = self._sequences.pop(seq)
        self._remove_occurrences(record, len(record.tokens))
        record.active = []

    def suffix_nodes(self, seq: int) -> list[int]:
        """The trie nodes of the last 1..D tokens of `seq` (index k - 1: the last k tokens)."""
        return self._sequences[seq].active

    # ------------------------------------------------------------------ reading
    def child(self, node: int, token: int) -> int:
        """The child of `node` for `token`, or -1."""
        if self._tok[node] == token:
            return self._kid[node]
        children = self._more.get(node)
        return -1 if children is None else children.get(token, -1)

    def children(self, node: int) -> Iterator[tuple[int, int]]:
        """(token, child) for each child of `node`, the inline one first."""
        if self._kid[node] >= 0:
            yield self._tok[node], self._kid[node]
        children = self._more.get(node)
        if children:
            yield from children.items()

    def node(self, path: Sequence[int]) -> int:
        """The trie node of `path` (at most D tokens; TRIE_ROOT for none), or -1 if it never occurred."""
        node = TRIE_ROOT
        for token in path:
            node = self.child(node, token)
            if node < 0:
                return -1
        return node

    def count(self, path: Sequence[int]) -> int:
        """How many stored occurrences `path` has (0 for an empty path or one never seen)."""
        node = self.node(path) if len(path) else -1
        return 0 if node < 0 else self._count[node]

    def continuations(self, path: Sequence[int]) -> dict[int, int]:
        """token -> how many stored occurrences of `path` it followed."""
        node = self.node(path)
        return {} if node < 0 else {token: self._count[child] for token, child in self.children(node)}

    # ------------------------------------------------------------------ eviction
    def _keep_within_caps(self, current: int) -> None:
        while self.nodes > self.max_nodes or self.tokens > self.max_tokens:
            oldest = next(iter(self._sequences))
            if oldest != current:
                self.forget(oldest)
                self.evicted += 1
                continue
            # `current` alone is over a cap: drop its oldest occurrences, one at a time, never
            # the last D (their nodes are its active ones).
            record = self._sequences[current]
            self._remove_occurrences(record, max(0, len(record.tokens) - self.max_depth), trim=True)
            return

    def _remove_occurrences(self, record: _Sequence, upto: int, *, trim: bool = False) -> None:
        """Take back the occurrences starting at record.tokens[:upto]: all of them, or with `trim`
        the oldest ones until the store is within its caps; then drop those tokens."""
        tokens, depth = record.tokens, self.max_depth
        counts, conts, kids = self._count, self._cont, self._kid
        n = len(tokens)
        start = 0
        while start < upto and not (trim and self.nodes <= self.max_nodes and self.tokens - start <= self.max_tokens):
            end = min(start + depth, n)
            parent = TRIE_ROOT
            for j in range(start, end):
                token = tokens[j]
                node = self.child(parent, token)
                conts[parent] -= 1
                counts[node] -= 1
                if counts[node] == 0:  # only this occurrence passed it: its subtree is this path
                    self._unlink(parent, token)
                    while node >= 0:  # free the path: each node on it has at most this one child
                        below = kids[node]
                        counts[node] = conts[node] = 0
                        self._tok[node] = kids[node] = -1
                        self._free.append(node)
                        self.nodes -= 1
                        node = below
                    break
                parent = node
            start += 1
        del tokens[:start]
        self.tokens -= start

    def _unlink(self, parent: int, token: int) -> None:
        """Remove `parent`'s child for `token` from its children."""
        more = self._more.get(parent)
        if self._tok[parent] == token:
            if more:
                self._tok[parent], self._kid[parent] = more.popitem()
                if not more:
                    del self._more[parent]
            else:
                self._tok[parent] = self._kid[parent] = -1
        else:
            del more[token]
            if not more:
                del self._more[parent]


_SHARED: dict[Hashable, SuffixStore] = {}


def shared_store(key: Hashable = None) -> SuffixStore:
    """The process's store for `key` (made on first use with the default caps). Models with
    different tokenizers must use different keys: a draft is token ids."""
    store = _SHARED.get(key)
    if store is None:
        store = _SHARED[key] = SuffixStore()
    return store


# ---------------------------------------------------------------------- the proposer
class _Branch:
    """A branch's place in the store: its sequence, how many of its tokens are stored, the last
    of them (to notice a context that changed under us), its last draft as proposed and the
    sequence each node of it came from."""

    __slots__ = ("cursor", "draft", "last", "seq", "sources", "store")

    def __init__(self, store: SuffixStore, seq: int, cursor: int) -> None:
        self.store, self.seq, self.cursor = store, seq, cursor
        self.last: int | None = None
        self.draft = DraftTree()
        self.sources: list[int] = []


class SuffixProposer(Proposer):
    """Drafts from a suffix trie over every sequence its store has seen (see the module notes).

    store: the `SuffixStore` shared with other proposers; default `shared_store()`.
    alpha: a draft has at most alpha * (match length) nodes (at least 1), capped by the budget.
    min_probability: the least conditional frequency a draft node may have.
    min_score: the least path score a draft node may have.
    max_match: the longest match tried; default D - budget, so a match leaves room for a draft
        of the whole budget below it in the trie.

    Draft nodes carry kind min(match length, 8), and as prior (the chance of acceptance once the
    parent is accepted) their count over (their parent's continued occurrences + 1): the
    conditional frequency, shrunk for small counts. A branch's tokens are stored when it is next
    proposed for or observed (its prompt on first sight), and when it finishes. With the shared
    store, `check` picks the one of the target's vocabulary.
    """

    name = "suffix"
    default_budget = 16
    """A long match sizes a long draft (and a short one a short draft): let the match decide."""

    def __init__(self, *, store: SuffixStore | None = None, alpha: float = 1.0, min_probability: float = 0.1,
                 min_score: float = 0.02, max_match: int | None = None) -> None:
        if alpha <= 0:
            raise ValueError("alpha must be positive")
        if not 0 <= min_probability <= 1 or not 0 <= min_score <= 1:
            raise ValueError("min_probability and min_score must lie in [0, 1]")
        if max_match is not None and max_match < 1:
            raise ValueError("max_match must be at least 1")
        self.store = shared_store() if store is None else store
        self._shared = store is None
        self.alpha, self.min_probability, self.min_score, self.max_match = alpha, min_probability, min_score, max_match

    def propose(self, context: BranchContext, budget: int) -> DraftTree:
        state = self._sync(context)
        draft = state.draft = DraftTree()
        state.sources = []
        if budget < 1:
            return draft
        store = self.store
        active = store.suffix_nodes(state.seq)
        counts, conts, seqs = store._count, store._cont, store._seq
        longest = self.max_match if self.max_match is not None else store.max_depth - budget
        longest = min(max(longest, 1), len(active), store.max_depth - 1)
        for length in range(longest, 0, -1):
            match = active[length - 1]
            if conts[match]:  # followed by something before (the branch's own occurrence never is)
                break
        else:
            return draft
        size = min(budget, max(1, int(self.alpha * length)))
        kind = min(length, MAX_KIND)
        min_p, min_score = self.min_probability, self.min_score
        tie = count()
        heap: list[tuple[float, int, int, int, int, int, float]] = []

        def push(node: int, score: float, parent: int) -> None:
            total = conts[node]
            for token, child in store.children(node):
                p = counts[child] / total
                if p >= min_p and score * p >= min_score:
                    # best path score first; on a tie, the continuation seen most recently
                    heapq.heappush(heap, (-score * p, -seqs[child], next(tie), token, child, parent,
                                          counts[child] / (total + 1)))

        push(match, 1.0, UNDER_LEAF)
        while heap and len(draft) < size:
            neg_score, neg_seq, _, token, node, parent, prior = heapq.heappop(heap)
            index = draft.add(token, parent, kind=kind, prior=prior)
            state.sources.append(-neg_seq)
            if conts[node]:
                push(node, -neg_score, index)
        return draft

    def check(self, model) -> None:
        """With the shared store, use the one of this model's vocabulary: ids drafted from another
        tokenizer's text would mean other words (or lie outside this vocabulary)."""
        if self._shared:
            self.store = shared_store(("vocabulary", model.get_input_embeddings().num_embeddings))

    def release(self, context: BranchContext) -> None:
        """A finished branch: store its last tokens too (its last step had no draft to observe)."""
        if "suffix" in context.scratch:
            self._sync(context)

    def observe(self, context: BranchContext, draft: DraftTree, accepted: Sequence[int],
                side_logits=None) -> None:
        state = context.scratch.get("suffix")
        if state is not None and accepted:
            # `draft` may be a cut of the proposed one (renumbered): find the accepted path in it
            at = UNDER_LEAF
            for i in accepted:
                at = state.draft.child(at, draft.tokens[i])
                if at is None:
                    break
            else:
                self.store.touch(state.sources[at])
        self._sync(context)

    def _sync(self, context: BranchContext) -> _Branch:
        """The branch's state, its tokens stored up to the newest (its prompt on first sight)."""
        store, tokens = self.store, context.tokens
        state = context.scratch.get("suffix")
        if state is None or state.store is not store or state.cursor > len(tokens) or \
                (state.cursor and tokens[state.cursor - 1] != state.last):
            state = context.scratch["suffix"] = _Branch(store, store.start(), 0)
        elif state.seq not in store:  # removed to keep the store within its caps: start again
            state.seq, state.cursor = store.start(), max(0, min(state.cursor, len(tokens) - store.max_depth))
        if state.cursor < len(tokens):
            store.extend(state.seq, tokens[state.cursor:])
            state.cursor, state.last = len(tokens), tokens[-1]
        return state
