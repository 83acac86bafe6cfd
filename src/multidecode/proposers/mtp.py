"""Multi-token-prediction (MTP) layers that ship inside a checkpoint, as a drafter.

DeepSeek-V3 (DeepSeek-AI, 2024, "DeepSeek-V3 Technical Report", arXiv 2412.19437, section 2.2)
trains extra modules after the model's last layer: module k combines the representation of token
i at depth k-1 with the embedding of token i+k,

    h'_i = eh_proj([enorm(Emb(t_{i+k})); hnorm(h_i^{k-1})]),

runs one transformer block of the model's own kind over it (attending over the earlier positions
of its depth), and the model's shared output head predicts t_{i+k+1}. DeepSeek-V3, GLM-4.5,
Mellum, MiMo and Qwen3-Next ship such layers; at inference they draft (DeepSeek reports its second
token accepted 85-90% of the time).

That is an EAGLE-style head whose weights come with the model: the same **pairs** (a feature,
the token chosen after it), the same best-first tree, so `Mtp` is `proposers.eagle.Eagle` with
this head. Terms:

- the **feature** of the first depth is the target's `hidden_states[-1]` (after its final norm,
  as transformers' own MTP assistant reads it); deeper nodes read the MTP block's output;
- only the checkpoint's **first** MTP layer drafts, at every depth of the tree (as vLLM runs a
  single MTP layer for several tokens): a later layer would need a cache of its own per depth.

transformers (5.24 on) builds these layers as `transformers.modeling_layers.MtpModel` and reads
their weights from the checkpoint (`MtpModel.from_pretrained(model)`), which the target's own load
leaves out. `MtpLM` gives that module's first layer the face of a causal LM (input vectors, a 4D
mask, position ids, a cache; logits and hidden states out), so an `Engine` runs it on a forest
like any model: a pair's input vector is [embedding of the token; the feature], split inside.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import InvalidArgument, UnsupportedModel
from ..models.converted import model_display_name
from ..models.packed import weights_device
from .drafting import vocabulary_size
from .eagle import Eagle
from .heads import causal_mask, check_head_fits


def mtp_layers(model) -> int:
    """How many MTP layers `model`'s config says its checkpoint holds, as transformers' `MtpModel`
    reads them (`num_mtp_layers`; 0: none, or none that transformers can build)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return int(getattr(config, "num_mtp_layers", None) or 0)


def _mtp_model_class():
    try:
        from transformers.modeling_layers import MtpModel
    except ImportError:  # before transformers 5.24
        import transformers

        raise UnsupportedModel(f"transformers {transformers.__version__} cannot build a checkpoint's MTP layers",
                               "upgrade it: pip install -U 'transformers>=5.24'") from None
    return MtpModel


class MtpLM(nn.Module):
    """The first layer of transformers' `MtpModel` as a causal LM an `Engine` can run (see the
    module notes). Its input vectors are [embedding; feature] ([1, q, 2 * hidden])."""

    def __init__(self, mtp) -> None:
        super().__init__()
        self.mtp = mtp
        self.config = mtp.config

    def get_input_embeddings(self) -> nn.Module:
        return self.mtp.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.mtp.shared_head

    def forward(self, inputs_embeds: torch.Tensor, attention_mask=None, position_ids: torch.Tensor | None = None,
                cache=None, logits_to_keep=None, output_hidden_states: bool = False, **kwargs):
        from transformers.modeling_outputs import CausalLMOutputWithPast

        mtp, hidden_size = self.mtp, self.config.hidden_size
        embeds, features = inputs_embeds.split(hidden_size, dim=-1)  # [1, q, hidden] each
        if attention_mask is None:  # a plain continuation: the mask the model would build itself
            attention_mask = causal_mask(self.config, embeds, cache, position_ids)
        rope = {"layer_type": self.config.layer_types[0]} if getattr(mtp, "has_per_layer_rope", False) else {}
        position_embeddings = None if mtp.rotary_emb is None else mtp.rotary_emb(embeds, position_ids=position_ids,
                                                                                  **rope)
        hidden = mtp.layers[0](embeds, features, position_embeddings=position_embeddings, attention_mask=attention_mask,
                               position_ids=position_ids, cache=cache, **kwargs)  # [1, q, hidden]
        if getattr(mtp, "use_shared_post_norm", False):
            hidden = mtp.shared_post_norm(hidden)
        kept = hidden if logits_to_keep is None else hidden[:, logits_to_keep]
        multiplier = getattr(self.config, "logits_mup_width_multiplier", None)  # as the target's head reads
        logits = mtp.shared_head(kept if multiplier is None else kept / multiplier)
        unpadded = getattr(self.config, "unpadded_vocab_size", None)
        if unpadded is not None:
            logits = logits[..., :unpadded]
        return CausalLMOutputWithPast(logits=logits, hidden_states=(hidden,))


class MtpHead(nn.Module):
    """A checkpoint's first MTP layer as an `Eagle` head (see the module notes).

    mtp: transformers' `MtpModel`, tied to its target (`MtpModel(model, n)` or
    `MtpModel.from_pretrained(model)`; `of` reads it from the target's checkpoint).
    """

    token_ids = None  # it drafts over the whole vocabulary
    target = None  # it comes with the model: nothing to check against a record
    reads_prompt = True  # trained with the model, over whole sequences

    def __init__(self, mtp) -> None:
        super().__init__()
        self.model = MtpLM(mtp)
        self.hidden_size = mtp.config.hidden_size
        self.vocab_size = getattr(mtp.config, "unpadded_vocab_size", None) or vocabulary_size(self.model)
        self.embed: list[nn.Module] = []

    @classmethod
    def of(cls, model) -> MtpHead:
        """The first MTP layer of `model`'s checkpoint (the folder or Hub name it was loaded from).
        Raises `InvalidArgument` for a model whose config names none, or whose files lack them."""
        name = str(getattr(model.config, "_name_or_path", "") or "")
        if not mtp_layers(model):
            raise InvalidArgument(f"{model_display_name(model)} has no multi-token-prediction layers "
                                  "(its config names none)",
                                  "speculate with eagle or medusa and a head trained for it "
                                  "(multidecode train-drafter), or with auto")
        if not name:
            raise InvalidArgument("the model was not loaded from a checkpoint, so its MTP layers cannot be read",
                                  "load it with from_pretrained from the folder that holds them")
        if getattr(model.config, "quantization_config", None):
            raise InvalidArgument(f"the MTP layers of {name} are quantized, and transformers reads them without "
                                  "their scales", "use a checkpoint of the model in bfloat16 or float32")
        from ..models.reading import quiet_transformers

        try:
            with quiet_transformers():
                mtp = _mtp_model_class().from_pretrained(model)
        except Exception as error:  # noqa: BLE001 - whatever stops the read, the user's fix is another checkpoint
            raise InvalidArgument(f"the MTP layers of {name} could not be read: {str(error).splitlines()[0]}",
                                  "load the model from a checkpoint that keeps them (config.json and "
                                  "*.safetensors as published)") from None
        return cls(mtp.to(weights_device(model)).eval()).bind(model)

    def bind(self, model) -> MtpHead:
        """Check the layer belongs to `model` (its widths) and read the target's embeddings through it."""
        check_head_fits(model, self.hidden_size, self.vocab_size, None, "mtp", what="the MTP layer",
                        fix="read the MTP layers from this model's own checkpoint")
        self.embed = [self.model.get_input_embeddings()]
        return self

    def inputs(self, features: torch.Tensor, tokens: torch.Tensor, *, own: bool = False) -> torch.Tensor:
        """The input vectors of pairs ([n, 2 * hidden]): each token's embedding beside its feature
        (the target's, or with `own` the layer's output at the parent: the same here)."""
        embedded = self.embed[0](tokens.to(features.device))  # [n, hidden]
        return torch.cat([embedded, features.to(embedded.dtype)], -1)


class Mtp(Eagle):
    """Drafts with a checkpoint's MTP layer (`MtpHead`; see the module notes), by `Eagle`'s tree:
    width candidates per node, grown while the path probability is at least confidence, up to
    max_depth. head None: read from the target's checkpoint when the run starts."""

    name = "mtp"

    def __init__(self, head: MtpHead | None = None, *, width: int = 1, confidence: float = 0.1,
                 max_depth: int = 4) -> None:
        super().__init__(head, width=width, confidence=confidence, max_depth=max_depth)

    def check(self, model) -> None:
        if self.head is None:
            self.head = MtpHead.of(model)
        super().check(model)
