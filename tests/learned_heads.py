"""Learned heads with random weights, bound to a tiny model: drafters unrelated to the target.

Exactness tests use them as the worst drafter a user could load (the output must not change), and
the benchmark and format tests save them where a trained head would be found. The seeds are fixed,
so every module gets the same heads.

- `random_heads(model)`: Medusa heads (`MedusaHeads`), optionally over a reduced draft vocabulary.
- `random_head(model)`: an EAGLE-style head (`EagleHead`), optionally over a reduced draft vocabulary.
"""

from __future__ import annotations

import torch

from multidecode.proposers.eagle import EagleHead, head_config
from multidecode.proposers.heads import fingerprint
from multidecode.proposers.medusa import MedusaHeads


def random_heads(model, heads: int = 3, *, draft_vocab: int | None = None, seed: int = 5) -> MedusaHeads:
    """Heads with random blocks (unrelated to the target), bound to `model`."""
    hidden, vocab = model.config.hidden_size, model.config.vocab_size
    token_ids = None if draft_vocab is None else \
        torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[:draft_vocab]
    module = MedusaHeads(hidden, vocab, heads, token_ids=token_ids, target=fingerprint(model))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.blocks.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.5)
    return module.bind(model)


def random_head(model, *, draft_vocab: int | None = None, seed: int = 3) -> EagleHead:
    """A head with random weights (unrelated to the target), bound to `model`."""
    vocab = model.config.vocab_size
    ids = torch.arange(vocab) if draft_vocab is None else \
        torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[:draft_vocab]
    torch.manual_seed(seed)
    return EagleHead(head_config(model, len(ids)), ids, vocab, target=fingerprint(model)).bind(model)
