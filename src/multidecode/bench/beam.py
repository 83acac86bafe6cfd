"""Benchmark: beam search, one tree over one cache against transformers' `generate(num_beams=B)`.

Two methods search the same prompt ids with the same settings, in one process:

- `hf_beam`: `model.generate(num_beams=B, do_sample=False, num_return_sequences=B)`. It prefills
  B copies of the prompt, keeps one cache row per beam, and reorders (copies) the whole cache
  at every step;
- `multidecode_beam`: `strategies.beam.run_beam_search`: the prompt prefilled once, beams as
  branches of one tree (common history stored once), dropped beams compacted out.

Both must return the same B sequences (token for token, up to and including the eos) and the
same scores to float32 rounding (`SCORE_ATOL`/`SCORE_RTOL`); anything else raises `AnswersDiffer`.
The main comparison is at `num_beams`; the sweep repeats it for each B in `beams_sweep`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from ..decoding import check_positive
from ..errors import InvalidArgument
from ..strategies.beam import check_settings, run_beam_search
from ..strategies.complete import prompt_ids
from .ask import excerpt_prompt
from .common import (
    AnswersDiffer,
    ForwardCounter,
    Measurement,
    Progress,
    RunOutput,
    cache_bytes,
    check_identical,
    environment,
    greedy_config,
    load_average,
    measure_together,
    pad_id_of,
    quiet_transformers,
    torch_threads,
    trim_at_eos,
)

HF, MULTIDECODE = "hf_beam", "multidecode_beam"
METHODS = (HF, MULTIDECODE)
LABELS = {
    HF: "HF generate(num_beams=B): B cache rows, reordered every step",
    MULTIDECODE: "MultiDecode beams: one tree, history stored once",
}
TARGETS = {"speedup_vs_hf_beam": 1.5}
SCORE_ATOL, SCORE_RTOL = 1e-4, 1e-5
INSTRUCTION = "Summarize this support call in one sentence."


def sample_prompt(tokenizer, tokens: int = 200) -> list[int]:
    """A request to summarize the sample support call, about `tokens` ids long."""
    return excerpt_prompt(tokenizer, tokens, INSTRUCTION)


# ---------------------------------------------------------------------- the two methods
def hf_beam(model, prompt: Sequence[int], counter: ForwardCounter, *, num_beams: int, max_new_tokens: int,
            length_penalty: float, early_stopping, eos_ids, pad_id) -> RunOutput:
    """transformers' beam search, all B hypotheses returned with their scores."""
    config = greedy_config(model, max_new_tokens, eos_ids, pad_id, num_beams=num_beams,
                           num_return_sequences=num_beams, length_penalty=length_penalty,
                           early_stopping=early_stopping)
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt)], dtype=torch.long, device=device)
    counter.prefill(1)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config,
                             return_dict_in_generate=True, output_scores=True)
    peak = cache_bytes(out.past_key_values)
    answers = [trim_at_eos(row, eos_ids) for row in out.sequences[:, len(prompt):].tolist()]
    fed = sum(math.prod(shape) for _, _, shape in counter.calls)
    return RunOutput(answers, peak, extra={"scores": out.sequences_scores.float().tolist(), "tokens_fed": fed,
                                           "peak_used_kv_bytes": peak})


def multidecode_beam(model, prompt: Sequence[int], counter: ForwardCounter, *, num_beams: int, max_new_tokens: int,
                     length_penalty: float, early_stopping, eos_ids, compaction=None) -> RunOutput:
    """MultiDecode's beam search on the same ids; counts from the engine's own stats."""
    counter.prefill(1)  # the engine's first forward reads the prompt
    run = run_beam_search(model, prompt, num_beams=num_beams, max_new_tokens=max_new_tokens,
                          length_penalty=length_penalty, early_stopping=early_stopping,
                          num_return_sequences=num_beams, eos_token_id=list(eos_ids), compaction=compaction)
    stats, cache = run.stats, run.engine.cache
    per_slot = cache.used_bytes // cache.num_slots if cache.num_slots else 0
    return RunOutput(
        [b.token_ids for b in run.beams], stats.peak_cache_bytes, forward_passes=stats.forward_passes,
        extra={"scores": [b.score for b in run.beams], "tokens_fed": stats.tokens_fed, "steps": run.steps,
               "peak_slots": stats.peak_slots, "peak_used_kv_bytes": stats.peak_slots * per_slot,
               "compactions": stats.compactions, "slots_dropped": stats.slots_dropped},
    )


def check_scores(hf: Measurement, ours: Measurement) -> float:
    """The largest score difference; raises `AnswersDiffer` past float32 rounding."""
    a = torch.tensor(hf.extra["scores"], dtype=torch.float32)
    b = torch.tensor(ours.extra["scores"], dtype=torch.float32)
    if a.shape != b.shape or not torch.allclose(b, a, atol=SCORE_ATOL, rtol=SCORE_RTOL):
        raise AnswersDiffer(f"beam scores differ: {a.tolist()} vs {b.tolist()}")
    return float((a - b).abs().max()) if a.numel() else 0.0


# ---------------------------------------------------------------------- the benchmark
def run_beam_benchmark(
    decoder,
    *,
    prompt: str | Sequence[int] | None = None,
    prompt_tokens: int = 200,
    num_beams: int = 4,
    beams_sweep: Sequence[int] = (2, 4, 8),
    max_new_tokens: int = 32,
    length_penalty: float = 1.0,
    early_stopping: bool | str = False,
    repeats: int = 3,
    repeat_budget_s: float = 60.0,
    sweep_repeat_budget_s: float = 20.0,
    warmup: bool = True,
    threads: int | None = None,
    progress: Progress | None = None,
) -> dict:
    """Measure HF beam search and MultiDecode's side by side; return a JSON-ready dict.

    decoder: a `MultiDecoder` (its model, tokenizer and compaction policy are used).
    prompt: text (chat-templated when the tokenizer has a template), ids, or None for about
        `prompt_tokens` ids about the sample support call (`sample_prompt`). Both methods make one
        forward pass per step and those cost about the same (weights dominate); MultiDecode saves
        the B-fold prompt prefill and the per-step cache copies, so its gain grows with B and with
        the prompt's length relative to max_new_tokens.
    num_beams: the main comparison's B (always measured); beams_sweep: the other B to measure.
    repeats, repeat_budget_s, sweep_repeat_budget_s: both methods run in interleaved rounds, a new
        round starting while fewer than `repeats` ran and all took under the budget (the first at
        the main B, the second elsewhere); the median run of each is kept.
    threads: torch intra-op threads for the run (restored afterwards); None keeps the setting.
    progress: called with a short message as each measurement ends.
    Raises `AnswersDiffer` unless both return the same sequences and (to float32 rounding) scores.
    """
    check_settings(num_beams, max_new_tokens, length_penalty, early_stopping, 1)
    check_positive("prompt_tokens", prompt_tokens)
    if any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in beams_sweep):
        raise InvalidArgument(f"every beam count must be a positive integer, got {list(beams_sweep)}",
                              "pass beams_sweep=(2, 4, 8)")
    with torch_threads(threads):
        return _run(decoder, prompt, prompt_tokens, num_beams, beams_sweep, max_new_tokens, length_penalty,
                    early_stopping, repeats, (repeat_budget_s, sweep_repeat_budget_s), warmup, progress)


def _run(decoder, prompt, prompt_tokens, num_beams, beams_sweep, max_new_tokens, length_penalty, early_stopping,
         repeats, budgets, warmup, progress) -> dict:
    say = progress or (lambda message: None)
    started = time.perf_counter()
    model, tokenizer = decoder.model, decoder.tokenizer
    ids = sample_prompt(tokenizer, prompt_tokens) if prompt is None else prompt_ids(tokenizer, prompt)
    eos_ids = sorted(decoder.eos_ids)
    pad_id = pad_id_of(model, tokenizer)
    settings = dict(max_new_tokens=max_new_tokens, length_penalty=length_penalty, early_stopping=early_stopping,
                    eos_ids=eos_ids)

    def runners(b: int, prompt_ids_: Sequence[int], **override):
        s = {**settings, "num_beams": b, **override}
        return {
            HF: lambda c: hf_beam(model, prompt_ids_, c, pad_id=pad_id, **s),
            MULTIDECODE: lambda c: multidecode_beam(model, prompt_ids_, c, compaction=decoder.compaction, **s),
        }

    meta = environment(model)
    all_b = sorted(set(int(b) for b in beams_sweep) | {num_beams})
    cells: dict[int, dict[str, Measurement]] = {}
    score_diff: dict[int, float] = {}
    with quiet_transformers():
        if warmup:
            say("warming up")
            measure_together(runners(2, ids[:32], max_new_tokens=2), 2, model, repeats=1)
        for b in all_b:
            budget = budgets[0] if b == num_beams else budgets[1]
            row = measure_together(runners(b, ids), b, model, repeats=repeats, budget_s=budget)
            check_identical({name: m.answers for name, m in row.items()}, reference=HF)
            score_diff[b] = check_scores(row[HF], row[MULTIDECODE])
            for m in row.values():
                say(_line(m))
            cells[b] = row

    result = {
        "benchmark": "beam",
        "metadata": {**meta, "load_average_at_end": load_average(),
                     "elapsed_s": round(time.perf_counter() - started, 2)},
        "config": {
            "prompt_tokens": len(ids),
            "prompt": "sample support call" if prompt is None else "given",
            "max_new_tokens": max_new_tokens,
            "num_beams": num_beams,
            "beams_sweep": all_b,
            "length_penalty": length_penalty,
            "early_stopping": early_stopping,
            "num_return_sequences": "num_beams (every hypothesis is compared)",
            "repeats": repeats,
            "repeat_budget_s": budgets[0],
            "sweep_repeat_budget_s": budgets[1],
            "eos_ids": eos_ids,
            "pad_id": pad_id,
            "score_tolerance": {"atol": SCORE_ATOL, "rtol": SCORE_RTOL},
            "notes": [
                "Sequences are compared token for token (up to and including the eos); scores to float32 "
                "rounding: log-probs over a forest cache sum in another order (differences ~1e-6).",
                "Both methods make one forward pass per step (the first reads the prompt); HF's passes "
                "carry B copies of the prompt and B cache rows, MultiDecode's one prompt and one tree.",
                "peak_kv_bytes: for HF, the cache tensors held at the end of generate (B rows of prompt + "
                "steps); for MultiDecode, the engine's preallocated cache buffer (prompt + B per step, "
                "reserved up front). extra.peak_used_kv_bytes is the part MultiDecode actually filled.",
                "wall_s is the median of runs_s; the methods run in interleaved rounds.",
            ],
        },
        "labels": LABELS,
        "main": _main(cells[num_beams], tokenizer, score_diff[num_beams]),
        "sweep": [_sweep_row(b, cells[b], score_diff[b]) for b in all_b],
        "answers_identical": True,
        "max_score_abs_diff": max(score_diff.values()),
    }
    result["targets"] = _targets(result)
    return result


def _line(m: Measurement) -> str:
    runs = f" (median of {len(m.runs_s)})" if len(m.runs_s) > 1 else ""
    return f"B={m.k} {m.method}: {m.wall_s:.2f} s{runs}, {m.forward_passes} forwards, {m.peak_kv_bytes / 1e6:.1f} MB KV"


def _ratios(row: dict[str, Measurement]) -> dict:
    hf, md = row[HF], row[MULTIDECODE]
    return {
        "speedup": hf.wall_s / md.wall_s,
        "forward_passes_ratio": md.forward_passes / hf.forward_passes,
        "tokens_fed_ratio": md.extra["tokens_fed"] / hf.extra["tokens_fed"] if hf.extra.get("tokens_fed") else None,
        "kv_bytes_ratio": md.peak_kv_bytes / hf.peak_kv_bytes if hf.peak_kv_bytes else None,
        "used_kv_bytes_ratio": (md.extra["peak_used_kv_bytes"] / hf.peak_kv_bytes) if hf.peak_kv_bytes else None,
        # where the time goes: the prompt pass, and the mean of the other passes
        "prefill_s": {name: m.prefill_s for name, m in row.items()},
        "decode_ms_per_step": {name: 1000 * m.decode_s / max(1, m.decode_passes) for name, m in row.items()},
    }


def _main(row: dict[str, Measurement], tokenizer, score_diff: float) -> dict:
    hf, md = row[HF], row[MULTIDECODE]
    beams = []
    for i, ids in enumerate(md.answers):
        text = tokenizer.decode(ids, skip_special_tokens=True) if tokenizer is not None else None
        beams.append({"rank": i + 1, "text": text, "token_ids": ids, "score_hf": hf.extra["scores"][i],
                      "score_multidecode": md.extra["scores"][i]})
    return {"num_beams": md.k, "methods": {name: m.as_dict() for name, m in row.items()},
            "multidecode_vs_hf": _ratios(row), "max_score_abs_diff": score_diff, "beams": beams}


def _sweep_row(b: int, row: dict[str, Measurement], score_diff: float) -> dict:
    ratios = _ratios(row)
    return {"num_beams": b, "methods": {name: m.as_dict() for name, m in row.items()}, **ratios,
            "generated_tokens": [len(a) for a in row[HF].answers], "max_score_abs_diff": score_diff}


def _targets(result: dict) -> list[dict]:
    got = result["main"]["multidecode_vs_hf"]["speedup"]
    want = TARGETS["speedup_vs_hf_beam"]
    return [{"name": f"beam search ({result['main']['num_beams']} beams) speedup over HF num_beams",
             "target": f">= {want}x", "measured": round(got, 3), "met": got >= want}]


# ---------------------------------------------------------------------- the plot
def plot_beam(result: dict, path: str | Path) -> Path:
    """Speed-up over transformers' beam search, and each side's peak KV cache, against B."""
    from .plot import plot_sweep

    rows = result["sweep"]
    config = result.get("config", {})
    return plot_sweep(
        path, xs=[row["num_beams"] for row in rows], xlabel="beams B",
        speedups={"over generate(num_beams=B)": [row["speedup"] for row in rows]},
        memory_mb={label: [row["methods"][key]["peak_kv_bytes"] / 1e6 for row in rows]
                   for key, label in ((HF, "transformers"), (MULTIDECODE, "MultiDecode"))},
        title=f"{result.get('metadata', {}).get('model', '?')}: {config.get('prompt_tokens', '?')}-token prompt, "
              f"{config.get('max_new_tokens', '?')} new tokens, beam search",
        target=TARGETS["speedup_vs_hf_beam"],
    )
