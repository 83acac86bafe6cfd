"""Choosing the next token of each branch: logits processors and seeded samplers.

Every branch has its own `SamplingParams` (`sampling_params`: the settings and their checks) and,
when it samples, its own `torch.Generator`. The processors run on all live branches at once with
one parameter per row, and each row's draw uses only that row's generator, so a branch seeded with
s gives the same tokens whatever branches run beside it.

The processors run in this order, each on the output of the one before:

1. repetition penalty, as transformers defines it: a token anywhere in the sequence (prompt
   included) has a negative logit multiplied by the penalty, a positive one divided;
2. presence and frequency penalties, as OpenAI defines them (and vLLM applies them, after the
   repetition penalty): logits[j] -= presence_penalty * (count[j] > 0) + frequency_penalty *
   count[j], where count[j] is how often token j occurs in the tokens this branch *generated*
   (not its prompt);
3. logit bias: logits[j] += logit_bias[j] (OpenAI's `logit_bias`, a bias in [-100, 100] per token);
4. when sampling, temperature, top-k, top-p and min-p, as transformers' `generate`, each keeping at
   least one token (top-k keeps every token tied with the k-th; of tokens tied exactly at the
   top-p edge, which ones top-p drops is the sort's choice, in transformers as here: the shares
   kept are the same).

Steps 1 to 3 apply to greedy branches too: they take the arg-max after them, as `generate` does
after its repetition penalty. Each step reads only the row's own history, so speculation applies
them with the right history at every draft node (`verify.walk` chooses a branch's tokens in order,
observing each before the next is chosen).

A constrained branch's grammar mask (`constraints`) comes after step 3, so greedy takes the best
allowed token and sampling draws among the allowed ones only.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .constraints import GrammarState, mask_logits
from .sampling_params import SEED_LIMIT, SamplingParams

TORCH_SEED_BITS = 32
"""The bits of a seed torch's CPU generator (a Mersenne twister) keeps: the low 32, the rest dropped."""


def mix64(value: int) -> int:
    """splitmix64's mix of `value` in [0, 2**64): one to one, every input bit moving every output bit."""
    z = (value + 0x9E3779B97F4A7C15) % SEED_LIMIT
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % SEED_LIMIT
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % SEED_LIMIT
    return z ^ (z >> 31)


def seeded_generator(seed: int | None) -> torch.Generator:
    """A CPU generator drawing from `seed`'s stream (None: from fresh entropy).

    torch's CPU generator keeps only a seed's low 32 bits (`TORCH_SEED_BITS`), so seeds s and
    s + 2**32 would share a stream. A seed of 2**32 or more is therefore mixed down to 32 bits
    first: the high half of `mix64(seed)` (the low half seeds its draft stream,
    `proposers.drafting.draft_seed`), so that its high bits count; a smaller seed is used as it
    is, giving the draws it always gave. There are 2**32 streams: two seeds share one with a
    chance of 1 in 2**32.
    """
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed if seed < 2**TORCH_SEED_BITS else mix64(seed) >> TORCH_SEED_BITS)
    return generator


class BranchSampler:
    """One branch's sampling state: its parameters, its generator, the tokens it has seen and,
    for a constrained branch, where its grammar stands (`constraints.GrammarState`)."""

    def __init__(self, params: SamplingParams, context: Sequence[int] = (), grammar: GrammarState | None = None) -> None:
        self.params = params
        self.grammar = grammar
        self.generator = seeded_generator(params.seed) if params.do_sample else None
        # Repetition penalty looks at the whole sequence, prompt included, as transformers does;
        # presence and frequency penalties at the generated tokens only, as OpenAI's do.
        self.seen: set[int] = set(context) if params.repetition_penalty not in (None, 1.0) else set()
        self.counts: Counter[int] = Counter()

    def observe(self, token: int) -> None:
        if self.params.repetition_penalty not in (None, 1.0):
            self.seen.add(token)
        if self.params.presence_penalty or self.params.frequency_penalty:
            self.counts[token] += 1
        if self.grammar is not None:
            self.grammar.consume(token)

    @property
    def plain(self) -> bool:
        """Whether it takes the arg-max of its raw logits (greedy, no penalty or bias, no grammar)."""
        return not self.params.do_sample and not self.params.penalized and self.grammar is None


# ---------------------------------------------------------------------- processors
def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """logits [n, V]; seen [n, V] bool; penalty [n, 1]. Seen tokens: negative logits are
    multiplied by the penalty, positive ones divided."""
    penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalized, logits)


def apply_presence_frequency(logits: torch.Tensor, counts: torch.Tensor, presence: torch.Tensor,
                             frequency: torch.Tensor) -> torch.Tensor:
    """logits [n, V]; counts [n, V] (each token's count among the generated ones); presence and
    frequency [n, 1]. OpenAI's definition: logits - (presence * (count > 0) + frequency * count)."""
    return logits - (presence * (counts > 0) + frequency * counts)


def apply_logit_bias(logits: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """logits [n, V]; bias [n, V] (0 where a row has none)."""
    return logits + bias


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """logits [n, V]; temperature [n, 1]. A row the division (or a strong repetition penalty before
    it) carries past float32's range, to infinities whose softmax is no distribution, is divided
    once its largest logit is taken out, that logit (and its ties) set to 0: the same distribution,
    every logit finite or -inf."""
    out = logits / temperature
    over = torch.isposinf(out).any(dim=-1, keepdim=True)  # [n, 1]
    if bool(over.any()):
        top = logits.amax(dim=-1, keepdim=True)  # [n, 1]
        out = torch.where(over, torch.where(logits == top, 0.0, (logits - top) / temperature), out)
    return out


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep the k highest logits of each row. top_k [n] long; 0 leaves a row as it is."""
    vocab = logits.shape[-1]
    k = top_k.clamp(max=vocab)
    k_max = int(k.max())
    if k_max == 0:
        return logits
    top_values = torch.topk(logits, k_max, dim=-1).values  # [n, k_max]
    threshold = top_values.gather(1, (k.clamp(min=1) - 1)[:, None])  # [n, 1]
    threshold = torch.where(k[:, None] > 0, threshold, torch.full_like(threshold, -float("inf")))
    return logits.masked_fill(logits < threshold, -float("inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches top_p. top_p [n, 1]:
    in float64 (`warp` gives it so), 1 - top_p is rounded to the logits' dtype once, as transformers
    compares with its Python float (1 - float32(0.9) is an ulp above float32(1 - 0.9))."""
    sorted_logits, sorted_index = torch.sort(logits, descending=False)  # [n, V]
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cumulative <= (1 - top_p).to(cumulative.dtype)
    remove_sorted[..., -1:] = False  # always keep the most likely token
    remove = remove_sorted.scatter(1, sorted_index, remove_sorted)
    return logits.masked_fill(remove, -float("inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens less likely than min_p times the most likely one. min_p [n, 1]."""
    probs = logits.softmax(dim=-1)
    remove = probs < min_p * probs.amax(dim=-1, keepdim=True)
    top = logits.argmax(dim=-1, keepdim=True)
    remove.scatter_(1, top, False)  # always keep the most likely token
    return logits.masked_fill(remove, -float("inf"))


CANDIDATE_LIMIT = 4096
"""A row with a top-k at most this large is warped and drawn among its own top-k only."""
SAMPLING_ROWS = 256
"""`choose_tokens` processes at most this many rows at once (its float copies stay small)."""


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device)[:, None]


def _scatter(rows: Sequence[dict[int, float] | Sequence[tuple[int, float]]], like: torch.Tensor) -> torch.Tensor:
    """[n, V] zeros of like's dtype, with row i's (token id, value) pairs filled in."""
    out = torch.zeros_like(like)
    for i, pairs in enumerate(rows):
        pairs = list(pairs.items()) if isinstance(pairs, dict) else list(pairs)
        if pairs:
            ids = torch.tensor([t for t, _ in pairs], dtype=torch.long, device=like.device)
            out[i, ids] = torch.tensor([v for _, v in pairs], dtype=like.dtype, device=like.device)
    return out


def penalize(logits: torch.Tensor, samplers: Sequence[BranchSampler]) -> torch.Tensor:
    """Steps 1 to 3 of the module notes (repetition, presence and frequency penalties, then logit
    bias) on every row that has them, greedy rows included. [n, V] -> [n, V]"""
    params = [s.params for s in samplers]
    vocab = logits.shape[-1]
    if any(p.repetition_penalty not in (None, 1.0) for p in params):
        seen = _scatter([dict.fromkeys((t for t in s.seen if t < vocab), 1.0) for s in samplers], logits) > 0
        logits = apply_repetition_penalty(logits, seen, _column([p.repetition_penalty or 1.0 for p in params], logits))
    if any(p.presence_penalty or p.frequency_penalty for p in params):
        counts = _scatter([s.counts for s in samplers], logits)  # [n, V]
        logits = apply_presence_frequency(logits, counts, _column([p.presence_penalty or 0.0 for p in params], logits),
                                          _column([p.frequency_penalty or 0.0 for p in params], logits))
    if any(p.logit_bias for p in params):
        logits = apply_logit_bias(logits, _scatter([p.logit_bias or () for p in params], logits))
    return logits


def warp(scores: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p, one setting per row, for sampled rows. [n, V] -> [n, V]"""
    return _cut(_tempered(scores, params), params)


def _tempered(scores: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    if any(p.temperature != 1.0 for p in params):
        scores = apply_temperature(scores, _column([p.temperature for p in params], scores))
    return scores


def _cut(scores: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Top-k, top-p and min-p of tempered scores. [n, m] -> [n, m]: m the whole vocabulary, or one
    row's candidates (`draws`), for which top-k keeps them all."""
    if any(p.top_k for p in params):
        scores = apply_top_k(scores, torch.tensor([p.top_k or 0 for p in params], device=scores.device))
    if any(p.top_p is not None and p.top_p < 1 for p in params):
        top_p = torch.tensor([1.0 if p.top_p is None else p.top_p for p in params], dtype=torch.float64)
        scores = apply_top_p(scores, top_p.to(scores.device)[:, None])
    if any(p.min_p for p in params):
        scores = apply_min_p(scores, _column([p.min_p or 0.0 for p in params], scores))
    return scores


def constrain(logits: torch.Tensor, samplers: Sequence[BranchSampler]) -> torch.Tensor:
    """The penalties and the logit bias (`penalize`), then each constrained row's grammar mask. [n, V] -> [n, V]"""
    return mask_logits(penalize(logits, samplers), [s.grammar for s in samplers])


def process_logits(logits: torch.Tensor, samplers: Sequence[BranchSampler]) -> torch.Tensor:
    """Every branch's processors on its row, over the whole vocabulary. logits [n, V] float32 -> [n, V]."""
    logits = constrain(logits, samplers)
    rows = [i for i, s in enumerate(samplers) if s.params.do_sample]
    if not rows:
        return logits
    out = logits.clone()
    out[rows] = warp(logits[rows], [samplers[i].params for i in rows])
    return out


@dataclass(frozen=True)
class Draw:
    """One row's distribution: ids [C] (ascending token ids; None: the whole vocabulary) and probs
    [C] (float32, on the CPU)."""

    ids: torch.Tensor | None
    probs: torch.Tensor

    def sample(self, generator: torch.Generator | None) -> int:
        drawn = int(torch.multinomial(self.probs, 1, generator=generator))
        return drawn if self.ids is None else int(self.ids[drawn])

    def over(self, vocab: int) -> torch.Tensor:
        """The distribution over the whole vocabulary. [vocab]"""
        if self.ids is None:
            return self.probs
        return torch.zeros(vocab, dtype=self.probs.dtype).index_copy_(0, self.ids, self.probs)


def draws(scores: torch.Tensor, samplers: Sequence[BranchSampler], rows: Sequence[int]) -> dict[int, Draw]:
    """What each of `rows` draws from: scores [n, V] float32 (`constrain`'s) -> {row: Draw}.

    A row with a top-k of at most CANDIDATE_LIMIT is warped over its own candidates only: every
    token whose tempered score reaches its k-th best (those tied with it too, as transformers'
    top-k keeps them), in id order, so that top-p sorts k scores, not the vocabulary. The set and
    its order depend on the row alone (its k-th best score is the same whatever the neighbours'
    k), and so does the width it is warped at (a softmax over another length may round
    otherwise): rows are warped together only with rows of the same width. Other rows are warped
    together over the vocabulary, each row's result its own.
    """
    out: dict[int, Draw] = {}
    short = [i for i in rows if samplers[i].params.top_k and samplers[i].params.top_k <= CANDIDATE_LIMIT]
    if short:
        picked = scores if short == list(range(scores.shape[0])) else scores[short]
        out.update(_candidate_draws(picked, short, [samplers[i].params for i in short]))
    full = [i for i in rows if i not in out]
    if full:
        probs = warp(scores[full], [samplers[i].params for i in full]).softmax(dim=-1).cpu()  # [n_full, V]
        out.update((i, Draw(None, probs[row])) for row, i in enumerate(full))
    return out


def _candidate_draws(scores: torch.Tensor, rows: Sequence[int], params: Sequence[SamplingParams]) -> dict[int, Draw]:
    """`draws` for top-k rows: scores [s, V] -> {row: Draw over its candidates}.

    The rows' k_max + 1 best scores are tempered (the same division, element by element, as the
    whole row's); a row whose (k_max + 1)-th still reaches its k-th best has ties past them, and
    takes its candidates from its whole row instead."""
    vocab = scores.shape[-1]
    ks = torch.tensor([min(p.top_k, vocab) for p in params], device=scores.device)
    width = min(int(ks.max()) + 1, vocab)
    raw, index = torch.topk(scores, width, dim=-1)  # [s, width] best first
    values = _tempered(raw, params)
    kth = values.gather(1, (ks - 1)[:, None])  # [s, 1]: the row's k-th best, whatever k_max
    inside = (values >= kth) & (values > -float("inf"))  # [s, width] (a grammar's -inf tokens have no chance)
    ids, order = torch.where(inside, index, vocab).sort(dim=-1)  # [s, width]: ascending ids, then `vocab`s
    values = values.gather(1, order).masked_fill(ids == vocab, -float("inf"))  # in the order of ids
    counts, past = inside.sum(dim=-1).tolist(), (inside[:, -1] & (width < vocab)).tolist()
    own: list[tuple[torch.Tensor, torch.Tensor]] = []  # each row's (ids [C] ascending, tempered scores [C])
    for row, (count, tied_past) in enumerate(zip(counts, past)):
        if count and not tied_past:
            own.append((ids[row, :count], values[row, :count]))
            continue
        whole = _tempered(scores[row][None], [params[row]])[0]  # [V]
        keep = (whole >= kth[row]) & (whole > -float("inf")) if count else torch.ones_like(whole, dtype=torch.bool)
        own.append((keep.nonzero().flatten(), whole[keep]))
    groups: dict[int, list[int]] = {}
    for row, (row_ids, _) in enumerate(own):
        groups.setdefault(max(16, 1 << (len(row_ids) - 1).bit_length()), []).append(row)
    out: dict[int, Draw] = {}
    for size, group in groups.items():  # [g, size]: each row's candidates, padded with -inf
        picked = torch.stack([torch.nn.functional.pad(own[r][1], (0, size - len(own[r][1])), value=-float("inf"))
                              for r in group])
        probs = _cut(picked, [params[r] for r in group]).softmax(dim=-1).cpu()
        for j, row in enumerate(group):
            out[rows[row]] = Draw(own[row][0].cpu(), probs[j, : len(own[row][0])])
    return out


def probabilities(logits: torch.Tensor, samplers: Sequence[BranchSampler]) -> torch.Tensor:
    """The distribution each row draws from: processors, then softmax. logits [n, V] -> [n, V]
    float32 on the CPU; a sampled row's is exactly the one `choose_tokens` draws from (`draws`)."""
    scores = constrain(logits.float(), samplers)
    sampled = [i for i, s in enumerate(samplers) if s.params.do_sample]
    if not sampled:
        return scores.softmax(dim=-1).cpu()
    probs = torch.empty(scores.shape, dtype=torch.float32)  # [n, V] on the CPU
    plain = [i for i, s in enumerate(samplers) if not s.params.do_sample]
    if plain:
        probs[plain] = scores[plain].softmax(dim=-1).cpu()
    for i, draw in draws(scores, samplers, sampled).items():
        probs[i] = draw.over(scores.shape[-1])
    return probs


def choose_tokens(logits: torch.Tensor, samplers: Sequence[BranchSampler]) -> list[int]:
    """Pick one token per row: arg-max for greedy rows, a draw from the row's generator otherwise.

    logits [n, V] (any float dtype; processed in float32). A row with top-k is warped and drawn
    among its own top-k candidates only (`draws`); a row without, over the whole vocabulary. Which
    way a row goes, and its draw, depend on that row alone, so a seeded branch gives the same
    tokens whatever runs beside it. Draws happen on the
    CPU, so a seed gives the same random stream on every device (the logits themselves may differ
    slightly between devices).
    """
    if logits.shape[0] > SAMPLING_ROWS:  # rows a slice at a time: the scratch stays small, no row changes
        return [token for start in range(0, logits.shape[0], SAMPLING_ROWS)
                for token in choose_tokens(logits[start : start + SAMPLING_ROWS], samplers[start : start + SAMPLING_ROWS])]
    scores = constrain(logits.float(), samplers)
    chosen = scores.argmax(dim=-1).tolist()
    ended = {i for i, s in enumerate(samplers) if s.grammar is not None and s.grammar.complete}
    for i in ended:  # the eos alone is allowed: it comes whatever the logits say (a model's -inf eos too)
        chosen[i] = samplers[i].grammar.compiled.eos_id
    sampled = [i for i, s in enumerate(samplers) if s.params.do_sample and i not in ended]
    for i, draw in draws(scores, samplers, sampled).items():
        chosen[i] = draw.sample(samplers[i].generator)
    for token, sampler in zip(chosen, samplers):
        sampler.observe(token)
    return chosen
