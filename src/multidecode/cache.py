"""The shared KV cache: one preallocated buffer per layer, addressed by slot.

transformers' `DynamicCache` concatenates on every step, copying the whole cache each time
(O(length) per step). `SlotCache` is a `transformers.Cache` built from the public `Cache(layers=...)`
constructor with our own layer class: keys are written in place into a buffer that grows by
doubling, and the model is handed a view of the filled part. No model code is touched; the
model sees an ordinary `Cache`.

Slots are columns of that buffer, appended in the order nodes are fed. `compact(keep)` moves the
kept columns to the front (in order) so that finished or pruned branches stop costing memory and
attention work. Columns before the first dropped one stay where they are, so a rollback (rejected
draft tokens at the tail) moves only the accepted tail columns, then crops: never the whole cache. Every layer keeps all of its keys: sliding windows are enforced by the mask, so
the mask width is always the number of slots the model is shown.

`window(start)` shows the model only the slots from `start` on for one forward (the engine uses
it when no new token can see the leading slots: finished requests' prompts kept in a server's
prefix cache, say); new keys are still appended after every slot.

**Writing at given slots** (`writing(q)`, for a compiled forward, see `compiled`): for one forward
the layers write the new keys at slot indices held as a tensor (`index_copy_`, a mutation a graph
can carry) and return their whole buffers, so the forward reads no number of the cache that changes
from step to step. The exact attention reads keys by the plan's slot indices only, so it needs no
view of the filled part; room is made and the length advanced outside the forward.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class SlotLayer(CacheLayerMixin):
    """One attention layer's keys and values: `[1, heads, capacity, head_dim]` buffers, the first
    `length` columns filled. `keys`/`values` are always views of the filled part.

    Every method that writes the buffers runs in inference mode: buffers first allocated inside
    the model's forward are inference tensors, which may only be written in that mode.
    """

    is_sliding = False
    is_croppable = True

    def __init__(self, capacity: int = 0) -> None:
        super().__init__()
        self.length = 0
        self.start = 0  # the first slot the model is shown (see `SlotCache.window`)
        self.capacity = capacity
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    @property
    def kv_buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole key and value buffers, [1, heads, capacity, head_dim] each, used slots or not."""
        return self._k, self._v

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self._allocate(max(self.capacity, key_states.shape[-2]), key_states, value_states)
        self.is_initialized = True

    @torch.inference_mode()
    def _allocate(self, capacity: int, like_k: torch.Tensor, like_v: torch.Tensor) -> None:
        batch, heads, _, k_dim = like_k.shape
        v_dim = like_v.shape[-1]
        new_k = like_k.new_empty(batch, heads, capacity, k_dim)
        new_v = like_v.new_empty(batch, heads, capacity, v_dim)
        if self._k is not None and self.length:
            new_k[:, :, : self.length] = self._k[:, :, : self.length]
            new_v[:, :, : self.length] = self._v[:, :, : self.length]
        self._k, self._v, self.capacity = new_k, new_v, capacity
        self._refresh_views()

    def write(self, slots: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor):
        """Keys and values [1, heads, q, head_dim] written at `slots` ([q] long); the whole buffers back
        (see `SlotCache.writing`: room is made, and the length advanced, outside)."""
        self._k.index_copy_(2, slots, key_states)
        self._v.index_copy_(2, slots, value_states)
        return self._k, self._v

    def _refresh_views(self) -> None:
        self.keys = self._k[:, :, self.start : self.length]
        self.values = self._v[:, :, self.start : self.length]

    @torch.inference_mode()
    def reserve(self, capacity: int) -> None:
        """Make room for `capacity` slots now, so that later steps never reallocate."""
        if capacity <= self.capacity:
            return
        if self._k is None:
            self.capacity = capacity
        else:
            self._allocate(capacity, self._k, self._v)

    @torch.inference_mode()
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append new keys/values ([1, heads, q, head_dim]) and return views of all slots."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q = key_states.shape[-2]
        end = self.length + q
        if end > self.capacity:
            self._allocate(max(end, 2 * self.capacity), self._k, self._v)
        self._k[:, :, self.length : end] = key_states
        self._v[:, :, self.length : end] = value_states
        self.length = end
        self._refresh_views()
        return self.keys, self.values

    @torch.inference_mode()
    def compact(self, keep: torch.Tensor, first: int = 0) -> None:
        """Keep only slots `keep` (sorted), moved to the front in order. first: how many leading
        slots `keep` leaves in place (see `forest.unchanged_prefix`); only the rest is moved."""
        if not self.is_initialized:
            return
        n = keep.numel()
        moved = keep[first:].to(self._k.device)  # [n - first] old slots, ascending
        if moved.numel():
            self._k[:, :, first:n] = self._k.index_select(2, moved)
            self._v[:, :, first:n] = self._v.index_select(2, moved)
        self.length = n
        self._refresh_views()

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last `-tokens_to_remove` slots (transformers' convention: a negative count)."""
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of slots to remove")
        self.length = max(0, self.length + tokens_to_remove)
        if self.is_initialized:
            self._refresh_views()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length - self.start + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.length = 0
        if self.is_initialized:
            self._refresh_views()

    @property
    def allocated_bytes(self) -> int:
        if self._k is None:
            return 0
        return self._k.numel() * self._k.element_size() + self._v.numel() * self._v.element_size()

    @property
    def used_bytes(self) -> int:
        if self._k is None:
            return 0
        per_slot = (self._k[0, :, 0].numel() * self._k.element_size()) + (
            self._v[0, :, 0].numel() * self._v.element_size()
        )
        return per_slot * self.length


class SlotCache(Cache):
    """A `transformers.Cache` of `SlotLayer`s, one per attention layer, created as the model asks."""

    def __init__(self, capacity: int = 0) -> None:
        super().__init__(layer_class_to_replicate=SlotLayer)
        self._capacity = capacity
        self._start = 0
        self.slots: torch.Tensor | None = None  # where a forward inside `writing` writes

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if self.slots is not None:
            return self.layers[layer_idx].write(self.slots, key_states, value_states)
        while len(self.layers) <= layer_idx:
            self.layers.append(SlotLayer(self._capacity))
            self.layers[-1].start = self._start
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    @property
    def num_slots(self) -> int:
        return self.layers[0].length if self.layers else 0

    @property
    def capacity(self) -> int:
        """Slots the cache holds room for (allocated once its layers exist)."""
        return max([self._capacity] + [layer.capacity for layer in self.layers])

    def reserve(self, capacity: int) -> None:
        self._capacity = max(self._capacity, capacity)
        for layer in self.layers:
            layer.reserve(capacity)

    def compact(self, keep: torch.Tensor, first: int = 0) -> None:
        for layer in self.layers:
            layer.compact(keep, first)

    @contextmanager
    def window(self, start: int):
        """Within the block, the model sees slots `start:` only (layers created inside it too)."""
        self._start = start
        for layer in self.layers:
            layer.start = start
            if layer.is_initialized:
                layer._refresh_views()
        try:
            yield self
        finally:
            self._start = 0
            for layer in self.layers:
                layer.start = 0
                if layer.is_initialized:
                    layer._refresh_views()

    def ready_to_write(self) -> bool:
        """Whether every layer has its buffers (a forward `writing` needs them: the first one allocates)."""
        return bool(self.layers) and all(layer.is_initialized for layer in self.layers)

    @contextmanager
    def writing(self, q: int, device):
        """Within the block, one forward of `q` new nodes writes them at the next `q` slots, given as a
        tensor, and gets the whole buffers back (see the module notes); afterwards they are filled."""
        end = self.num_slots + q
        if end > self.capacity:
            self.reserve(max(end, 2 * self.capacity))
        self.slots = torch.arange(self.num_slots, end, device=device)
        try:
            yield self
        finally:
            self.slots = None
        for layer in self.layers:
            layer.length = end
            layer._refresh_views()

    def truncate(self, slots: int) -> None:
        """Keep at most the first `slots` slots in every layer."""
        for layer in self.layers:
            layer.crop(min(0, slots - layer.length))

    @property
    def allocated_bytes(self) -> int:
        return sum(layer.allocated_bytes for layer in self.layers)

    @property
    def used_bytes(self) -> int:
        return sum(layer.used_bytes for layer in self.layers)
