"""Tiny random-weight causal LMs, built from configs (nothing is downloaded).

Each architecture is chosen for a trait a forest must get right: rotary positions (Llama, Qwen2),
a sliding window shorter than the sequences (Mistral), hybrid sliding and full layers in one model
(Gemma3, Qwen2-hybrid), learned absolute positions (GPT-2), partial rotary (Phi-3, GPT-NeoX).
Weights are larger than the usual init so that greedy choices are not near-ties.
"""

from __future__ import annotations

import functools

import pytest
import torch
import transformers as tf

from multidecode import attention

VOCAB = 256
EOS = 2

COMMON = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=EOS, pad_token_id=0)
ROPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.1)

ARCHITECTURES = {
    "llama": lambda: (tf.LlamaConfig(**COMMON, **ROPE), tf.LlamaForCausalLM),
    "qwen2": lambda: (tf.Qwen2Config(**COMMON, **ROPE), tf.Qwen2ForCausalLM),
    "qwen2-hybrid": lambda: (
        tf.Qwen2Config(**COMMON, **ROPE, use_sliding_window=True, sliding_window=6, max_window_layers=1),
        tf.Qwen2ForCausalLM,
    ),
    "mistral": lambda: (tf.MistralConfig(**COMMON, **ROPE, sliding_window=6), tf.MistralForCausalLM),
    "gemma3": lambda: (
        tf.Gemma3TextConfig(**COMMON, **{**ROPE, "num_hidden_layers": 4}, head_dim=16, sliding_window=6,
                            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"]),
        tf.Gemma3ForCausalLM,
    ),
    "gpt2": lambda: (
        tf.GPT2Config(**COMMON, n_embd=64, n_layer=3, n_head=4, n_positions=512, initializer_range=0.1),
        tf.GPT2LMHeadModel,
    ),
    "phi3": lambda: (tf.Phi3Config(**COMMON, **ROPE, partial_rotary_factor=0.5), tf.Phi3ForCausalLM),
    "gpt_neox": lambda: (
        tf.GPTNeoXConfig(**COMMON, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, rotary_pct=0.25, max_position_embeddings=512, initializer_range=0.1),
        tf.GPTNeoXForCausalLM,
    ),
}
"""Name -> () -> (config, model class)."""

ARCHS = list(ARCHITECTURES)
"""Every tiny architecture, in one fixed order (the test ids follow it)."""
NO_EOS = VOCAB
"""An id no tiny model can produce (one past the vocabulary): given as eos, nothing stops early."""

MAIN_ARCHITECTURES = ["llama", "qwen2", "mistral", "gemma3", "gpt2", "phi3", "gpt_neox"]
ATTENTION = ["eager", "sdpa", "multidecode_sdpa"]
"""multidecode_sdpa is our grouped-query sdpa kernel (`multidecode.attention`); generate() on a
single unpadded sequence passes no mask, so references still run transformers' own sdpa."""


def combos(attns=("eager", "sdpa")):
    """(arch, attn) test parameters: every architecture with each of `attns`, each architecture
    kept on one xdist worker so that its model and references are built once."""
    return [pytest.param(arch, attn, id=f"{arch}-{attn}", marks=pytest.mark.xdist_group(arch))
            for arch in ARCHS for attn in attns]


@functools.cache
def tiny_model(arch: str, attn: str = "sdpa", dtype: torch.dtype = torch.float32):
    """A deterministic tiny model of `arch` with attention implementation `attn` (cached)."""
    config, cls = ARCHITECTURES[arch]()
    if attn == attention.NAME:
        attention.register()
    config._attn_implementation = attn
    torch.manual_seed(1234)
    model = cls(config).to(dtype).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = EOS
    return model


def reference_generate(model, prompt: list[int], *, max_new_tokens: int, eos_token_id=None) -> list[int]:
    """What plain sequential greedy decoding gives after `prompt` (transformers' own generate)."""
    kwargs = {} if eos_token_id is None else {"eos_token_id": eos_token_id}
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False, max_new_tokens=max_new_tokens, **kwargs,
        )
    return out[0, len(prompt):].tolist()


MOE = dict(moe_intermediate_size=32, num_experts_per_tok=2)
MTP_ARCHITECTURES = {
    # hybrid sliding and full layers, MoE; its MTP layer is a sliding one
    "mellum": lambda: (
        tf.MellumConfig(**COMMON, **{**ROPE, "num_hidden_layers": 2}, **MOE, head_dim=16, num_experts=4,
                        sliding_window=6, layer_types=["sliding_attention", "full_attention"],
                        mlp_layer_types=["dense", "sparse"], num_mtp_layers=1),
        tf.MellumForCausalLM,
    ),
    # GQA with partial rotary, a dense first layer then MoE (GLM-4.5)
    "glm4_moe": lambda: (
        tf.Glm4MoeConfig(**COMMON, **ROPE, **MOE, n_routed_experts=4, first_k_dense_replace=1, n_group=1,
                         topk_group=1, num_nextn_predict_layers=1),
        tf.Glm4MoeForCausalLM,
    ),
    # multi-head latent attention, MoE (DeepSeek-V3)
    "deepseek_v3": lambda: (
        tf.DeepseekV3Config(**COMMON, **{**ROPE, "num_key_value_heads": 4}, **MOE, n_routed_experts=4,
                            first_k_dense_replace=1, n_group=1, topk_group=1, num_nextn_predict_layers=1,
                            q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16),
        tf.DeepseekV3ForCausalLM,
    ),
}
"""Models whose checkpoints carry one multi-token-prediction layer: name -> () -> (config, model class)."""


@functools.cache
def tiny_mtp_model(arch: str, attn: str = "sdpa"):
    """A deterministic tiny model of an `MTP_ARCHITECTURES` kind (cached)."""
    config, cls = MTP_ARCHITECTURES[arch]()
    config._attn_implementation = attn
    torch.manual_seed(1234)
    model = cls(config).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = EOS
    return model


def random_mtp(model, seed: int = 5):
    """transformers' MTP module for `model` (one layer), with random weights (norms at one).

    Every weight of its own is drawn here: `MtpModel`'s init leaves some (the experts' stacked
    projections) as uninitialized memory, which a checkpoint's load fills."""
    from transformers.modeling_layers import MtpModel

    mtp = MtpModel(model, 1).eval()
    generator = torch.Generator().manual_seed(seed)
    shared = {id(p) for p in [*model.get_input_embeddings().parameters(), *model.get_output_embeddings().parameters()]}
    with torch.no_grad():
        for name, weight in mtp.named_parameters():
            if id(weight) in shared:
                continue
            if "norm" in name:
                weight.fill_(1.0)
            else:
                weight.copy_(torch.randn(weight.shape, generator=generator) * 0.1)
    return mtp
