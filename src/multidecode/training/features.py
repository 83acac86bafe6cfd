"""The target's features as training reads them: every position of every sequence, in one place.

A **feature** is the target's last hidden state at a position (after its final norm). The read
phase of `distill` keeps, per sequence, the features, the target's `TOP` likeliest next tokens
with their probabilities, the tokens and where the prompt ends; `load_features` joins them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

TOP = 16
"""The target's likeliest next tokens kept per position: the soft targets."""
HOLDOUT = 20
"""One sequence in this many is held out for measuring acceptance (the last one, in a run of fewer)."""


@dataclass
class Features:
    """Every position of every sequence, concatenated: features [N, hidden] float32, top_ids and
    top_probs [N, TOP], last [N] (the index of its sequence's last position), answer [N] (whether
    a position is in an answer), holdout [N] (held-out sequences), tokens [N]; starts: each
    sequence's answer as (first position, end, held out); begins: each sequence's first position."""

    features: torch.Tensor
    top_ids: torch.Tensor
    top_probs: torch.Tensor
    last: torch.Tensor
    answer: torch.Tensor
    holdout: torch.Tensor
    tokens: torch.Tensor
    starts: list[tuple[int, int, bool]]
    begins: list[int]


def load_features(folder: Path, indices: list[int]) -> Features:
    """The features of the sequences of the prompts `indices` (their files: `NNNNN.pt`), joined."""
    parts = [torch.load(folder / f"{i:05d}.pt", weights_only=True) for i in indices]
    count = len(parts)
    lengths = [p["features"].shape[0] for p in parts]
    ends = torch.tensor(lengths).cumsum(0)
    last = torch.cat([torch.full((n,), int(e) - 1) for n, e in zip(lengths, ends)])
    answer = torch.cat([torch.arange(n) >= p["prompt_length"] - 1 for n, p in zip(lengths, parts)])
    held = [i % HOLDOUT == HOLDOUT - 1 or (count < HOLDOUT and i == count - 1) for i in range(count)]  # at least one
    holdout = torch.cat([torch.full((n,), h) for h, n in zip(held, lengths)])
    # each sequence's answer: (its first position, one past its last, held out)
    starts = [(int(e) - n + p["prompt_length"] - 1, int(e), h) for n, e, p, h in zip(lengths, ends, parts, held)]
    return Features(torch.cat([p["features"] for p in parts]).float(), torch.cat([p["top_ids"] for p in parts]).long(),
                    torch.cat([p["top_probs"] for p in parts]).float(), last, answer, holdout,
                    torch.cat([p["tokens"] for p in parts]).long(), starts, [int(e) - n for n, e in zip(lengths, ends)])
