"""A branch's sampling settings and their checks (`SamplingParams`, `per_branch_sampling`), apart
from `sampling` (which chooses tokens, with torch): a command sent to a server (`--server`) checks
and reads its settings here before any torch is loaded, so it refuses what the library refuses, in
the same words, and decides greedy or sampled as the library does."""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from numbers import Real

from .errors import COUNT_LIMIT, InvalidArgument, InvalidInput, check_flag, is_int

SAMPLING_KEYS = ("do_sample", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "logit_bias", "seed")
"""Every setting `per_branch_sampling` takes."""
SAMPLING_SWITCHES = ("temperature", "top_k", "top_p", "min_p", "seed")
"""Settings that turn sampling on where `do_sample` is not given; the rest (penalties, bias) change
greedy branches' logits too and never turn sampling on by themselves."""
TINIEST_TEMPERATURE = 1e-30
"""The smallest temperature taken: logits (at most about 1e4 in size) divided by it stay finite in
float32 (below float32's smallest normal number, 1.2e-38, they reach infinity and the draw fails)."""


def divides_logits(temperature: float) -> bool:
    """Whether float32 logits can be divided by `temperature` and still give a distribution: from
    `TINIEST_TEMPERATURE` to a finite number (the library's, the server's and the command's rule)."""
    return TINIEST_TEMPERATURE <= temperature < float("inf")


def greedy_temperature(value) -> bool:
    """Whether a temperature asks for greedy decoding: 0, as OpenAI's API reads it (whatever else
    is given, `do_sample` too)."""
    return isinstance(value, Real) and not isinstance(value, bool) and value == 0


def switches_given(settings: dict) -> list[str]:
    """The `SAMPLING_SWITCHES` that `settings` (one value each) give and that ask for sampling:
    top_k 0 is off and temperature 0 greedy, so neither does."""
    return [key for key in SAMPLING_SWITCHES if settings.get(key) is not None
            and not (key == "top_k" and settings[key] == 0) and not (key == "temperature" and greedy_temperature(settings[key]))]


MAX_PENALTY = 2.0
"""presence_penalty and frequency_penalty lie in [-MAX_PENALTY, MAX_PENALTY] (OpenAI's range)."""
SEED_LIMIT = 2**64
"""Seeds lie in [0, SEED_LIMIT): a branch's draws come from a generator seeded from it (`seeded_generator`)."""
MAX_BIAS = 100.0
"""A logit bias lies in [-MAX_BIAS, MAX_BIAS] (OpenAI's range): +100 all but forces a token, -100 bans it."""


@dataclass(frozen=True)
class SamplingParams:
    """How one branch picks its tokens. The defaults are greedy decoding.

    logit_bias: {token id: bias}; kept as a tuple of (token id, bias) pairs sorted by id, so that
    params stay hashable and compare by value.
    """

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        check_flag("do_sample", self.do_sample)
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, Real)):
                raise InvalidArgument(f"{name} must be a number, got {value!r}", "pass it as a float, or leave it unset")
        if self.seed is not None and not (is_int(self.seed) and 0 <= self.seed < SEED_LIMIT):
            raise InvalidArgument(f"seed must be an integer from 0 to 2**64 - 1, got {self.seed!r}",
                                  "branch i uses seed + i, which must stay in that range too")
        # None: unset, as generate(temperature=None) and transformers read it; 0 without do_sample:
        # greedy, as OpenAI's API reads it (no division)
        if self.temperature is None or self.temperature == 0 and not self.do_sample:
            object.__setattr__(self, "temperature", 1.0)
        if math.isnan(self.temperature):
            raise InvalidArgument("temperature must be a number, got nan", "0.7 samples, for example; 0 is greedy")
        if not self.temperature > 0:
            raise InvalidArgument(f"temperature must be > 0 to sample, got {self.temperature}",
                                  "for greedy decoding give temperature=0 without do_sample=True, or do_sample=False")
        if not divides_logits(self.temperature):  # logits / it overflow float32: no distribution
            raise InvalidArgument(f"temperature {self.temperature} is outside what float32 logits can be divided by",
                                  f"use a temperature from {TINIEST_TEMPERATURE:g} to a finite number, or greedy "
                                  "decoding (do_sample=False) for the arg-max")
        if is_int(self.top_k) and self.top_k == 0:  # off, as transformers and the server read it
            object.__setattr__(self, "top_k", None)
        if self.top_k is not None and (not is_int(self.top_k) or not 1 <= self.top_k < COUNT_LIMIT):
            raise InvalidArgument(f"top_k must be 0 (off) or a positive integer below 2**63, got {self.top_k!r}",
                                  "0, or leaving it unset, turns it off")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise InvalidArgument(f"top_p must be in (0, 1], got {self.top_p}",
                                  "1, or leaving it unset, turns it off; 0.9 samples from the likeliest tokens "
                                  "that make up 90% of the probability")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise InvalidArgument(f"min_p must be in [0, 1], got {self.min_p}",
                                  "0, or leaving it unset, turns it off; 0.05 drops tokens under 5% of the "
                                  "likeliest one's probability")
        if self.repetition_penalty is not None and not self.repetition_penalty > 0:
            raise InvalidArgument(f"repetition_penalty must be > 0, got {self.repetition_penalty}",
                                  "1 (or leaving it unset) turns it off; above 1 penalizes repeats, e.g. 1.2")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value is not None and not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise InvalidArgument(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}",
                                      "0 turns it off")
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        for name in ("seed", "top_k"):  # NumPy integers pass the checks; torch's generator takes Python ints only
            if getattr(self, name) is not None:
                object.__setattr__(self, name, int(getattr(self, name)))

    @property
    def penalized(self) -> bool:
        """Whether a penalty or a logit bias changes this branch's logits (greedy or not)."""
        return (self.repetition_penalty not in (None, 1.0) or bool(self.presence_penalty)
                or bool(self.frequency_penalty) or bool(self.logit_bias))


def _bias_pairs(bias) -> tuple[tuple[int, float], ...] | None:
    """A logit bias ({token id: bias}, or (token id, bias) pairs) as sorted pairs, checked; None if empty."""
    if bias is None:
        return None
    if isinstance(bias, Mapping):
        pairs = list(bias.items())
    elif isinstance(bias, (list, tuple)) and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in bias):
        pairs = [tuple(p) for p in bias]
    else:
        raise InvalidArgument(f"logit_bias must map token ids to biases, got {bias!r}", "e.g. {13: 5.0, 198: -100}")
    for token, value in pairs:
        if not is_int(token) or token < 0:
            raise InvalidArgument(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
        if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value) \
                or not -MAX_BIAS <= value <= MAX_BIAS:
            raise InvalidArgument(f"the logit bias of token {token} must be a number in [-{MAX_BIAS:g}, {MAX_BIAS:g}], "
                                  f"got {value!r}", "+100 all but forces a token, -100 bans it")
    if len({int(t) for t, _ in pairs}) != len(pairs):
        raise InvalidArgument("logit_bias names a token id twice")
    return tuple(sorted((int(t), float(v)) for t, v in pairs)) or None


def check_vocabulary(params: Sequence[SamplingParams], vocab_size: int, *, whose: str = "branch {}",
                     first: int = 0) -> None:
    """Refuse a logit bias on a token id the model does not have; whose: how to name the params
    numbered from `first` (a batch line's questions count from 1)."""
    for i, p in enumerate(params, start=first):
        bad = [t for t, _ in p.logit_bias or () if t >= vocab_size]
        if bad:
            raise InvalidArgument(f"logit_bias of {whose.format(i)} names token id {bad[0]}, outside the model's "
                                  f"vocabulary of {vocab_size}", "tokenize with this model's tokenizer")


def check_branch_seeds(seed, n: int) -> None:
    """Refuse one `seed` for `n` branches (branch i is seeded seed + i) where it is no integer, or
    where the seed is in range but the last branch's is not (the seed's own range is `SamplingParams`')."""
    if not is_int(seed):
        raise InvalidArgument(f"seed must be an integer, got {seed!r}", "for example seed=0")
    if 0 <= seed < SEED_LIMIT <= seed + n - 1:
        raise InvalidArgument(f"seed {seed} gives the last of {n} branches the seed {seed} + {n - 1}, past "
                              "2**64 - 1 (branch i is seeded seed + i)", f"use a seed of at most 2**64 - {n}")


def drawn_seed() -> int:
    """A random base seed, for branches that sample without one (31 bits: easy to retype)."""
    return secrets.randbits(31)


NEUTRAL = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "top_k": 0}
"""The settings at the value that turns them off. Not a top_p of 1 or a min_p of 0: cutting nothing,
they still ask for sampling (`switches_given`), which a job without them would not do."""


def without_neutral(sampling: Mapping) -> dict:
    """`sampling` without the settings that change no token, whatever a batch line adds over them:
    a penalty or top_k that is off (`NEUTRAL`), a logit bias of zeros (adding 0 to a logit leaves
    its bits). Two spellings of one decoding,
    `--repetition-penalty 1` and nothing, say, then compare equal. Greedy spelled out (do_sample
    False, temperature 0) is kept: a line with sampling settings of its own decodes greedily under
    it and samples without it."""
    def neutral(key: str, value) -> bool:
        if key == "logit_bias":
            return isinstance(value, Mapping) and all(bias == 0 for bias in value.values())
        return key in NEUTRAL and isinstance(value, Real) and not isinstance(value, bool) and value == NEUTRAL[key]

    return {key: value for key, value in sampling.items() if not neutral(key, value)}


def per_branch_sampling(n: int, sampling: dict) -> list[SamplingParams]:
    """Expand sampling settings (each a value for all branches, or a list of n) into n params.

    A single `seed` s gives branch i the seed s + i; a list gives each branch its own. Where
    branches sample and no seed is given, a base seed is drawn at random (`drawn_seed`) and used
    as if given; a sampled branch a list leaves None draws one of its own: every sampled branch
    reports the seed that reproduces it. A `logit_bias` is one
    {token id: bias} for all branches, or a list of n (None for none).
    """
    unknown = set(sampling) - set(SAMPLING_KEYS)
    if unknown:
        raise InvalidInput(f"unknown setting(s) {', '.join(sorted(unknown))}: neither an argument of this call nor a "
                           "sampling setting", f"the call's arguments are in its docstring; the sampling settings are "
                           f"{', '.join(SAMPLING_KEYS)}")
    columns: dict[str, list] = {}
    for key, value in sampling.items():
        per_branch = isinstance(value, (list, tuple))
        if key == "logit_bias" and per_branch:  # a list of maps is one per branch; (id, bias) pairs are one bias
            per_branch = all(v is None or isinstance(v, Mapping) for v in value)
        if per_branch:
            if len(value) != n:
                raise InvalidInput(f"{key} has {len(value)} values for {n} branches", "give one value, or one per branch (a question, a completion or a prompt each)")
            columns[key] = list(value)
        elif key == "seed" and value is not None:
            check_branch_seeds(value, n)
            columns[key] = [value + i for i in range(n)]
        else:
            columns[key] = [value] * n
    if "do_sample" not in columns:
        # Asking for a temperature, top-k/p, min-p or a seed means sampling (top_k 0, off, does not).
        columns["do_sample"] = [bool(switches_given({k: v[i] for k, v in columns.items()})) for i in range(n)]
    _greedy_at_zero(columns, n)
    seeds = columns.get("seed", [None] * n)
    if all(seed is None for seed in seeds) and any(columns["do_sample"]):
        base = drawn_seed()
        columns["seed"] = [base + i for i in range(n)]
    elif any(seed is None and sample for seed, sample in zip(seeds, columns["do_sample"])):
        # A list with gaps: each sampled branch it leaves unseeded draws a seed of its own, reported too.
        columns["seed"] = [drawn_seed() if seed is None and sample else seed
                           for seed, sample in zip(seeds, columns["do_sample"])]
    params = []
    for i in range(n):
        kwargs = {k: v[i] for k, v in columns.items() if v[i] is not None}
        params.append(SamplingParams(**kwargs))
    return params


def _greedy_at_zero(columns: dict[str, list], n: int) -> None:
    """A branch at temperature 0 decodes greedily, as OpenAI's API and llama.cpp read it: it samples
    nothing and has no seed, whatever else it names (`do_sample` too: `complete` samples by default);
    its penalties and bias stay."""
    greedy = [greedy_temperature(t) for t in columns.get("temperature", [None] * n)]
    if any(greedy):
        columns["do_sample"] = [sample and not zero for sample, zero in zip(columns["do_sample"], greedy)]
        for key in SAMPLING_SWITCHES:
            if key in columns:
                columns[key] = [None if zero else value for value, zero in zip(columns[key], greedy)]


__all__ = ["MAX_BIAS", "MAX_PENALTY", "NEUTRAL", "SAMPLING_KEYS", "SAMPLING_SWITCHES", "SEED_LIMIT", "TINIEST_TEMPERATURE", "SamplingParams", "check_vocabulary", "divides_logits", "drawn_seed", "greedy_temperature", "per_branch_sampling", "switches_given", "without_neutral"]
