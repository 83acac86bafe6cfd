"""An sdpa attention kernel that keeps grouped-query heads grouped when a mask is given.

Models with grouped-query attention (GQA: fewer key/value heads than query heads) store one
key/value head per group. transformers' sdpa path lets torch share those heads (`enable_gqa`)
only when there is no mask; with a mask and more than one query, as in every forest step, it
first repeats each key/value head for its whole group: a copy of the entire cache in every layer
on every step (about 12% of a step on the embedded model with a 1,500-token document).

`forest_sdpa` is the same computation without that copy: torch's own scaled-dot-product
attention with `enable_gqa=True` and the forest mask. It is registered under the name
`"multidecode_sdpa"` through transformers' public `AttentionInterface` (and the matching mask
builder through `AttentionMaskInterface`), so a model selects it like any other attention
implementation. `load()` selects it for the models it loads; a model you pass in yourself keeps
the attention you loaded it with unless you call `use_forest_sdpa(model)`. Anything the fast path
does not cover (no mask, no grouping, soft-capping, attention sinks) goes to transformers' sdpa.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NAME = "multidecode_sdpa"


def forest_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """query [B, H, q, D]; key/value [B, H_kv, k, D]; attention_mask [B, 1, q, k] float or None.

    Returns ([B, q, H, D], None), as transformers' attention functions do.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    plain = (
        attention_mask is None
        or groups == 1
        or attention_mask.dtype == torch.bool
        or kwargs.get("softcap") is not None
        or kwargs.get("s_aux") is not None
        or (module.training and dropout > 0)
    )
    if plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Make `"multidecode_sdpa"` a known attention implementation (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, forest_sdpa)
    AttentionMaskInterface.register(NAME, sdpa_mask)


def use_forest_sdpa(model) -> bool:
    """Switch an sdpa model to `forest_sdpa`; returns whether it switched (eager models stay eager)."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    register()
    model.set_attn_implementation(NAME)
    return True
