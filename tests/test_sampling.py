"""Choosing tokens: per-row processors equal transformers' own, seeded branches do not depend on
their neighbours, and sampled first tokens follow the processed softmax (chi-square)."""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from tiny_models import reference_generate, tiny_model
from transformers import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import multidecode
from multidecode import CompactionPolicy, SamplingParams
from multidecode.api import stream_decode
from multidecode.errors import InvalidArgument
from multidecode.sampling import (
    BranchSampler,
    apply_min_p,
    apply_repetition_penalty,
    apply_temperature,
    apply_top_k,
    apply_top_p,
    choose_tokens,
    process_logits,
)
from multidecode.sampling_params import per_branch_sampling

VOCAB = 50
ROWS = 6


def random_logits(seed: int = 0) -> torch.Tensor:
    """[ROWS, VOCAB] float32 logits with a realistic spread."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(ROWS, VOCAB, generator=g) * 3


def column(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)[:, None]


def same(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """Equal values, with -inf in the same places."""
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


# ---------------------------------------------------------------------- processors vs transformers
def test_temperature_per_row_equals_transformers():
    logits = random_logits(1)
    temps = [0.5, 1.0, 2.0, 0.7, 1.3, 1.0]
    ours = apply_temperature(logits, column(temps))
    for i, t in enumerate(temps):
        same(ours[i : i + 1], TemperatureLogitsWarper(t)(None, logits[i : i + 1]))


def test_top_k_per_row_equals_transformers():
    """Each row keeps its own k (k above the vocabulary keeps all); k = 0 leaves a row untouched."""
    logits = random_logits(2)
    ks = [0, 1, 5, VOCAB, 3 * VOCAB, 3]
    ours = apply_top_k(logits, torch.tensor(ks))
    for i, k in enumerate(ks):
        theirs = logits[i : i + 1] if k == 0 else TopKLogitsWarper(k)(None, logits[i : i + 1])
        same(ours[i : i + 1], theirs)


@pytest.mark.parametrize(
    "ours_fn, theirs_cls, values",
    [
        (apply_top_p, TopPLogitsWarper, [1.0, 0.9, 0.5, 0.1, 0.999, 0.3]),  # top_p = 1 is a no-op
        (apply_min_p, MinPLogitsWarper, [0.0, 0.05, 0.2, 0.5, 1.0, 0.1]),  # min_p = 0 is a no-op
    ],
    ids=["top_p", "min_p"],
)
def test_nucleus_and_min_p_per_row_equal_transformers(ours_fn, theirs_cls, values):
    """Each row uses its own threshold; the first value of each list leaves its row untouched."""
    logits = random_logits(3)
    ours = ours_fn(logits, column(values))
    for i, value in enumerate(values):
        same(ours[i : i + 1], theirs_cls(value)(None, logits[i : i + 1]))
    same(ours[0], logits[0])


def test_repetition_penalty_per_row_equals_transformers():
    """Seen tokens: negative logits times the penalty, positive ones divided; penalty 1 is a no-op."""
    logits = random_logits(5)
    penalties = [1.0, 1.2, 0.8, 2.0, 1.5, 1.0]
    g = torch.Generator().manual_seed(5)
    history = [torch.randint(0, VOCAB, (12,), generator=g) for _ in range(ROWS)]
    seen = torch.zeros(ROWS, VOCAB, dtype=torch.bool)
    for i, ids in enumerate(history):
        seen[i, ids] = True
    ours = apply_repetition_penalty(logits, seen, column(penalties))
    for i, p in enumerate(penalties):
        same(ours[i : i + 1], RepetitionPenaltyLogitsProcessor(p)(history[i][None], logits[i : i + 1]))


MIXED = [
    SamplingParams(),  # greedy
    SamplingParams(repetition_penalty=1.3),  # greedy with a penalty
    SamplingParams(do_sample=True, temperature=0.7, top_k=8, top_p=0.9, min_p=0.05, repetition_penalty=1.2, seed=1),
    SamplingParams(do_sample=True, seed=2),  # plain sampling: nothing warps this row
    SamplingParams(do_sample=True, temperature=1.5, top_p=0.5, seed=3),
    SamplingParams(do_sample=True, top_k=3, min_p=0.2, repetition_penalty=0.9, seed=4),
]


def transformers_processors(params: SamplingParams) -> LogitsProcessorList:
    """The processors generate() would build for `params`, in its order."""
    procs = LogitsProcessorList()
    if params.repetition_penalty not in (None, 1.0):
        procs.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    if params.do_sample:
        if params.temperature != 1.0:
            procs.append(TemperatureLogitsWarper(params.temperature))
        if params.top_k:
            procs.append(TopKLogitsWarper(params.top_k))
        if params.top_p is not None and params.top_p < 1:
            procs.append(TopPLogitsWarper(params.top_p))
        if params.min_p:
            procs.append(MinPLogitsWarper(params.min_p))
    return procs


def test_process_logits_mixed_rows_equal_transformers():
    """One batched call over rows with different (or no) processors equals running transformers'
    processor list for each row alone, greedy rows getting only the repetition penalty."""
    logits = random_logits(6)
    contexts = [[(7 * i + j) % VOCAB for j in range(10)] for i in range(ROWS)]
    samplers = [BranchSampler(p, ctx) for p, ctx in zip(MIXED, contexts)]
    ours = process_logits(logits, samplers)
    for i, (params, ctx) in enumerate(zip(MIXED, contexts)):
        theirs = transformers_processors(params)(torch.tensor([ctx]), logits[i : i + 1].clone())
        same(ours[i : i + 1], theirs)


def test_greedy_rows_take_the_arg_max_after_the_penalty():
    logits = random_logits(7)
    samplers = [BranchSampler(p, [int(logits[i].argmax())]) for i, p in enumerate(MIXED)]
    chosen = choose_tokens(logits, samplers)
    expected_first = int(logits[0].argmax())
    penalized = RepetitionPenaltyLogitsProcessor(1.3)(logits[1:2].argmax(-1, keepdim=True), logits[1:2].clone())
    assert chosen[0] == expected_first
    assert chosen[1] == int(penalized.argmax())


def test_sampled_tokens_stay_inside_the_kept_set():
    """A row with top_k = 3 only ever draws one of its 3 best tokens."""
    logits = random_logits(8)[:1].repeat(200, 1)
    samplers = [BranchSampler(SamplingParams(do_sample=True, top_k=3, seed=s)) for s in range(200)]
    chosen = set(choose_tokens(logits, samplers))
    assert chosen <= set(logits[0].topk(3).indices.tolist())
    assert len(chosen) > 1


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=0.0, do_sample=True), dict(temperature=-0.5), dict(top_k=-1), dict(top_k=1.5), dict(top_p=0.0), dict(top_p=1.5), dict(min_p=-0.1),
        dict(repetition_penalty=0.0),
        dict(temperature=1e-40), dict(temperature=float("inf")),  # passed, then torch's 'probability tensor contains inf'
        dict(temperature=float("nan"), do_sample=True),
    ],
)
def test_bad_sampling_params_raise(kwargs):
    with pytest.raises(InvalidArgument):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs", [dict(do_sample=True, temperature="hot"), dict(repetition_penalty=0.0),
                                    dict(do_sample=True, top_k=-1), dict(top_p=2.0), dict(min_p=1.5)])
def test_every_refused_setting_has_a_hint(kwargs):
    """A string temperature and repetition_penalty=0 were refused with no hint at all."""
    with pytest.raises(InvalidArgument) as caught:
        SamplingParams(**kwargs)
    assert caught.value.hint


def test_a_temperature_of_none_is_the_default_as_in_generate():
    """SamplingParams(temperature=None) was a TypeError; generate(temperature=None) the default."""
    assert SamplingParams(do_sample=True, temperature=None, seed=1) == SamplingParams(do_sample=True, seed=1)


def test_a_temperature_that_is_no_number_is_not_told_about_greedy_decoding():
    """nan was 'temperature must be > 0 to sample', with a hint on how to decode greedily."""
    with pytest.raises(InvalidArgument, match="temperature must be a number, got nan") as caught:
        SamplingParams(do_sample=True, temperature=float("nan"))
    assert "do_sample" not in caught.value.hint


def test_temperature_zero_is_greedy_as_openai_reads_it():
    """The server and the command line read temperature 0 as greedy; the library refused it, with a
    hint (leave it out) that made `complete` sample at temperature 1."""
    assert SamplingParams(temperature=0) == SamplingParams()
    assert SamplingParams(do_sample=True, top_k=0) == SamplingParams(do_sample=True)  # off, as in transformers
    assert per_branch_sampling(1, {"top_k": 0}) == [SamplingParams()]  # and asks for no sampling
    for settings in ({"temperature": 0}, {"temperature": 0, "do_sample": True, "top_p": 0.5, "seed": 3}):
        assert per_branch_sampling(2, settings) == [SamplingParams()] * 2
    mixed = per_branch_sampling(3, {"temperature": [0.7, 0, 1.0], "seed": 10})
    assert [(p.do_sample, p.temperature, p.seed) for p in mixed] == [(True, 0.7, 10), (False, 1.0, None), (True, 1.0, 12)]


def test_a_tiny_temperature_after_a_strong_penalty_still_draws():
    """repetition_penalty=1e-9 then temperature=1e-30 carried logits past float32: torch's
    'probability tensor contains either inf, nan or element < 0'. The draw is now the arg-max."""
    logits = torch.tensor([[2.0, -1.0, 3.0, 0.5]])
    for penalty, drawn in ((1e-9, {2}), (1e-40, {0, 2, 3})):  # 1e-40 takes every positive logit to infinity
        params = SamplingParams(do_sample=True, temperature=1e-30, repetition_penalty=penalty, seed=1)
        sampler = BranchSampler(params, context=[0, 1, 2, 3])
        assert set(choose_tokens(logits, [sampler])) <= drawn


# ---------------------------------------------------------------------- seeds and neighbours
ARCH, ATTN = "llama", "sdpa"
PREFIX = [17, 33, 95, 4, 250, 61, 78, 140]
STEPS = 12
TARGET = [40, 41]
SEEDED = SamplingParams(do_sample=True, temperature=0.8, top_k=20, seed=7)


def run(branches, sampling, **kwargs) -> list[list[int]]:
    out = [[] for _ in branches]
    model = tiny_model(ARCH, ATTN)
    for event in stream_decode(model, PREFIX, branches, max_new_tokens=STEPS, sampling=sampling,
                               eos_token_id=kwargs.pop("eos_token_id", 256), **kwargs):
        out[event.branch].append(event.token_id)
    return out


@pytest.mark.xdist_group("sampling")
def test_seeded_branch_does_not_depend_on_its_neighbours():
    """A branch sampled with seed s gives the same tokens alone, first or last among others,
    beside greedy and other sampled branches, and when neighbours stop early and get compacted."""
    (alone,) = run([TARGET], [SEEDED])
    assert len(alone) == STEPS
    others = [SamplingParams(do_sample=True, temperature=1.5, seed=99), SamplingParams(),
              SamplingParams(do_sample=True, top_p=0.5, seed=3)]
    out = run([[5, 6, 7], TARGET, [], [8]], [others[0], SEEDED, others[1], others[2]])
    assert out[1] == alone
    out = run([[9], [], TARGET], [others[2], others[0], SEEDED])
    assert out[2] == alone


@pytest.mark.xdist_group("sampling")
def test_seeded_branch_unchanged_when_neighbours_stop_and_are_compacted():
    """Neighbours that stop on eos early and are compacted out of the cache do not change a
    seeded branch's tokens."""
    (alone,) = run([TARGET], [SEEDED])
    others = [SamplingParams(do_sample=True, top_p=0.5, seed=3),
              SamplingParams(do_sample=True, temperature=1.5, seed=99)]
    free = run([[9], [], TARGET], [*others, SEEDED])
    stops = [t for t in free[0][:2] + free[1][:2] if t not in alone]
    assert stops
    out = run([[9], [], TARGET], [*others, SEEDED], eos_token_id=stops, compaction=CompactionPolicy(every=1))
    assert out[2] == alone
    assert min(len(o) for o in out) < STEPS


@pytest.mark.xdist_group("sampling")
def test_seeds_matter_and_repeat():
    """The same seed gives the same tokens twice; another seed gives other tokens."""
    (first,) = run([TARGET], [SEEDED])
    (again,) = run([TARGET], [SEEDED])
    (other,) = run([TARGET], [SamplingParams(do_sample=True, temperature=0.8, top_k=20, seed=8)])
    assert first == again
    assert first != other


def test_a_seed_list_with_gaps_gives_every_sampled_branch_a_seed_it_reports():
    """seed=[5, None, None]: the branches left unseeded draw seeds of their own, so each reports the
    seed that reproduces it (the gaps sampled from a seed no one saw, and reported None, as greedy);
    a greedy branch keeps none."""
    from multidecode.sampling_params import per_branch_sampling

    params = per_branch_sampling(3, {"seed": [5, None, None], "do_sample": [True, True, False], "temperature": 0.9})
    assert params[0].seed == 5 and isinstance(params[1].seed, int) and params[2].seed is None
    first = run([TARGET, TARGET], params[:2])
    assert run([TARGET, TARGET], params[:2]) == first  # the drawn seed, reported, repeats the branch


def test_numpy_integers_are_seeds_and_top_k_like_python_ones():
    """A NumPy seed or top_k passes the checks, and samples as the Python int does (torch's
    generator takes Python ints only: it raised a TypeError at the first draw)."""
    (python,) = run([TARGET], [SEEDED])
    (numpy,) = run([TARGET], [SamplingParams(do_sample=True, temperature=SEEDED.temperature,
                                             top_k=np.int64(SEEDED.top_k), seed=np.int64(SEEDED.seed))])
    assert numpy == python


@pytest.mark.xdist_group("sampling")
def test_greedy_branch_beside_sampled_ones_stays_exact():
    model = tiny_model(ARCH, ATTN)
    out = run([[3, 4], TARGET], [SamplingParams(do_sample=True, seed=1), SamplingParams()])
    assert out[1] == reference_generate(model, PREFIX + TARGET, max_new_tokens=STEPS, eos_token_id=256)


@pytest.mark.xdist_group("sampling")
def test_decode_seeds_branch_i_with_seed_plus_i():
    """decode(seed=s) samples branch i as stream_decode does alone with seed s + i."""
    model = tiny_model(ARCH, ATTN)
    branches = [[3], TARGET, []]
    out = multidecode.decode(model, PREFIX, branches, max_new_tokens=STEPS, eos_token_id=256,
                             do_sample=True, temperature=0.9, top_k=30, top_p=0.95, seed=10)
    for i, branch in enumerate(branches):
        params = SamplingParams(do_sample=True, temperature=0.9, top_k=30, top_p=0.95, seed=10 + i)
        assert out[i] == run([branch], [params])[0]


@pytest.mark.xdist_group("sampling")
def test_decode_reads_sampling_settings_as_stream_decode_does():
    """A temperature and a seed ask for sampling in decode as in stream_decode (decode passed
    do_sample=False always, and decoded greedily whatever was asked); do_sample=False still wins."""
    from multidecode.api import stream_decode

    model = tiny_model(ARCH, ATTN)
    branches, asked = [[3], TARGET], dict(max_new_tokens=STEPS, eos_token_id=256, temperature=1.5, seed=3)
    greedy = multidecode.decode(model, PREFIX, branches, max_new_tokens=STEPS, eos_token_id=256)
    sampled = multidecode.decode(model, PREFIX, branches, **asked)
    streamed = [[e.token_id for e in stream_decode(model, PREFIX, branches, **asked) if e.branch == b] for b in (0, 1)]
    assert sampled == streamed == multidecode.decode(model, PREFIX, branches, do_sample=True, **asked)
    assert sampled != greedy
    assert multidecode.decode(model, PREFIX, branches, do_sample=False, **asked) == greedy


# ---------------------------------------------------------------------- distribution
def expected_first_token_probs(logits: np.ndarray, temperature: float, top_k, top_p) -> np.ndarray:
    """The distribution generate samples from, computed independently in float64 numpy."""
    scaled = logits.astype(np.float64) / temperature
    order = np.argsort(-scaled, kind="stable")
    keep = np.zeros(len(scaled), dtype=bool)
    keep[order[: top_k or len(scaled)]] = True
    probs = np.where(keep, np.exp(scaled - scaled.max()), 0.0)
    probs /= probs.sum()
    if top_p is not None:
        more_likely_mass = np.concatenate([[0.0], np.cumsum(probs[order])[:-1]])
        nucleus = np.zeros(len(scaled), dtype=bool)
        nucleus[order[more_likely_mass < top_p]] = True
        probs = np.where(nucleus, probs, 0.0)
        probs /= probs.sum()
    return probs


@pytest.mark.xdist_group("sampling")
@pytest.mark.parametrize(
    "temperature, top_k, top_p",
    [(0.5, None, None), (0.7, 12, None), (0.6, None, 0.4), (0.8, 30, 0.6)],
)
def test_first_token_frequencies_follow_the_processed_softmax(temperature, top_k, top_p):
    """4000 seeded branches (seeds 0..3999) each draw one first token from the prefix's logits:
    counts pass a chi-square test against softmax after temperature/top-k/top-p, and no token
    outside the kept set is ever drawn."""
    model = tiny_model(ARCH, ATTN)
    draws = 4000
    with torch.inference_mode():
        logits = model(torch.tensor([PREFIX])).logits[0, -1].float().numpy()
    probs = expected_first_token_probs(logits, temperature, top_k, top_p)
    out = multidecode.decode(model, PREFIX, [[]] * draws, max_new_tokens=1, eos_token_id=256, do_sample=True,
                             temperature=temperature, top_k=top_k, top_p=top_p, seed=0)
    counts = np.bincount([o[0] for o in out], minlength=len(probs))
    assert counts[probs == 0].sum() == 0
    expected = probs * draws
    big = expected >= 5  # pool the rare tokens into one bin
    f_obs = np.append(counts[big], counts[~big].sum())
    f_exp = np.append(expected[big], expected[~big].sum())
    if f_exp[-1] == 0:
        f_obs, f_exp = f_obs[:-1], f_exp[:-1]
    assert len(f_obs) >= 5
    assert chisquare(f_obs, f_exp).pvalue > 1e-3


def test_many_rows_choose_as_each_row_alone():
    """Past SAMPLING_ROWS rows are chosen a slice at a time; every row still draws what it draws
    alone (its own generator, its own settings)."""
    from multidecode.sampling import SAMPLING_ROWS

    rows = SAMPLING_ROWS + 70
    logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(3))
    settings = [SamplingParams(do_sample=i % 3 != 0, temperature=0.8, top_k=None if i % 2 else 5, seed=i)
                for i in range(rows)]
    together = choose_tokens(logits, [BranchSampler(p) for p in settings])
    alone = [choose_tokens(logits[i : i + 1], [BranchSampler(p)])[0] for i, p in enumerate(settings)]
    assert together == alone


# ---------------------------------------------------------------------- ties and the top-k candidates
def test_a_tie_at_the_kth_logit_keeps_every_tied_token_as_transformers_does():
    """top_k=2 over [1, 0, 0, 0, -5...]: transformers keeps token 0 and the three tied at 0. The draw
    among a row's own top-k candidates kept two (0.73 / 0.27, tokens 2 and 3 never drawn), while the
    distribution speculation verifies against (`probabilities`) kept four."""
    from multidecode.sampling import probabilities

    logits = torch.full((1, VOCAB), -5.0)
    logits[0, 0], logits[0, 1:4] = 1.0, 0.0
    params = SamplingParams(do_sample=True, top_k=2, seed=0)
    expected = TopKLogitsWarper(2)(None, logits.clone()).softmax(-1)[0]
    torch.testing.assert_close(probabilities(logits, [BranchSampler(params)])[0], expected)
    sampler, draws = BranchSampler(params), 4000
    counts = np.bincount([choose_tokens(logits, [sampler])[0] for _ in range(draws)], minlength=VOCAB)
    assert set(np.flatnonzero(counts)) == {0, 1, 2, 3}
    share = expected[:4].double().numpy()
    assert chisquare(counts[:4], share / share.sum() * draws).pvalue > 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_top_k_row_draws_alike_whatever_top_k_its_neighbours_use(dtype):
    """A seeded top-k row among rows of another k: its candidates were the neighbours' k_max best,
    in an order of ties that depended on k_max, so a bfloat16 row (whose 40th and 41st logits tie
    often) drew another token in about a quarter of 300 steps beside k = 41 or 100."""
    logits = (torch.randn(300, 49152, generator=torch.Generator().manual_seed(0)) * 2).to(dtype)
    mine = SamplingParams(do_sample=True, top_k=40, top_p=0.9, seed=5)
    alone_sampler = BranchSampler(mine)
    alone = [choose_tokens(row[None], [alone_sampler])[0] for row in logits]
    for other in (41, 100, 5000, None):
        samplers = [BranchSampler(mine), BranchSampler(SamplingParams(do_sample=True, top_k=other, seed=9))]
        beside = [choose_tokens(torch.stack([row, row]), samplers)[0] for row in logits]
        assert beside == alone, other


def test_top_k_candidates_and_the_vocabulary_give_one_distribution():
    """A top-k row's draw (over its own candidates) is the distribution `probabilities` gives, and
    transformers' warpers give over the whole vocabulary, ties at the top-k edge included. Of tokens
    tied at the top-p edge, which ones top-p drops is the sort's choice (transformers' unstable
    sort of the vocabulary, ours of the candidates: 22 of these 64 rows differ so): the same
    probabilities, on tokens of equal logits."""
    from multidecode.sampling import draws, probabilities

    logits = (torch.randn(64, 49152, generator=torch.Generator().manual_seed(1)) * 2.5).bfloat16().float()
    params = [SamplingParams(do_sample=True, temperature=0.8, top_k=40, top_p=0.9, seed=i) for i in range(64)]
    samplers = [BranchSampler(p) for p in params]
    ours = probabilities(logits, samplers)
    for i, draw in draws(logits, samplers, range(64)).items():
        assert torch.equal(draw.over(49152), ours[i])
        theirs = transformers_processors(params[i])(None, logits[i : i + 1].clone()).softmax(-1)[0]
        torch.testing.assert_close(ours[i].sort().values, theirs.sort().values)  # the same shares
        differ = (theirs > 0) != (ours[i] > 0)
        kept = logits[i][theirs > 0]
        assert all(bool((kept == logits[i, t]).any()) for t in differ.nonzero().flatten()), i  # only among ties


def test_top_p_compares_as_transformers_does_at_the_last_ulp():
    """1 - float32(0.9) is an ulp above float32(1 - 0.9): a token whose share is 0.10000001639 was
    dropped here and kept by transformers."""
    row = torch.tensor([[0.0, 2.1972243785858154]])
    ours = warp_probs(row, SamplingParams(do_sample=True, top_p=0.9, seed=0))
    torch.testing.assert_close(ours, TopPLogitsWarper(0.9)(None, row.clone()).softmax(-1)[0])
    assert float(ours[0]) > 0


def warp_probs(row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    from multidecode.sampling import probabilities

    return probabilities(row, [BranchSampler(params)])[0]


# ---------------------------------------------------------------------- seeds at the edge of their range
def test_a_seed_too_large_for_the_last_branch_names_the_seed_given():
    """seed=2**64 - 1 with two branches said 'got 18446744073709551616', a seed nobody passed."""
    from multidecode.sampling_params import per_branch_sampling

    with pytest.raises(InvalidArgument, match=r"seed 18446744073709551615 gives the last of 2 branches the seed "
                                              r"18446744073709551615 \+ 1"):
        per_branch_sampling(2, {"seed": 2**64 - 1})
    assert [p.seed for p in per_branch_sampling(2, {"seed": 2**64 - 2})] == [2**64 - 2, 2**64 - 1]


def test_draft_streams_take_every_seed_and_are_no_other_branchs_stream():
    """A proposer's stream was seeded seed + 7919: an overflow for seeds near 2**64, and the very
    stream of the branch seeded seed + 7919 (complete(n > 7919) with speculation)."""
    from multidecode.proposers.drafting import draft_generator

    assert draft_generator(SamplingParams(do_sample=True, seed=2**64 - 1)) is not None
    for seed in (0, 5, 2**40, 2**64 - 8000):  # seed * m + 1 gave seed 0 the stream of branch 1; a seed of 2**32 or
        # more, mixed down to 32 bits, once drew its candidates from its own stream
        draft = torch.rand(4, generator=draft_generator(SamplingParams(do_sample=True, seed=seed)))
        for neighbour in range(seed, seed + 8):
            assert not torch.equal(draft, torch.rand(4, generator=BranchSampler(
                SamplingParams(do_sample=True, seed=neighbour)).generator))
        assert not torch.equal(draft, torch.rand(4, generator=BranchSampler(
            SamplingParams(do_sample=True, seed=seed + 7919)).generator))


def test_the_tiniest_temperature_taken_still_draws():
    from multidecode.sampling_params import TINIEST_TEMPERATURE

    logits = random_logits(9) * 3000  # logits of size 1e4 at most
    sampler = BranchSampler(SamplingParams(do_sample=True, temperature=TINIEST_TEMPERATURE, seed=1))
    assert choose_tokens(logits[:1], [sampler]) == [int(logits[0].argmax())]


def test_a_seed_keeps_its_high_bits():
    """torch's CPU generator keeps a seed's low 32 bits: seeds s and s + 2**32 drew one stream (and
    branch 1 of seed 2**32 - 1 was branch 0 of seed 0). A seed below 2**32 keeps the draws it gave."""
    def draws(seed):
        return torch.rand(8, generator=BranchSampler(SamplingParams(do_sample=True, seed=seed)).generator)

    for seed in (0, 5, 2**32 - 1):
        assert torch.equal(draws(seed), torch.rand(8, generator=torch.Generator().manual_seed(seed)))
        assert not torch.equal(draws(seed), draws(seed + 2**32))
        assert not torch.equal(draws(seed), draws(seed + 2**63))
    assert not torch.equal(draws(2**32), draws(0)) and torch.equal(draws(2**64 - 1), draws(2**64 - 1))
