"""Beam search as branches of one tree equals transformers' `generate(num_beams=...)`.

Every tiny architecture (float32; eager, sdpa and our grouped-query sdpa on some) and the
embedded model: the returned sequences must equal `generate`'s token for token, and the scores
its `sequences_scores`. Scores are compared to float32 rounding (atol 1e-5, rtol 1e-6): the same
log-probs summed over a forest cache rather than per-beam rows differ by about 1e-6, and a score
of -200 has a float32 spacing of 1.5e-5.

The eos ids are chosen per architecture (from a run without eos) so that beams end on eos at
different steps while others run to max_new_tokens; each case asserts that it does. The mutant
tests show the comparison fails when the score rule or the mask is wrong.
"""

from __future__ import annotations

import collections
import copy
import functools
import itertools
import json
import random

import pytest
import torch
from byte_tokenizer import ByteTokenizer
from click.testing import CliRunner
from tiny_models import ARCHS, NO_EOS, VOCAB, reference_generate, tiny_model

import multidecode
import multidecode.engine
from multidecode import CompactionPolicy, InvalidArgument, InvalidInput
from multidecode.bench.common import trim_at_eos
from multidecode.engine import Engine
from multidecode.masks import build_attention_mask
from multidecode.strategies import beam as beam_module
from multidecode.strategies.beam import run_beam_search

STEPS = 14  # past the sliding window (6) of mistral, gemma3 and qwen2-hybrid


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


PROMPT = _tokens(8, 0)
LONG_PROMPT = _tokens(40, 1)

# eos ids found by `find_eos` for PROMPT with 4 beams; used first because the search costs ~20
# generate calls. If a model changed, `eos_case` falls back to searching again.
EOS_HINTS = {
    "llama": [213], "qwen2": [100, 117], "qwen2-hybrid": [13], "mistral": [252], "gemma3": [24],
    "gpt2": [11, 159], "phi3": [242], "gpt_neox": [31],
}

# (num_beams, length_penalty, early_stopping, num_return_sequences)
SETTINGS = [
    (4, 1.0, False, 4),
    (3, 2.0, True, 2),
    (4, -0.5, "never", 1),
    (5, 0.7, "never", 3),
    (2, 0.0, False, 2),
]
ATOL, RTOL = 1e-5, 1e-6


def group(arch: str, attn: str, *rest):
    return pytest.param(arch, attn, *rest, id="-".join(map(str, (arch, attn, *rest))),
                        marks=pytest.mark.xdist_group(arch))


# ---------------------------------------------------------------------- transformers' answer
@functools.cache
def hf_beams(arch, attn, prompt, num_beams, max_new_tokens, length_penalty, early_stopping, num_return_sequences,
             eos) -> tuple[list[list[int]], torch.Tensor | None]:
    """`generate(num_beams=...)`'s sequences (generated part, cut after the eos that ends each) and scores."""
    model = tiny_model(arch, attn)
    return _generate(model, list(prompt), num_beams, max_new_tokens, length_penalty, early_stopping,
                     num_return_sequences, list(eos))


def _generate(model, prompt, num_beams, max_new_tokens, length_penalty, early_stopping, num_return_sequences, eos):
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt], device=model.device), attention_mask=torch.ones(1, len(prompt), dtype=torch.long,
                                                                      device=model.device), do_sample=False,
            num_beams=num_beams, num_return_sequences=num_return_sequences, max_new_tokens=max_new_tokens,
            length_penalty=length_penalty, early_stopping=early_stopping, eos_token_id=eos,
            output_scores=True, return_dict_in_generate=True,
        )
    rows = [trim_at_eos(row[len(prompt):], eos) for row in out.sequences.tolist()]
    return rows, out.sequences_scores.cpu()


def assert_same(run, expected) -> None:
    """Sequences exactly, scores to float32 rounding, reasons consistent with the tokens."""
    sequences, scores = expected
    got = [b.token_ids for b in run.beams]
    assert got == sequences
    if scores is not None:
        ours = torch.tensor([b.score for b in run.beams])
        assert torch.allclose(ours, scores.float(), atol=ATOL, rtol=RTOL), (ours, scores)
    assert [b.index for b in run.beams] == list(range(len(run.beams)))
    assert all(a.score >= b.score for a, b in zip(run.beams, run.beams[1:]))


def differs(run, expected) -> bool:
    try:
        assert_same(run, expected)
    except AssertionError:
        return True
    return False


def ends_on_eos_at_different_steps(sequences, eos, steps) -> bool:
    """At least two beams end on eos, at different steps before the last one."""
    return len({len(s) for s in sequences if s[-1] in eos and len(s) < steps}) >= 2


def find_eos(arch: str, attn: str) -> tuple[int, ...]:
    """Among the tokens the 4 beams produce without eos (and pairs of them), an eos choice that
    ends beams at different steps, preferring one that also leaves a beam running to the end."""
    base, _ = hf_beams(arch, attn, tuple(PROMPT), 4, STEPS, 1.0, False, 4, (NO_EOS,))
    top = [t for t, _ in collections.Counter(t for s in base for t in s).most_common(10)]
    best, best_score = None, 0.0
    for cand in [(t,) for t in top] + list(itertools.combinations(top[:6], 2)):
        sequences, _ = hf_beams(arch, attn, tuple(PROMPT), 4, STEPS, 1.0, False, 4, cand)
        score = len({len(s) for s in sequences if s[-1] in cand and len(s) < STEPS})
        score += 0.5 * any(len(s) == STEPS for s in sequences)
        if score > best_score:
            best, best_score = cand, score
        if score >= 3.5:
            break
    assert best is not None and best_score >= 2, f"no eos choice ends {arch}'s beams at different steps"
    return best


@functools.cache
def eos_case(arch: str, attn: str) -> tuple[int, ...]:
    eos = tuple(EOS_HINTS[arch])
    sequences, _ = hf_beams(arch, attn, tuple(PROMPT), 4, STEPS, 1.0, False, 4, eos)
    if not ends_on_eos_at_different_steps(sequences, eos, STEPS):
        eos = find_eos(arch, attn)
    return eos


def ours(arch, attn, prompt, settings, eos, **kw):
    num_beams, length_penalty, early_stopping, r = settings
    return run_beam_search(tiny_model(arch, attn), prompt, num_beams=num_beams, max_new_tokens=kw.pop("steps", STEPS),
                           length_penalty=length_penalty, early_stopping=early_stopping, num_return_sequences=r,
                           eos_token_id=list(eos), **kw)


def expected(arch, attn, prompt, settings, eos, steps=STEPS):
    return hf_beams(arch, attn, tuple(prompt), settings[0], steps, settings[1], settings[2], settings[3], tuple(eos))


# ---------------------------------------------------------------------- equality with generate
@pytest.mark.parametrize("arch, attn", [group(a, "sdpa") for a in ARCHS]
                         + [group(a, t) for a in ("llama", "gemma3") for t in ("eager", "multidecode_sdpa")]
                         + [group("mistral", "eager")])
def test_beams_ending_on_eos_at_different_steps(arch, attn):
    """4 beams, all 4 returned: some end on eos at different steps, some run to max_new_tokens;
    sequences and scores equal generate's, and finish reasons say which."""
    eos = eos_case(arch, attn)
    exp = expected(arch, attn, PROMPT, SETTINGS[0], eos)
    assert ends_on_eos_at_different_steps(exp[0], eos, STEPS)
    run = ours(arch, attn, PROMPT, SETTINGS[0], eos)
    assert_same(run, exp)
    assert [b.finish_reason for b in run.beams] == ["stop" if b.token_ids[-1] in eos else "length" for b in run.beams]
    assert {b.finish_reason for b in run.beams} == {"stop", "length"} or len({len(b.token_ids) for b in run.beams}) > 2


@pytest.mark.parametrize("arch, attn, case", [group(a, "sdpa", i) for a in ARCHS for i in range(1, len(SETTINGS))]
                         + [group("phi3", "eager", i) for i in (1, 3)]
                         + [group("gpt2", "eager", i) for i in (2, 4)])
def test_settings_match_generate(arch, attn, case):
    """Several beam counts, length penalties (2, -0.5, 0.7, 0), early_stopping True / False /
    "never", and fewer returned sequences than beams, with the architecture's eos."""
    eos = eos_case(arch, attn)
    assert_same(ours(arch, attn, PROMPT, SETTINGS[case], eos), expected(arch, attn, PROMPT, SETTINGS[case], eos))


@pytest.mark.parametrize("arch, attn", [group(a, "sdpa") for a in ("llama", "mistral", "gpt_neox")])
def test_without_eos_and_with_one_new_token(arch, attn):
    """No eos (every beam runs to max_new_tokens), and max_new_tokens = 1 (the first step is the last)."""
    eos = (NO_EOS,)
    assert_same(ours(arch, attn, PROMPT, SETTINGS[0], eos), expected(arch, attn, PROMPT, SETTINGS[0], eos))
    for settings in (SETTINGS[0], SETTINGS[1]):
        assert_same(ours(arch, attn, PROMPT, settings, eos, steps=1), expected(arch, attn, PROMPT, settings, eos, 1))


@pytest.mark.parametrize("arch, attn", [group(a, "sdpa") for a in ("qwen2", "gemma3")])
def test_early_stopping_changes_when_the_search_ends(arch, attn):
    """early_stopping True, False and "never" (with a positive length penalty) each match
    generate, and they do not all stop at the same step (the stopping rules are exercised)."""
    eos = eos_case(arch, attn)
    steps = set()
    for early in (True, False, "never"):
        settings = (4, 1.0, early, 4)
        run = ours(arch, attn, PROMPT, settings, eos)
        assert_same(run, expected(arch, attn, PROMPT, settings, eos))
        steps.add(run.steps)
    assert len(steps) > 1


@pytest.mark.parametrize("arch, attn", [group(a, "sdpa") for a in ("llama", "gpt_neox")])
def test_one_beam_is_greedy(arch, attn):
    """num_beams=1: generate runs greedy search, and so does this (whatever early_stopping says)."""
    eos = eos_case(arch, attn)
    greedy = reference_generate(tiny_model(arch, attn), PROMPT, max_new_tokens=STEPS, eos_token_id=list(eos))
    for early in (True, False, "never"):
        run = ours(arch, attn, PROMPT, (1, 1.0, early, 1), eos)
        assert [b.token_ids for b in run.beams] == [greedy]


def test_one_beam_breaks_equal_logits_as_greedy_search_does():
    """bfloat16 and 4-bit logits often tie exactly at the top: greedy search takes the lowest id
    (`argmax`), and one beam must too (a topk over the scores returned either). Here every step
    ties two tokens at the top: rows a and b of the LM head are one vector, a+1 and b+1 its negative."""
    base = tiny_model("llama", "sdpa")
    for a, b in ((4, 200), (77, 130), (250, 3)):
        model = copy.deepcopy(base)
        head = model.get_output_embeddings().weight
        with torch.no_grad():
            direction = torch.randn(head.shape[1], generator=torch.Generator().manual_seed(a)) * 3
            head.zero_()
            head[a] = head[b] = direction
            head[a + 1] = head[b + 1] = -direction
        for eos in ([NO_EOS], [NO_EOS, 10, 11, 12]):  # 3 eos ids or more: 4 candidates, a topk picked the second
            greedy = reference_generate(model, PROMPT, max_new_tokens=6, eos_token_id=eos)
            assert set(greedy) <= {min(a, b), min(a, b) + 1}
            found = run_beam_search(model, PROMPT, num_beams=1, max_new_tokens=6, eos_token_id=eos)
            assert found.beams[0].token_ids == greedy


# ---------------------------------------------------------------------- one tree, compacted
@pytest.mark.parametrize("policy", [CompactionPolicy(every=1), CompactionPolicy(min_fraction=0.05, min_slots=1)],
                         ids=["every-step", "threshold"])
@pytest.mark.parametrize("arch, attn", [group(a, "sdpa") for a in ("llama", "mistral", "gemma3")])
def test_dropped_beams_are_compacted_out_exactly(arch, attn, policy):
    """Dropped beams' slots leave the cache mid-search (every step, or by a low threshold) and the
    result stays equal to generate's."""
    eos = eos_case(arch, attn)
    engine = Engine(tiny_model(arch, attn))
    run = ours(arch, attn, PROMPT, SETTINGS[0], eos, compaction=policy, engine=engine)
    assert_same(run, expected(arch, attn, PROMPT, SETTINGS[0], eos))
    assert engine.stats.compactions > 0 and engine.stats.slots_dropped > 0
    assert engine.forest.num_slots < engine.stats.tokens_fed


@pytest.mark.parametrize("arch, attn", [group(a, "sdpa") for a in ("llama", "qwen2-hybrid")])
def test_common_history_is_stored_once(arch, attn):
    """A 40-token prompt, 4 beams, 24 steps: the prompt is fed once, each step feeds exactly the 4
    new tokens, and the cache never holds more than prompt + 4 per step, far below the 4 full
    copies (4 x (prompt + steps)) that per-beam rows need. With the default policy, dropped beams
    are compacted out along the way; the result equals generate's."""
    eos, steps = (NO_EOS,), 24
    settings = (4, 1.0, False, 4)
    run = ours(arch, attn, LONG_PROMPT, settings, eos, steps=steps)
    assert_same(run, expected(arch, attn, LONG_PROMPT, settings, eos, steps))
    stats, p, b = run.stats, len(LONG_PROMPT), 4
    assert run.steps == steps
    assert stats.forward_passes == steps  # the prefill, then one pass per step but the last
    assert stats.tokens_fed == p + b * (steps - 1)
    assert stats.compactions >= 1 and stats.slots_dropped > 0
    assert stats.peak_slots < p + b * (steps - 1) < b * (p + steps)
    prompt_nodes = [n for n in run.engine.forest.node_at_slot if n < p]
    assert prompt_nodes == list(range(p))  # every prompt token in the cache, once


# ---------------------------------------------------------------------- the comparison can fail
def _see_everything(rows, query_positions, key_positions, layout, dtype, device="cpu"):
    return build_attention_mask(torch.ones_like(rows), query_positions, key_positions, layout, dtype, device)


MUTANTS = {
    "score-counts-the-prompt": lambda mp: mp.setattr(
        beam_module, "finished_scores", lambda top, generated, lp: top / ((generated + len(PROMPT)) ** lp)),
    "score-without-length-penalty": lambda mp: mp.setattr(
        beam_module, "finished_scores", lambda top, generated, lp: top.clone()),
    "beams-see-each-other": lambda mp: mp.setattr(multidecode.engine, "build_attention_mask", _see_everything),
}


@pytest.mark.parametrize("mutant", list(MUTANTS))
@pytest.mark.parametrize("arch, attn", [group(a, "sdpa") for a in ("llama", "gemma3")])
def test_mutants_disagree_with_generate(arch, attn, mutant, monkeypatch):
    """A wrong finished-score rule or a mask that lets beams see each other (patched here only)
    makes the result differ from generate's."""
    eos = eos_case(arch, attn)
    settings = (4, 2.0, False, 4)
    exp = expected(arch, attn, PROMPT, settings, eos)
    assert not differs(ours(arch, attn, PROMPT, settings, eos), exp)
    MUTANTS[mutant](monkeypatch)
    assert differs(ours(arch, attn, PROMPT, settings, eos), exp)


# ---------------------------------------------------------------------- arguments
@pytest.mark.parametrize("bad, needle", [
    (dict(num_beams=0), "num_beams"),
    (dict(num_beams=2.5), "num_beams"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(num_return_sequences=5), "num_return_sequences"),
    (dict(num_return_sequences=0), "num_return_sequences"),
    (dict(early_stopping="sometimes"), "early_stopping"),
    (dict(early_stopping=1), "early_stopping"),
    (dict(length_penalty=float("nan")), "length_penalty"),
    (dict(length_penalty="1"), "length_penalty"),
])
def test_bad_arguments(bad, needle):
    settings = {**dict(num_beams=4, max_new_tokens=4), **bad}
    with pytest.raises(InvalidArgument, match=needle):
        run_beam_search(tiny_model("llama", "sdpa"), PROMPT, **settings)


def test_bad_prompts():
    model = tiny_model("llama", "sdpa")
    with pytest.raises(InvalidInput):
        run_beam_search(model, [], num_beams=2, max_new_tokens=2)
    with pytest.raises(multidecode.PromptTooLong):
        run_beam_search(model, PROMPT, num_beams=2, max_new_tokens=600)


# ---------------------------------------------------------------------- facade and CLI
@pytest.fixture(scope="module")
def model_dir(model_dir_of):
    """The shared tiny model folder with a short context: 96 positions."""
    return model_dir_of(96)


@pytest.mark.xdist_group("cli")
def test_facade_and_cli(model_dir):
    """`MultiDecoder.beam_search` on a text prompt equals generate on its ids; `multidecode beam
    --json` prints the same beams; bad settings exit with an error line, not a traceback."""
    decoder = multidecode.load(str(model_dir))
    beams = decoder.beam_search("hello there", num_beams=3, max_new_tokens=6, num_return_sequences=2, chat=False)
    ids = beams[0].prompt_ids
    eos = sorted(decoder.eos_ids)
    sequences, scores = _generate(decoder.model, ids, 3, 6, 1.0, False, 2, eos)
    assert [b.token_ids for b in beams] == sequences
    assert torch.allclose(torch.tensor([b.score for b in beams]), scores, atol=ATOL, rtol=RTOL)
    assert beams[0].text == decoder.tokenizer.decode(beams[0].token_ids, skip_special_tokens=True)

    from multidecode.cli import main

    runner = CliRunner()
    result = runner.invoke(main, ["beam", "--model", str(model_dir), "--prompt", "hello there", "--num-beams", "3",
                                  "--max-new-tokens", "6", "--num-return-sequences", "2", "--no-chat", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert [r["token_ids"] for r in rows] == sequences
    assert [r["score"] for r in rows] == [b.score for b in beams]

    human = runner.invoke(main, ["beam", "--model", str(model_dir), "--prompt", "hello there", "--num-beams", "3",
                                 "--max-new-tokens", "6", "--num-return-sequences", "2", "--no-chat"])
    assert human.exit_code == 0, human.output
    assert f"{beams[0].score:.4f}" in human.stdout

    bad = runner.invoke(main, ["beam", "--model", str(model_dir), "--prompt", "hi", "--num-beams", "2",
                               "--num-return-sequences", "3"])
    assert bad.exit_code == 2 and "error:" in bad.output and "Traceback" not in bad.output
    none = runner.invoke(main, ["beam", "--model", str(model_dir)])
    assert none.exit_code == 2 and "error:" in none.output


# ---------------------------------------------------------------------- the embedded model
@pytest.mark.embedded
@pytest.mark.xdist_group("embedded")
@pytest.mark.parametrize("settings", [(4, 1.0, False, 4), (3, 0.5, True, 2)], ids=str)
def test_embedded_model_matches_generate(embedded_decoder, settings):
    """SmolLM2-135M-Instruct, a short chat prompt, 16 new tokens: the beams and their scores equal
    generate's; some beams end on eos before others."""
    num_beams, lp, early, r = settings
    run = beam_module.search(embedded_decoder.scheduler(), embedded_decoder.tokenizer, "Name one colour of the sky.",
                             num_beams=num_beams, max_new_tokens=16,
                             length_penalty=lp, early_stopping=early, num_return_sequences=r)
    eos = sorted(embedded_decoder.eos_ids)
    assert_same(run, _generate(embedded_decoder.model, run.prompt_ids, num_beams, 16, lp, early, r, eos))
    assert all(b.text == embedded_decoder.tokenizer.decode(b.token_ids, skip_special_tokens=True) for b in run.beams)
    if r == 4:
        assert any(b.finish_reason == "stop" for b in run.beams)
        assert len({len(b.token_ids) for b in run.beams}) > 1


@pytest.mark.embedded
@pytest.mark.xdist_group("embedded")
def test_equal_scores_rank_as_generate_ranks_them(embedded_decoder):
    """The 4-bit model gives two finished hypotheses exactly equal scores on this prompt: they rank
    as generate's merge ranks them (one topk over the kept and the new), so the best beam is its
    best beam (a sort of the finished list kept the older first, and returned another best)."""
    run = beam_module.search(embedded_decoder.scheduler(), embedded_decoder.tokenizer, "Say hi in one word.",
                             num_beams=3, max_new_tokens=12, length_penalty=1.0, early_stopping=False,
                             num_return_sequences=3)
    scores = [b.score for b in run.beams]
    assert len(set(scores)) < len(scores)  # the tie this case is about
    eos = sorted(embedded_decoder.eos_ids)
    assert_same(run, _generate(embedded_decoder.model, run.prompt_ids, 3, 12, 1.0, False, 3, eos))


# ---------------------------------------------------------------------- the benchmark
@pytest.mark.xdist_group("llama")
def test_benchmark_on_a_tiny_model(tmp_path):
    """`run_beam_benchmark` runs both methods per beam count, checks identical sequences and
    scores, reports times, forward passes, KV bytes and ratios, and plots speedup vs beams."""
    from multidecode.bench.beam import METHODS, run_beam_benchmark
    from multidecode.bench.results import plot as plot_beam

    decoder = multidecode.MultiDecoder(tiny_model("llama", "sdpa"), ByteTokenizer())
    messages = []
    result = run_beam_benchmark(decoder, prompt_tokens=40, num_beams=3, beams_sweep=(2, 3), max_new_tokens=6,
                                repeats=1, warmup=False, progress=messages.append)
    assert result["benchmark"] == "beam" and result["answers_identical"]
    assert [row["num_beams"] for row in result["sweep"]] == [2, 3]
    assert result["config"]["prompt_tokens"] >= 40 and messages
    main = result["main"]
    assert main["num_beams"] == 3 and set(main["methods"]) == set(METHODS) and len(main["beams"]) == 3
    hf, md = main["methods"]["hf_beam"], main["methods"]["multidecode_beam"]
    assert md["forward_passes"] == hf["forward_passes"] == md["extra"]["steps"]
    p = result["config"]["prompt_tokens"]
    assert hf["extra"]["tokens_fed"] == 3 * p + 3 * (md["extra"]["steps"] - 1)
    assert md["extra"]["tokens_fed"] == p + 3 * (md["extra"]["steps"] - 1)
    ratios = main["multidecode_vs_hf"]
    assert ratios["speedup"] > 0 and ratios["kv_bytes_ratio"] < 1 and ratios["forward_passes_ratio"] == 1
    assert result["max_score_abs_diff"] < 1e-4
    assert [t["met"] for t in result["targets"]] in ([True], [False])
    json.dumps(result)
    path = plot_beam(result, tmp_path / "beam.png")
    assert path.stat().st_size > 10_000
    with pytest.raises(InvalidArgument):
        run_beam_benchmark(decoder, beams_sweep=(0,), max_new_tokens=2)
    for one in (dict(num_beams=1, beams_sweep=(2,)), dict(num_beams=2, beams_sweep=(1,))):  # was a KeyError, after measuring
        with pytest.raises(InvalidArgument, match="at 2 beams or more"):
            run_beam_benchmark(decoder, max_new_tokens=2, **one)


def test_more_beams_than_memory_holds_are_refused_before_they_run(monkeypatch):
    """The beams are branches of the prompt, and their memory is known before the search: a width
    the machine cannot hold is a `NotEnoughMemory` saying what fits, not an allocation failure
    from the middle of the first step (100,000 beams took 19.7 GB of a 23 GB machine, then crashed)."""
    from multidecode import memory

    monkeypatch.setenv(memory.ENVIRONMENT, "50MB")
    model = tiny_model("llama", "sdpa")
    with pytest.raises(multidecode.NotEnoughMemory, match="needs about") as caught:
        run_beam_search(model, [5, 6, 7], num_beams=100_000, max_new_tokens=4)
    assert "of these branches fit at once" in caught.value.hint
