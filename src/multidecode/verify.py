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

**Drafts drawn from a distribution.** When a proposer drew a node's candidates from a known
distribution q (a draft model sampling, `DraftTree.dists`) and the speculation asks for it
(`Speculation.against_q`; `drawn` below), a sampled branch uses the speculative-sampling rule
against q instead, which accepts more often (on average the overlap
sum_x min(p(x), q(x)) rather than p(x)): candidate x_i is accepted with probability
min(1, p_i(x_i) / q_i(x_i)); on rejection p_{i+1} = norm(max(p_i - q_i, 0)) and q_{i+1} = q_i
without x_i, renormalised (the candidates were drawn without replacement); when every candidate
is rejected the token is drawn from the last residual. This is recursive rejection sampling
(Jeon et al., 2024, arXiv 2402.14160), the without-replacement form of SpecInfer's multi-candidate
rule; the emitted token is distributed exactly as p. It costs one uniform draw per candidate
tried, so a seeded run is reproducible but not draw-for-draw the run without speculation, and a
branch's draws then depend on the drafts its neighbours shaped: not the default.
Greedy branches ignore q: arg-max and match, as above.

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

from .sampling import BranchSampler, choose_tokens, probabilities

Drawn = tuple[list[int], torch.Tensor]
"""Candidates under one node in the order they were drawn, and the distribution q ([vocab]) they
were drawn from."""


def walk(
    logits: torch.Tensor,
    heads: Sequence[int],
    children: Sequence[dict[int, dict[int, int]]],
    samplers: Sequence[BranchSampler],
    emit: Callable[[int, int, int], bool],
    drawn: Sequence[dict[int, Drawn]] | None = None,
) -> list[list[int]]:
    """Verify the draft trees of several branches at once.

    logits: [rows, vocab], one row per fed node that has logits.
    heads[b]: the row of branch b's head; children[b][row] maps a token to the row of the draft
        child that guesses it.
    emit(b, token, row): records a token for branch b, chosen from logits row `row`; returns False
        once the branch has finished (the walk stops there, as sequential decoding would).
    drawn[b][row]: the candidates under that row of branch b, if they were drawn from a known
        distribution (see the module notes); used by sampled branches only.
    Returns, per branch, the rows of its accepted path (its head first); a draft child that guessed
    the token a branch ended on is on it (the draft was right, though nothing follows it).

    Branches are walked in rounds, one token per live branch per round, so the draws of each
    round are made together (`choose_tokens` vectorises the processors across branches).
    """
    current = list(heads)
    paths = [[h] for h in heads]
    live = list(range(len(heads)))
    # Plain greedy branches (no penalty, no bias, no grammar) choose the arg-max of a row whatever
    # came before it: take every row's at once, one device sync per step instead of one per round.
    plain = all(s.plain for s in samplers)
    best = logits.argmax(dim=-1).tolist() if plain else None  # [rows]
    while live:
        if best is not None:
            tokens = [best[current[b]] for b in live]
        else:
            tokens = _choose(logits, [current[b] for b in live], [samplers[b] for b in live],
                             [drawn[b] if drawn else {} for b in live])
        going = []
        for b, token in zip(live, tokens):
            goes_on = emit(b, token, current[b])
            child = children[b].get(current[b], {}).get(token)
            if child is None:
                continue
            current[b] = child  # the draft guessed it: accepted, the token that ends a branch too
            paths[b].append(child)
            if goes_on:
                going.append(b)
        live = going
    return paths


def _choose(logits: torch.Tensor, rows: list[int], samplers: list[BranchSampler], drawn: list[dict[int, Drawn]]) -> list[int]:
    """One token per (row, sampler): by the rule against q where the row's candidates were drawn
    from one and the branch samples, else as plain decoding chooses."""
    special = [i for i, (row, s) in enumerate(zip(rows, samplers)) if s.params.do_sample and row in drawn[i]]
    plain = [i for i in range(len(rows)) if i not in special]
    tokens = [0] * len(rows)
    if plain:
        picked = logits[torch.tensor([rows[i] for i in plain], dtype=torch.long, device=logits.device)]  # [n, V]
        for i, token in zip(plain, choose_tokens(picked, [samplers[i] for i in plain])):
            tokens[i] = token
    for i in special:
        p = probabilities(logits[rows[i]][None], [samplers[i]])[0]  # [V]
        candidates, q = drawn[i][rows[i]]
        tokens[i] = speculative_sample(p, q, candidates, samplers[i].generator)
        samplers[i].observe(tokens[i])
    return tokens


def speculative_sample(p: torch.Tensor, q: torch.Tensor, candidates: Sequence[int],
                       generator: torch.Generator | None) -> int:
    """A token distributed exactly as p ([V]), given candidates drawn from q ([V]) in order without
    replacement: recursive rejection sampling (see the module notes)."""
    p, q = p.double(), q.double().clone()  # float64: residuals of nearly equal p and q stay accurate
    for x in candidates:
        qx = float(q[x])
        if qx <= 0:
            continue  # not a draw from q (a proposer's mistake): not a candidate of the rule
        if float(torch.rand((), generator=generator, dtype=torch.float64)) * qx < float(p[x]):
            return int(x)
        residual = (p - q).clamp_min(0)
        total = float(residual.sum())
        if total > 0:
            p = residual / total
        q[x] = 0
        left = float(q.sum())
        if left <= 0:
            break
        q /= left
    return int(torch.multinomial(p, 1, generator=generator))
