"""The speculative-sampling rule against a draft distribution emits tokens distributed exactly as
the target's p, whatever q and however many candidates were drawn from it; a rule that trusts
the draft (accepts its first candidate where the target gives it some probability) does not."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from speculation_cases import trusting_rule

from multidecode.verify import speculative_sample

V = 6


def _draw_without_replacement(q: torch.Tensor, k: int, g: torch.Generator) -> list[int]:
    return torch.multinomial(q, k, replacement=False, generator=g).tolist()


def _frequencies(rule, p, q, k, n=20000, seed=0) -> np.ndarray:
    g_draft, g_target = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 1)
    counts = np.zeros(V)
    for _ in range(n):
        counts[rule(p, q, _draw_without_replacement(q, k, g_draft), g_target)] += 1
    return counts


P = torch.tensor([0.35, 0.25, 0.2, 0.1, 0.06, 0.04])
Q = torch.tensor([0.05, 0.1, 0.15, 0.2, 0.25, 0.25])


@pytest.mark.parametrize("k", [1, 2, 4])
def test_recursive_rejection_sampling_emits_p(k):
    counts = _frequencies(speculative_sample, P, Q, k)
    assert chisquare(counts, P.numpy() * counts.sum()).pvalue > 1e-3


def test_a_rule_that_trusts_the_draft_fails_the_same_check():
    counts = _frequencies(trusting_rule, P, Q, 2)
    assert chisquare(counts, P.numpy() * counts.sum()).pvalue < 1e-6


def test_q_equal_to_p_accepts_the_first_candidate_always():
    g = torch.Generator().manual_seed(3)
    for _ in range(200):
        first = int(torch.multinomial(P, 1, generator=g))
        assert speculative_sample(P, P, [first], g) == first
