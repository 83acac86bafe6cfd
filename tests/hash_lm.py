"""A model-free stand-in for a causal LM, for testing the scheduler, rollback and verification.

`HashLM` has no weights to speak of: each token contributes a feature, a fixed hash of (token,
position), stored in the KV cache like a key. A query's next-token logits are a fixed function of
the sum of the features it may see (given by the attention mask, or causal without one). So its
predictions depend on exactly the visible path, in order (positions enter the hash), as a real
model's do, while every step costs microseconds and any two paths with different tokens give
unrelated logits. `reference` computes the same function straight from a token list, with no
cache, engine or mask: the sequential oracle.
"""

from __future__ import annotations

import math

import torch
from transformers import PretrainedConfig

VOCAB = 48
EOS = 2
MODULUS = 1 << 31


def feature(token: int | torch.Tensor, position: int | torch.Tensor):
    """A token's contribution at a position (an int below 2**31)."""
    return (token * 1_000_003 + (position + 1) * 7_919 + 12_345) % 65_521 * 32_749 % MODULUS


def logits_of(total: torch.Tensor) -> torch.Tensor:
    """[...] float64 sums of features -> [..., VOCAB] logits: a spread-out, deterministic function."""
    s = torch.remainder(total, MODULUS)[..., None]  # [..., 1]
    v = torch.arange(VOCAB, dtype=torch.float64)  # [V]
    return 3.0 * torch.sin(s * 0.000_37 * (v + 1) + v * 1.7)  # [..., V]


class HashLM(torch.nn.Module):
    """A causal-LM look-alike (see the module notes), in float64 so feature sums stay exact."""

    def __init__(self, max_positions: int = 2048) -> None:
        super().__init__()
        self.config = PretrainedConfig(vocab_size=VOCAB, max_position_embeddings=max_positions, eos_token_id=EOS,
                                       num_hidden_layers=1)
        self.config.model_type = "hash-lm"
        self.config._attn_implementation = "eager"
        self.embed = torch.nn.Embedding(VOCAB, 1, dtype=torch.float64)
        self.calls = 0

    def get_input_embeddings(self):
        return self.embed

    def forward(self, input_ids, position_ids=None, attention_mask=None, past_key_values=None, use_cache=True,
                logits_to_keep=None, **kwargs):
        self.calls += 1
        q = input_ids.shape[1]
        own = feature(input_ids[0].to(torch.float64), position_ids[0].to(torch.float64))  # [q]
        state = own[None, None, :, None]  # [1, 1, q, 1]: one head, one feature
        keys, _ = past_key_values.update(state, state, 0)
        keys = keys[0, 0, :, 0]  # [past + q]
        past = keys.shape[0] - q
        if attention_mask is None:
            visible = torch.ones(q, past + q, dtype=torch.bool).tril(diagonal=past)  # causal over slots
        else:
            if isinstance(attention_mask, dict):
                (attention_mask,) = attention_mask.values()
            visible = attention_mask[0, 0] == 0  # [q, past + q]
        totals = (visible.to(torch.float64) * keys[None, :]).sum(-1)  # [q]
        logits = logits_of(totals)[None]  # [1, q, V]
        if logits_to_keep is not None and not isinstance(logits_to_keep, int):
            logits = logits[:, logits_to_keep]
        hidden = None
        if kwargs.get("output_hidden_states"):  # its one "hidden state": the visible sum and the position
            hidden = (torch.stack([totals, position_ids[0].to(torch.float64)], -1)[None],)  # [1, q, 2]
        return _Output(logits, hidden)


class _Output:
    def __init__(self, logits: torch.Tensor, hidden_states=None) -> None:
        self.logits = logits
        self.hidden_states = hidden_states


def path_logits(tokens: list[int]) -> torch.Tensor:
    """[VOCAB] next-token logits after `tokens` (positions 0..n-1), computed directly."""
    total = sum(int(feature(t, i)) for i, t in enumerate(tokens))
    return logits_of(torch.tensor(float(total), dtype=torch.float64))


def reference(prompt: list[int], max_new_tokens: int, eos: set[int] = frozenset()) -> list[int]:
    """Plain sequential greedy decoding of the hash model from `prompt`."""
    tokens, out = list(prompt), []
    for _ in range(max_new_tokens):
        token = int(path_logits(tokens).argmax())
        out.append(token)
        tokens.append(token)
        if token in eos:
            break
    return out


class LetterTokenizer:
    """Token id i <-> one letter, for stop-string tests (ids past 'z' map to digits and symbols)."""

    ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 .,;:!?-+=*"

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False) -> str:
        return "".join(self.ALPHABET[i % len(self.ALPHABET)] for i in ids if not (skip_special_tokens and i == EOS))


assert math.isfinite(float(path_logits([1, 2, 3]).sum()))
