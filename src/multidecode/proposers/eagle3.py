"""EAGLE-3 draft heads as published: the EAGLE project's layout and the `speculators` format.

EAGLE-3 (Li et al., 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test", arXiv 2503.01840) drafts like EAGLE (`proposers.eagle`: pairs of a feature
and the token after it, run ahead one depth per head forward) with three changes. Terms:

- **aux features**: the target's hidden states entering three of its layers, a low, a middle and a
  high one (by default layers 2, L // 2 and L - 3 of L; in transformers' numbering the public
  `hidden_states[i]`, 0 being the embeddings), concatenated ([3H]) and projected by `fc` to the
  head's width h. Deeper draft nodes feed back the head's own output instead, already h wide, so
  `fc` applies to the target's features only;
- the **midlayer**: one decoder layer whose attention reads [input_layernorm(embedding of the
  token); hidden_norm(h)], 2h wide, and adds its output to h (to hidden_norm(h) where the head was
  trained with `norm_before_residual`), then an MLP block. Its output before the final `norm` is
  the feature the next depth reads;
- a **draft vocabulary** of Vd tokens: the head's own `lm_head` [Vd, h] after `norm`; draft id i
  is the target's token i + d2t[i] (`d2t` holds offsets).

Published heads come in two layouts, both read here: the EAGLE project's (`config.json`, a Llama
config with `draft_vocab_size`; `pytorch_model.bin` or `model.safetensors` with `fc`, `midlayer.*`,
`norm`, `lm_head`, `d2t`) and the `speculators` format that vLLM reads (`speculators_model_type`
"eagle3", the layer's config under `transformer_layer_config`, the midlayer as `layers.0.*`, the
aux layers in `eagle_aux_hidden_state_layer_ids`). The target's embeddings are used unless the
file holds its own.

`Eagle3LM` is the midlayer with the face of a causal LM (input vectors [embedding; h], a 4D mask,
positions, a cache; logits and hidden states out), built from transformers' Llama modules (its
attention is Llama's, 2h wide in and h wide out), so the head runs on an `Engine` forest like our
own EAGLE head, by the same `Eagle` proposer.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

from ..errors import InvalidArgument
from ..models.vetting import cache_argument
from .heads import causal_mask, check_head_fits, load_checked, on_device_of, read_config, read_state_dict

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
"""Where a published head keeps its weights, in the order they are looked for."""
NOT_LAYER_KEYS = ("draft_vocab_size", "target_hidden_size", "eagle_config", "architectures", "torch_dtype", "dtype",
                  "bias", "transformers_version", "auto_map")
"""Keys of a published head's config that are not its layer's Llama settings."""


def aux_layers_of(model) -> tuple[int, ...]:
    """EAGLE-3's default aux layers for a target of L layers: 2, L // 2 and L - 3, ascending."""
    count = model.config.get_text_config().num_hidden_layers
    return tuple(sorted({2, count // 2, count - 3}))


class Eagle3LM(nn.Module):
    """EAGLE-3's midlayer, final norm and draft LM head as a causal LM (see the module notes).

    config: the layer's Llama config (hidden h, `head_dim`, `vocab_size` = the draft vocabulary).
    norm_before_residual: add the attention's output to hidden_norm(h) rather than to h.
    """

    def __init__(self, config, *, norm_before_residual: bool = False) -> None:
        from transformers.models.llama.modeling_llama import (
            LlamaAttention,
            LlamaMLP,
            LlamaRMSNorm,
            LlamaRotaryEmbedding,
        )

        super().__init__()
        self.config = config
        self.norm_before_residual = norm_before_residual
        h, eps = config.hidden_size, config.rms_norm_eps
        wide = copy.deepcopy(config)  # the attention reads [embedding; h], 2h wide, with the layer's heads
        wide.hidden_size = 2 * h
        self.input_layernorm, self.hidden_norm = LlamaRMSNorm(h, eps), LlamaRMSNorm(h, eps)
        self.self_attn = LlamaAttention(wide, layer_idx=0)
        self.self_attn.o_proj = nn.Linear(config.num_attention_heads * config.head_dim, h,
                                          bias=config.attention_bias)  # back to h
        self.post_attention_layernorm = LlamaRMSNorm(h, eps)
        self.mlp = LlamaMLP(config)
        self.norm = LlamaRMSNorm(h, eps)
        self.lm_head = nn.Linear(h, config.vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(config)
        self.cache_name = cache_argument(self.self_attn)  # "cache", or "past_key_values" before 5.23
        self.embed: list[nn.Module] = []  # the token embeddings the head reads (set by `Eagle3Head.bind`)

    def get_input_embeddings(self) -> nn.Module:
        return self.embed[0]

    def forward(self, inputs_embeds: torch.Tensor, attention_mask=None, position_ids: torch.Tensor | None = None,
                cache=None, logits_to_keep=None, output_hidden_states: bool = False, use_cache: bool = True,
                **kwargs):
        from transformers.modeling_outputs import CausalLMOutputWithPast

        embeds, hidden = inputs_embeds.split(self.config.hidden_size, dim=-1)  # [1, q, h] each
        if attention_mask is None:  # a plain continuation: the mask the model would build itself
            attention_mask = causal_mask(self.config, embeds, cache, position_ids)
        normed = self.hidden_norm(hidden)
        x = torch.cat([self.input_layernorm(embeds), normed], -1)  # [1, q, 2h]
        attended, _ = self.self_attn(x, position_embeddings=self.rotary_emb(x, position_ids),
                                     attention_mask=attention_mask, **{self.cache_name: cache}, **kwargs)
        x = (normed if self.norm_before_residual else hidden) + attended
        out = x + self.mlp(self.post_attention_layernorm(x))  # [1, q, h]: fed back at the next depth
        kept = out if logits_to_keep is None else out[:, logits_to_keep]
        return CausalLMOutputWithPast(logits=self.lm_head(self.norm(kept)), hidden_states=(out,))


class Eagle3Head(nn.Module):
    """A published EAGLE-3 head (see the module notes), drafting for the `Eagle` proposer.

    config: the midlayer's Llama config (vocab_size: the draft vocabulary). d2t: [Vd] offsets from
    draft ids to the target's. vocab_size: the target's. target_hidden_size: H (default h).
    aux_layers: the target layers whose states `fc` reads (default: `aux_layers_of` the target).
    fc_inputs: the width `fc` reads (default: that many layers, or 3, of H).
    """

    target = None  # published heads carry no fingerprint: their shapes are checked instead
    reads_prompt = True  # trained over whole conversations

    def __init__(self, config, d2t: torch.Tensor, vocab_size: int, *, target_hidden_size: int | None = None,
                 aux_layers: tuple[int, ...] | None = None, norm_before_residual: bool = False,
                 own_embeddings: bool = False, fc_inputs: int | None = None) -> None:
        super().__init__()
        self.hidden_size, self.vocab_size = config.hidden_size, vocab_size
        self.target_hidden_size = target_hidden_size or config.hidden_size
        self.aux_layers = None if aux_layers is None else tuple(aux_layers)
        self.fc = nn.Linear(fc_inputs or len(aux_layers or (0, 0, 0)) * self.target_hidden_size, config.hidden_size,
                            bias=False)
        self.model = Eagle3LM(config, norm_before_residual=norm_before_residual)
        self.register_buffer("token_ids", torch.arange(len(d2t)) + d2t.long(), persistent=False)  # [Vd] target ids
        self.embed_tokens = nn.Embedding(vocab_size, config.hidden_size) if own_embeddings else None
        self.embed: list[nn.Module] = []

    @property
    def layers(self) -> tuple[int, ...]:
        """The target layers the head reads (known once bound, where the file does not name them)."""
        if self.aux_layers is None:
            raise InvalidArgument("the EAGLE-3 head was not bound to a target, so its aux layers are not known",
                                  "call bind(model) first, or load it with speculate='eagle'")
        return self.aux_layers

    def bind(self, model) -> Eagle3Head:
        """Check the head fits `model` (its widths and vocabulary) and read the target's embeddings."""
        check_head_fits(model, self.target_hidden_size, self.vocab_size, None, "eagle", what="the EAGLE-3 head",
                        fix="use a head published for this model", token_ids=self.token_ids)
        hidden = self.target_hidden_size
        if self.embed_tokens is None and model.get_input_embeddings().embedding_dim != self.hidden_size:
            raise InvalidArgument(f"the EAGLE-3 head is {self.hidden_size} wide and has no embeddings of its own, "
                                  f"and the model's are {model.get_input_embeddings().embedding_dim} wide",
                                  "use a head published with its embeddings (embed_tokens)")
        if self.aux_layers is None:
            self.aux_layers = aux_layers_of(model)
        if len(self.aux_layers) * hidden != self.fc.in_features:
            raise InvalidArgument(f"the EAGLE-3 head reads {self.fc.in_features // hidden} layers, but "
                                  f"{list(self.aux_layers)} were named", "name as many aux layers as fc reads")
        on_device_of(self, model)
        self.embed = [self.embed_tokens if self.embed_tokens is not None else model.get_input_embeddings()]
        self.model.embed = self.embed
        return self

    @property
    def draft_vocab_size(self) -> int:
        return len(self.token_ids)

    def inputs(self, features: torch.Tensor, tokens: torch.Tensor, *, own: bool = False) -> torch.Tensor:
        """The input vectors of pairs ([n, 2h]): the token's embedding beside h, where h is `fc` of
        the target's aux features ([n, layers * H]), or with `own` a deeper node's fed-back output
        ([n, h], which `fc` does not read again)."""
        dtype = self.fc.weight.dtype
        if not own:
            features = self.fc(features.to(dtype))
        embedded = self.embed[0](tokens.to(features.device)).to(dtype)  # [n, h]
        return torch.cat([embedded, features.to(dtype)], -1)

    # ------------------------------------------------------------------ files
    @classmethod
    def load(cls, folder: str | Path) -> Eagle3Head:
        """A head in the EAGLE project's EAGLE-3 layout or the `speculators` format (see the module notes)."""
        from transformers import LlamaConfig

        folder, what = Path(folder), "the EAGLE-3 head"
        config = read_config(folder, what)
        tensors = read_state_dict(folder, WEIGHT_FILES, what)
        aux = None
        if "speculators_model_type" in config:
            kind = config["speculators_model_type"]
            if kind != "eagle3":
                raise InvalidArgument(f"{what} in {folder} is a speculators {kind!r} model",
                                      "use an EAGLE-3 head (speculators_model_type 'eagle3')")
            for flag in ("norm_before_fc", "fc_norm", "norm_output"):
                if config.get(flag):
                    raise InvalidArgument(f"{what} in {folder} sets {flag}, which multidecode does not read",
                                          "use a head trained without it")
            layer = dict(config.get("transformer_layer_config") or {})
            if layer.get("model_type", "llama") != "llama":
                raise InvalidArgument(f"{what} in {folder} has a {layer['model_type']} layer",
                                      "use a head whose layer is a Llama layer")
            if (layer.get("num_hidden_layers") or 1) != 1 or any(k.startswith("layers.1.") for k in tensors):
                raise InvalidArgument(f"{what} in {folder} has more than one layer", "use a one-layer head")
            tensors = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v
                       for k, v in tensors.items()}
            aux = config.get("eagle_aux_hidden_state_layer_ids")
            norm_before_residual = bool(config.get("norm_before_residual", False))
        else:
            layer = config
            aux = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
            norm_before_residual = False
        missing = [k for k in ("fc.weight", "midlayer.self_attn.q_proj.weight", "norm.weight", "lm_head.weight")
                   if k not in tensors]
        if missing:
            raise InvalidArgument(f"{what} in {folder} lacks {missing}", "point at an EAGLE-3 head's folder")
        draft_vocab = tensors["lm_head.weight"].shape[0]
        d2t = tensors.pop("d2t", torch.zeros(draft_vocab, dtype=torch.long))
        t2d = tensors.pop("t2d", None)
        vocab = len(t2d) if t2d is not None else layer.get("vocab_size") or config.get("vocab_size")
        layer_config = LlamaConfig(**{k: v for k, v in layer.items() if k not in NOT_LAYER_KEYS})
        layer_config.vocab_size, layer_config.num_hidden_layers = draft_vocab, 1
        if not layer.get("head_dim"):  # as EAGLE computes it where the config names none
            layer_config.head_dim = layer_config.hidden_size // layer_config.num_attention_heads
        layer_config._attn_implementation = "sdpa"
        head = cls(layer_config, d2t, vocab, target_hidden_size=config.get("target_hidden_size"), aux_layers=aux,
                   norm_before_residual=norm_before_residual, own_embeddings="embed_tokens.weight" in tensors,
                   fc_inputs=tensors["fc.weight"].shape[1])
        state = {("model." + k[len("midlayer."):] if k.startswith("midlayer.") else
                  "model." + k if k.startswith(("norm.", "lm_head.")) else k): v for k, v in tensors.items()}
        missing, unexpected = load_checked(head, state, f"{what} in {folder}")
        if missing or unexpected:
            raise InvalidArgument(f"{what} in {folder} does not match its config "
                                  f"(missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]})",
                                  "point at an EAGLE-3 head's folder as published")
        head.config = config
        return head.eval()
