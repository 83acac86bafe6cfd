"""Benchmark: beam search as one tree over one cache against transformers' `generate(num_beams=B)`,
identical sequences and scores asserted (docs/benchmarks.md, `bench beam`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import InvalidArgument, check_counts, check_positive
from ..strategies.beam import check_settings, run_beam_search
from ..strategies.complete import prompt_ids
from .common import (
    AnswersDiffer,
    ForwardCounter,
    Measurement,
    RunOutput,
    Setup,
    engine_output,
    excerpt_prompt,
    hf_sequential,
)
from .harness import Benchmark, Case, Method, Plot, Target, ratios, runs

HF, MULTIDECODE = "hf_beam", "multidecode_beam"
METHODS = (HF, MULTIDECODE)
SCORE_ATOL, SCORE_RTOL = 1e-4, 1e-5
INSTRUCTION = "Summarize this support call in one sentence."


def hf_beam(model, prompt: Sequence[int], counter: ForwardCounter, *, num_beams: int, **settings) -> RunOutput:
    """transformers' beam search, all B hypotheses returned with their scores."""
    out = hf_sequential(model, [prompt], counter, num_beams=num_beams, num_return_sequences=num_beams,
                        output_scores=True, **settings)
    out.extra.update(tokens_fed=counter.tokens_fed, peak_used_kv_bytes=out.kv_bytes)
    return out


def multidecode_beam(model, prompt: Sequence[int], counter: ForwardCounter, *, num_beams: int, max_new_tokens: int,
                     length_penalty: float, early_stopping, eos_ids, compaction=None) -> RunOutput:
    """MultiDecode's beam search on the same ids; counts from the engine's own stats."""
    counter.prefill(1)  # the engine's first forward reads the prompt
    run_ = run_beam_search(model, prompt, num_beams=num_beams, max_new_tokens=max_new_tokens,
                           length_penalty=length_penalty, early_stopping=early_stopping,
                           num_return_sequences=num_beams, eos_token_id=list(eos_ids), compaction=compaction)
    stats, cache = run_.stats, run_.engine.cache
    per_slot = cache.used_bytes // cache.num_slots if cache.num_slots else 0
    return engine_output([b.token_ids for b in run_.beams], stats, scores=[b.score for b in run_.beams],
                         steps=run_.steps, peak_used_kv_bytes=stats.peak_slots * per_slot,
                         slots_dropped=stats.slots_dropped)


def check_scores(hf: Measurement, ours: Measurement) -> float:
    """The largest score difference; raises `AnswersDiffer` past float32 rounding."""
    a = torch.tensor(hf.extra["scores"], dtype=torch.float32)
    b = torch.tensor(ours.extra["scores"], dtype=torch.float32)
    if a.shape != b.shape or not torch.allclose(b, a, atol=SCORE_ATOL, rtol=SCORE_RTOL):
        raise AnswersDiffer(f"beam scores differ: {a.tolist()} vs {b.tolist()}")
    return float((a - b).abs().max()) if a.numel() else 0.0


def beam_benchmark(decoder, *, prompt: str | Sequence[int] | None = None, prompt_tokens: int = 200,
                   num_beams: int = 4, beams_sweep: Sequence[int] = (2, 4, 8), max_new_tokens: int = 32,
                   length_penalty: float = 1.0, early_stopping: bool | str = False, repeats: int = 3,
                   repeat_budget_s: float = 60.0, sweep_repeat_budget_s: float = 20.0, warmup: bool = True) -> Benchmark:
    """Both beam searches as data. prompt: text, ids, or None for about `prompt_tokens` ids asking
    to summarize the sample call; num_beams: the main B (always measured), beams_sweep the others."""
    check_settings(num_beams, max_new_tokens, length_penalty, early_stopping, 1)
    check_positive("prompt_tokens", prompt_tokens)
    check_counts("beam count", beams_sweep, "pass beams_sweep=(2, 4, 8)")
    if min(num_beams, *beams_sweep) < 2:  # transformers' generate(num_beams=1) is greedy: no scores to compare
        raise InvalidArgument(f"beam search is compared at 2 beams or more, got {sorted({num_beams, *beams_sweep})}",
                              "one beam is greedy decoding, which bench ask measures")
    setup = Setup.of(decoder)
    ids = prompt_ids(setup.tokenizer, prompt) if prompt is not None else excerpt_prompt(
        setup.tokenizer, prompt_tokens, INSTRUCTION)
    settings = {"max_new_tokens": max_new_tokens, "length_penalty": length_penalty,
                "early_stopping": early_stopping, "eos_ids": setup.eos_ids}

    def case(b: int) -> Case:
        main = b == num_beams
        target = Target(f"beam search ({b} beams) speedup over HF num_beams", ("multidecode_vs_hf", "speedup"),
                        ">=", 1.5)
        return Case({"num_beams": b}, _methods(setup, ids, num_beams=b, **settings), main=main,
                    budget_s=repeat_budget_s if main else sweep_repeat_budget_s, targets=(target,) if main else (),
                    report=_report(setup, main))

    return Benchmark(
        name="beam", title=f"beam search over a {len(ids)}-token prompt, {max_new_tokens} new tokens",
        model=setup.model, reference=HF, pairs=((MULTIDECODE, HF),), repeats=repeats,
        cases=tuple(case(b) for b in sorted({int(b) for b in beams_sweep} | {num_beams})),
        config={"prompt_tokens": len(ids), "prompt": "sample support call" if prompt is None else "given",
                "max_new_tokens": max_new_tokens, "num_beams": num_beams, "length_penalty": length_penalty,
                "early_stopping": early_stopping, "num_return_sequences": "num_beams (every hypothesis is compared)",
                "eos_ids": setup.eos_ids, "pad_id": setup.pad_id,
                "score_tolerance": {"atol": SCORE_ATOL, "rtol": SCORE_RTOL}},
        warmup=_methods(setup, ids[:32], **{**settings, "num_beams": 2, "max_new_tokens": 2}) if warmup else (),
        columns=("wall_s", "forward_passes", "peak_kv_bytes", "prefill_s", "decode_ms_per_step"),
        plot=Plot("sweep", figures=("peak_kv_bytes",), x="num_beams", xlabel="beams B"),
        summary=lambda result: {"max_score_abs_diff": max(row["max_score_abs_diff"] for row in result["sweep"])},
    )


run_beam_benchmark = runs(beam_benchmark)


def _methods(setup: Setup, prompt: Sequence[int], **settings) -> tuple[Method, ...]:
    """Both beam searches over `prompt` with the same settings."""
    return (Method(HF, "HF generate(num_beams=B): B cache rows, reordered every step", short="transformers",
                   run=lambda c: hf_beam(setup.model, prompt, c, pad_id=setup.pad_id, **settings)),
            Method(MULTIDECODE, "MultiDecode beams: one tree, history stored once", short="MultiDecode",
                   run=lambda c: multidecode_beam(setup.model, prompt, c, compaction=setup.decoder.compaction,
                                                  **settings)))


def _report(setup: Setup, main: bool):
    """Scores checked; the ratios beam search adds (tokens fed, KV filled); at the main B, the beams."""
    def report(got: dict) -> dict:
        hf, md = got[HF], got[MULTIDECODE]
        vs = {**ratios(md, hf), "tokens_fed_ratio": md.extra["tokens_fed"] / hf.extra["tokens_fed"],
              "used_kv_bytes_ratio": md.extra["peak_used_kv_bytes"] / hf.peak_kv_bytes if hf.peak_kv_bytes else None}
        out = {"multidecode_vs_hf": vs, "max_score_abs_diff": check_scores(hf, md)}
        if main:
            out["beams"] = [{"rank": i + 1, "token_ids": ids, "score_hf": hf.extra["scores"][i],
                             "score_multidecode": md.extra["scores"][i], "text": setup.text(ids)}
                            for i, ids in enumerate(md.answers)]
        return out
    return report
