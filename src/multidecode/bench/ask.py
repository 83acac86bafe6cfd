"""Benchmark: many questions about one document, MultiDecode against transformers.

Four methods answer the same questions from the same whole-prompt ids
(`MultiDecoder.question_prompts`), greedy, in one process:

- (a) `hf_sequential`: `model.generate` once per question, the full prompt each time;
- (b) `hf_batched`: one `generate` over all full prompts, left-padded;
- (c) `hf_shared_prefix`: the shared prefix prefilled once, its `DynamicCache` copied to a batch,
  then one `generate` over the (left-padded inside the tail) question tails;
- (d) `multidecode`: one forest over one cache (`MultiDecoder.start`, what `ask` runs).

All four must give identical answer ids (compared up to and including the first eos); a
difference raises `AnswersDiffer`. The main comparison is at K = len(questions); the sweep runs
K = 1, 2, 4, 8, 16 questions (the list extended with `extra_questions`, then cycled). The
sequential cost of K questions is the sum of the per-question runs, which is exactly what (a) does.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from importlib import resources

from ..errors import InvalidArgument
from ..prompts import common_prefix_length
from .common import (
    Measurement,
    Progress,
    check_identical,
    combine_sequential,
    environment,
    hf_batched,
    hf_sequential,
    hf_shared_prefix,
    load_average,
    measure,
    measure_together,
    multidecode_forest,
    pad_id_of,
    quiet_transformers,
    shared_prefix_length,
    torch_threads,
)

SEQUENTIAL, BATCHED, SHARED, MULTIDECODE = "hf_sequential", "hf_batched", "hf_shared_prefix", "multidecode"
METHODS = (SEQUENTIAL, BATCHED, SHARED, MULTIDECODE)
LABELS = {
    SEQUENTIAL: "(a) HF generate, one question at a time",
    BATCHED: "(b) HF generate, left-padded batch of full prompts",
    SHARED: "(c) HF shared-prefix cache copied to a batch",
    MULTIDECODE: "(d) MultiDecode forest",
}

# Eight more simple factual questions about the sample support call, for the K = 16 point.
SUPPORT_CALL_EXTRA_QUESTIONS = (
    "What is the customer's account number?",
    "What is the name of the support agent?",
    "Which internet plan is the customer on?",
    "What is the customer's street address?",
    "What colour does the Internet light turn when the connection drops?",
    "When will the replacement cable arrive?",
    "For how many days is the mobile backup service switched on?",
    "When is the customer's next bill issued?",
)

TARGETS = {
    "speedup_vs_hf_sequential": 5.0,
    "speedup_vs_hf_batched": 3.0,
    "speedup_vs_hf_shared_prefix": 1.5,
    "kv_bytes_vs_hf_batched": 0.25,
    "time_k8_over_k1": 1.6,
}


def sample_document() -> str:
    """The sample document shipped with the package (a support-call transcript)."""
    return resources.files("multidecode").joinpath("data/support_call.txt").read_text(encoding="utf-8")


def excerpt_prompt(tokenizer, tokens: int, instruction: str) -> list[int]:
    """`instruction`, a blank line, then the sample document's opening lines up to about `tokens`
    ids in all (the whole document if it is shorter), through the chat template when there is one."""
    from ..strategies.complete import prompt_ids

    excerpt, ids = "", []
    for line in sample_document().splitlines(keepends=True):
        excerpt += line
        ids = prompt_ids(tokenizer, f"{instruction}\n\n{excerpt.strip()}")
        if len(ids) >= tokens:
            break
    return ids


def sample_questions() -> list[str]:
    text = resources.files("multidecode").joinpath("data/support_call_questions.txt").read_text(encoding="utf-8")
    return [line.strip() for line in text.splitlines() if line.strip()]


def extend_questions(questions: Sequence[str], extra: Sequence[str], n: int) -> list[str]:
    """`questions`, then `extra`, then the whole list again, until there are `n`."""
    pool = list(questions) + list(extra)
    return [pool[i % len(pool)] for i in range(max(n, len(questions)))]


def run_ask_benchmark(
    decoder,
    *,
    document: str | None = None,
    questions: Sequence[str] | None = None,
    extra_questions: Sequence[str] | None = None,
    max_new_tokens: int = 32,
    ks: Sequence[int] = (1, 2, 4, 8, 16),
    sweep_methods: Sequence[str] = METHODS,
    repeats: int = 3,
    repeat_budget_s: float = 30.0,
    sweep_repeat_budget_s: float = 8.0,
    warmup: bool = True,
    threads: int | None = None,
    progress: Progress | None = None,
) -> dict:
    """Measure (a)-(d) side by side and return the results as a JSON-ready dict.

    decoder: a `MultiDecoder` (its model and tokenizer are used for all four methods).
    document, questions: default to the sample support call and its 8 questions.
    extra_questions: more questions for sweep points past len(questions) (default: 8 more about
        the sample document when it is the document; otherwise the list is cycled).
    ks: the sweep's question counts; the main comparison is at K = len(questions), always run.
    sweep_methods: which of (b), (c), (d) the sweep measures at K other than len(questions);
        (a) is always measured, as the reference the answers are checked against.
    repeats, repeat_budget_s, sweep_repeat_budget_s: (c) and (d) run in interleaved rounds, a new
        round starting while fewer than `repeats` ran and they took under the budget in all
        (`repeat_budget_s` at the main K, `sweep_repeat_budget_s` elsewhere); (b) repeats alone
        under half that budget; (a) runs once per question. The median run is kept.
    threads: torch intra-op threads for the run (restored afterwards); None keeps the current
        setting. On a machine shared with other busy processes, 1 thread is far steadier than 2.
    progress: called with a short message as each measurement ends.
    Raises `AnswersDiffer` if any method's answers differ from (a)'s.
    """
    with torch_threads(threads):
        return _run(decoder, document, questions, extra_questions, max_new_tokens, ks, sweep_methods, repeats,
                    (repeat_budget_s, sweep_repeat_budget_s), warmup, progress)


def _run(decoder, document, questions, extra_questions, max_new_tokens, ks, sweep_methods, repeats,
         budgets, warmup, progress) -> dict:
    say = progress or (lambda message: None)
    started = time.perf_counter()
    model, tokenizer = decoder.model, decoder.tokenizer
    if document is None:
        document = sample_document()
        if extra_questions is None:
            extra_questions = SUPPORT_CALL_EXTRA_QUESTIONS
    if questions is None:
        questions = sample_questions()
    questions = list(questions)
    unknown = set(sweep_methods) - set(METHODS)
    if unknown:
        raise InvalidArgument(f"unknown method(s): {', '.join(sorted(unknown))}", f"use {', '.join(METHODS)}")
    if any(not isinstance(k, int) or isinstance(k, bool) or k < 1 for k in ks):
        raise InvalidArgument(f"every K must be a positive integer, got {list(ks)}", "pass ks=(1, 2, 4, 8, 16)")
    main_k = len(questions)
    all_ks = sorted(set(int(k) for k in ks) | {main_k})
    pool = extend_questions(questions, extra_questions or (), max(all_ks))
    prompts = decoder.question_prompts(document, pool)
    eos_ids = sorted(decoder.eos_ids)
    pad_id = pad_id_of(model, tokenizer)
    hf = dict(max_new_tokens=max_new_tokens, eos_ids=eos_ids, pad_id=pad_id)
    runners = {
        SEQUENTIAL: lambda ps: lambda c: hf_sequential(model, ps, c, **hf),
        BATCHED: lambda ps: lambda c: hf_batched(model, ps, c, **hf),
        SHARED: lambda ps: lambda c: hf_shared_prefix(model, ps, c, **hf),
        MULTIDECODE: lambda ps: lambda c: multidecode_forest(decoder, ps, c, max_new_tokens=max_new_tokens),
    }
    meta = environment(model)

    with quiet_transformers():
        if warmup:
            say("warming up")
            short = _short_prompts(prompts[:2])
            for method in METHODS:
                measure(method, 2, _warm_runner(method, short, model, decoder, eos_ids, pad_id), model, repeats=1)

        per_question: list[Measurement] = []
        cells: dict[int, dict[str, Measurement]] = {}
        for k in all_ks:
            row: dict[str, Measurement] = {}
            while len(per_question) < k:
                i = len(per_question)
                m = measure(SEQUENTIAL, 1, runners[SEQUENTIAL](prompts[i : i + 1]), model, repeats=1)
                per_question.append(m)
                say(f"(a) question {i + 1}: {m.wall_s:.2f} s")
            row[SEQUENTIAL] = combine_sequential(SEQUENTIAL, per_question[:k])
            wanted = [m for m in (BATCHED, SHARED, MULTIDECODE) if k == main_k or m in sweep_methods]
            budget = budgets[0] if k == main_k else budgets[1]
            if BATCHED in wanted:  # the costly one: repeated only while cheap, on its own
                row[BATCHED] = measure(BATCHED, k, runners[BATCHED](prompts[:k]), model, repeats=repeats,
                                       budget_s=budget / 2)
                say(_line(row[BATCHED]))
            together = {m: runners[m](prompts[:k]) for m in wanted if m != BATCHED}
            if together:  # (c) and (d) in interleaved rounds: same conditions, same number of runs
                for m in measure_together(together, k, model, repeats=repeats, budget_s=budget).values():
                    row[m.method] = m
                    say(_line(m))
            check_identical({name: m.answers for name, m in row.items()}, reference=SEQUENTIAL)
            cells[k] = row

        # "The time of 1 answer": (d) on each of the main questions alone, so that the K-answer
        # run is compared with answers of the same lengths, not with whichever question is first.
        singles = []
        for i in range(main_k):
            m = measure(MULTIDECODE, 1, runners[MULTIDECODE](prompts[i : i + 1]), model, repeats=1)
            singles.append(m)
            say(f"(d) question {i + 1} alone: {m.wall_s:.2f} s")
        check_identical({"alone": [m.answers[0] for m in singles], "together": cells[main_k][MULTIDECODE].answers})

    result = {
        "benchmark": "ask",
        "metadata": {**meta, "load_average_at_end": load_average(),
                     "elapsed_s": round(time.perf_counter() - started, 2)},
        "config": _config(decoder, document, questions, pool, prompts, main_k, all_ks, max_new_tokens,
                          sweep_methods, repeats, budgets, eos_ids, pad_id),
        "labels": LABELS,
        "main": _main(cells[main_k], pool, prompts, tokenizer),
        "sweep": [_sweep_row(k, cells[k], cells.get(1, {}), per_question) for k in all_ks],
    }
    result["scaling"] = _scaling(cells, main_k, per_question, singles)
    result["targets"] = _targets(result)
    result["answers_identical"] = True
    return result


# ---------------------------------------------------------------------- pieces of the result
def _line(m: Measurement) -> str:
    runs = f" (median of {len(m.runs_s)})" if len(m.runs_s) > 1 else ""
    return f"K={m.k} {LABELS[m.method]}: {m.wall_s:.2f} s{runs}, {m.forward_passes} forwards"


def _short_prompts(prompts: Sequence[Sequence[int]], keep: int = 96) -> list[list[int]]:
    """Cheap warm-up prompts: the first `keep` shared tokens plus each prompt's own tail."""
    n = shared_prefix_length(prompts)
    return [list(p[: min(keep, n)]) + list(p[n:]) for p in prompts]


def _warm_runner(method, prompts, model, decoder, eos_ids, pad_id):
    hf = dict(max_new_tokens=2, eos_ids=eos_ids, pad_id=pad_id)
    if method == SEQUENTIAL:
        return lambda c: hf_sequential(model, prompts[:1], c, **hf)
    if method == BATCHED:
        return lambda c: hf_batched(model, prompts, c, **hf)
    if method == SHARED:
        return lambda c: hf_shared_prefix(model, prompts, c, **hf)
    return lambda c: multidecode_forest(decoder, prompts, c, max_new_tokens=2)



def _config(decoder, document, questions, pool, prompts, main_k, ks, max_new_tokens, sweep_methods, repeats,
            budget, eos_ids, pad_id) -> dict:
    tokenizer = decoder.tokenizer
    doc_tokens = None
    if tokenizer is not None:
        doc_tokens = len(tokenizer(document, add_special_tokens=False)["input_ids"])
    main_prompts = prompts[:main_k]
    return {
        "max_new_tokens": max_new_tokens,
        "decoding": "greedy",
        "main_k": main_k,
        "ks": list(ks),
        "sweep_methods": list(sweep_methods),
        "repeats": repeats,
        "repeat_budget_s": budget[0],
        "sweep_repeat_budget_s": budget[1],
        "document_tokens": doc_tokens,
        "prompt_tokens": [len(p) for p in main_prompts],
        "shared_prefix_tokens": common_prefix_length(main_prompts),
        "questions": list(questions),
        "sweep_questions": list(pool),
        "eos_ids": list(eos_ids),
        "pad_id": pad_id,
        "notes": [
            "Answers are compared token for token, up to and including the first eos.",
            "The cost of (a) for K questions is the sum of its per-question runs.",
            "KV bytes: for HF, the cache tensors held at the end of generate (the largest cache held); "
            "for MultiDecode, the engine's peak allocated (preallocated) cache buffer.",
            "wall_s is the median of runs_s; prefill_s/decode_s are time inside model forward calls, "
            "other_s the rest (python, masks, sampling, cache copies).",
        ],
    }


def _main(row: dict[str, Measurement], pool, prompts, tokenizer) -> dict:
    d = row[MULTIDECODE]
    methods = {name: m.as_dict() for name, m in row.items()}
    ratios = {}
    for name, m in row.items():
        if name == MULTIDECODE:
            continue
        ratios[name] = {
            "speedup": m.wall_s / d.wall_s,
            "forward_passes_ratio": d.forward_passes / m.forward_passes,
            "tokens_per_s_ratio": d.tokens_per_s / m.tokens_per_s,
            "kv_bytes_ratio": d.peak_kv_bytes / m.peak_kv_bytes if m.peak_kv_bytes else None,
        }
    answers = []
    for i, ids in enumerate(d.answers):
        text = None
        if tokenizer is not None:
            text = tokenizer.decode(ids, skip_special_tokens=True)
        answers.append({"question": pool[i], "text": text, "token_ids": ids, "prompt_tokens": len(prompts[i])})
    return {"k": d.k, "methods": methods, "multidecode_vs": ratios, "answers": answers}


def _sweep_row(k: int, row: dict[str, Measurement], first: dict[str, Measurement],
               per_question: Sequence[Measurement]) -> dict:
    d = row.get(MULTIDECODE)
    out: dict = {"k": k, "methods": {name: m.as_dict() for name, m in row.items()}}
    answers = row[SEQUENTIAL].answers
    out["answer_tokens"] = [len(a) for a in answers]
    if d is not None:
        for name in (SEQUENTIAL, BATCHED, SHARED):
            if name in row:
                out[f"speedup_vs_{name}"] = row[name].wall_s / d.wall_s
        if MULTIDECODE in first:
            out["multidecode_time_vs_k1"] = d.wall_s / first[MULTIDECODE].wall_s
        out["multidecode_decode_ms_per_step"] = 1000 * d.decode_s / max(1, d.decode_passes)
        out["multidecode_time_vs_mean_single_question_generate"] = d.wall_s / (
            sum(p.wall_s for p in per_question[:k]) / k)
    return out


def _scaling(cells: dict[int, dict[str, Measurement]], main_k: int, per_question: Sequence[Measurement],
             singles: Sequence[Measurement]) -> dict:
    """How (d)'s time grows with K. "One answer" is the mean of (d) answering each of the K
    questions alone (`singles`): the sweep's K = 1 point is only the first question, whose answer
    may be much shorter than the longest of K (the forest decodes until its longest answer ends)."""
    main = cells[main_k].get(MULTIDECODE)
    if main is None:
        return {}
    step = {str(k): 1000 * row[MULTIDECODE].decode_s / max(1, row[MULTIDECODE].decode_passes)
            for k, row in cells.items() if MULTIDECODE in row}
    cost = {
        "k": main_k,
        "longest_answer_tokens": max(len(a) for a in main.answers),
        "decode_step_ms_k": step[str(main_k)],
        "times_mean_single_question_generate": main.wall_s / (sum(p.wall_s for p in per_question[:main_k]) / main_k),
    }
    if singles:
        mean_single = sum(m.wall_s for m in singles) / len(singles)
        cost.update({"times_one_answer": main.wall_s / mean_single, "mean_single_answer_s": mean_single,
                     "single_answer_s": [m.wall_s for m in singles],
                     "single_answer_tokens": [len(m.answers[0]) for m in singles]})
    times = {}
    one = cells.get(1, {}).get(MULTIDECODE)
    if one is not None:
        times = {str(k): row[MULTIDECODE].wall_s / one.wall_s for k, row in cells.items() if MULTIDECODE in row}
        cost.update({"times_first_question_alone": times[str(main_k)], "one_answer_tokens": len(one.answers[0]),
                     "decode_step_ms_k1": step["1"]})
    return {"multidecode_time_vs_one_answer": times, "multidecode_decode_ms_per_step": step, "answers_cost": cost}


def _targets(result: dict) -> list[dict]:
    ratios = result["main"]["multidecode_vs"]
    rows = []
    for name in (SEQUENTIAL, BATCHED, SHARED):
        if name in ratios:
            want = TARGETS[f"speedup_vs_{name}"]
            got = ratios[name]["speedup"]
            rows.append({"name": f"(d) speedup over {LABELS[name][:3]}", "target": f">= {want}x",
                         "measured": round(got, 3), "met": got >= want})
    if BATCHED in ratios and ratios[BATCHED]["kv_bytes_ratio"] is not None:
        got = ratios[BATCHED]["kv_bytes_ratio"]
        want = TARGETS["kv_bytes_vs_hf_batched"]
        rows.append({"name": "(d) KV bytes / (b) KV bytes", "target": f"<= {want}", "measured": round(got, 4),
                     "met": got <= want})
    cost = result.get("scaling", {}).get("answers_cost", {})
    if cost.get("times_one_answer") is not None:
        got = cost["times_one_answer"]
        want = TARGETS["time_k8_over_k1"]
        rows.append({"name": f"(d) time of {cost['k']} answers / 1 answer", "target": f"<= {want}x",
                     "measured": round(got, 3), "met": got <= want})
    return rows
