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

**Exactness: sums (and rotary angles) in aten's order.** Inductor fuses a chain of bfloat16 operations and would round
once at its end where eager torch rounds after each; `emulate_precision_casts` makes the fused code
round where eager does. A sum is another matter: inductor's CPU reduction adds a row in its own
order (32 lanes, then a tree), aten's in another (a cascade of 4 x 16-lane accumulators), and the
two round differently for some rows: on the embedded model the post-attention norm of layer 6
(`pow(2).mean(-1)` of token 1235 under a 22-token prompt) gave a mean of squares one bit off
(14.736589 against eager's 14.736588), which flipped 3 elements of the normed row and 0.56 in a
logit. So every sum and mean of the graph is handed to aten: a pass (`eager_ops`, inductor's
`post_grad_custom_pre_pass`) replaces `aten.sum` and `aten.mean` by `multidecode::eager_sum` and
`multidecode::eager_mean`, operators whose kernel is aten's (inductor calls them as they are, as it
calls the products), so a norm's reduction is eager's, bit for bit; the elementwise work around
it stays fused. Rotary angles likewise: inductor's own cos and sin are a unit in the last place
off aten's for about a third of float32 angles, so a float32 forest compiled gave no node its
path's logits (the prompt's first forward runs eagerly); the pass makes `aten.cos` and
`aten.sin` `multidecode::eager_cos` / `eager_sin`. (An RMSNorm the exact kernels compute,
`exact.ExactRMSNorm`, is one of their operators: called from the graph as it is, no sum of its
own left to hand back.) A reduction
inductor makes out of another operation (a softmax's, a layer norm's `var_mean`) is not one of
them: a graph with one of those is refused before it runs (GPT-2's layer norms), and that model
runs eagerly. The embedded model gives eager's logits compiled (the siblings above, random
forests of 1 to 8 rows, at 1 and 2 threads, and a row of an 8-row forest equals the node fed
alone); the step is offered off by default (`load(compile=True)`, `serve --compile`, `batch
--compile`).

**Guards.** Before each call dynamo checks that what the graph assumed still holds; for a whole
model that is about 9,400 checks (every module's hook dictionaries and attributes, every
parameter's dtype and shape, the globals the modeling code reads): 1.8 ms of a 10 ms step. The
model and its code do not change while the engine holds it, so the step keeps only the checks on
what a call passes (its ids, positions, plan, cache) and the interpreter's state (`call_guards`),
and each model's graphs carry its own key (a string argument the graph compares: dynamo matches
its value as a constant), so two models of one process never share a graph. What this asks of a
caller: a model is not changed in place after `compile_forward` (no module swapped, no hook
added: call `uncompile` first).

**When.** Compiling costs tens of seconds to minutes the first time (inductor's artifacts are kept in
the user cache, `cache_dir()/inductor`, and a later process reuses them). Forwards that ask for
hidden states or give input vectors, and a cache's first forward (it allocates the buffers), run
eagerly.
"""

from __future__ import annotations

import itertools
import os
import warnings
import weakref

import torch

from .models.packed import weights_device
from .user_cache import cache_dir

OPTIONS = {"emulate_precision_casts": True}
"""Inductor's settings for the step (see the module notes); `options()` adds the `eager_ops` pass."""


# ---------------------------------------------------------------------- sums in aten's order
_SCHEMA = "(Tensor self, int[1]? dim, bool keepdim=False, *, ScalarType? dtype=None) -> Tensor"
_library = None


def _eager_sum(x, dim, keepdim=False, dtype=None):
    return torch.ops.aten.sum.dim_IntList(x, dim, keepdim, dtype=dtype)


def _eager_mean(x, dim, keepdim=False, dtype=None):
    return torch.ops.aten.mean.dim(x, dim, keepdim, dtype=dtype)


def _eager_cos(x):
    return torch.ops.aten.cos.default(x)


def _eager_sin(x):
    return torch.ops.aten.sin.default(x)


def register_eager_ops() -> None:
    """Define `multidecode::eager_sum` and `eager_mean` (aten's `sum.dim_IntList` and `mean.dim`), and
    `eager_cos` / `eager_sin` (aten's, for rotary angles: inductor's own cos and sin are a unit in the
    last place off aten's for a third of float32 angles), under names inductor has no lowering for:
    it calls them as they are. Idempotent."""
    global _library
    if _library is not None:
        return
    library = torch.library.Library("multidecode", "FRAGMENT")
    for name, kernel, schema in (("eager_sum", _eager_sum, _SCHEMA), ("eager_mean", _eager_mean, _SCHEMA),
                                 ("eager_cos", _eager_cos, "(Tensor self) -> Tensor"),
                                 ("eager_sin", _eager_sin, "(Tensor self) -> Tensor")):
        library.define(name + schema)
        library.impl(name, kernel, "CompositeExplicitAutograd")  # aten's kernel: eager's order and rounding
        torch.library.register_fake(f"multidecode::{name}", kernel, lib=library)
    _library = library


def eager_ops():
    """An inductor pass (`post_grad_custom_pre_pass`: after autograd, before inductor's pattern matcher)
    that makes every `aten.sum` and `aten.mean` of the graph `multidecode::eager_sum` / `eager_mean`,
    and every `aten.cos` and `aten.sin` `eager_cos` / `eager_sin`, so each is computed as aten
    computes it (see the module notes). Made on first use: inductor's modules take a second to import."""
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

    register_eager_ops()

    class EagerOps(CustomGraphPass):
        def __call__(self, graph: torch.fx.Graph) -> None:
            aten, ops = torch.ops.aten, torch.ops.multidecode
            replaced = {aten.sum.dim_IntList: ops.eager_sum.default, aten.sum.default: ops.eager_sum.default,
                        aten.mean.dim: ops.eager_mean.default, aten.mean.default: ops.eager_mean.default,
                        aten.cos.default: ops.eager_cos.default, aten.sin.default: ops.eager_sin.default}
            for node in [node for old in replaced for node in graph.find_nodes(op="call_function", target=old)]:
                target = replaced[node.target]
                # (self, *, dtype) is over every dim: (self, None, False, *, dtype)
                everything = node.target in (aten.sum.default, aten.mean.default)
                args = (node.args[0], None, False) if everything else node.args
                with graph.inserting_before(node):
                    new = graph.call_function(target, args, dict(node.kwargs))
                new.meta.update(node.meta)
                node.replace_all_uses_with(new)
                graph.erase_node(node)
            left = sorted({name for node in graph.nodes if node.op == "call_function"
                           and (name := _packet(node.target)) in ORDERED_REDUCTIONS})
            if left:
                raise CompileRefused(f"its graph reduces with {', '.join(left)}, whose order of additions inductor "
                                     "would choose (only sums and means are kept in aten's order)")

        def uuid(self) -> bytes:  # compiled artifacts are cached under the pass's source
            return get_hash_for_files((__file__,))

    return EagerOps()


ORDERED_REDUCTIONS = frozenset({"sum", "mean", "var", "var_mean", "std", "std_mean", "prod", "cumsum", "cumprod",
                                "logsumexp", "linalg_vector_norm", "norm", "nansum", "nanmean", "_softmax",
                                "_log_softmax", "logcumsumexp"})
"""aten reductions whose result depends on the order of their additions (a max, a min or an
any does not): after `eager_ops`, a graph with one left is refused (`CompileRefused`)."""


class CompileRefused(RuntimeError):
    """A forward that the compiled step cannot run exactly (it runs eagerly instead)."""


def _packet(target) -> str | None:
    """An aten operator's name without its overload (`aten.var_mean.correction` -> "var_mean")."""
    packet = getattr(target, "overloadpacket", None)
    return getattr(packet, "__name__", None)


def options() -> dict:
    """`OPTIONS` and the `eager_ops` pass: what the step is compiled with."""
    return {**OPTIONS, "post_grad_custom_pre_pass": eager_ops()}


RECOMPILE_LIMIT = 64
"""Graphs dynamo keeps for one model class's forward code in a process: each model compiles its
own (a one-row step and a forest: 2), and dynamo's default of 8 would refuse the fifth model of a
process (a test session, a notebook that loads several)."""

OBLIVIOUS = True
"""Size-oblivious shapes: sizes of 1 are not specialized, so a one-row step and a forest share a graph."""

_compiled: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> CompiledForward
_numbers = itertools.count()  # each compiled forward's key

STATIC_SOURCES = ("self", "G[", "GG[", "dict(type(self")
"""Guard sources that do not change while the engine holds a model: the compiled forward itself and
its model (`self...`: modules, hooks, parameters) and module-level globals (`G[...]`, `GG[...]`)."""


def call_guards(entries) -> list[bool]:
    """Dynamo's `guard_filter_fn`: keep the guards on what a call passes and on the interpreter's
    state, drop those on `STATIC_SOURCES` (see the module notes)."""
    return [not entry.name.startswith(STATIC_SOURCES) for entry in entries]


class CompiledForward:
    """`model`'s forward as one compiled graph over a `SlotCache` inside `writing` (see the module
    notes). `refused`: why it cannot be compiled exactly (None until a compile fails, or from the
    start for a model on a GPU, whose exact path is not this one's): from then on
    `__call__` raises `CompileRefused` at once, before the graph runs (nothing written to the
    cache), and the engine runs its forwards eagerly, as exact as ever, only slower."""

    def __init__(self, model) -> None:
        self.model = model
        device = weights_device(model)
        self.refused: str | None = None if device.type == "cpu" else (
            f"the compiled step is built and checked on the CPU only, and this model is on {device}")
        self.key = f"model {next(_numbers)}"  # keeps this model's graphs its own
        self.compiled = torch.compile(self._forward, dynamic=True, fullgraph=True,
                                      options={**options(), "guard_filter_fn": call_guards})

    def _forward(self, input_ids, position_ids, mask, cache, logits_to_keep, units, cache_argument: str, key: str):
        if key != self.key:  # read here, so dynamo guards the key's value: each model its own graphs
            raise CompileRefused(f"a graph of {key} was given to {self.key}")
        return self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask, use_cache=True,
                          logits_to_keep=logits_to_keep, forest_units=units, **{cache_argument: cache}).logits

    def __call__(self, input_ids, position_ids, mask, cache, logits_to_keep, units, cache_argument: str):
        torch._dynamo.maybe_mark_dynamic(cache.slots, 0)
        for layer in cache.layers:  # the capacity grows by doubling: one graph for all of them
            for buffer in layer.kv_buffers:
                torch._dynamo.maybe_mark_dynamic(buffer, 2)
        if self.refused is not None:
            raise CompileRefused(self.refused)
        try:
            with torch.fx.experimental._config.patch(backed_size_oblivious=OBLIVIOUS), \
                    torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
                return self.compiled(input_ids, position_ids, mask, cache, logits_to_keep, units, cache_argument,
                                     self.key)
        except Exception as error:  # refused by `eager_ops`, or a graph inductor cannot build: run eagerly
            inner = getattr(error, "inner_exception", None) or error.__cause__ or error
            self.refused = str(inner) if isinstance(inner, CompileRefused) else \
                f"compiling failed ({type(inner).__name__}: {str(inner).splitlines()[0] if str(inner) else ''})"
            raise CompileRefused(self.refused) from error


def use_inductor_cache() -> None:
    """Keep inductor's compiled artifacts in multidecode's user cache, unless the user chose a place.
    torch writes its default (a folder in /tmp) into the variable the first time it asks for it,
    which a load does: that is no choice, so it is replaced too."""
    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        torchs_own = default_cache_dir()
    except (ImportError, AttributeError):  # another torch: only an unset variable is ours to fill
        torchs_own = None
    if chosen is None or chosen == torchs_own:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir() / "inductor")


def compile_forward(model) -> CompiledForward:
    """Run `model`'s engine forwards compiled from now on (the model must be on the exact kernels:
    `load` puts it there). Compiles on the first forward that can use it. Idempotent. Adds one
    process-wide warnings filter, for inductor's note on mixed half precisions alone."""
    from .exact import is_exact

    if not is_exact(model):
        raise ValueError("a compiled forward needs the model on multidecode's exact kernels (load it with exact=True)")
    if model not in _compiled:
        use_inductor_cache()
        # inductor's note on a graph that mixes bfloat16 and float16 (the packed kernels' activations and
        # steps): code generation's business, not the user's, and the library prints nothing
        warnings.filterwarnings("ignore", message="bf16 and fp16 are mixed in the scheduler node",
                                category=UserWarning, module=r"torch\._inductor")
        _compiled[model] = CompiledForward(model)
    return _compiled[model]


def compiled_forward(model) -> CompiledForward | None:
    """The compiled forward of `model`, if `compile_forward` was called for it."""
    return _compiled.get(model)


def uncompile(model) -> None:
    """Back to eager forwards for `model`."""
    _compiled.pop(model, None)


__all__ = ["ORDERED_REDUCTIONS", "STATIC_SOURCES", "CompileRefused", "CompiledForward", "call_guards", "compile_forward",
           "compiled_forward", "eager_ops", "options", "register_eager_ops", "uncompile", "use_inductor_cache"]
