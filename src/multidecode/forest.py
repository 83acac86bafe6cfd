"""The token forest: the data that MultiDecode decodes, with no model in sight.

MultiDecode (the seed repository "Generating tokens faster using predictions from multiple
token positions") runs many token sequences through one causal language model at once. The
sequences form a *forest*: each **node** holds one token and points to its **parent** (or to
nothing, for a **root**). A root-to-node path is one sequence as the model would see it alone.

Terms used across the package:

- **position**: the position id the model sees for a node. It is the node's depth in its tree
  plus its root's offset, so a node sits at the position it would have in its own sequence.
- **slot**: where the node's key/value lives in the shared KV cache (its column in the attention
  mask). Slots are handed out in the order nodes are fed to the model and are renumbered by
  compaction. A slot is never a position: two branches at the same depth share a position and
  never a slot.
- **visibility**: a node may attend to itself and its ancestors only. Its visibility row is a
  boolean vector over slots. Because a child sees exactly what its parent sees plus itself, rows
  are built incrementally from the parent's row.
- **owner**: who a node belongs to (a branch group, a request). Compaction acts on one owner's
  nodes and never touches another's, so unrelated work can share one forest.
- **removal**: a node that should never have been there (a rejected draft token) leaves the tree:
  its parent's child count drops, it can no longer be a parent, and its slot is freed. A
  *compacted* node, by contrast, stays in the tree as history (tokens and parents can still be
  read) but holds no slot.

`Forest` keeps the tree and the node-to-slot map; `attention_rows` and `compaction_plan` are what
the engine asks of it. Everything here is plain Python and boolean tensors and is tested without
a model.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

import torch

ROOT = -1
"""Parent id of a root node."""

EVERYONE = object()
"""`compaction_plan(owner=EVERYONE)`: any owner's slots may go."""


class Forest:
    """Token nodes with parents, positions and cache slots.

    Node ids are dense integers in creation order and never reused. A node gets a slot when it is
    placed into the cache (`place`), and loses it when compaction drops it.
    """

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.positions: list[int] = []
        self.owners: list[object] = []
        self.slot_of: list[int | None] = []
        self.node_at_slot: list[int] = []
        self._child_count: list[int] = []
        self._removed: list[bool] = []
        # Visibility rows (over slots) of the nodes that may still get children or be queried:
        # the newest nodes and every leaf. Others are rebuilt by walking up to a known row.
        self._rows: dict[int, torch.Tensor] = {}

    # ------------------------------------------------------------------ building
    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def num_slots(self) -> int:
        return len(self.node_at_slot)

    def add(self, tokens: Sequence[int], parents: Sequence[int], *, root_position: int = 0,
            owners: Sequence[object] | None = None) -> list[int]:
        """Add nodes; `parents[i]` is a node id, an index into this call's nodes written as
        `-(i + 2)`, or `ROOT`. Roots start at `root_position`; children sit one past their parent.
        owners: one owner per node (default None for all).

        Returns the new node ids, in order.
        """
        if len(tokens) != len(parents):
            raise ValueError(f"{len(tokens)} tokens but {len(parents)} parents")
        if owners is not None and len(owners) != len(tokens):
            raise ValueError(f"{len(tokens)} tokens but {len(owners)} owners")
        first = len(self.tokens)
        new: list[int] = []
        for i, (token, parent) in enumerate(zip(tokens, parents)):
            if (local := local_parent(parent)) is not None:  # a node of this same call
                parent = first + local
                if parent >= first + len(new):
                    raise ValueError("a node's parent must come before it")
            elif parent != ROOT and not 0 <= parent < first:
                raise ValueError(f"unknown parent node {parent}")
            elif parent != ROOT and self._removed[parent]:
                raise ValueError(f"parent node {parent} was removed")
            node = len(self.tokens)
            self.tokens.append(int(token))
            self.parents.append(parent)
            self.positions.append(root_position if parent == ROOT else self.positions[parent] + 1)
            self.owners.append(None if owners is None else owners[i])
            self.slot_of.append(None)
            self._child_count.append(0)
            self._removed.append(False)
            if parent != ROOT:
                self._child_count[parent] += 1
            new.append(node)
        return new

    def add_chain(self, tokens: Sequence[int], parent: int = ROOT, *, root_position: int = 0) -> list[int]:
        """Add a straight sequence under `parent` (or as a new tree)."""
        return self.add(tokens, chain_parents(len(tokens), parent), root_position=root_position)

    def place(self, nodes: Sequence[int]) -> list[int]:
        """Give `nodes` the next cache slots, in order (the model appends their keys in that order)."""
        slots = []
        for node in nodes:
            if self.slot_of[node] is not None:
                raise ValueError(f"node {node} is already in the cache")
            parent = self.parents[node]
            if parent != ROOT and self.slot_of[parent] is None:
                raise ValueError(f"node {node} is placed before its parent {parent}")
            slot = len(self.node_at_slot)
            self.slot_of[node] = slot
            self.node_at_slot.append(node)
            slots.append(slot)
        return slots

    # ------------------------------------------------------------------ reading
    def is_leaf(self, node: int) -> bool:
        return self._child_count[node] == 0

    def is_removed(self, node: int) -> bool:
        return self._removed[node]

    def children_count(self, node: int) -> int:
        return self._child_count[node]

    def path(self, node: int) -> list[int]:
        """Node ids from the root down to `node`."""
        nodes = []
        while node != ROOT:
            nodes.append(node)
            node = self.parents[node]
        return nodes[::-1]

    def path_tokens(self, node: int) -> list[int]:
        """The token sequence the model sees at `node`, as if that path were run alone."""
        return [self.tokens[n] for n in self.path(node)]

    def slot_owners(self) -> list[object]:
        """Owner of the node in each slot. [num_slots]"""
        return [self.owners[n] for n in self.node_at_slot]

    def slot_positions(self) -> torch.Tensor:
        """Position id of the node in each slot. [num_slots]"""
        return torch.tensor([self.positions[n] for n in self.node_at_slot], dtype=torch.long)

    def positions_of(self, nodes: Sequence[int]) -> torch.Tensor:
        """[len(nodes)]"""
        return torch.tensor([self.positions[n] for n in nodes], dtype=torch.long)

    def is_plain_continuation(self, nodes: Sequence[int]) -> bool:
        """True when `nodes` is one chain that may use the model's own causal mask: every slot
        already in the cache is an ancestor of the chain, so "see everything before you" is exact.
        """
        if not nodes:
            return False
        for prev, node in itertools.pairwise(nodes):
            if self.parents[node] != prev:
                return False
        head_parent = self.parents[nodes[0]]
        placed_before = self.slot_of[nodes[0]]
        if placed_before is None:
            raise ValueError("place the nodes before asking how to run them")
        if head_parent == ROOT:
            return placed_before == 0
        row = self._row(head_parent)  # covers slots up to the parent's own
        return row.numel() == placed_before and bool(row.all())

    # ------------------------------------------------------------------ visibility
    def _row(self, node: int) -> torch.Tensor:
        """Visibility row of a placed node over the slots up to its own (the cache never holds
        an ancestor after its descendant)."""
        row = self._rows.get(node)
        if row is not None:
            return row
        # Walk up to the nearest node with a known row, then add the walked slots back.
        walked = []
        cur = node
        while cur != ROOT and cur not in self._rows:
            walked.append(cur)
            cur = self.parents[cur]
        slots = [self.slot_of[n] for n in walked]
        if any(s is None for s in slots):
            raise ValueError(f"node {node} has an ancestor that is not in the cache")
        row = torch.zeros(max(slots) + 1, dtype=torch.bool)  # type: ignore[type-var]
        if cur != ROOT:
            base = self._rows[cur]
            row[: base.numel()] = base
        row[slots] = True
        return row

    def attention_rows(self, nodes: Sequence[int]) -> torch.Tensor:
        """Boolean visibility of each of `nodes` (already placed) over all slots. [len(nodes), num_slots]

        Row i is True at the slots of node i and of its ancestors, and False elsewhere.
        """
        width = self.num_slots
        out = torch.zeros(len(nodes), width, dtype=torch.bool)
        for i, node in enumerate(nodes):
            slot = self.slot_of[node]
            if slot is None:
                raise ValueError(f"node {node} is not in the cache")
            parent = self.parents[node]
            if parent != ROOT:
                prow = self._row(parent)
                out[i, : prow.numel()] = prow
            out[i, slot] = True
            self._rows[node] = out[i, : slot + 1].clone()
        self._forget_inner_rows(nodes)
        return out

    def _forget_inner_rows(self, newest: Iterable[int]) -> None:
        keep = set(newest)
        for node in list(self._rows):
            if node not in keep and not self.is_leaf(node):
                del self._rows[node]

    # ------------------------------------------------------------------ compaction and removal
    def compaction_plan(self, live: Sequence[int], *, owner: object = EVERYONE) -> torch.Tensor:
        """Slots to keep so that `live` nodes (and hence their ancestors) stay, in slot order. [n_keep]

        owner: only this owner's slots may go (every other owner's are kept whatever `live`
        says); EVERYONE lets any slot go.
        """
        keep = torch.zeros(self.num_slots, dtype=torch.bool)
        if owner is not EVERYONE:
            keep |= torch.tensor([o != owner for o in self.slot_owners()], dtype=torch.bool)
        for node in live:
            row = self._row(node)
            keep[: row.numel()] |= row
        return keep.nonzero().flatten()

    def remove(self, nodes: Iterable[int]) -> None:
        """Take `nodes` out of the tree (rejected drafts, or a feed that failed). Each must be a node
        whose children are all removed with it; the slots of placed ones are freed by the
        `compact` that must follow."""
        nodes = set(nodes)
        for node in nodes:
            if self._removed[node]:
                raise ValueError(f"node {node} was already removed")
        for node in nodes:
            parent = self.parents[node]
            if parent != ROOT:
                self._child_count[parent] -= 1
        for node in nodes:
            if self._child_count[node]:
                raise ValueError(f"node {node} still has children that are not removed with it")
            self._removed[node] = True
            self._rows.pop(node, None)

    def compact(self, keep_slots: torch.Tensor) -> None:
        """Renumber slots after the cache kept only `keep_slots` (sorted ascending).

        Slots before the first change keep their numbers, and rows that end before it are left as
        they are, so dropping a few slots at the tail (a rollback) costs work for the tail only.
        """
        first = unchanged_prefix(keep_slots)
        kept_tail = keep_slots[first:]  # [n_tail] old slot numbers, ascending
        tail_list = kept_tail.tolist()
        if any(b <= a for a, b in itertools.pairwise(tail_list)) or (
                tail_list and (tail_list[0] < first or tail_list[-1] >= self.num_slots)):
            raise ValueError("slots to keep must be sorted, unique and in the cache")
        for node in self.node_at_slot[first:]:
            self.slot_of[node] = None
        tail = [self.node_at_slot[s] for s in tail_list]
        self.node_at_slot[first:] = tail
        for slot, node in enumerate(tail, start=first):
            self.slot_of[node] = slot
        rows = {}
        for node, row in self._rows.items():
            if self.slot_of[node] is None:
                continue
            if row.numel() > first:
                row = torch.cat([row[:first], row[kept_tail[kept_tail < row.numel()]]])
            rows[node] = row
        self._rows = rows


    def renumbered(self) -> tuple[Forest, dict[int, int]]:
        """A new forest of only the nodes that have a slot, numbered afresh in slot order, and
        the map from old node ids to new ones. Slots, tokens, positions, owners and visibility
        are the same; the history of compacted and removed nodes is gone, so a forest that lives
        for ever (a server's) does not grow for ever. Nothing may hold an old node id after this
        but through the map."""
        new = Forest()
        ids: dict[int, int] = {}
        for slot, node in enumerate(self.node_at_slot):
            parent = self.parents[node]
            if parent != ROOT and parent not in ids:
                raise ValueError(f"node {node} is cached but its parent {parent} is not")
            ids[node] = slot
            new.tokens.append(self.tokens[node])
            new.parents.append(ROOT if parent == ROOT else ids[parent])
            new.positions.append(self.positions[node])
            new.owners.append(self.owners[node])
            new.slot_of.append(slot)
            new.node_at_slot.append(slot)
            new._child_count.append(0)
            new._removed.append(False)
            if parent != ROOT:
                new._child_count[ids[parent]] += 1
        return new, ids


def unchanged_prefix(keep: Sequence[int] | torch.Tensor) -> int:
    """How many leading slots `keep` (sorted, unique) leaves where they are: the first i with
    keep[i] != i. A binary search: keep[i] == i holds exactly for a prefix of i."""
    lo, hi = 0, len(keep)
    while lo < hi:
        mid = (lo + hi) // 2
        if int(keep[mid]) == mid:
            lo = mid + 1
        else:
            hi = mid
    return lo


def local_parent(parent: int) -> int | None:
    """The index, within its own call, of a parent written `-(i + 2)`; None for a node id or ROOT."""
    return -parent - 2 if parent <= -2 else None


def chain_parents(length: int, parent: int = ROOT, start: int = 0) -> list[int]:
    """`Forest.add` parents for a chain of `length` nodes under `parent`, when the chain begins at
    index `start` of the call's nodes: each node's parent is the node before it."""
    return ([parent] + [-(start + i + 2) for i in range(length - 1)])[:length]
