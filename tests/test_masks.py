"""Attention masks from visibility rows: dtype, blocked value, window by position, per-layer dicts."""

import pytest
import torch

from multidecode.forest import Forest
from multidecode.masks import FULL, SLIDING, MaskLayout, additive_mask, build_attention_mask

FULL_ONLY = MaskLayout(layer_types=(FULL,) * 3, sliding_window=None, as_dict=False)


def branchy_forest():
    """Prefix of 4 tokens, then two branches of 5 fed in interleaved steps (slots far apart from
    positions). Returns (forest, nodes of the last step)."""
    f = Forest()
    p = f.add_chain([1, 2, 3, 4])
    f.place(p)
    f.attention_rows(p)
    leaves = [p[-1], p[-1]]
    for step in range(5):
        new = f.add([10 + step, 20 + step], leaves)
        f.place(new)
        f.attention_rows(new)
        leaves = new
    return f, leaves


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_float_mask_zero_or_finfo_min(dtype):
    """The mask is [1, 1, q, k] in the model's float dtype: 0 where allowed, finfo.min elsewhere, no -inf."""
    rows = torch.tensor([[True, False, True], [False, True, False]])
    mask = build_attention_mask(rows, torch.tensor([2, 1]), torch.tensor([0, 1, 2]), FULL_ONLY, dtype)
    assert mask.shape == (1, 1, 2, 3)
    assert mask.dtype == dtype
    assert not torch.isinf(mask).any() and not torch.isnan(mask).any()
    expected = torch.where(rows, 0.0, torch.finfo(dtype).min).to(dtype)
    assert torch.equal(mask[0, 0], expected)


def test_additive_mask_shape_and_values():
    allowed = torch.tensor([[True, False]])
    mask = additive_mask(allowed, torch.float32, "cpu")
    assert mask.shape == (1, 1, 1, 2)
    assert mask.tolist() == [[[[0.0, torch.finfo(torch.float32).min]]]]


def test_full_layout_mask_equals_rows():
    """Without a window the mask is exactly the visibility rows of the forest."""
    f, nodes = branchy_forest()
    rows = f.attention_rows(nodes)
    mask = build_attention_mask(rows, f.positions_of(nodes), f.slot_positions(), FULL_ONLY, torch.float32)
    assert mask.shape == (1, 1, len(nodes), f.num_slots)
    assert torch.equal(mask[0, 0] == 0, rows)


@pytest.mark.parametrize("window", [1, 2, 3, 6, 100])
def test_window_folded_by_position_distance(window):
    """In a sliding layer, query at position p sees an ancestor at position p' iff p - p' < window,
    measured in positions (depths), never in slots; every row still sees itself."""
    f, nodes = branchy_forest()
    rows = f.attention_rows(nodes)
    qpos, kpos = f.positions_of(nodes), f.slot_positions()
    layout = MaskLayout(layer_types=(SLIDING,) * 2, sliding_window=window, as_dict=False)
    mask = build_attention_mask(rows, qpos, kpos, layout, torch.float32)
    assert torch.is_tensor(mask)
    allowed = mask[0, 0] == 0
    for i, node in enumerate(nodes):
        q_slot = f.slot_of[node]
        assert allowed[i, q_slot], "a row must always see itself"
        ancestors = set(f.path(node))
        for k, key in enumerate(f.node_at_slot):
            want = key in ancestors and f.positions[node] - f.positions[key] < window
            assert bool(allowed[i, k]) == want
    # Positions, not slots: the branch's keys lie 2 slots apart but 1 position apart.
    if window == 3:
        assert int(allowed[0].sum()) == 3


def test_window_one_sees_only_itself():
    f, nodes = branchy_forest()
    layout = MaskLayout(layer_types=(SLIDING,), sliding_window=1, as_dict=False)
    rows = f.attention_rows(nodes)
    mask = build_attention_mask(rows, f.positions_of(nodes), f.slot_positions(), layout, torch.float32)
    allowed = mask[0, 0] == 0
    assert allowed.sum(dim=-1).tolist() == [1] * len(nodes)
    assert [int(allowed[i].nonzero()) for i in range(len(nodes))] == [f.slot_of[n] for n in nodes]


def test_hybrid_layout_gives_one_mask_per_layer_type():
    """Hybrid models get {"full_attention": M, "sliding_attention": M & window}, each [1, 1, q, k]."""
    f, nodes = branchy_forest()
    rows = f.attention_rows(nodes)
    qpos, kpos = f.positions_of(nodes), f.slot_positions()
    layout = MaskLayout(layer_types=(SLIDING, FULL, SLIDING, FULL), sliding_window=3, as_dict=True)
    masks = build_attention_mask(rows, qpos, kpos, layout, torch.float32)
    assert isinstance(masks, dict) and set(masks) == {FULL, SLIDING}
    for mask in masks.values():
        assert mask.shape == (1, 1, len(nodes), f.num_slots) and mask.dtype == torch.float32
    assert torch.equal(masks[FULL][0, 0] == 0, rows)
    window = (qpos[:, None] - kpos[None, :]) < 3
    assert torch.equal(masks[SLIDING][0, 0] == 0, rows & window)
    assert (masks[SLIDING][0, 0] == 0).sum() < rows.sum()


def test_dict_layout_with_one_kind_still_returns_a_dict():
    layout = MaskLayout(layer_types=(FULL, FULL), sliding_window=None, as_dict=True)
    rows = torch.ones(1, 1, dtype=torch.bool)
    masks = build_attention_mask(rows, torch.tensor([0]), torch.tensor([0]), layout, torch.float32)
    assert set(masks) == {FULL}


def test_layout_kinds_sorted_unique():
    layout = MaskLayout(layer_types=(SLIDING, FULL, SLIDING), sliding_window=4, as_dict=True)
    assert layout.kinds == (FULL, SLIDING)


def test_model_layouts_of_tiny_models():
    """mask_layout reads each tiny config right: plain, all-sliding, and hybrid per layer type."""
    from tiny_models import ARCHITECTURES

    from multidecode.models.vetting import mask_layout

    def layout(arch):
        config, cls = ARCHITECTURES[arch]()
        return mask_layout(cls(config))

    assert layout("llama") == MaskLayout((FULL,) * 3, None, False)
    assert layout("mistral") == MaskLayout((SLIDING,) * 3, 6, False)
    assert layout("gemma3") == MaskLayout((SLIDING, FULL, SLIDING, FULL), 6, True)
    hybrid = layout("qwen2-hybrid")
    assert hybrid.as_dict and hybrid.sliding_window == 6 and set(hybrid.layer_types) == {FULL, SLIDING}


def test_a_sliding_window_the_model_never_reads_windows_nothing():
    """Llama's code never windows: a stray `sliding_window` in its config (Moshi's real config has
    one, and its code builds full masks too) windowed every layer of the forest, whose tokens then
    left the model's. The reference is the model's forward over each whole sequence: `generate`
    is no oracle here, as its cache, built from the config, keeps a window of keys after the prompt."""
    from tiny_models import ARCHITECTURES

    from multidecode.api import decode
    from multidecode.models.vetting import mask_layout

    config, cls = ARCHITECTURES["llama"]()
    config.sliding_window, config._attn_implementation = 4, "sdpa"
    torch.manual_seed(0)
    model = cls(config).eval()
    assert mask_layout(model).layer_types == (FULL,) * config.num_hidden_layers
    prompt = [(7 * i) % 250 + 3 for i in range(40)]
    expected = list(prompt)
    with torch.no_grad():
        for _ in range(8):  # greedy, each token from a forward over the whole sequence (no cache)
            expected.append(int(model(torch.tensor([expected])).logits[0, -1].argmax()))
    assert decode(model, prompt, [[]], max_new_tokens=8, eos_token_id=[])[0] == expected[40:]
    branches = decode(model, prompt[:30], [prompt[30:], prompt[30:35]], max_new_tokens=8, eos_token_id=[])
    assert branches[0] == expected[40:]
