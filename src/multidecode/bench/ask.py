"""Benchmark: many questions about one document, (a)-(c) transformers, (d) one forest, (e) the
forest speculating, and (d) answering each question alone (docs/benchmarks.md, `bench ask`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .. import data
from ..errors import check_counts, check_known
from ..exact import is_exact
from ..prompts import common_prefix_length
from ..speculation import SpeculationSettings
from .common import Setup, hf_batched, hf_sequential, hf_shared_prefix, multidecode_forest, shared_prefix_length
from .harness import Benchmark, Case, Method, Part, Plot, Target, runs

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
BASELINES = {SEQUENTIAL: hf_sequential, BATCHED: hf_batched, SHARED: hf_shared_prefix}


def ask_benchmark(decoder, *, document: str | None = None, questions: Sequence[str] | None = None,
                  extra_questions: Sequence[str] | None = None, max_new_tokens: int = 32,
                  ks: Sequence[int] = (1, 2, 4, 8, 16), sweep_methods: Sequence[str] = METHODS,
                  speculate: str | SpeculationSettings | None = None, repeats: int = 3, repeat_budget_s: float = 30.0,
                  sweep_repeat_budget_s: float = 8.0, warmup: bool = True) -> Benchmark:
    """The ask benchmark as data (the sample call and its questions by default): ks, the sweep's question counts
    (len(questions) always); sweep_methods, which of (b)-(d) it measures; speculate, (e)'s mode (None: no (e))."""
    if document is None:
        document = data.sample_document()
        if extra_questions is None:
            extra_questions = data.sample_questions("support_call_extra_questions.txt")
    questions = list(questions) if questions is not None else data.sample_questions()
    check_known(sweep_methods, METHODS, "method(s)")
    check_counts("K", ks, "pass ks=(1, 2, 4, 8, 16)")
    if not isinstance(speculate, SpeculationSettings):
        speculate = SpeculationSettings.parse(speculate)
    speculate.check(decoder.model.dtype, draft=decoder.draft, exact=is_exact(decoder.model))
    if not speculate.off:
        decoder.speculation(speculate)  # a learned mode without its head is refused here, before the warm-up
    all_ks = sorted({int(k) for k in ks} | {len(questions)})
    pool = questions + list(extra_questions or ())  # then the whole list again, until there are enough
    pool = [pool[i % len(pool)] for i in range(max(all_ks))]
    plan = _Plan(Setup.of(decoder), decoder.question_prompts(document, pool), pool, len(questions), max_new_tokens,
                 tuple(sweep_methods), speculate, (repeat_budget_s, sweep_repeat_budget_s))
    return Benchmark(
        name="ask", title=f"{plan.main_k} questions about one document, {max_new_tokens} new tokens at most, greedy",
        model=decoder.model, cases=tuple(plan.case(k) for k in all_ks), reference=SEQUENTIAL,
        pairs=tuple((MULTIDECODE, b) for b in (SEQUENTIAL, BATCHED, SHARED))
        + tuple((SPECULATING, b) for b in (SEQUENTIAL, BATCHED, SHARED, MULTIDECODE)),
        config=plan.config(document, questions, all_ks), warmup=plan.warmup() if warmup else (), repeats=repeats,
        columns=("wall_s", "forward_passes", "tokens_per_s", "peak_kv_bytes", "prefill_s", "decode_ms_per_step"),
        plot=Plot("sweep", figures=("wall_s",), x="k", xlabel="questions K"),
    )


run_ask_benchmark = runs(ask_benchmark)


@dataclass(frozen=True)
class _Plan:
    """The benchmark's prompts (one per question of `pool`) and how each case measures them."""

    setup: Setup
    prompts: list[list[int]]
    pool: list[str]
    main_k: int
    max_new_tokens: int
    sweep_methods: tuple[str, ...]
    speculate: SpeculationSettings
    budgets_s: tuple[float, float]  # at the main K, elsewhere

    def method(self, name: str, prompts: Sequence[Sequence[int]], new: int | None = None, **how) -> Method:
        new = new or self.max_new_tokens
        if name in BASELINES:
            return Method.named(LABELS, name, run=self.setup.baseline(BASELINES[name], prompts, new), **how)
        speculate = self.speculate if name == SPECULATING else None
        return Method.named(LABELS, name, **how, run=lambda c: multidecode_forest(
            self.setup.decoder, prompts, c, max_new_tokens=new, speculate=speculate))

    def one_by_one(self, name: str, k: int) -> Method:
        return Method.named(LABELS, name, parts=tuple(Part(i, self.method(name, self.prompts[i:i + 1]).run)
                                                      for i in range(k)))

    def case(self, k: int) -> Case:
        main = k == self.main_k
        methods = [self.one_by_one(SEQUENTIAL, k)]
        methods += [self.method(name, self.prompts[:k], solo=name == BATCHED) for name in (BATCHED, SHARED, MULTIDECODE)
                    if main or name in self.sweep_methods]
        if not self.speculate.off and (main or MULTIDECODE in self.sweep_methods):
            methods.append(self.method(SPECULATING, self.prompts[:k]))
        if main:
            methods.append(self.one_by_one(ALONE, k))
        return Case({"k": k}, tuple(methods), budget_s=self.budgets_s[0] if main else self.budgets_s[1], main=main,
                    targets=_targets(k) if main else (), report=self.answers if main else None)

    def warmup(self) -> tuple[Method, ...]:
        """Every method once on cheap prompts: the first 96 shared tokens plus each prompt's own tail."""
        n = shared_prefix_length(self.prompts[:2])
        short = [p[:min(96, n)] + p[n:] for p in self.prompts[:2]]
        names = (BATCHED, SHARED, MULTIDECODE) + (() if self.speculate.off else (SPECULATING,))
        return (self.method(SEQUENTIAL, short[:1], 2), *(self.method(name, short, 2) for name in names))

    def answers(self, got: dict) -> dict:
        """The main case's answers as text, and K answers' time over one (the mean of (d) alone)."""
        d, alone = got[MULTIDECODE], got[ALONE]
        mean_single = alone.wall_s / len(alone.answers)
        answers = [{"question": self.pool[i], "text": self.setup.text(ids), "token_ids": ids,
                    "prompt_tokens": len(self.prompts[i])} for i, ids in enumerate(d.answers)]
        cost = {"k": len(d.answers), "longest_answer_tokens": max(len(a) for a in d.answers),
                "times_one_answer": d.wall_s / mean_single, "mean_single_answer_s": mean_single,
                "single_answer_s": alone.runs_s, "single_answer_tokens": [len(a) for a in alone.answers]}
        return {"answers": answers, "answers_cost": cost}

    def config(self, document: str, questions: list[str], ks: list[int]) -> dict:
        main_prompts, tokenizer = self.prompts[:self.main_k], self.setup.tokenizer
        return {
            "max_new_tokens": self.max_new_tokens, "decoding": "greedy", "main_k": self.main_k, "ks": list(ks),
            "sweep_methods": list(self.sweep_methods), "speculate": self.speculate.mode,
            "document_tokens": len(tokenizer(document, add_special_tokens=False)["input_ids"]) if tokenizer else None,
            "prompt_tokens": [len(p) for p in main_prompts], "shared_prefix_tokens": common_prefix_length(main_prompts),
            "questions": list(questions), "sweep_questions": list(self.pool), "eos_ids": list(self.setup.eos_ids),
            "pad_id": self.setup.pad_id,
        }


def _targets(k: int) -> tuple[Target, ...]:
    return (
        Target("(d) speedup over (a)", ("multidecode_vs", SEQUENTIAL, "speedup"), ">=", 5.0),
        Target("(d) speedup over (b)", ("multidecode_vs", BATCHED, "speedup"), ">=", 3.0),
        Target("(d) speedup over (c)", ("multidecode_vs", SHARED, "speedup"), ">=", 1.5),
        Target("(d) KV bytes / (b) KV bytes", ("multidecode_vs", BATCHED, "kv_bytes_ratio"), "<=", 0.25, unit=""),
        Target(f"(d) time of {k} answers / 1 answer", ("answers_cost", "times_one_answer"), "<=", 1.6),
        Target("(e) speedup over (a)", (f"{SPECULATING}_vs", SEQUENTIAL, "speedup"), ">=", 6.5),
    )
