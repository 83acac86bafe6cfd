"""Verifying draft trees against the target model's own choices, greedy or sampled.

After a forward that fed each branch's newest token (its **head**) and a draft tree under it,
every fed node has the target's next-token logits. Verification walks each branch down its tree:

1. at the current node (the head first), the target picks the next token y exactly as plain
   decoding would: arg-max for a greedy branch, a draw from the processed distribution with the
   branch's own generator for a sampled one (`sampling.choose_tokens`, the same function plain
   decoding uses);
2. y is emitted; if a draft child of the current node carries y, that child is **accepted** and
   the walk goes on from it; otherwise the walk ends, and y is the branch's new head token (fed
   in the next step, with a new draft under it).

Each step so emits the accepted path plus one token of the target's own, and every draft node off
that path is **rejected** (taken back out of the forest and cache by the scheduler).

Why this is exact. Greedy: every emitted token is the arg-max after exactly the tokens before it,
as in sequential decoding (the draft only decides how many come per step). Sampled: this is the
rule for deterministic drafts of speculative sampling (Leviathan et al., 2023; Chen et al., 2023)
and its multi-candidate form for trees (SpecInfer, Miao et al., 2024): a draft x is accepted
with probability p(x) (the draw equals x); when it is not, the emitted token is distributed as p
with x removed and renormalised (the residual); with several sibling candidates the next is then
tried against that residual, and so on. Drawing y first and matching the candidates afterwards
is that rule with its random numbers shared.

**Random numbers.** Each branch has its own generator and draws exactly once per emitted token,
in order, from the same processed distribution as plain decoding. So a branch's output does not
depend on its neighbours, and a seeded run gives the same tokens with or without speculation,
whatever the proposer or the budget (up to float32 rounding of the logits, which can move a draw
that lands within ~1e-6 of a boundary). It also means a proposal's fate is decided by the tokens
the branch goes on to produce, which lets `cost.AcceptanceTracker` learn from proposals that
were never fed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .sampling import BranchSampler, choose_tokens


def walk(
    logits: torch.Tensor,
    heads: Sequence[int],
    children: Sequence[dict[int, dict[int, int]]],
    samplers: Sequence[BranchSampler],
    emit: Callable[[int, int], bool],
) -> list[list[int]]:
    """Verify the draft trees of several branches at once.

    logits: [rows, vocab], one row per fed node that has logits.
    heads[b]: the row of branch b's head; children[b][row] maps a token to the row of the draft
        child that guesses it.
    emit(b, token): records a token for branch b; returns False once the branch has finished (the
        walk stops there, as sequential decoding would).
    Returns, per branch, the rows of its accepted path (its head first).

    Branches are walked in rounds, one token per live branch per round, so the draws of each
    round are made together (`choose_tokens` vectorises the processors across branches).
    """
    current = list(heads)
    paths = [[h] for h in heads]
    live = list(range(len(heads)))
    # Plain greedy branches (no repetition penalty) choose the arg-max of a row whatever came
    # before it: take every row's at once, one device sync per step instead of one per round.
    plain = all(not s.params.do_sample and s.params.repetition_penalty in (None, 1.0) for s in samplers)
    best = logits.argmax(dim=-1).tolist() if plain else None  # [rows]
    while live:
        if best is not None:
            tokens = [best[current[b]] for b in live]
        else:
            rows = logits[torch.tensor([current[b] for b in live], dtype=torch.long, device=logits.device)]  # [n, V]
            tokens = choose_tokens(rows, [samplers[b] for b in live])
        going = []
        for b, token in zip(live, tokens):
            if not emit(b, token):
                continue
            child = children[b].get(current[b], {}).get(token)
            if child is None:
                continue
            current[b] = child
            paths[b].append(child)
            going.append(b)
        live = going
    return paths
