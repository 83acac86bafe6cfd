"""Drafting from a model's next-token distribution: what the draft model and the learned heads share.

A drafter that runs a network of its own (a draft model, `draft`; Medusa heads, `medusa`; an
EAGLE-style layer, `eagle`; an MTP layer, `mtp`) turns its logits into a **draft distribution**
over the target's vocabulary (`draft_distribution`), and adds candidates from it under a node
(`add_candidates`): the likeliest for a greedy branch, drawn without replacement for a sampled one
(from `draft_generator`'s stream), the distribution then going with the draft (`DraftTree.dists`)
so that verification keeps the target's distribution.
"""

from __future__ import annotations

import torch

from ..sampling import TORCH_SEED_BITS, mix64, seeded_generator, warp
from ..sampling_params import SamplingParams
from .base import DraftTree


def vocabulary_size(model) -> int:
    """The size of the model's next-token distribution: its output layer's, else its embeddings'."""
    head = getattr(model, "get_output_embeddings", lambda: None)()
    if head is not None:
        return head.out_features if hasattr(head, "out_features") else head.weight.shape[0]
    return model.get_input_embeddings().num_embeddings


def draft_distribution(logits: torch.Tensor, token_ids: torch.Tensor | None, vocab_size: int,
                       sampling: SamplingParams) -> torch.Tensor:
    """A drafter's logits over its draft vocabulary ([V'], the target ids `token_ids`; None: the
    whole vocabulary) as a distribution over the target's [vocab] (on the CPU), warped as the
    branch samples."""
    full = torch.full((vocab_size,), float("-inf"))
    full[slice(None) if token_ids is None else token_ids.cpu()] = logits.float().cpu()
    return (warp(full[None], [sampling])[0] if sampling.do_sample else full).softmax(-1)


def add_candidates(tree: DraftTree, parent: int, q: torch.Tensor, count: int, generator: torch.Generator | None, *,
                   min_prob: float = 0.0, kind: int | None = None) -> list[tuple[int, int, float]]:
    """Add up to `count` candidates under `parent` from the draft distribution q ([vocab]): drawn
    without replacement where `generator` is given (a sampled branch; q goes with the draft, see
    `DraftTree.dists`), else the likeliest, those after the first only at `min_prob` or above.
    A node's prior is its q; its kind is `kind`, else its q's decile. Returns (candidate index,
    token, q) of each."""
    count = min(count, int((q > 0).sum()))
    if count < 1:
        return []
    if generator is not None:
        tokens = torch.multinomial(q, count, replacement=False, generator=generator).tolist()
        tree.dists[parent] = q
    else:
        values, ids = q.topk(count)
        tokens = [t for n, (t, v) in enumerate(zip(ids.tolist(), values.tolist())) if n == 0 or v >= min_prob]
    out = []
    for token in tokens:
        chance = float(q[token])
        out.append((tree.add(token, parent, kind=min(int(chance * 10), 9) if kind is None else kind, prior=chance),
                    token, chance))
    return out


def draft_seed(seed: int) -> int:
    """The seed of a branch's draft stream: the low 32 bits of `mix64(seed)`, a whole seed for
    torch's generator in which every bit of the branch's seed counts, with no small offset between
    the two (an offset c made the draft stream of s the main stream of s + c, and s = 0 would meet
    branch 1 under seed * m + 1)."""
    return mix64(seed) % 2**TORCH_SEED_BITS


def draft_generator(sampling: SamplingParams) -> torch.Generator | None:
    """The random stream a proposer draws a sampled branch's candidates from: seeded from the
    branch's seed (mixed, so it is not the branch's own stream), else fresh; None for greedy."""
    if not sampling.do_sample:
        return None
    return seeded_generator(None if sampling.seed is None else draft_seed(sampling.seed))
