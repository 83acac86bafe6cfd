"""The token forest as plain data: positions, slots, visibility rows and compaction, no model."""

import random

import pytest
import torch

from multidecode.forest import ROOT, Forest


# ---------------------------------------------------------------------- a brute-force oracle
class Shadow:
    """An independent record of a forest: parents, root offsets and the slot order, from which
    positions and visibility rows are recomputed by walking parents."""

    def __init__(self) -> None:
        self.parents: list[int] = []
        self.root_position: list[int] = []
        self.slots: list[int] = []  # node in each slot

    def add(self, parents: list[int], root_position: int) -> None:
        first = len(self.parents)
        for p in parents:
            self.parents.append(first + (-p - 2) if p <= -2 else p)
            self.root_position.append(root_position)

    def ancestors_or_self(self, node: int) -> set[int]:
        seen = set()
        while node != ROOT:
            seen.add(node)
            node = self.parents[node]
        return seen

    def position(self, node: int) -> int:
        depth = len(self.ancestors_or_self(node)) - 1
        root = node
        while self.parents[root] != ROOT:
            root = self.parents[root]
        return self.root_position[root] + depth

    def row(self, node: int) -> list[bool]:
        mine = self.ancestors_or_self(node)
        return [n in mine for n in self.slots]


def check_rows(forest: Forest, shadow: Shadow, nodes: list[int]) -> None:
    rows = forest.attention_rows(nodes)
    assert rows.dtype == torch.bool
    assert rows.shape == (len(nodes), len(shadow.slots))
    assert rows.tolist() == [shadow.row(n) for n in nodes]


# ---------------------------------------------------------------------- building
def test_add_positions_with_root_offsets_and_same_call_parents():
    """Roots sit at root_position, children one past their parent; -(i + 2) names node i of the call."""
    f = Forest()
    nodes = f.add([10, 11, 12, 13, 14], [ROOT, -2, -3, ROOT, -5], root_position=5)
    assert nodes == [0, 1, 2, 3, 4]
    assert f.positions == [5, 6, 7, 5, 6]
    assert f.parents == [ROOT, 0, 1, ROOT, 3]
    more = f.add([20, 21], [2, 4])
    assert f.positions_of(more).tolist() == [8, 7]
    assert f.positions_of(more).dtype == torch.long
    assert f.tokens == [10, 11, 12, 13, 14, 20, 21]
    assert len(f) == 7


def test_add_chain_under_a_parent_and_as_a_new_root():
    """A chain counts depth from its parent, or from its own root offset."""
    f = Forest()
    a = f.add_chain([1, 2, 3])
    b = f.add_chain([4, 5], parent=a[1])
    c = f.add_chain([6, 7], root_position=100)
    assert [f.positions[n] for n in a + b + c] == [0, 1, 2, 2, 3, 100, 101]
    assert f.parents[b[0]] == a[1] and f.parents[b[1]] == b[0]
    assert f.parents[c[0]] == ROOT
    assert f.add_chain([]) == []


def test_path_and_path_tokens():
    """path_tokens is the sequence the model would see if that path ran alone."""
    f = Forest()
    a = f.add_chain([1, 2, 3])
    b = f.add_chain([7, 8], parent=a[0])
    assert f.path(b[1]) == [a[0], b[0], b[1]]
    assert f.path_tokens(b[1]) == [1, 7, 8]
    assert f.path_tokens(a[2]) == [1, 2, 3]
    assert f.is_leaf(a[2]) and f.is_leaf(b[1]) and not f.is_leaf(a[0])


@pytest.mark.parametrize(
    "tokens, parents",
    [
        ([1, 2], [ROOT]),  # lengths differ
        ([1], [0]),  # parent does not exist yet
        ([1], [5]),
        ([1], [-2]),  # a node as its own parent
        ([1, 2], [ROOT, -3]),  # node 1 of the call names itself
        ([1, 2], [-3, ROOT]),  # node 0 names a later node
    ],
)
def test_add_rejects_bad_parents(tokens, parents):
    """Unknown, self or forward parents raise ValueError and add nothing usable."""
    f = Forest()
    with pytest.raises(ValueError):
        f.add(tokens, parents)


def test_add_rejects_parents_beyond_the_forest():
    f = Forest()
    f.add_chain([1, 2])
    with pytest.raises(ValueError):
        f.add([3], [2])


# ---------------------------------------------------------------------- slots
def test_place_hands_out_slots_in_feed_order():
    """Slots follow the order nodes are placed, not node ids; slot positions follow the slots."""
    f = Forest()
    a = f.add_chain([1, 2], root_position=3)
    b = f.add([5, 6], [a[0], a[0]])
    assert f.place(a) == [0, 1]
    assert f.place([b[1], b[0]]) == [2, 3]
    assert f.slot_of == [0, 1, 3, 2]
    assert f.node_at_slot == [a[0], a[1], b[1], b[0]]
    assert f.num_slots == 4
    assert f.slot_positions().tolist() == [3, 4, 4, 4]


def test_place_rejects_twice_and_before_parent():
    f = Forest()
    a = f.add_chain([1, 2])
    with pytest.raises(ValueError):
        f.place([a[1]])  # parent not in the cache yet
    f.place([a[0]])
    with pytest.raises(ValueError):
        f.place([a[0]])


def test_attention_rows_of_unplaced_node_raise():
    f = Forest()
    a = f.add_chain([1, 2])
    f.place(a[:1])
    with pytest.raises(ValueError):
        f.attention_rows(a)


# ---------------------------------------------------------------------- visibility
def test_attention_rows_small_example():
    """Prefix of 3, two branches of 2 fed together: each sees itself, its branch and the prefix."""
    f = Forest()
    p = f.add_chain([1, 2, 3])
    f.place(p)
    assert f.attention_rows(p).tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    new = f.add([4, 5, 6, 7], [p[-1], p[-1], -2, -3])  # a, b, a's child, b's child
    f.place(new)
    rows = f.attention_rows(new).int().tolist()
    assert rows == [
        [1, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 0, 1, 0, 0],
        [1, 1, 1, 1, 0, 1, 0],
        [1, 1, 1, 0, 1, 0, 1],
    ]
    # An older node asked again sees the same ancestors, and nothing placed after it.
    assert f.attention_rows([new[0]]).int().tolist() == [[1, 1, 1, 1, 0, 0, 0]]


def grow_randomly(seed: int, steps: int = 40, compact_every: int | None = None) -> None:
    """Grow a random forest step by step as the engine would, checking every row, position and
    slot against the brute-force shadow, with compaction now and then."""
    rng = random.Random(seed)
    f, s = Forest(), Shadow()
    for step in range(steps):
        placed = [n for n in s.slots]
        tokens, parents = [], []
        for i in range(rng.randint(1, 6)):
            choice = rng.random()
            if choice < 0.15 or not placed and i == 0:
                parents.append(ROOT)
            elif choice < 0.45 and i > 0:
                parents.append(-(rng.randrange(i) + 2))
            elif placed:
                parents.append(rng.choice(placed))
            else:
                parents.append(-(rng.randrange(i) + 2))
            tokens.append(rng.randrange(100))
        root_position = rng.choice([0, 0, 7])
        nodes = f.add(tokens, parents, root_position=root_position)
        s.add(parents, root_position)
        assert nodes == list(range(len(s.parents) - len(nodes), len(s.parents)))
        assert f.positions_of(nodes).tolist() == [s.position(n) for n in nodes]
        order = nodes[:]
        rng.shuffle(order)
        order.sort(key=lambda n: len(s.ancestors_or_self(n)))  # parents before children
        f.place(order)
        s.slots.extend(order)
        assert f.node_at_slot == s.slots
        assert f.slot_positions().tolist() == [s.position(n) for n in s.slots]
        check_rows(f, s, order)
        if rng.random() < 0.3:  # ask again about some older nodes
            check_rows(f, s, rng.sample(s.slots, min(3, len(s.slots))))
        if compact_every and step % compact_every == compact_every - 1:
            leaves = [n for n in s.slots if f.is_leaf(n)]
            live = rng.sample(leaves, max(1, len(leaves) // 2))
            keep = f.compaction_plan(live)
            wanted = set().union(*(s.ancestors_or_self(n) for n in live))
            assert keep.tolist() == [i for i, n in enumerate(s.slots) if n in wanted]
            f.compact(keep)
            s.slots = [n for n in s.slots if n in wanted]
            assert f.node_at_slot == s.slots
            assert [f.slot_of[n] for n in s.slots] == list(range(len(s.slots)))
            assert all(f.slot_of[n] is None for n in range(len(s.parents)) if n not in wanted)
            check_rows(f, s, live)


@pytest.mark.parametrize("seed", range(6))
def test_attention_rows_equal_ancestor_or_self(seed):
    """On random forests fed in random groups, every row is exactly the ancestor-or-self set."""
    grow_randomly(seed)


@pytest.mark.parametrize("seed", range(6))
def test_compaction_keeps_rows_right(seed):
    """Compaction keeps live nodes and their ancestors in slot order, renumbers slots densely,
    and later rows (old and new nodes) still equal ancestor-or-self over the new slots."""
    grow_randomly(seed, compact_every=4)


def test_compaction_plan_and_compact_example():
    """Prefix [0,1], branches a=[2,3] and b=[4,5] interleaved; keeping b drops a's slots."""
    f = Forest()
    p = f.add_chain([1, 2])
    f.place(p)
    f.attention_rows(p)
    step1 = f.add([3, 4], [p[-1], p[-1]])  # a0 at slot 2, b0 at slot 3
    f.place(step1)
    f.attention_rows(step1)
    step2 = f.add([5, 6], [step1[0], step1[1]])  # a1 at slot 4, b1 at slot 5
    f.place(step2)
    f.attention_rows(step2)
    keep = f.compaction_plan([step2[1]])
    assert keep.tolist() == [0, 1, 3, 5]
    f.compact(keep)
    assert f.node_at_slot == [p[0], p[1], step1[1], step2[1]]
    assert f.slot_of[step1[0]] is None and f.slot_of[step2[0]] is None
    assert f.slot_positions().tolist() == [0, 1, 2, 3]
    child = f.add([7], [step2[1]])
    f.place(child)
    assert f.attention_rows(child).tolist() == [[True] * 5]


def test_compact_rejects_unsorted_or_repeated_slots():
    f = Forest()
    f.place(f.add_chain([1, 2, 3]))
    with pytest.raises(ValueError):
        f.compact(torch.tensor([2, 0]))
    with pytest.raises(ValueError):
        f.compact(torch.tensor([0, 0]))


def test_dropped_node_cannot_get_children():
    """A node whose slot was compacted away is no longer in the cache, so a child cannot be placed."""
    f = Forest()
    p = f.add_chain([1])
    f.place(p)
    a, b = f.add([2, 3], [p[0], p[0]])
    f.place([a, b])
    f.attention_rows([a, b])
    f.compact(f.compaction_plan([b]))
    child = f.add([4], [a])
    with pytest.raises(ValueError):
        f.place(child)


# ---------------------------------------------------------------------- plain continuation
def test_plain_continuation_true_cases():
    """A first root chain, and a chain continuing the newest node, may use the causal mask."""
    f = Forest()
    a = f.add_chain([1, 2, 3])
    f.place(a)
    assert f.is_plain_continuation(a)
    f.attention_rows(a[-1:])
    b = f.add_chain([4, 5], parent=a[-1])
    f.place(b)
    assert f.is_plain_continuation(b)


def test_plain_continuation_false_cases():
    """Siblings, a second root and a non-chain need the forest mask; empty is False; unplaced raises."""
    f = Forest()
    a = f.add_chain([1, 2, 3])
    f.place(a)
    f.attention_rows(a)
    assert not f.is_plain_continuation([])
    sib = f.add([4, 5], [a[-1], a[-1]])
    f.place(sib)
    assert not f.is_plain_continuation(sib)
    f.attention_rows(sib)
    root = f.add_chain([6])
    f.place(root)
    assert not f.is_plain_continuation(root)
    unplaced = f.add_chain([7], parent=a[-1])
    with pytest.raises(ValueError):
        f.is_plain_continuation(unplaced)


def test_plain_continuation_after_compaction():
    """Once compaction leaves only one path, continuing its leaf is plain again."""
    f = Forest()
    p = f.add_chain([1, 2])
    f.place(p)
    f.attention_rows(p)
    ab = f.add([3, 4], [p[-1], p[-1]])
    f.place(ab)
    f.attention_rows(ab)
    f.compact(f.compaction_plan([ab[0]]))
    nxt = f.add_chain([5], parent=ab[0])
    f.place(nxt)
    assert f.is_plain_continuation(nxt)


def test_plain_continuation_false_for_a_sibling_chain_fed_later():
    """BUG (src/multidecode/forest.py): a chain fed under the prefix's end after another branch
    was fed there is not a plain continuation (the causal mask would show it the other branch).
    `_row(parent)[:placed_before]` is cut to the parent's shorter row, so the other branch's
    slots are never checked."""
    f = Forest()
    p = f.add_chain([1, 2, 3])
    f.place(p)
    f.attention_rows(p[-1:])
    a = f.add_chain([4, 5], parent=p[-1])
    f.place(a)
    f.attention_rows(a)
    b = f.add_chain([6], parent=p[-1])
    f.place(b)
    assert not f.is_plain_continuation(b)


def test_plain_continuation_false_for_a_chain_under_an_inner_node():
    """BUG (same cause): a chain under a node in the middle of the cached prefix must not see the
    prefix's later slots, so it is not a plain continuation."""
    f = Forest()
    p = f.add_chain([1, 2, 3, 4])
    f.place(p)
    f.attention_rows(p[-1:])
    c = f.add_chain([5], parent=p[1])
    f.place(c)
    assert not f.is_plain_continuation(c)


def test_renumbered_keeps_what_is_cached_and_drops_the_history():
    forest = Forest()
    a = forest.add_chain([5, 6, 7])
    b = forest.add([8, 9], [a[1], -2], owners=["x", "x"])
    c = forest.add([4], [a[2]], root_position=0)
    forest.place(a + b + c)
    before = {n: (forest.path_tokens(n), forest.positions[n], forest.owners[n]) for n in a + b + c}
    rows = forest.attention_rows([b[1], c[0]])
    forest.compact(torch.tensor([0, 1, 2, 5]))  # b leaves the cache: history
    new, ids = forest.renumbered()
    assert len(new) == new.num_slots == 4 and set(ids) == set(a + c)
    for old, node in ids.items():
        assert (new.path_tokens(node), new.positions[node], new.owners[node]) == before[old]
        assert new.slot_of[node] == forest.slot_of[old]
    assert new.attention_rows([ids[c[0]]])[0].tolist() == rows[1][[0, 1, 2, 5]].tolist()
    assert new.is_leaf(ids[c[0]]) and not new.is_leaf(ids[a[1]])
