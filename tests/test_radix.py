"""The prefix index over cached prompts, without a model."""

from multidecode.runtime.radix import PrefixIndex


def test_match_finds_the_longest_indexed_prefix_and_its_node():
    index = PrefixIndex()
    assert index.match([1, 2, 3]) == (0, None)
    index.insert([1, 2, 3, 4], [10, 11, 12, 13])
    assert index.match([1, 2, 3, 4, 5]) == (4, 13)
    assert index.match([1, 2, 9]) == (2, 11)
    assert index.match([2]) == (0, None)
    assert len(index) == 4


def test_insert_splits_an_edge_where_paths_diverge_and_keeps_the_first_copy():
    index = PrefixIndex()
    index.insert([1, 2, 3, 4], [10, 11, 12, 13])
    index.insert([1, 2, 7], [10, 11, 20])
    assert index.match([1, 2, 7]) == (3, 20)
    assert index.match([1, 2, 3, 4]) == (4, 13)
    # the same prefix fed twice (two requests at once): the indexed nodes stay
    index.insert([1, 2, 3], [30, 31, 32])
    assert index.match([1, 2, 3]) == (3, 12)
    assert len(index) == 5
    assert sorted(index.leaves()) == [13, 20]


def test_a_path_that_left_the_indexed_nodes_is_not_indexed_past_that_point():
    """A copy of an indexed prefix with a new tail: the tail hangs under the copy in the forest,
    so indexing it under the indexed nodes would point a later request at the wrong parent."""
    index = PrefixIndex()
    index.insert([1, 2, 3], [10, 11, 12])
    index.insert([1, 2, 3, 4, 5], [10, 11, 32, 33, 34])  # node 32 is a second copy of token 3
    assert index.match([1, 2, 3, 4, 5]) == (3, 12)
    assert len(index) == 3 and index.leaves() == [12]
    index.insert([1, 2, 3, 4], [10, 11, 12, 40])  # under the indexed copy: indexed
    assert index.match([1, 2, 3, 4, 5]) == (4, 40)


def test_evict_forgets_least_recently_used_tails_down_to_the_budget():
    index = PrefixIndex()
    index.insert([1, 2, 3, 4], [10, 11, 12, 13])
    index.insert([1, 2, 7, 8], [10, 11, 20, 21])
    index.match([1, 2, 3])  # the [.., 3, 4] branch is used after the [.., 7, 8] one
    assert index.evict(4) == 2
    assert len(index) == 4
    assert index.match([1, 2, 7, 8]) == (2, 11)
    assert index.match([1, 2, 3, 4]) == (4, 13)
    assert index.evict(3) == 1  # the tail of a leaf goes first
    assert index.match([1, 2, 3, 4]) == (3, 12)
    assert index.evict(0) == 3
    assert index.match([1]) == (0, None) and index.leaves() == []


def test_a_split_edge_keeps_its_subtree():
    index = PrefixIndex()
    index.insert([1, 2, 3, 4], [10, 11, 12, 13])
    index.insert([1, 2, 3, 4, 5, 6], [10, 11, 12, 13, 14, 15])
    index.insert([1, 9], [10, 40])
    assert index.match([1, 2, 3, 4, 5, 6]) == (6, 15)
    assert index.match([1, 9, 9]) == (2, 40)
    assert sorted(index.leaves()) == [15, 40]
    assert len(index) == 7
