"""Shared cases for the speculation tests (speculation, draft model, lookahead, suffix decoding).

- `run` / `outputs`: a forest started with `start_forest` on a fixed cost curve (`FLAT`: no
  timing in tests) and finished; its branches' token ids.
- Model-free cases on `hash_lm.HashLM`: `HASH_PREFIX` (it repeats, so lookup finds matches),
  `HASH_BRANCHES`, `hash_expected` (the sequential rule's outputs) and `cut_at_stop` (texts as
  sequential decoding returns them with a stop string).
- Tiny transformers cases: `PREFIX` (built from `BASE`, repeated), `BRANCHES`, `STEPS` (longer
  than the sliding window) and `tiny_references` (what `generate` gives, never stopping early:
  `NO_EOS`, from `tiny_models`, is an id no model produces). The (arch, attn) parameters are
  `tiny_models.combos()`.
- Sampling: `SAMPLE_PREFIX`, temperature `T`, `tiny_softmax` (the tiny Llama's next-token
  distribution at T), `frequencies_pass` (a chi-square test of drawn tokens against it),
  `sampled_run` / `sample_three_tokens` (seeded samples of the tiny Llama with a drafter) and
  `trusting_rule` (the control: a rule that trusts the draft, which these checks must catch).

The token lists come from fixed seeds, so every module sees the same cases.
"""

from __future__ import annotations

import random

import numpy as np
import torch
from hash_lm import HashLM, LetterTokenizer, reference
from scipy.stats import chisquare
from tiny_models import NO_EOS, VOCAB, reference_generate, tiny_model

from multidecode.api import start_forest
from multidecode.cost import CostCurve
from multidecode.sampling_params import SamplingParams, per_branch_sampling

FLAT = CostCurve.from_relative({1: 1.0, 2: 1.02, 64: 1.5, 512: 4.0})
"""A GPU-like cost curve: extra rows are nearly free, so "auto" drafts whatever has a chance."""


def run(model, prefix, branches, *, speculate, max_new_tokens, eos=(), sampling=None, tokenizer=None, stop=(),
        compaction=None, cost=FLAT):
    """`start_forest` with a fixed cost curve (no timing in tests); returns the finished run."""
    forest = start_forest(model, prefix, branches, max_new_tokens=max_new_tokens, eos_token_id=list(eos),
                          sampling=sampling or [SamplingParams()] * len(branches), tokenizer=tokenizer, stop=stop,
                          speculate=speculate, compaction=compaction, cost=cost)
    return forest.finish()


def outputs(forest) -> list[list[int]]:
    return [list(b.output.token_ids) for b in forest.branches]


# ---------------------------------------------------------------------- model-free: HashLM
_rng = random.Random(7)
HASH_PREFIX = [_rng.randrange(3, 48) for _ in range(5)] * 3  # repeats, so lookup finds matches
HASH_BRANCHES = [[], [5, 6, 7], HASH_PREFIX[:4], [9]]


def cut_at_stop(texts, stop: str) -> list[str]:
    """Each text as sequential decoding returns it with stop string `stop`: cut before it."""
    return [text[: text.index(stop)] if stop in text else text for text in texts]


def hash_expected(prefix, branches, steps, eos=frozenset()):
    return [reference(prefix + b, steps, set(eos)) for b in branches]


def check_stops_and_eos_inside_drafts(spec_of) -> None:
    """On the hash LM with a proposer whose drafts are all right (`spec_of()`: a fresh
    `Speculation`): a stop string and an eos land inside accepted drafts, and the text and tokens
    are cut where sequential decoding cuts them."""
    tokenizer = LetterTokenizer()
    full = hash_expected(HASH_PREFIX, HASH_BRANCHES, 40)
    stop = tokenizer.decode(full[0][6:8])
    forest = run(HashLM(), HASH_PREFIX, HASH_BRANCHES, speculate=spec_of(), max_new_tokens=40, tokenizer=tokenizer,
                 stop=[stop])
    assert [b.output.text for b in forest.branches] == cut_at_stop([tokenizer.decode(out) for out in full], stop)
    assert forest.branches[0].output.finish_reason == "stop"
    eos = {full[1][9]}
    forest = run(HashLM(), HASH_PREFIX, HASH_BRANCHES, speculate=spec_of(), max_new_tokens=40, eos=eos)
    assert outputs(forest) == hash_expected(HASH_PREFIX, HASH_BRANCHES, 40, eos)
    assert forest.stats.accepted > 0


# ---------------------------------------------------------------------- tiny transformers models
_trng = random.Random(11)
BASE = [_trng.randrange(3, VOCAB) for _ in range(5)]
PREFIX = BASE * 2 + [_trng.randrange(3, VOCAB) for _ in range(3)]
BRANCHES = [[], BASE[:3], [_trng.randrange(3, VOCAB) for _ in range(4)], [_trng.randrange(3, VOCAB) for _ in range(7)]]
STEPS = 20  # longer than the sliding window (6) of mistral, gemma3 and qwen2-hybrid


def check_exact_with_eos_and_compaction(model, full, spec_of) -> None:
    """A run of `model` with `spec_of()` (a fresh `Speculation`) gives `full` (what `generate` gives,
    never stopping early) and drafts; with eos ids picked inside the run and finished branches
    compacted out at every step, it gives `full` cut at them."""
    from eos_cases import pick_eos, truncate

    from multidecode.scheduler import CompactionPolicy

    forest = run(model, PREFIX, BRANCHES, speculate=spec_of(), max_new_tokens=STEPS, eos=[NO_EOS])
    assert outputs(forest) == full
    assert forest.stats.drafted > 0
    eos = set(pick_eos(full, STEPS))
    forest = run(model, PREFIX, BRANCHES, speculate=spec_of(), max_new_tokens=STEPS, eos=eos,
                 compaction=CompactionPolicy(every=1))
    assert outputs(forest) == truncate(full, eos)


def tiny_references(arch, attn, branches=BRANCHES, steps=STEPS):
    model = tiny_model(arch, attn)
    return [reference_generate(model, PREFIX + b, max_new_tokens=steps, eos_token_id=NO_EOS) for b in branches]


# ---------------------------------------------------------------------- sampling: chi-square
SAMPLE_PREFIX = PREFIX[:8]
T = 0.4


def frequencies_pass(draws: list[int], probs: np.ndarray) -> bool:
    """Whether a chi-square test (p > 1e-3) accepts `draws` as samples of `probs` (tokens expected
    fewer than 5 times pooled; a draw of a token of probability 0 fails outright)."""
    counts = np.bincount(draws, minlength=len(probs))
    if counts[probs == 0].sum():
        return False
    expected = probs * len(draws)
    big = expected >= 5
    f_obs = np.append(counts[big], counts[~big].sum())
    f_exp = np.append(expected[big], expected[~big].sum())
    if f_exp[-1] == 0:
        f_obs, f_exp = f_obs[:-1], f_exp[:-1]
    return chisquare(f_obs, f_exp).pvalue > 1e-3


def tiny_softmax(tokens: list[int]) -> np.ndarray:
    """The tiny Llama's next-token distribution after `tokens`, at temperature T."""
    model = tiny_model("llama", "sdpa")  # made outside inference mode: the cached model is shared
    with torch.inference_mode():
        logits = model(torch.tensor([tokens])).logits[0, -1].double()
    return torch.softmax(logits / T, -1).numpy()


def sampled_run(draws: int, max_new_tokens: int, spec_of):
    """`draws` seeded samples of `max_new_tokens` tokens from the tiny Llama after SAMPLE_PREFIX at
    temperature T, drafted by `spec_of(model)`: the finished run (its outputs and its stats)."""
    model = tiny_model("llama", "sdpa")
    return start_forest(
        model, SAMPLE_PREFIX, [[]] * draws, max_new_tokens=max_new_tokens, eos_token_id=[NO_EOS],
        sampling=per_branch_sampling(draws, dict(do_sample=True, temperature=T, seed=0)),
        speculate=spec_of(model)).finish()


def sample_three_tokens(draws: int, spec_of) -> tuple[list[int], list[list[int]], object]:
    """`sampled_run` of 3 tokens (learned heads draft from the second step on, after the first
    forward gave them a hidden state): the second tokens of the samples whose first token is the
    likeliest one, every sample's tokens, and the run's stats."""
    run_ = sampled_run(draws, 3, spec_of)
    out = outputs(run_)
    first = int(tiny_softmax(SAMPLE_PREFIX).argmax())
    seconds = [o[1] for o in out if o[0] == first]
    return seconds, out, run_.stats


def trusting_rule(p, q, candidates, generator) -> int:
    """The control of the sampling tests, put in place of `verify.speculative_sample`: take the
    draft's first candidate whenever the target gives it 5% or more (else draw from p). Its tokens
    do not follow p, so a check that passes the real rule must fail this one."""
    if p[candidates[0]] >= 0.05:
        return int(candidates[0])
    return int(torch.multinomial(p, 1, generator=generator))
