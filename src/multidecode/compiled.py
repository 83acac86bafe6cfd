"""A compiled forward: the step's small operations fused by `torch.compile`, the kernels inside.

A one-row decode step of the embedded model spends more time in transformers' modules, run op by
op in Python (norms, rotary embeddings, residuals, reshapes), than in its products. Compiled,
the whole forward is one graph: inductor fuses the small operations into a few loops, and the
products and the attention stay `multidecode.kernels` operators (custom operators with their
shapes registered), called from the graph as they are called eagerly. What makes one graph
serve every step:

- **the cache write is a graph operation**: the engine opens `SlotCache.writing(q)`, and each
  layer writes its new keys at slot indices given as a tensor (`index_copy_` into the layer's
  buffer) and returns the whole buffer; the attention reads keys by the plan's slot indices, so
  no view of the filled part, and no number of the cache that changes per step, enters the graph;
- **the plan as tensors** (`exact.plan_tensors`, the keyword `forest_units`): the attention takes
  its indices and each layer's visible bits from them, and the model is given an empty mask
  (transformers returns a 4D mask as it is, so it builds none);
- **dynamic shapes**: the rows, the plan's units and the cache's capacity are symbolic, so forests
  of changing size reuse the graphs compiled so far (torch specializes sizes 0 and 1: a one-row
  step and a forest are different graphs; a handful in all, see docs/benchmarks.md).

**Exactness: not yet.** Inductor fuses a chain of bfloat16 operations and would round once at its
end where eager torch rounds after each; `emulate_precision_casts` makes the fused code round
where eager does. On tiny random Llama models (bfloat16 and int4) the compiled engine then gives
the eager engine's bits and every node its path's alone (139 of 139 nodes). On the embedded model
it does not: a forest step of siblings [1235, 1234] under a 22-token prompt differs from the
eager step in the row of token 1235 (0.56 in a logit; 1234, 4000, 4007, 4014 agree), though the
embedding, norm, MLP, rotary, residual and head each agree with eager on random inputs, compiled
alone. Until the op whose fused code rounds otherwise is found (or kept out of the fusion), this
is an experiment: nothing turns it on by default, and `load` does not offer it.

**When.** Compiling costs tens of seconds to minutes the first time (inductor's artifacts are kept in
the user cache, `cache_dir()/inductor`, and a later process reuses them). Forwards that ask for
hidden states or give input vectors, and a cache's first forward (it allocates the buffers), run
eagerly.
"""

from __future__ import annotations

import os
import weakref

import torch

from .user_cache import cache_dir

OPTIONS = {"emulate_precision_casts": True}
"""Inductor's settings for the step (see the module notes)."""

OBLIVIOUS = True
"""Size-oblivious shapes: sizes of 1 are not specialized, so a one-row step and a forest share a graph."""

_compiled: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> CompiledForward


class CompiledForward:
    """`model`'s forward as one compiled graph over a `SlotCache` inside `writing` (see the module notes)."""

    def __init__(self, model) -> None:
        self.model = model
        self.compiled = torch.compile(self._forward, dynamic=True, fullgraph=True, options=OPTIONS)

    def _forward(self, input_ids, position_ids, mask, cache, logits_to_keep, units, cache_argument: str):
        return self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask, use_cache=True,
                          logits_to_keep=logits_to_keep, forest_units=units, **{cache_argument: cache}).logits

    def __call__(self, input_ids, position_ids, mask, cache, logits_to_keep, units, cache_argument: str):
        torch._dynamo.maybe_mark_dynamic(cache.slots, 0)
        for layer in cache.layers:  # the capacity grows by doubling: one graph for all of them
            torch._dynamo.maybe_mark_dynamic(layer._k, 2)
            torch._dynamo.maybe_mark_dynamic(layer._v, 2)
        with torch.fx.experimental._config.patch(backed_size_oblivious=OBLIVIOUS):
            return self.compiled(input_ids, position_ids, mask, cache, logits_to_keep, units, cache_argument)


def use_inductor_cache() -> None:
    """Keep inductor's compiled artifacts in multidecode's user cache (unless the user chose a place)."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))


def compile_forward(model) -> CompiledForward:
    """Run `model`'s engine forwards compiled from now on (the model must be on the exact kernels:
    `load` puts it there). Compiles on the first forward that can use it. Idempotent."""
    from .exact import is_exact

    if not is_exact(model):
        raise ValueError("a compiled forward needs the model on multidecode's exact kernels (load it with exact=True)")
    if model not in _compiled:
        use_inductor_cache()
        _compiled[model] = CompiledForward(model)
    return _compiled[model]


def compiled_forward(model) -> CompiledForward | None:
    """The compiled forward of `model`, if `compile_forward` was called for it."""
    return _compiled.get(model)


def uncompile(model) -> None:
    """Back to eager forwards for `model`."""
    _compiled.pop(model, None)


__all__ = ["CompiledForward", "compile_forward", "compiled_forward", "uncompile", "use_inductor_cache"]
