"""A radix tree over the token paths of the forest: which prompt prefixes are cached, and where.

A server keeps every prompt it has fed in the forest under one **cache owner**, so that a later
request whose prompt starts the same way hangs its remainder under the cached node instead of
computing that prefix again (the idea of SGLang's RadixAttention, Zheng et al. 2024, here over a
token forest rather than over cache blocks). The index maps token sequences to the forest nodes
that hold them:

- an **edge** holds a run of tokens and the node id of each of them (node i holds token i, and
  is the parent of node i + 1); a node's children are keyed by their first token;
- `match(tokens)` walks down as far as the tokens agree and returns how many matched and the
  node of the last matched token;
- `insert(tokens, nodes)` adds a fed path (splitting an edge where it diverges). Where the same
  tokens are already indexed under other nodes (two requests fed the same prefix at once), the
  indexed copy stays and the new path is indexed only down to where it left the indexed nodes:
  an indexed node's parent in the forest is always the indexed node before it;
- `evict(budget)` forgets the least recently used leaves until at most `budget` tokens are
  indexed; the server then compacts the cache owner's slots that no index entry and no running
  request still needs (`leaves()` are what must stay).

Plain data, no model: it is tested on its own.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(eq=False)
class _Edge:
    """A run of tokens below a parent edge, with the forest node that holds each token."""

    tokens: list[int]
    nodes: list[int]
    parent: _Edge | None
    children: dict[int, _Edge] = field(default_factory=dict)  # first token -> child edge
    used: int = 0  # the clock value of its last match or insert


class PrefixIndex:
    """Token prefixes of the forest's cached prompts (see the module notes)."""

    def __init__(self) -> None:
        self._root = _Edge([], [], None)
        self._clock = itertools.count(1)
        self.tokens = 0  # tokens indexed in all

    def __len__(self) -> int:
        return self.tokens

    def match(self, tokens: Sequence[int]) -> tuple[int, int | None]:
        """How many leading `tokens` are indexed, and the node holding the last of them (None
        when nothing matched). The matched path counts as just used."""
        now = next(self._clock)
        edge, matched, node = self._root, 0, None
        while matched < len(tokens):
            child = edge.children.get(tokens[matched])
            if child is None:
                break
            run = 0
            while run < len(child.tokens) and matched + run < len(tokens) and child.tokens[run] == tokens[matched + run]:
                run += 1
            matched += run
            node = child.nodes[run - 1]
            self._touch(child, now)
            if run < len(child.tokens):
                break
            edge = child
        return matched, node

    def insert(self, tokens: Sequence[int], nodes: Sequence[int]) -> None:
        """Index a fed path: `nodes[i]` holds `tokens[i]`, from a root down."""
        if len(tokens) != len(nodes):
            raise ValueError(f"{len(tokens)} tokens but {len(nodes)} nodes")
        now = next(self._clock)
        edge, at = self._root, 0
        while at < len(tokens):
            child = edge.children.get(tokens[at])
            if child is None:
                new = _Edge(list(tokens[at:]), list(nodes[at:]), edge, used=now)
                edge.children[tokens[at]] = new
                self.tokens += len(new.tokens)
                self._touch(edge, now)
                return
            run = 0
            while run < len(child.tokens) and at + run < len(tokens) and child.tokens[run] == tokens[at + run]:
                if child.nodes[run] != nodes[at + run]:
                    # The same tokens, held by another copy: the rest of this path hangs under that
                    # copy, not under the indexed nodes, so it is not indexed.
                    self._touch(child, now)
                    return
                run += 1
            if run < len(child.tokens):
                self._split(child, run)
            at += run
            edge = child
            self._touch(edge, now)

    def _split(self, edge: _Edge, at: int) -> None:
        """Cut `edge` after its first `at` tokens; the rest becomes its only child."""
        tail = _Edge(edge.tokens[at:], edge.nodes[at:], edge, edge.children, edge.used)
        for child in tail.children.values():
            child.parent = tail
        edge.tokens, edge.nodes = edge.tokens[:at], edge.nodes[:at]
        edge.children = {tail.tokens[0]: tail}

    def _touch(self, edge: _Edge, now: int) -> None:
        while edge is not None and edge.used < now:
            edge.used = now
            edge = edge.parent

    def renumber(self, ids: dict[int, int]) -> None:
        """Follow the forest's renumbering (`Forest.renumbered`): every indexed node must be in `ids`."""
        for edge in self._edges():
            edge.nodes = [ids[n] for n in edge.nodes]

    def leaves(self) -> list[int]:
        """The last node of every indexed path (keeping them keeps every indexed node)."""
        return [edge.nodes[-1] for edge in self._edges() if not edge.children and edge.nodes]

    def _edges(self) -> list[_Edge]:
        out, todo = [], [self._root]
        while todo:
            edge = todo.pop()
            out.append(edge)
            todo.extend(edge.children.values())
        return out

    def evict(self, budget: int) -> int:
        """Forget least recently used leaves (whole, or their tail) until at most `budget` tokens
        are indexed. Returns the number of tokens forgotten."""
        forgotten = 0
        while self.tokens > budget:
            leaf = min((e for e in self._edges() if not e.children and e is not self._root), key=lambda e: e.used)
            cut = min(len(leaf.tokens), self.tokens - budget)
            keep = len(leaf.tokens) - cut
            if keep:
                leaf.tokens, leaf.nodes = leaf.tokens[:keep], leaf.nodes[:keep]
            else:
                del leaf.parent.children[leaf.tokens[0]]
            self.tokens -= cut
            forgotten += cut
        return forgotten


__all__ = ["PrefixIndex"]
