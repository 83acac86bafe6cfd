"""Benchmark: the batch job run for real, on similar documents and on a day's logs in merged forests
(docs/benchmarks.md, `bench batch`)."""

from __future__ import annotations

import functools
import json
import tempfile
import time
from pathlib import Path

from .. import data
from ..batch import BatchSettings, open_batch, total_stats
from ..batch.merged import FOREST_TOKENS
from ..cost import cost_curve
from ..errors import check_positive
from ..speculation import SpeculationSettings
from .common import ForwardCounter, RunOutput, Setup, auto_over, fresh, hf_sequential, spread, suffix_over
from .harness import Benchmark, Case, Method, Plot, Target, runs

PLAIN, LOOKUP, SUFFIX, AUTO = "batch_plain", "batch_lookup", "batch_suffix", "batch_auto"
LABELS = {
    PLAIN: ("batch job, speculate=None", "plain"),
    LOOKUP: ("batch job, speculate='lookup'", "lookup"),
    SUFFIX: ("batch job, suffix over a new store", "suffix"),
    AUTO: ("batch job, auto over a new store", "auto"),
}
SPECULATE = {PLAIN: None, LOOKUP: SpeculationSettings.parse("lookup"), SUFFIX: suffix_over, AUTO: auto_over}
"""Method -> `speculate=` for one run of the job (a function: a fresh store for all its documents)."""
TARGETS = {SUFFIX: 1.0, AUTO: 1.0}
"""Speed-ups over the plain job that the methods are held to."""
GENERATE, ONE, MERGED, MERGED_SUFFIX = "generate_loop", "one_at_a_time", "merged", "merged_suffix"
MERGED_LABELS = {
    GENERATE: ("HF generate, one question at a time", "generate loop"),
    ONE: ("batch job, one document at a time", "one at a time"),
    MERGED: ("batch job, merged forests", "merged"),
    MERGED_SUFFIX: ("batch job, merged forests, suffix drafts", "merged + suffix"),
}
MERGED_TARGETS = ((MERGED, ONE, 1.3), (MERGED, GENERATE, 6.0))
"""(fast, slow, speed-up) the merged job is held to."""


def similar_documents(n: int) -> list[dict]:
    """n support calls in the style of `data/example_batch.jsonl`, as input lines ({"id",
    "document"}), made of `data/similar_call_*` by index: the same n always gives the same calls."""
    problems = [json.loads(line) for line in data.lines("similar_call_problems.jsonl")]
    parts, rows = json.loads(data.text("similar_call_parts.json")), []

    def pick(kind: str, i: int):
        return parts[kind][i % len(parts[kind])]

    for i in range(n):
        customer, agent, credit = pick("customers", i), pick("agents", i * 3 + i // 4), pick("credits", i * 2)
        problem, ticket = problems[(i * 5) % len(problems)], 48213 + 17 * i
        first, agent_first = customer.split()[0], agent.split()[0]
        reply = [problem["cause"], problem["done"],
                 f"I am sending you {problem['sent']}." if problem["sent"] else "Nothing needs to be sent.",
                 pick("visits", i), f"I have added a credit of {credit} dollars to your account." if credit else
                 "There is no credit for this one."]
        document = (f"Support call. Northwind Fiber. Ticket number {ticket}. Agent: {agent}. Customer: {customer}.\n"
                    f"{first}: {problem['complaint']} {problem['since']}. My router is a Northwind Gateway "
                    f"{pick('routers', i // 2)}.\n{agent_first}: {' '.join(r for r in reply if r)}\n"
                    f"{first}: Thank you, that helps.")
        rows.append({"id": f"call-{ticket}", "document": document})
    return rows


def questions() -> list[str]:
    """The 8 shipped questions about a support call."""
    return data.sample_questions()


def call_logs(n: int) -> list[dict]:
    """n input lines, each a day's log of 3 to 12 support calls (about 300 to 1,500 tokens) with
    its own 4 to 8 questions; the same n always gives the same lines."""
    calls, asking = similar_documents(64), data.lines("call_log_questions.txt")  # line i asks 4 to 8 of them
    rows = []
    for i in range(n):
        first = (i * 7) % len(calls)
        document = "\n\n".join(calls[(first + j) % len(calls)]["document"] for j in range(3 + (i * 7) % 10))
        rows.append({"id": f"log-{i + 1}", "document": f"Support line log, day {i + 1}.\n\n{document}",
                     "questions": [asking[(i + j) % len(asking)] for j in range(4 + (i * 3) % 5)]})
    return rows


def run_job(decoder, rows: list[dict], settings: BatchSettings, speculate, counter: ForwardCounter, *,
            forest_tokens: int = FOREST_TOKENS, forwards_from_stats: bool = True) -> RunOutput:
    """The whole job once over the input lines `rows`, in a temporary folder: its answers in input order,
    documents/s and drafts (forwards too where `forwards_from_stats`; merged lines' are counted at the model)."""
    by_line, stats = {}, []
    with tempfile.TemporaryDirectory(prefix="multidecode-bench-batch-") as folder:
        source, out = Path(folder) / "documents.jsonl", Path(folder) / "answers.jsonl"
        source.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        started = time.perf_counter()
        with open_batch(source, out, settings) as job:
            for result in job.run(decoder, speculate=fresh(speculate), forest_tokens=forest_tokens):
                if not result.ok:
                    raise AssertionError(f"line {result.line} failed: {result.error['message']}")
                by_line[result.line] = [list(a.token_ids) for a in result.answers]
                stats.append(result.stats)
        wall = time.perf_counter() - started
    total = total_stats(stats)
    extra = {k: total[k] for k in ("speculate", "drafted", "accepted", "acceptance", "steps", "steps_speculating",
                                   "mean_draft_budget")} | {"documents_per_s": len(by_line) / wall}
    answers = [a for line in sorted(by_line) for a in by_line[line]]
    return RunOutput(answers, 0, forward_passes=total["forward_passes"] if forwards_from_stats else None, extra=extra)


def similar_benchmark(decoder, *, documents: int = 16, max_new_tokens: int = 48, repeats: int = 3,
                      budget_s: float = 300.0, warmup: bool = True) -> Benchmark:
    """The batch job over `documents` similar calls with every method, side by side, as data."""
    check_positive("documents", documents)
    check_positive("max_new_tokens", max_new_tokens)
    if decoder.cost is None:
        cost_curve(decoder.model)  # "auto" needs it: measured (once) before the timing, not inside it
    setup, asked, rows = Setup.of(decoder), questions(), similar_documents(documents)

    def methods(lines: list[dict], new: int) -> tuple[Method, ...]:
        job = BatchSettings(questions=tuple(asked), max_new_tokens=new, model="bench")
        return tuple(Method.named(LABELS, name, run=functools.partial(run_job, decoder, lines, job, speculate))
                     for name, speculate in SPECULATE.items())

    def report(got: dict) -> dict:
        return {"document_tokens": _token_counts(setup.tokenizer, rows), "first_document": rows[0]["document"],
                "first_answers": [setup.text(ids) for ids in got[PLAIN].answers[: len(asked)]]}

    targets = tuple(Target(f"{LABELS[name][1]} over the plain job", (f"{name}_vs", PLAIN, "speedup"), ">=", value)
                    for name, value in TARGETS.items())
    return Benchmark(
        name="batch", title=f"the batch job over {documents} similar documents, {len(asked)} questions each",
        model=decoder.model, reference=PLAIN, pairs=tuple((name, PLAIN) for name in LABELS if name != PLAIN),
        cases=(Case({"documents": documents}, methods(rows, max_new_tokens), budget_s=budget_s, targets=targets,
                    report=report),),
        config={"documents": documents, "questions": asked, "max_new_tokens": max_new_tokens, "decoding": "greedy"},
        warmup=methods(similar_documents(2), 2) if warmup else (), repeats=repeats,
        columns=("wall_s", "forward_passes", "tokens_per_forward", "acceptance", "tokens_per_s"),
        plot=Plot("bars", figures=("wall_s", "forward_passes", "tokens_per_forward", "acceptance")), rows_key=None,
    )


run_batch_benchmark = runs(similar_benchmark)


def merged_benchmark(decoder, *, documents: int = 24, max_new_tokens: int = 48, repeats: int = 1,
                     budget_s: float = 600.0, forest_tokens: int = FOREST_TOKENS, warmup: bool = True) -> Benchmark:
    """HF generate per question, the job one document at a time and in merged forests, over call logs, as data."""
    check_positive("documents", documents)
    check_positive("max_new_tokens", max_new_tokens)
    setup, rows = Setup.of(decoder), call_logs(documents)
    prompts = [p for r in rows for p in decoder.question_prompts(r["document"], r["questions"])]

    def generate_loop(counter: ForwardCounter) -> RunOutput:
        started = time.perf_counter()
        out = setup.baseline(hf_sequential, prompts, max_new_tokens)(counter)
        out.extra["documents_per_s"] = len(rows) / (time.perf_counter() - started)
        return out

    def jobs(lines: list[dict], new: int) -> tuple[Method, ...]:
        job = BatchSettings(max_new_tokens=new, model="bench")
        return tuple(Method.named(MERGED_LABELS, name, run=functools.partial(
            run_job, decoder, lines, job, speculate, forest_tokens=budget, forwards_from_stats=budget == 0))
            for name, budget, speculate in ((ONE, 0, None), (MERGED, forest_tokens, None),
                                            (MERGED_SUFFIX, forest_tokens, suffix_over)))

    targets = tuple(Target(f"{MERGED_LABELS[fast][1]} over {MERGED_LABELS[slow][1]}",
                           (f"{fast}_vs", slow, "speedup"), ">=", value) for fast, slow, value in MERGED_TARGETS)
    return Benchmark(
        name="batch", title=f"the batch job over {documents} documents of 300-1,500 tokens, 4-8 questions each",
        model=decoder.model, reference=GENERATE,
        pairs=((MERGED, ONE), (MERGED_SUFFIX, ONE), (ONE, GENERATE), (MERGED, GENERATE), (MERGED_SUFFIX, GENERATE)),
        cases=(Case({"documents": documents}, (Method.named(MERGED_LABELS, GENERATE, run=generate_loop),
                                                *jobs(rows, max_new_tokens)), budget_s=budget_s, targets=targets,
                    report=lambda got: {"document_tokens": _token_counts(setup.tokenizer, rows),
                                        "questions": sum(len(r["questions"]) for r in rows)}),),
        config={"workload": "merged", "documents": documents, "max_new_tokens": max_new_tokens,
                "forest_tokens": forest_tokens, "decoding": "greedy"},
        warmup=jobs(call_logs(2), 2) if warmup else (), repeats=repeats,
        columns=("wall_s", "documents_per_s", "tokens_per_s", "forward_passes", "tokens_per_forward"),
        plot=Plot("bars", figures=("wall_s", "documents_per_s", "tokens_per_s", "forward_passes")), rows_key=None,
    )


run_merged_benchmark = runs(merged_benchmark)


def _token_counts(tokenizer, rows: list[dict]) -> dict | None:
    """The least, most and mean tokens of the lines' documents (None without a tokenizer)."""
    return spread([len(tokenizer(r["document"])["input_ids"]) for r in rows]) if tokenizer is not None else None
