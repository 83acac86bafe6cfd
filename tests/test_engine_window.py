"""A forest forward leaves out the leading slots none of its nodes can see (a server's finished
requests' prompts): exactly the same logits as an engine that never held them."""

import contextlib

import pytest
import torch
from tiny_models import ATTENTION, MAIN_ARCHITECTURES, tiny_model

from multidecode import memory
from multidecode.engine import WINDOW_MIN_SKIP, Engine
from multidecode.exact import exact_kernels

generator = torch.Generator().manual_seed(0)
UNRELATED = torch.randint(3, 250, (WINDOW_MIN_SKIP + 40,), generator=generator).tolist()
PROMPT = torch.randint(3, 250, (30,), generator=generator).tolist()


def _tree_logits(engine: Engine, under: int) -> torch.Tensor:
    """Two sibling branches of two tokens under `under`: a forest feed (not a plain chain)."""
    return engine.feed([7, 8, 9, 10], [under, -2, under, -4], logits_for=[0, 1, 2, 3]).logits


@pytest.mark.parametrize("attn", ATTENTION)
@pytest.mark.parametrize("arch", MAIN_ARCHITECTURES)
def test_leading_slots_nobody_sees_are_left_out_exactly(arch, attn):
    model = tiny_model(arch, attn)
    alone = Engine(model)
    nodes = alone.feed_chain(PROMPT).nodes
    expected = _tree_logits(alone, nodes[-1])  # [4, vocab]

    crowded = Engine(model)
    crowded.feed_chain(UNRELATED)  # another request's prompt, at the leading slots
    nodes = crowded.feed_chain(PROMPT).nodes
    got = _tree_logits(crowded, nodes[-1])
    assert crowded.stats.slots_skipped == 2 * len(UNRELATED)  # the prompt (a second root) and the tree
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert crowded.cache.layers[0].keys.shape[-2] == crowded.forest.num_slots  # views restored after


def test_a_few_unseen_slots_are_not_worth_a_window():
    model = tiny_model("llama")
    engine = Engine(model)
    engine.feed_chain(UNRELATED[: WINDOW_MIN_SKIP - 1])
    nodes = engine.feed_chain(PROMPT).nodes
    _tree_logits(engine, nodes[-1])
    assert engine.stats.slots_skipped == 0


@pytest.mark.parametrize("exact", [False, True])
def test_a_feed_cut_into_pieces_windows_each_piece_by_its_own_keys(monkeypatch, exact):
    """A feed wider than a forward's scratch runs in pieces, all its nodes placed before the first:
    off the exact kernels a piece's sliding-window mask took every placed slot as a key (a
    RuntimeError, 'the size of tensor a must match the size of tensor b'; the server's 500)."""
    model = tiny_model("mistral")  # a window of 6 over a 30-token prompt
    with exact_kernels(model) if exact else contextlib.nullcontext():
        whole = Engine(model)
        expected = _tree_logits(whole, whole.feed_chain(PROMPT).nodes[-1])
        monkeypatch.setattr(memory, "FORWARD_BYTES", 1)  # a forward's scratch holds one row
        cut = Engine(model)
        got = _tree_logits(cut, cut.feed_chain(PROMPT).nodes[-1])
    assert cut.stats.forward_passes == len(PROMPT) + 4 > whole.stats.forward_passes  # every row on its own
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
