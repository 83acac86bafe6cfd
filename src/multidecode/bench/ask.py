"""Benchmark: many questions about one document, MultiDecode against transformers.

The methods answer the same questions from the same whole-prompt ids
(`MultiDecoder.question_prompts`), greedy, in one process:

- (a) `hf_sequential`: `model.generate` once per question, the full prompt each time; the cost
  of K questions is the sum of the first K single-question runs (each measured once);
- (b) `hf_batched`: one `generate` over all full prompts, left-padded (measured in rounds of its
  own: it is the costly one);
- (c) `hf_shared_prefix`: the shared prefix prefilled once, its `DynamicCache` copied to a batch,
  then one `generate` over the (left-padded inside the tail) question tails;
- (d) `multidecode`: one forest over one cache (`MultiDecoder.start`, what `ask` runs);
- (e) `multidecode_speculate`, with `speculate=MODE`: (d) with every branch speculating, where
  the decoder's `start` takes `speculate=` (left out, with the reason, where it does not).

At the main K (the number of questions) (d) also answers each question alone
(`multidecode_alone`), which gives "the time of one answer" for the scaling target. Every
method must give (a)'s answer ids (up to and including the first eos). The sweep runs
K = 1, 2, 4, 8, 16 questions (the list extended with `extra_questions`, then cycled).
"""

from __future__ import annotations

from collections.abc import Sequence

from .. import data
from ..errors import InvalidArgument
from ..prompts import common_prefix_length
from .common import (
    Progress,
    hf_batched,
    hf_sequential,
    hf_shared_prefix,
    multidecode_forest,
    pad_id_of,
    shared_prefix_length,
)
from .harness import Benchmark, Case, Method, Part, Plot, Runner, Target, declared_only, run

SEQUENTIAL, BATCHED, SHARED, MULTIDECODE = "hf_sequential", "hf_batched", "hf_shared_prefix", "multidecode"
ALONE, SPECULATING = "multidecode_alone", "multidecode_speculate"
METHODS = (SEQUENTIAL, BATCHED, SHARED, MULTIDECODE)
LABELS = {
    SEQUENTIAL: ("(a) HF generate, one question at a time", "(a) one by one"),
    BATCHED: ("(b) HF generate, left-padded batch of full prompts", "(b) padded batch"),
    SHARED: ("(c) HF shared-prefix cache copied to a batch", "(c) shared-prefix batch"),
    MULTIDECODE: ("(d) MultiDecode forest", "(d) MultiDecode"),
    ALONE: ("(d) MultiDecode, each question alone", "(d) alone"),
    SPECULATING: ("(e) MultiDecode forest, every branch speculating", "(e) speculating"),
}
"""Method -> (label, short label)."""

def extend_questions(questions: Sequence[str], extra: Sequence[str], n: int) -> list[str]:
    """`questions`, then `extra`, then the whole list again, until there are `n`."""
    pool = list(questions) + list(extra)
    return [pool[i % len(pool)] for i in range(max(n, len(questions)))]


def run_ask_benchmark(decoder, *, threads: int | None = None, progress: Progress | None = None, **settings) -> dict:
    """Measure (a)-(d) (and (e)) side by side and return the results as a JSON-ready dict; the
    settings are `ask_benchmark`'s. Raises `AnswersDiffer` if any method's answers differ from (a)'s."""
    return run(ask_benchmark(decoder, **settings), threads=threads, progress=progress)


def ask_benchmark(
    decoder,
    *,
    document: str | None = None,
    questions: Sequence[str] | None = None,
    extra_questions: Sequence[str] | None = None,
    max_new_tokens: int = 32,
    ks: Sequence[int] = (1, 2, 4, 8, 16),
    sweep_methods: Sequence[str] = METHODS,
    speculate: str | None = None,
    repeats: int = 3,
    repeat_budget_s: float = 30.0,
    sweep_repeat_budget_s: float = 8.0,
    warmup: bool = True,
) -> Benchmark:
    """The ask benchmark as data.

    decoder: a `MultiDecoder` (its model and tokenizer are used for every method).
    document, questions: default to the sample support call and its 8 questions.
    extra_questions: more questions for sweep points past len(questions) (default: 8 more about
        the sample document when it is the document; otherwise the list is cycled).
    ks: the sweep's question counts; the main comparison is at K = len(questions), always run.
    sweep_methods: which of (b), (c), (d) the sweep measures at K other than len(questions);
        (a) is always measured, as the reference. (e) runs wherever (d) does.
    speculate: a speculation mode for (e) ("lookup", "auto"); None leaves (e) out.
    repeat_budget_s, sweep_repeat_budget_s: the time budget of the rounds at the main K and
        elsewhere. On a machine shared with other busy processes, 1 thread is far steadier than 2.
    """
    if document is None:
        document = data.sample_document()
        if extra_questions is None:
            extra_questions = data.sample_questions("support_call_extra_questions.txt")
    questions = list(questions) if questions is not None else data.sample_questions()
    declared_only(sweep_methods, METHODS, "method(s)")
    if any(not isinstance(k, int) or isinstance(k, bool) or k < 1 for k in ks):
        raise InvalidArgument(f"every K must be a positive integer, got {list(ks)}", "pass ks=(1, 2, 4, 8, 16)")
    model, tokenizer = decoder.model, decoder.tokenizer
    main_k = len(questions)
    all_ks = sorted({int(k) for k in ks} | {main_k})
    pool = extend_questions(questions, extra_questions or (), max(all_ks))
    prompts = decoder.question_prompts(document, pool)
    eos_ids, pad_id = sorted(decoder.eos_ids), pad_id_of(model, tokenizer)

    def runner(name: str, ps: Sequence[Sequence[int]], new: int = max_new_tokens) -> Runner:
        if name == SPECULATING:
            return lambda c: multidecode_forest(decoder, ps, c, max_new_tokens=new, speculate=speculate)
        if name in (MULTIDECODE, ALONE):
            return lambda c: multidecode_forest(decoder, ps, c, max_new_tokens=new)
        baseline = {SEQUENTIAL: hf_sequential, BATCHED: hf_batched, SHARED: hf_shared_prefix}[name]
        return lambda c: baseline(model, ps, c, max_new_tokens=new, eos_ids=eos_ids, pad_id=pad_id)

    def method(name: str, ps: Sequence[Sequence[int]], new: int = max_new_tokens, **how) -> Method:
        return Method(name, LABELS[name][0], short=LABELS[name][1], run=runner(name, ps, new), **how)

    def one_by_one(name: str, k: int) -> Method:
        parts = tuple(Part(i, runner(name, prompts[i:i + 1])) for i in range(k))
        return Method(name, LABELS[name][0], short=LABELS[name][1], parts=parts)

    def case(k: int) -> Case:
        main = k == main_k
        methods = [one_by_one(SEQUENTIAL, k)]
        methods += [method(name, prompts[:k], solo=name == BATCHED) for name in (BATCHED, SHARED, MULTIDECODE)
                    if main or name in sweep_methods]
        if speculate and (main or MULTIDECODE in sweep_methods):
            methods.append(method(SPECULATING, prompts[:k]))
        if main:
            methods.append(one_by_one(ALONE, k))
        return Case({"k": k}, tuple(methods), budget_s=repeat_budget_s if main else sweep_repeat_budget_s,
                    main=main, targets=_targets(k) if main else (),
                    report=_answers(pool, prompts, tokenizer) if main else None)

    short = _short_prompts(prompts[:2])
    warm = [method(SEQUENTIAL, short[:1], 2)] + [method(name, short, 2) for name in (BATCHED, SHARED, MULTIDECODE)]
    if speculate:
        warm.append(method(SPECULATING, short, 2))
    return Benchmark(
        name="ask", title=f"{main_k} questions about one document, {max_new_tokens} new tokens at most, greedy",
        model=model, cases=tuple(case(k) for k in all_ks), reference=SEQUENTIAL,
        pairs=tuple((MULTIDECODE, b) for b in (SEQUENTIAL, BATCHED, SHARED))
        + tuple((SPECULATING, b) for b in (SEQUENTIAL, BATCHED, SHARED, MULTIDECODE)),
        config=_config(tokenizer, document, questions, pool, prompts[:main_k], max_new_tokens, all_ks, sweep_methods,
                       speculate, eos_ids, pad_id),
        warmup=tuple(warm) if warmup else (), repeats=repeats,
        columns=("wall_s", "forward_passes", "tokens_per_s", "peak_kv_bytes", "prefill_s", "decode_ms_per_step"),
        plot=Plot("sweep", figures=("wall_s",), x="k", xlabel="questions K"),
    )


def _short_prompts(prompts: Sequence[Sequence[int]], keep: int = 96) -> list[list[int]]:
    """Cheap warm-up prompts: the first `keep` shared tokens plus each prompt's own tail."""
    n = shared_prefix_length(prompts)
    return [list(p[: min(keep, n)]) + list(p[n:]) for p in prompts]


def _targets(k: int) -> tuple[Target, ...]:
    return (
        Target("(d) speedup over (a)", ("multidecode_vs", SEQUENTIAL, "speedup"), ">=", 5.0),
        Target("(d) speedup over (b)", ("multidecode_vs", BATCHED, "speedup"), ">=", 3.0),
        Target("(d) speedup over (c)", ("multidecode_vs", SHARED, "speedup"), ">=", 1.5),
        Target("(d) KV bytes / (b) KV bytes", ("multidecode_vs", BATCHED, "kv_bytes_ratio"), "<=", 0.25, unit=""),
        Target(f"(d) time of {k} answers / 1 answer", ("answers_cost", "times_one_answer"), "<=", 1.6),
        Target("(e) speedup over (a)", (f"{SPECULATING}_vs", SEQUENTIAL, "speedup"), ">=", 6.5),
    )


def _answers(pool: Sequence[str], prompts, tokenizer):
    """The main case's answers as text, and what K answers cost against one: "one answer" is the
    mean of (d) answering each question alone, not the first question alone, because the forest
    decodes until its longest answer ends."""
    def report(got: dict) -> dict:
        d, alone = got[MULTIDECODE], got[ALONE]
        mean_single = alone.wall_s / len(alone.answers)
        answers = [{"question": pool[i], "text": tokenizer.decode(ids, skip_special_tokens=True) if tokenizer else None,
                    "token_ids": ids, "prompt_tokens": len(prompts[i])} for i, ids in enumerate(d.answers)]
        cost = {"k": len(d.answers), "longest_answer_tokens": max(len(a) for a in d.answers),
                "times_one_answer": d.wall_s / mean_single, "mean_single_answer_s": mean_single,
                "single_answer_s": alone.runs_s, "single_answer_tokens": [len(a) for a in alone.answers]}
        return {"answers": answers, "answers_cost": cost}
    return report


def _config(tokenizer, document, questions, pool, main_prompts, max_new_tokens, ks, sweep_methods, speculate,
            eos_ids, pad_id) -> dict:
    return {
        "max_new_tokens": max_new_tokens,
        "decoding": "greedy",
        "main_k": len(main_prompts),
        "ks": list(ks),
        "sweep_methods": list(sweep_methods),
        "speculate": speculate,
        "document_tokens": len(tokenizer(document, add_special_tokens=False)["input_ids"]) if tokenizer else None,
        "prompt_tokens": [len(p) for p in main_prompts],
        "shared_prefix_tokens": common_prefix_length(main_prompts),
        "questions": list(questions),
        "sweep_questions": list(pool),
        "eos_ids": list(eos_ids),
        "pad_id": pad_id,
        "notes": ["The cost of (a) for K questions is the sum of its per-question runs."],
    }
