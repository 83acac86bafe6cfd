"""Which models a forest runs exactly: vetting, and the facts about a model the engine needs.

A forest is exact only for decoder-only attention models that take position ids and an additive
4D mask through `forward`: eager or sdpa attention, full or sliding-window layers. Everything else
(flash-attention, recurrent or convolution layers, encoder-decoders, ALiBi, chunked or
bidirectional attention, windows or temperatures read from cache slots) is refused with an
`UnsupportedModel` error. `mask_layout` says which masks a model needs (one, or one per layer
type for hybrid models), `max_positions` how far its positions go and `cache_argument` what its
forward calls the KV cache.
"""

from __future__ import annotations

import inspect
import os
import sys

from ..errors import InvalidArgument, UnsupportedModel
from ..masks import FULL, SLIDING, MaskLayout

SUPPORTED_ATTENTION = ("eager", "sdpa", "multidecode_sdpa", "multidecode_exact")
WINDOW_MASK_BUILDER = "create_sliding_window_causal_mask"
"""What transformers' modeling code imports to window a layer's attention (`windows_by_config`)."""
# Model types whose layers are not all attention, or whose positions are not position ids.
_REFUSED_TYPES = {
    "rwkv": "recurrent layers",
    "mamba": "recurrent layers",
    "mamba2": "recurrent layers",
    "falcon_mamba": "recurrent layers",
    "xlstm": "recurrent layers",
    "recurrent_gemma": "recurrent layers",
    "jamba": "recurrent layers",
    "zamba": "recurrent layers",
    "zamba2": "recurrent layers",
    "bamba": "recurrent layers",
    "falcon_h1": "recurrent layers",
    "granitemoehybrid": "recurrent layers",
    "lfm2": "convolution layers",
    "lfm2_moe": "convolution layers",
    "qwen3_next": "linear-attention layers",
    "bloom": "ALiBi positions (computed from cache order, not position ids)",
    "mpt": "ALiBi positions (computed from cache order, not position ids)",
    "openai-gpt": "an attention of its own that cannot take a 4D mask",
    "xlm": "an attention of its own that builds its mask from lengths and cannot take a 4D mask",
    "reformer": "hashed and chunked attention (tokens grouped by their order in the input, not by position)",
}


def text_config(config):
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def check_is_model(model) -> None:
    """Refuse what is not a model at all (None, a tokenizer given in its place) by name, before
    anything reads its config."""
    if not hasattr(model, "config") or not callable(getattr(model, "forward", None)):
        what = "None" if model is None else type(model).__name__
        if isinstance(model, (str, os.PathLike)):  # a name (a str has an `encode` too)
            what = f"the name {str(model)!r}"
            hint = f"load it first: multidecode.load({str(model)!r}) is the decoder, its .model the model"
        elif hasattr(model, "encode") or hasattr(model, "convert_tokens_to_ids"):
            hint = "pass the model first, then its tokenizer: MultiDecoder(model, tokenizer)"
        else:
            hint = "load one with multidecode.load(...) or transformers' AutoModelForCausalLM.from_pretrained(...)"
        raise InvalidArgument(f"the model must be a transformers causal LM (a PreTrainedModel), got {what}", hint)


def check_has_weights(model) -> None:
    """Refuse a model built without its weights (under torch.device("meta")) before it decodes:
    it fails deep inside torch otherwise. Not part of `check_supported`: loading vets such a
    skeleton before it reads the weights."""
    if any(p.is_meta for p in model.parameters()):
        raise InvalidArgument("the model's weights are on the meta device: it was built without them, so there "
                              "is nothing to compute with",
                              "load its weights first (from_pretrained, or to_empty(device='cpu') then "
                              "load_state_dict)")


def check_supported(model) -> None:
    """Raise `UnsupportedModel` unless `model` can be decoded as a forest exactly."""
    check_is_model(model)
    config = model.config
    name = getattr(config, "model_type", type(model).__name__)
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModel(
            f"{name} is an encoder-decoder model; MultiDecode needs a decoder-only causal LM",
            "use a decoder-only model such as Llama, Qwen2, Mistral, Gemma or GPT-2",
        )
    impl = getattr(config, "_attn_implementation", None) or "eager"
    if impl not in SUPPORTED_ATTENTION:
        raise UnsupportedModel(
            f"attention implementation {impl!r} cannot take a tree-shaped 4D mask",
            "load the model with attn_implementation='sdpa' or 'eager'",
        )
    tconfig = text_config(config)
    reason = _REFUSED_TYPES.get(getattr(tconfig, "model_type", name)) or _REFUSED_TYPES.get(name)
    if reason is None and getattr(tconfig, "alibi", False):
        reason = "ALiBi positions (computed from cache order, not position ids)"
    if reason is None and (getattr(tconfig, "use_bidirectional_attention", False) or _sees_ahead(model, tconfig)):
        reason = "bidirectional attention"
    if reason is None and "local" in (getattr(tconfig, "attention_layers", None) or ()):
        reason = "local attention layers that window by cache slot (GPT-Neo's), not by position"
    if reason is None and getattr(tconfig, "attn_temperature_tuning", False):
        reason = "an attention temperature computed from cache slots (Llama 4's), not from positions"
    if reason is None and getattr(tconfig, "attention_chunk_size", None):
        reason = "chunked attention"
    if reason is None and getattr(tconfig, "recurrent_kv_cache_mode", None) == "last_loop":
        reason = "loops that read the last loop's cache, windowed by cache slot (Dory's last_loop mode)"
    if reason is None:
        odd = sorted(set(_layer_types(tconfig)) - {FULL, SLIDING})
        if odd:
            reason = f"layers of type {', '.join(odd)}"
    if reason is not None:
        raise UnsupportedModel(
            f"{name} has {reason}, which a forest over one KV cache cannot run exactly",
            "use a model whose layers are all full or sliding-window attention",
        )
    if "position_ids" not in inspect.signature(model.forward).parameters:
        raise UnsupportedModel(
            f"{name}'s forward takes no position_ids, so a branch's tokens would get positions from "
            "their cache order instead of their depth",
            "use a model whose forward accepts position_ids, such as Llama, Qwen2, Mistral, Gemma or GPT-2",
        )


def _sees_ahead(model, config) -> bool:
    """Whether a BERT-family model loaded as a causal LM without `is_decoder` attends both ways
    (its self-attention is then not causal, or its layers build a bidirectional mask: transformers
    only warns). Other configs that say `is_decoder=False` (GPT-NeoX's) still attend causally, so
    the layers are asked: BERT's say `is_causal`, BigBird's, MegatronBERT's and RemBERT's
    `is_decoder`."""
    if getattr(config, "is_decoder", None) is not False:
        return False
    return any(getattr(m, "is_decoder", None) is False
               or (getattr(m, "is_causal", None) is False and type(m).__name__.endswith("SelfAttention"))
               for m in model.modules())


def _layer_types(config, windowed: bool = True) -> list[str]:
    """Each layer's type: the config's `layer_types`, else all sliding where it names a
    `sliding_window` that the model reads (`windowed`), else all full."""
    types = getattr(config, "layer_types", None)
    if types is not None:
        return list(types)
    layers = getattr(config, "num_hidden_layers", 1)
    sliding = windowed and getattr(config, "sliding_window", None) is not None
    return [SLIDING if sliding else FULL] * layers


def windows_by_config(model) -> bool:
    """Whether `model` windows its attention where its config names a `sliding_window` but no
    `layer_types`. transformers' families that do so build their masks with
    `WINDOW_MASK_BUILDER`; a family whose modeling code never imports it (Llama, OPT or Moshi given
    the key; OLMoE, whose flash-attention path alone reads it) attends in full, whatever its config
    says. The decoder's modules are asked (`get_decoder`), not a composite's other towers (Moshi's
    audio codec imports the builder; its decoder does not). A model of code from outside
    transformers is taken at its config's word."""
    try:
        decoder = model.get_decoder()
    except (AttributeError, NotImplementedError, ValueError):  # a model of its own, or one without a decoder part
        decoder = None
    names = {type(module).__module__ for module in (decoder if hasattr(decoder, "modules") else model).modules()}
    modeling = [sys.modules[name] for name in names if name.startswith("transformers.models.") and name in sys.modules]
    return not modeling or any(hasattr(module, WINDOW_MASK_BUILDER) for module in modeling)


def mask_layout(model) -> MaskLayout:
    """The masks `model` needs: one tensor, or a dict per layer type for hybrids."""
    tconfig = text_config(model.config)
    types = tuple(_layer_types(tconfig, windows_by_config(model)))
    window = getattr(tconfig, "sliding_window", None) if SLIDING in types else None
    return MaskLayout(layer_types=types, sliding_window=window, as_dict=len(set(types)) > 1)


def cache_argument(model) -> str:
    """The keyword `model.forward` takes its KV cache by: `cache` from transformers 5.23 on (which
    deprecates `past_key_values`, to be removed in 5.40), `past_key_values` before it and in
    models that keep the old name."""
    parameters = inspect.signature(model.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def max_positions(config) -> int | None:
    """How many positions a forest may use (0 .. limit - 1): the model's `max_position_embeddings`,
    or fewer where its rotary embedding switches with a forward's highest position
    (`rotary_switch`). None: no limit known."""
    return _switch_first(config) or getattr(text_config(config), "max_position_embeddings", None)


def _switch_first(config) -> int | None:
    """The rotary switch (`rotary_switch`) where it comes before the model's last position, else None."""
    switch, limit = rotary_switch(config), getattr(text_config(config), "max_position_embeddings", None)
    return switch if switch is not None and (limit is None or switch < limit) else None


def rotary_switch(config) -> int | None:
    """Where a "longrope" rotary embedding (Phi-3 128k, Phi-3.5, Phi-4-mini) switches from its short
    factors to its long ones, or None. transformers picks one set for a whole forward, by its
    highest position id (the long one from `original_max_position_embeddings` on): in a forest a
    long branch, or a branch's own drafts, would turn every other row of the forward by the long
    factors, which none of them would get alone. Below the switch every row turns as it would
    alone, so a forest stays there."""
    config = text_config(config)
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(rope, dict):
        return None
    per_type = not ("rope_type" in rope or "type" in rope)  # {layer type: parameters} in hybrid models
    sets = [p for p in rope.values() if isinstance(p, dict)] if per_type else [rope]
    switches = [p.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings", None)
                for p in sets if (p.get("rope_type") or p.get("type")) == "longrope"]
    return min((int(s) for s in switches if s), default=None)


def positions_note(config) -> str:
    """Why a forest's positions stop short of the model's own, in words ("" where they do not)."""
    switch = _switch_first(config)
    if switch is None:
        return ""
    return (f" (its longrope rotary embedding switches to other factors at position {switch} for a whole forward "
            "at once, which would turn every branch by the longest one's, so a forest stays below it)")
