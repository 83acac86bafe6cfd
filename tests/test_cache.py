"""SlotLayer and SlotCache with plain tensors: appending, growth, views, compaction, bytes."""

import pytest
import torch
from transformers import DynamicCache

from multidecode.cache import SlotCache, SlotLayer

HEADS, K_DIM, V_DIM = 2, 4, 3


def kv(q: int, start: float = 0.0):
    """Distinct keys/values for q slots: key[..., s, :] holds start + s, values the negative."""
    base = torch.arange(q, dtype=torch.float32) + start  # [q]
    keys = base[None, None, :, None].expand(1, HEADS, q, K_DIM).clone()
    values = -base[None, None, :, None].expand(1, HEADS, q, V_DIM).clone()
    return keys, values


def slot_ids(layer: SlotLayer) -> list[float]:
    """Which kv() slot each filled column holds, read back from the keys."""
    return layer.keys[0, 0, :, 0].tolist()


def test_append_returns_views_of_all_slots():
    """update appends and returns [1, heads, length, dim] views of the filled buffer part."""
    layer = SlotLayer()
    k, v = layer.update(*kv(3))
    assert k.shape == (1, HEADS, 3, K_DIM) and v.shape == (1, HEADS, 3, V_DIM)
    k, v = layer.update(*kv(2, start=3))
    assert slot_ids(layer) == [0, 1, 2, 3, 4]
    assert torch.equal(v, -layer.keys[..., :1].expand(1, HEADS, 5, V_DIM))
    assert k.data_ptr() == layer._k.data_ptr() and v.data_ptr() == layer._v.data_ptr()
    assert layer.get_seq_length() == 5
    assert layer.get_mask_sizes(4) == (9, 0)


def test_growth_by_doubling_keeps_data():
    """Past capacity the buffer at least doubles, and the filled slots survive the move."""
    layer = SlotLayer()
    layer.update(*kv(3))
    assert layer.capacity == 3
    layer.update(*kv(1, start=3))
    assert layer.capacity == 6
    layer.update(*kv(2, start=4))
    assert layer.capacity == 6
    layer.update(*kv(10, start=6))
    assert layer.capacity == 16  # max(needed, 2 * capacity)
    assert slot_ids(layer) == list(range(16))
    assert layer.values[0, 1, :, 2].tolist() == [-float(i) for i in range(16)]


def test_reserve_before_first_update_preallocates():
    """reserve on an empty layer sets the capacity used on the first update; no move after that."""
    layer = SlotLayer()
    layer.reserve(10)
    layer.update(*kv(2))
    assert layer.capacity == 10
    ptr = layer._k.data_ptr()
    for i in range(8):
        layer.update(*kv(1, start=2 + i))
    assert layer._k.data_ptr() == ptr and layer.capacity == 10
    assert slot_ids(layer) == list(range(10))


def test_reserve_after_update_keeps_data_and_smaller_is_a_no_op():
    layer = SlotLayer()
    layer.update(*kv(4))
    layer.reserve(32)
    assert layer.capacity == 32 and slot_ids(layer) == [0, 1, 2, 3]
    ptr = layer._k.data_ptr()
    layer.reserve(8)
    assert layer.capacity == 32 and layer._k.data_ptr() == ptr


@pytest.mark.parametrize("keep", [[0, 2, 5], [3, 4, 5, 6], [6], [0, 1, 2, 3, 4, 5, 6], []])
def test_compact_keeps_the_right_columns_in_order(keep):
    """compact(keep) moves exactly the kept slots, in order, to the front; later appends follow them."""
    layer = SlotLayer()
    layer.update(*kv(7))
    layer.compact(torch.tensor(keep, dtype=torch.long))
    assert layer.get_seq_length() == len(keep)
    assert slot_ids(layer) == [float(s) for s in keep]
    assert layer.values[0, :, :, 0].tolist() == [[-float(s) for s in keep]] * HEADS
    layer.update(*kv(2, start=100))
    assert slot_ids(layer) == [float(s) for s in keep] + [100.0, 101.0]


def test_compact_before_any_update_is_a_no_op():
    layer = SlotLayer()
    layer.compact(torch.tensor([], dtype=torch.long))
    assert layer.get_seq_length() == 0


def test_compact_after_updates_made_in_inference_mode():
    """BUG (src/multidecode/cache.py): the engine runs forwards under torch.inference_mode, so the
    buffers SlotLayer allocates there are inference tensors; compact, called between steps outside
    inference mode, then fails ("Inplace update to inference tensor outside InferenceMode")."""
    layer = SlotLayer()
    with torch.inference_mode():
        layer.update(*kv(5))
    layer.compact(torch.tensor([1, 3]))
    assert slot_ids(layer) == [1.0, 3.0]


def test_crop_takes_a_negative_count():
    """crop follows transformers: a negative number of slots to drop from the end."""
    layer = SlotLayer()
    layer.update(*kv(5))
    layer.crop(-2)
    assert slot_ids(layer) == [0, 1, 2]
    with pytest.raises(ValueError):
        layer.crop(1)


def test_bytes_accounting():
    """allocated counts the whole buffer, used only the filled slots (keys and values)."""
    layer = SlotLayer()
    assert layer.allocated_bytes == 0 and layer.used_bytes == 0
    layer.reserve(8)
    layer.update(*kv(3))
    per_slot = HEADS * (K_DIM + V_DIM) * 4
    assert layer.used_bytes == 3 * per_slot
    assert layer.allocated_bytes == 8 * per_slot
    layer.compact(torch.tensor([1]))
    assert layer.used_bytes == per_slot and layer.allocated_bytes == 8 * per_slot


def test_slot_cache_layers_reserve_compact_and_bytes():
    """SlotCache makes one SlotLayer per layer index, reserves and compacts all, sums the bytes."""
    cache = SlotCache(capacity=4)
    assert cache.num_slots == 0 and cache.allocated_bytes == 0
    for layer_idx in range(3):
        cache.update(*kv(3), layer_idx)
    assert len(cache.layers) == 3 and all(isinstance(layer, SlotLayer) for layer in cache.layers)
    assert cache.num_slots == 3 and cache.get_seq_length() == 3
    cache.reserve(20)
    assert all(layer.capacity == 20 for layer in cache.layers)
    for layer_idx in range(3):
        cache.update(*kv(2, start=3), layer_idx)
    cache.compact(torch.tensor([1, 3, 4]))
    assert cache.num_slots == 3
    assert all(slot_ids(layer) == [1.0, 3.0, 4.0] for layer in cache.layers)
    per_slot = HEADS * (K_DIM + V_DIM) * 4
    assert cache.used_bytes == 3 * 3 * per_slot
    assert cache.allocated_bytes == 3 * 20 * per_slot


def test_slot_cache_reserve_applies_to_layers_made_later():
    cache = SlotCache()
    cache.reserve(12)
    cache.update(*kv(1), 0)
    assert cache.layers[0].capacity == 12


def test_slot_cache_matches_dynamic_cache():
    """The same updates give the same keys and values as transformers' DynamicCache."""
    ours, theirs = SlotCache(), DynamicCache()
    torch.manual_seed(0)
    for q in [5, 1, 3, 1, 1, 7]:
        for layer_idx in range(2):
            k, v = torch.randn(1, HEADS, q, K_DIM), torch.randn(1, HEADS, q, V_DIM)
            ok, ov = ours.update(k, v, layer_idx)
            tk, tv = theirs.update(k, v, layer_idx)
            assert torch.equal(ok, tk) and torch.equal(ov, tv)
    assert ours.get_seq_length() == theirs.get_seq_length() == 18
