"""Self-draft: the target model with some decoder layers skipped, as the draft of speculative decoding.

Terms. The **target** is the model whose output we want. A **draft** proposes tokens that the target
then checks in one forward; a proposed token is **accepted** when it equals what the target would
have produced. A **self-draft** is the target itself with a set of its decoder layers **skipped**:
the residual stream passes over them unchanged. It needs no second model and no second copy of
the weights. Draft & Verify (Zhang et al., 2023, arXiv 2309.08168) draft by skipping intermediate
layers chosen by search; LayerSkip (Elhoushi et al., 2024, arXiv 2404.16710) exits early, that is
skips the last layers. Both are sets of skipped layers here.

**Building the draft** (`self_draft`) uses public APIs only: no forward is patched, no modeling
file is forked, and the target's own ModuleList is never edited (that would change the target).
It works for any transformers model class through what every class offers, its config, its
constructor, and torch's `load_state_dict`:

1. a copy of the config with `num_hidden_layers` reduced and the per-layer settings (such as
   `layer_types`) kept for the kept layers only;
2. a new model of the same class built from it on the meta device (no memory is allocated);
3. `load_state_dict(..., assign=True, strict=True)` with the target's own tensors
   (`state_dict(keep_vars=True)`, kept layers renumbered 0..k-1): `assign=True` puts the very
   same Parameter objects into the draft instead of copying into its (meta) tensors, so the draft
   shares every weight and costs no weight memory; tied embeddings stay one Parameter. The
   target's non-persistent buffers (rotary frequencies) are shared with `register_buffer`.

The draft's layers are numbered 0..k-1, so its attention modules' `layer_idx` (the KV-cache layer
they write) are consistent with a cache of k layers. The target is not modified: not its modules,
not its config (the draft has its own copy), not its parameters' `requires_grad`. Before loading,
every kept layer of the draft is compared with the target layer it stands for (module tree,
tensor shapes, plain settings such as sliding windows); a model whose layers depend on their own
index in some other way (GPT-2's `scale_attn_by_inverse_layer_idx`) is refused, since renumbering
would change what those layers compute. The target is taken to be a plain model: neither
quantized nor dispatched with offloading hooks.

**Choosing the layers** (`choose_skip`): the target runs once over a sample (teacher forcing) for
its greedy next token at every position; a candidate draft runs over the same sample, and its
**agreement** alpha is the fraction of positions where its arg-max equals the target's. With draft
cost c (the draft's weights read per token over the target's, output head included) and chains of k draft tokens accepted token by token with
probability alpha, a step yields (1 - alpha^(k+1)) / (1 - alpha) tokens for 1 + k*c target-forward
units of work (the best k in 1..8 is taken). The search is greedy: from no skips, it adds the
layer whose removal keeps agreement highest, and returns the set with the best expected speedup.
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import InvalidArgument, UnsupportedModel, is_int
from ..exact import ExactActivation, ExactLinear, ExactRMSNorm, RowTiledNorm
from ..models.packed import PackedEmbedding, PackedLinear, packed_bytes, tied_embeddings, weights_device
from ..models.vetting import text_config

MAX_DRAFT_LENGTH = 8
"""The longest draft chain the expected-speedup model considers."""

# Per-layer config settings. Lists with one entry per layer (`layer_types`, `mlp_layer_types`,
# `no_rope_layers`, ...) are found generically and cut to the kept layers; two other kinds are named.
_THRESHOLD_FIELDS = ("max_window_layers", "first_k_dense_replace")
"""Fields meaning 'layers below this index': they become the number of kept layers below it."""
_INDEX_LIST_FIELDS = ("mlp_only_layers",)
"""Fields listing layer indices: they become the kept layers' new indices."""
_INDEX_ATTRIBUTE = re.compile(r"(^|_)(idx|index|layer_id|layer_number)$")
"""Module attributes that hold the layer's own index (they may differ between target and draft)."""


# ---------------------------------------------------------------------- finding the layers
def decoder_layers(model) -> tuple[str, nn.ModuleList]:
    """The qualified name and the ModuleList of `model`'s decoder layers.

    Found generically: the ModuleList whose length is the text config's `num_hidden_layers`
    (`model.layers` for Llama-like models, `transformer.h` for GPT-2, `gpt_neox.layers`), looked
    for first inside `model.get_decoder()` so that a vision tower of the same depth is not taken.
    """
    config = getattr(model, "config", None)
    layers = getattr(text_config(config), "num_hidden_layers", None) if config is not None else None
    if not is_int(layers):
        raise InvalidArgument(
            f"{type(model).__name__} has no config.num_hidden_layers, so its decoder layers cannot be found",
            "pass a transformers causal LM (a PreTrainedModel)",
        )
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) == layers]
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if decoder is not None and decoder is not model:
        prefix = next((name for name, m in model.named_modules() if m is decoder), None)
        inside = [(n, m) for n, m in lists if prefix is not None and n.startswith(prefix + ".")]
        lists = inside or lists
    if len(lists) != 1:
        found = "none" if not lists else ", ".join(name for name, _ in lists)
        raise InvalidArgument(
            f"cannot tell which ModuleList of {type(model).__name__} holds its {layers} decoder layers "
            f"(ModuleLists of that length: {found})",
            "self-drafting needs a model whose decoder layers are one ModuleList of num_hidden_layers layers",
        )
    return lists[0]


# ---------------------------------------------------------------------- building the draft
def self_draft(model, skip_layers: Sequence[int]):
    """A new model of `model`'s class that runs `model` with the layers `skip_layers` skipped.

    Every parameter and buffer is shared with `model` (no copy), and `model` is left untouched.
    The draft has the same dtype, device, training mode, attention implementation and generation
    config. Skipping the first or the last layers is allowed (skipping the last ones is
    LayerSkip's early exit; skipping the first ones feeds the embeddings straight into a later
    layer, which usually drafts badly); skipping every layer is not. Modules other than decoder
    layers are all kept.

    Shared means the same Parameter objects: `draft.to(...)` or `draft.half()` would move or cast
    the target's weights too; the draft's modules, config, attention implementation and train/eval
    mode are its own.
    """
    name, layers = decoder_layers(model)
    skip = _check_skip(skip_layers, len(layers))
    keep = [i for i in range(len(layers)) if i not in skip]  # old index of new layer j = keep[j]
    config = _draft_config(model.config, keep, len(layers))

    with torch.device("meta"):
        try:
            draft = type(model)(config)
        except Exception as err:  # a model class that cannot be built on the meta device
            raise UnsupportedModel(
                f"cannot build a {type(model).__name__} with {len(keep)} layers on the meta device: {err}",
                "self-drafting needs a model class that can be built from a config",
            ) from err
    renamed = _renamer(name, keep)
    _share_kernel_modules(model, draft, renamed)
    draft.train(model.training)
    draft_layers = draft.get_submodule(name)
    for new, old in enumerate(keep):
        _check_same_layer(layers[old], draft_layers[new], old, new)

    # assign=True hands the draft the target's Parameter objects and sets their requires_grad to the
    # draft's own flags: match them first, so that the target's flags are left as they were.
    for key, param in draft.named_parameters(remove_duplicate=False):
        param.requires_grad_(model.get_parameter(renamed(key)).requires_grad)
    own = model.state_dict(keep_vars=True)
    sources = {key: renamed(key) for key in draft.state_dict(keep_vars=True)}  # draft key -> target key
    unmatched = [key for key, source in sources.items() if source not in own]
    unmatched += sorted({key for key in own if _kept(key, name, skip)} - set(sources.values()))
    if unmatched:
        raise UnsupportedModel(
            f"the draft's and the target's tensors do not match one to one ({', '.join(unmatched[:3])})",
            "self-drafting needs a model whose layers are numbered only by their place in the layer list",
        )
    draft.load_state_dict({key: own[source] for key, source in sources.items()}, strict=True, assign=True)
    _share_remaining_tensors(model, draft, renamed)

    if model.get_output_embeddings() is not None and tied_embeddings(model) != tied_embeddings(draft):
        raise UnsupportedModel(f"{type(model).__name__}'s tied embeddings came apart in the draft", "report this")
    draft.generation_config = copy.deepcopy(model.generation_config)
    return draft


def _check_skip(skip_layers, layers: int) -> set[int]:
    skip = _layer_indices(skip_layers, layers, "skip_layers")
    if len(skip) == layers:
        raise InvalidArgument(f"skip_layers skips all {layers} layers, which leaves no model",
                              "keep at least one layer")
    return skip


def _layer_indices(values, layers: int, what: str) -> set[int]:
    """`values` as a set of layer indices of a `layers`-layer model, each named once."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise InvalidArgument(f"{what} must be a sequence of layer indices, got {values!r}", "pass e.g. [10, 12, 15]")
    values = list(values)
    bad = [i for i in values if not is_int(i) or not 0 <= i < layers]
    if bad:
        named = ", ".join(map(repr, bad[:5])) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise InvalidArgument(f"{what} {named} {'is' if len(bad) == 1 else 'are'} not layer indices of a "
                              f"{layers}-layer model", f"use integers from 0 to {layers - 1}")
    if len(set(values)) != len(values):
        twice = sorted({i for i in values if values.count(i) > 1})
        raise InvalidArgument(f"{what} names layers {twice} more than once", "name each layer once")
    return {int(i) for i in values}


def _draft_config(config, keep: list[int], layers: int):
    """A copy of `config` for the kept layers: fewer layers, per-layer settings of the kept ones."""
    config = copy.deepcopy(config)
    tconfig = text_config(config)
    new_index = {old: new for new, old in enumerate(keep)}
    for key, value in list(vars(tconfig).items()):
        if key.startswith("_") or key.endswith(("_token_id", "_token_ids")):
            continue
        if isinstance(value, (list, tuple)) and len(value) == layers:
            setattr(tconfig, key, type(value)(value[i] for i in keep))
        elif key in _THRESHOLD_FIELDS and is_int(value):
            setattr(tconfig, key, sum(1 for i in keep if i < value))
        elif key in _INDEX_LIST_FIELDS and isinstance(value, (list, tuple)):
            setattr(tconfig, key, type(value)(new_index[i] for i in value if i in new_index))
    tconfig.num_hidden_layers = len(keep)
    return config


def _check_same_layer(target: nn.Module, draft: nn.Module, old: int, new: int) -> None:
    """Refuse a draft layer that would not compute what the target layer it stands for computes."""
    want, got = _layer_signature(target, old), _layer_signature(draft, new)
    if want != got:
        diff = sorted(k for k in want.keys() | got.keys() if want.get(k) != got.get(k))
        raise UnsupportedModel(
            f"layer {old} of the target and layer {new} of the draft differ in {', '.join(diff[:5])}: this model's "
            "layers depend on their own index, so renumbering them would change what they compute",
            "choose skip_layers that keep such layers at their index, or use another model",
        )


def _layer_signature(layer: nn.Module, index: int) -> dict:
    """Everything about `layer` that must not change when it is renumbered (its own index aside)."""
    sig: dict = {}
    for path, module in layer.named_modules():
        sig[f"{path}:class"] = type(module)
        for key, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            sig[f"{path}.{key}:shape"] = tuple(tensor.shape)
        for key, value in vars(module).items():
            if key.startswith("_") or not _plain(value):
                continue
            if _INDEX_ATTRIBUTE.search(key) and is_int(value) and value == index:
                value = "<own index>"
            sig[f"{path}.{key}"] = value
    return sig


def _plain(value) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


def _kept(key: str, name: str, skip: set[int]) -> bool:
    index = _layer_of(key, name)
    return index is None or index not in skip


def _layer_of(key: str, name: str) -> int | None:
    if not key.startswith(name + "."):
        return None
    return int(key[len(name) + 1:].split(".", 1)[0])


def _renamer(name: str, keep: list[int]):
    """Draft key -> target key: layer j of the draft is layer keep[j] of the target."""
    def renamed(key: str) -> str:
        index = _layer_of(key, name)
        if index is None:
            return key
        return f"{name}.{keep[index]}{key[len(name) + 1 + len(str(index)):]}"
    return renamed


def _share_kernel_modules(model, draft, renamed) -> None:
    """Put the target's own kernel layers (exact linear layers, norms and activations, a GPU's tiled
    norms, packed linear layers and embeddings, which hold no index of their own) in the draft,
    where a draft built from the config has plain ones: the draft computes with the same kernels
    and shares their tensors as they are."""
    for path, _ in list(draft.named_modules()):
        try:
            module = model.get_submodule(renamed(path)) if path else None
        except AttributeError:
            continue
        if isinstance(module, (ExactLinear, ExactRMSNorm, RowTiledNorm, ExactActivation, PackedLinear,
                               PackedEmbedding)):
            parent, _, child = path.rpartition(".")
            setattr(draft.get_submodule(parent) if parent else draft, child, module)


def _share_remaining_tensors(model, draft, renamed) -> None:
    """Share what the state dict leaves out (non-persistent buffers such as rotary frequencies)."""
    for key, buffer in draft.named_buffers(remove_duplicate=False):
        if buffer.is_meta:
            owner, _, attr = key.rpartition(".")
            draft.get_submodule(owner).register_buffer(attr, model.get_buffer(renamed(key)), persistent=False)
    for path, module in draft.named_modules():
        for key, value in vars(module).items():
            if isinstance(value, torch.Tensor) and value.is_meta:
                raise UnsupportedModel(
                    f"{type(model).__name__} keeps a plain tensor {path}.{key} that the draft cannot share",
                    "self-drafting needs every tensor of the model to be a parameter or a buffer",
                )
    left = [key for key, t in [*draft.named_parameters(), *draft.named_buffers()] if t.is_meta]
    if left:
        raise UnsupportedModel(f"the draft's {', '.join(left[:3])} could not be shared with the target", "report this")


# ---------------------------------------------------------------------- choosing the layers
@dataclass(frozen=True)
class SkipChoice:
    """A set of skipped layers and what it is expected to give, measured on a sample.

    agreement: fraction of sample positions where the draft's arg-max equals the target's.
    draft_cost: the draft's cost per token over the target's (weights read per token).
    draft_length: the best draft chain length k (0 for no skips: no drafting).
    expected_speedup: target tokens per unit of target-forward work, from the model above.
    """

    layers: tuple[int, ...]
    agreement: float
    draft_cost: float
    draft_length: int
    expected_speedup: float


def expected_speedup(agreement: float, draft_cost: float, max_draft: int = MAX_DRAFT_LENGTH) -> tuple[float, int]:
    """(speedup, k): the best over k in 1..max_draft of tokens per step / cost per step, with
    tokens = (1 - a^(k+1)) / (1 - a) and cost = 1 + k*c (one verify forward plus k draft tokens)."""
    best, best_k = -math.inf, 1
    for k in range(1, max_draft + 1):
        tokens = k + 1.0 if agreement >= 1.0 else (1.0 - agreement ** (k + 1)) / (1.0 - agreement)
        speedup = tokens / (1.0 + k * draft_cost)
        if speedup > best:
            best, best_k = speedup, k
    return best, best_k


def choose_skip(model, sample_ids, *, max_skip: int | None = None, candidates: Iterable[int] | None = None,
                max_draft: int = MAX_DRAFT_LENGTH, min_skip: int = 0) -> SkipChoice:
    """The set of skipped layers with the best expected speedup found by a greedy search.

    sample_ids: token ids (one sequence, several, or a [batch, length] tensor), a few hundred tokens
    in all: every sequence is run whole by every draft tried. candidates: the layers that may be
    skipped (default: all). max_skip: the most layers skipped (default: half the layers, which
    bounds the cost; early exit as in LayerSkip may want more). min_skip: the fewest (to have a
    draft to measure even where no set is expected to pay; the search then goes on at least that far).

    The search adds one layer at a time, the one whose skipping keeps the most sample positions
    agreeing with the target (ties: the lowest index), and stops at max_skip or once agreement is
    so low that even the cheapest draft left to try could not beat the best set found. It does not
    stop at the first step that fails to improve: a few skipped layers cost agreement and save
    little, so the expected speedup often dips below 1 before it rises. It is a lazy greedy search:
    a layer's agreement measured at an earlier step is taken as an upper bound of its agreement
    now (skipping more layers does not make a draft agree more), so a step re-measures candidates
    only until the best one measured now beats every other's bound.

    Cost: one target forward, n draft forwards over the sample to take the first layer (n
    candidates), then fewer per further layer; at worst n + (n-1) + ... + (n-max_skip+1). On the
    embedded SmolLM2-135M (30 layers) with 210 sample tokens: 30, then 9 to 16 a step, 76 drafts
    in all, about 50 s on one CPU thread. Deterministic for a given model, sample and machine.
    """
    depth = len(decoder_layers(model)[1])
    pool = _layer_indices(range(depth) if candidates is None else candidates, depth, "candidates")
    limit = depth // 2 if max_skip is None else max_skip
    if not is_int(limit) or limit < 0:
        raise InvalidArgument(f"max_skip must be a non-negative integer, got {max_skip!r}", "use 0 or more")
    limit = min(max(limit, min_skip), len(pool), depth - 1)
    drafts = _Drafts(model, sample_ids, max_draft)
    best = SkipChoice((), 1.0, 1.0, 0, 1.0)
    chosen: tuple[int, ...] = ()
    bound = {i: math.inf for i in pool}  # layer -> hits when last measured (an upper bound of its hits now)
    while len(chosen) < limit:
        measured: dict[int, SkipChoice] = {}  # measured at this step
        while True:
            layer = min(bound, key=lambda i: (-bound[i], i))  # highest bound, then lowest index
            if layer in measured:
                break
            bound[layer], measured[layer] = drafts.measure((*chosen, layer))
        choice = measured[layer]
        chosen = (*chosen, layer)
        del bound[layer]
        if len(chosen) >= min_skip and (choice.expected_speedup > best.expected_speedup or len(best.layers) < min_skip):
            best = choice
        # The best any further set could do: this agreement at the cost of the lightest set left to try.
        heaviest = sorted(bound, key=lambda i: -drafts.weight[i])[: limit - len(chosen)]
        ceiling, _ = expected_speedup(choice.agreement, drafts.cost((*chosen, *heaviest)), max_draft)
        if ceiling <= best.expected_speedup and len(chosen) >= min_skip:
            break
    return best


class _Drafts:
    """Self-drafts of `model` scored on one sample: how often each agrees with the target's greedy
    choice, and what its layers cost relative to the target's (`_layer_weights`)."""

    def __init__(self, model, sample_ids, max_draft: int) -> None:
        _, layers = decoder_layers(model)
        self.model, self.depth, self.max_draft = model, len(layers), max_draft
        self.sample = _sample(sample_ids, model)
        self.expected = [_greedy(model, ids) for ids in self.sample]  # per sequence: [length] target arg-max
        self.positions = sum(t.numel() for t in self.expected)
        self.weight = _layer_weights(model, layers)

    def cost(self, skip: Iterable[int]) -> float:
        skip = set(skip)
        kept = sum(self.weight[i] for i in range(self.depth) if i not in skip)
        return (self.weight["head"] + kept) / self.weight["all"]

    def measure(self, skip: tuple[int, ...]) -> tuple[int, SkipChoice]:
        """(positions agreeing, the choice) of the draft skipping `skip`."""
        draft = self_draft(self.model, skip)
        hits = sum(int((_greedy(draft, ids) == want).sum()) for ids, want in zip(self.sample, self.expected))
        agreement = hits / self.positions
        speedup, k = expected_speedup(agreement, self.cost(skip), self.max_draft)
        return hits, SkipChoice(tuple(sorted(skip)), agreement, self.cost(skip), k, speedup)


def choose_skip_layers(model, sample_ids, *, max_skip: int | None = None,
                       candidates: Iterable[int] | None = None) -> list[int]:
    """The skipped layers of `choose_skip` (sorted; [] when no skip set is expected to pay off)."""
    return list(choose_skip(model, sample_ids, max_skip=max_skip, candidates=candidates).layers)


def _sample(sample_ids, model) -> list[torch.Tensor]:
    """The sample as [1, length] id tensors on the model's device."""
    if isinstance(sample_ids, torch.Tensor):
        rows = [sample_ids.tolist()] if sample_ids.dim() == 1 else sample_ids.tolist()
    elif isinstance(sample_ids, Sequence) and sample_ids and all(is_int(t) for t in sample_ids):
        rows = [list(sample_ids)]
    else:
        rows = [list(r) for r in sample_ids] if isinstance(sample_ids, Iterable) else []
    vocab = text_config(model.config).vocab_size
    rows = [r for r in rows if r]
    if not rows or not all(is_int(t) and 0 <= t < vocab for r in rows for t in r):
        raise InvalidArgument("sample_ids must be token ids (one sequence or several) within the vocabulary",
                              "pass e.g. tokenizer(text).input_ids for a few hundred tokens of typical text")
    device = weights_device(model)
    return [torch.tensor([r], device=device) for r in rows]


@torch.inference_mode()
def _greedy(model, ids: torch.Tensor) -> torch.Tensor:
    """ids [1, n] -> [n]: the model's arg-max next token at every position."""
    return model(input_ids=ids, use_cache=False).logits[0].argmax(-1)


def _layer_weights(model, layers: nn.ModuleList) -> dict:
    """Bytes of weights read per token: each layer's, the output head's, and the sum (packed
    layers keep theirs in buffers, so bytes of both are counted, not parameters)."""
    weight: dict = {i: packed_bytes(layer) for i, layer in enumerate(layers)}
    head = model.get_output_embeddings()
    weight["head"] = packed_bytes(head) if head is not None else 0
    weight["all"] = weight["head"] + sum(weight[i] for i in range(len(layers)))
    return weight


__all__ = ["SkipChoice", "choose_skip", "choose_skip_layers", "decoder_layers", "expected_speedup", "self_draft"]

