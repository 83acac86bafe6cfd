"""Attention masks for a forest step, in the form transformers' `forward` takes unchanged.

A step feeds q new nodes while `past` keys are cached. The model is given a 4D additive float
mask `[1, 1, q, past + q]`: 0 where a query may attend, `finfo(dtype).min` where it may not
(never -inf, and never a row with nothing allowed: both produce NaN that poisons the cache).
Boolean masks are avoided because eager attention adds them as 0/1 (silently wrong).

Sliding-window layers would normally get their window from the model's own mask code, which a 4D
mask bypasses. The window is therefore folded in by position: a query at position p may see a
key at position p' only if `p - p' < window`. Positions, not slots, measure that distance: a
branch's keys are scattered through the cache but their positions are their depths. Hybrid models
(some layers sliding, some full) take one mask per layer type as a dict.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FULL = "full_attention"
SLIDING = "sliding_attention"


@dataclass(frozen=True)
class MaskLayout:
    """Which masks a model needs: its attention layer types and its sliding window.

    `as_dict` is True for models whose forward takes a mapping of masks per layer type.
    """

    layer_types: tuple[str, ...]
    sliding_window: int | None
    as_dict: bool

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(sorted(set(self.layer_types)))


def build_attention_mask(
    rows: torch.Tensor,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    layout: MaskLayout,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> torch.Tensor | dict[str, torch.Tensor]:
    """Turn visibility rows into the mask(s) the model's forward takes.

    rows: [q, k] bool, True where query i may see slot j (itself and its ancestors).
    query_positions: [q] long; key_positions: [k] long (position of the node in each slot).
    Returns a float mask [1, 1, q, k], or a dict of them keyed by layer type.
    """
    masks: dict[str, torch.Tensor] = {}
    for kind in layout.kinds:
        allowed = rows
        if kind == SLIDING and layout.sliding_window is not None:
            # [q, k]: distance back from each query to each key, in positions
            distance = query_positions[:, None] - key_positions[None, :]
            allowed = rows & (distance < layout.sliding_window)
        masks[kind] = additive_mask(allowed, dtype, device)
    if layout.as_dict:
        return masks
    (only,) = masks.values()
    return only


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """[q, k] bool -> [1, 1, q, k] float: 0 where allowed, the dtype's most negative value elsewhere."""
    blocked = torch.tensor(torch.finfo(dtype).min, dtype=dtype)
    zero = torch.tensor(0.0, dtype=dtype)
    return torch.where(allowed, zero, blocked).to(device)[None, None]
