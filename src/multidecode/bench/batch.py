"""Benchmark: the batch job over many similar documents, with and without speculation.

The suffix proposer pays on repetitive work, and a batch job is that: the same 8 questions
(`data/support_call_questions.txt`) about N support calls that differ only in names, ticket
numbers, router models, problem, visit and credit, so their answers repeat each other's words.
The documents (`similar_documents`) follow the four calls of `data/example_batch.jsonl`, built
from fixed lists by index (no randomness), about 100-150 tokens each.

Every method runs the real job (`open_batch` and `BatchJob.run`, as `run_batch` does: records
appended and fsync-ed to a fresh output file in a temporary folder), greedy:
- `batch_plain`: no speculation, the reference every other method must equal token for token;
- `batch_lookup`: prompt lookup in every branch (drafts from the branch's own prompt and output);
- `batch_suffix`: the suffix proposer over a store that is new for each run, so that only this
  run's earlier documents (prompts and answers) help: the job learns as it goes;
- `batch_auto`: "auto" (lookup and suffix merged, sized by the cost curve) over a new store.

Figures per method: wall time of the whole job, forward passes, tokens per forward, acceptance
(accepted / drafted draft tokens, summed over the documents) and tokens/s.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from .. import data
from ..batch import BatchSettings, lock_path, meta_path, open_batch, total_stats
from ..batch.merged import FOREST_TOKENS
from ..cost import cost_curve
from ..errors import check_positive
from ..proposers.suffix import SuffixProposer, SuffixStore
from ..speculation import Speculation, auto_proposer
from .common import ForwardCounter, Progress, RunOutput, hf_sequential, pad_id_of
from .harness import Benchmark, Case, Method, Plot, Runner, Target, run

PLAIN, LOOKUP, SUFFIX, AUTO = "batch_plain", "batch_lookup", "batch_suffix", "batch_auto"
LABELS = {
    PLAIN: ("batch job, speculate=None", "plain"),
    LOOKUP: ("batch job, speculate='lookup'", "lookup"),
    SUFFIX: ("batch job, suffix over a new store", "suffix"),
    AUTO: ("batch job, auto over a new store", "auto"),
}
"""Method -> (label, short label)."""
SPECULATE = {
    PLAIN: lambda: None,
    LOOKUP: lambda: "lookup",
    SUFFIX: lambda: SuffixProposer(store=SuffixStore()),
    AUTO: lambda: Speculation(auto_proposer(SuffixStore()), None),
}
"""Method -> a fresh `speculate=` value for one run of the job (one store for all its documents)."""
TARGETS = {SUFFIX: 1.0, AUTO: 1.0}
"""Speed-ups over the plain job that the methods are held to."""

# ---------------------------------------------------------------------- the documents
CUSTOMERS = ["Daniel Okafor", "Aiko Tanaka", "Lena Fischer", "Rosa Delgado", "Omar Haddad", "Grace Mensah",
             "Piotr Nowak", "Sofia Rossi", "Kwame Boateng", "Mei Lin", "Lucas Moreau"]
AGENTS = ["Priya Raman", "Marco Silva", "Tom Becker", "Hannah Cole"]
ROUTERS = ["G7", "G5", "G9"]
PROBLEMS = [
    # (complaint, since when, cause, what is sent or None, what else the agent did)
    ("My internet keeps dropping every twenty minutes", "since Saturday",
     "The line test shows the optical signal falling, so the fiber connector is dirty or bent.",
     "a new patch cable today", ""),
    ("The Wi-Fi keeps disappearing whenever the microwave runs", "since Monday morning",
     "Your router only uses the 2.4 GHz band, which the microwave disturbs.",
     "a G7 router that also uses 5 GHz", ""),
    ("My connection has been very slow", "for three days",
     "Your router firmware is out of date and has a known speed bug.",
     None, "I have updated it remotely; please restart the router tonight."),
    ("Nothing has worked at all", "since the storm last night",
     "The storm damaged the line outside your house.",
     "a mobile hotspot so you can work until then", ""),
    ("Video calls keep freezing every evening", "since last week",
     "Your area's network node is overloaded at peak hours.",
     None, "I have moved your line to a new node."),
    ("The router keeps restarting by itself several times a day", "since Tuesday",
     "The power adapter of your router is failing.",
     "a new power adapter today", ""),
]
VISITS = ["A technician will visit on Thursday between 8 and 12.", "No technician visit is needed.",
          "A technician will visit tomorrow, Friday, at 2 pm.", "A technician will visit on Monday between 1 and 5.",
          "No technician visit is needed."]
CREDITS = [15, 10, 0, 25, 20]


def similar_documents(n: int) -> list[dict]:
    """n support calls in the style of `data/example_batch.jsonl`, as input lines
    ({"id", "document"}); the same n always gives the same calls."""
    rows = []
    for i in range(n):
        customer, agent = CUSTOMERS[i % len(CUSTOMERS)], AGENTS[(i * 3 + i // 4) % len(AGENTS)]
        complaint, since, cause, sent, done = PROBLEMS[(i * 5) % len(PROBLEMS)]
        router, visit, credit = ROUTERS[(i // 2) % len(ROUTERS)], VISITS[i % len(VISITS)], CREDITS[(i * 2) % 5]
        ticket = 48213 + 17 * i
        first, agent_first = customer.split()[0], agent.split()[0]
        reply = [cause, done, f"I am sending you {sent}." if sent else "Nothing needs to be sent.", visit,
                 f"I have added a credit of {credit} dollars to your account." if credit else
                 "There is no credit for this one."]
        document = (f"Support call. Northwind Fiber. Ticket number {ticket}. Agent: {agent}. Customer: {customer}.\n"
                    f"{first}: {complaint} {since}. My router is a Northwind Gateway {router}.\n"
                    f"{agent_first}: {' '.join(r for r in reply if r)}\n"
                    f"{first}: Thank you, that helps.")
        rows.append({"id": f"call-{ticket}", "document": document})
    return rows


def questions() -> list[str]:
    """The 8 shipped questions about a support call."""
    return data.sample_questions()


# ---------------------------------------------------------------------- one run of the job
def run_job(decoder, source: Path, folder: Path, settings: BatchSettings, speculate, counter: ForwardCounter, *,
            forest_tokens: int = FOREST_TOKENS, forwards_from_stats: bool = True) -> RunOutput:
    """The whole batch job once, into a new output file in `folder` (removed afterwards); its
    answers' token ids in input order (records come in the order lines finish), its documents/s,
    and its drafts summed from the lines' stats. forwards_from_stats: count forwards from the
    lines' stats (right for one line at a time); otherwise the counter's hooked count (in a merged
    forest the lines share their forwards)."""
    with tempfile.NamedTemporaryFile(dir=folder, suffix=".jsonl", delete=False) as handle:
        out = Path(handle.name)
    by_line, stats = {}, []
    started = time.perf_counter()
    try:
        with open_batch(source, out, settings) as job:
            for result in job.run(decoder, speculate=speculate, forest_tokens=forest_tokens):
                if not result.ok:
                    raise AssertionError(f"line {result.line} failed: {result.error['message']}")
                by_line[result.line] = [list(a.token_ids) for a in result.answers]
                stats.append(result.stats)
    finally:
        for path in (out, meta_path(out), lock_path(out)):
            path.unlink(missing_ok=True)
    wall = time.perf_counter() - started
    total = total_stats(stats)
    extra = {k: total[k] for k in ("speculate", "drafted", "accepted", "acceptance", "steps", "steps_speculating",
                                   "mean_draft_budget")}
    extra["documents_per_s"] = len(by_line) / wall
    answers = [a for line in sorted(by_line) for a in by_line[line]]
    return RunOutput(answers, 0, forward_passes=total["forward_passes"] if forwards_from_stats else None, extra=extra)


def run_batch_benchmark(decoder, *, documents: int = 16, max_new_tokens: int = 48, repeats: int = 3,
                        budget_s: float = 300.0, warmup: bool = True, threads: int | None = None,
                        progress: Progress | None = None) -> dict:
    """Run the batch job over `documents` similar calls with every method, side by side.

    budget_s: the time budget for rounds of all methods (one round always runs).
    Raises `AnswersDiffer` where a method's answers differ from the plain job's.
    """
    check_positive("documents", documents)
    check_positive("max_new_tokens", max_new_tokens)
    if decoder.cost is None:
        cost_curve(decoder.model)  # "auto" needs it: measured (once) before the timing, not inside it
    asked = questions()
    rows = similar_documents(documents)
    settings = BatchSettings(questions=tuple(asked), max_new_tokens=max_new_tokens, model="bench")
    tokenizer = decoder.tokenizer
    lengths = [len(tokenizer(r["document"])["input_ids"]) for r in rows] if tokenizer is not None else []
    with tempfile.TemporaryDirectory(prefix="multidecode-bench-batch-") as tmp:
        folder = Path(tmp)
        source = folder / "documents.jsonl"
        source.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        warm_source = folder / "warmup.jsonl"
        warm_source.write_text("".join(json.dumps(r) + "\n" for r in similar_documents(2)), encoding="utf-8")
        warm_settings = BatchSettings(questions=tuple(asked), max_new_tokens=2, model="bench")

        def methods(path: Path, job: BatchSettings) -> tuple[Method, ...]:
            def method(name: str) -> Method:
                return Method(name, LABELS[name][0], short=LABELS[name][1],
                              run=lambda c: run_job(decoder, path, folder, job, SPECULATE[name](), c))
            return tuple(method(name) for name in LABELS)

        def report(got: dict) -> dict:
            first = got[PLAIN].answers[: len(asked)]
            texts = [tokenizer.decode(ids, skip_special_tokens=True) if tokenizer is not None else None for ids in first]
            return {"document_tokens": {"min": min(lengths), "max": max(lengths),
                                        "mean": round(sum(lengths) / len(lengths), 1)} if lengths else None,
                    "first_document": rows[0]["document"], "first_answers": texts}

        targets = tuple(Target(f"{LABELS[name][1]} over the plain job", (f"{name}_vs", PLAIN, "speedup"), ">=", value)
                        for name, value in TARGETS.items())
        bench = Benchmark(
            name="batch", title=f"the batch job over {documents} similar documents, {len(asked)} questions each",
            model=decoder.model, reference=PLAIN, pairs=tuple((name, PLAIN) for name in LABELS if name != PLAIN),
            cases=(Case({"documents": documents}, methods(source, settings), budget_s=budget_s, targets=targets,
                        report=report),),
            config={"documents": documents, "questions": asked, "max_new_tokens": max_new_tokens,
                    "decoding": "greedy", "notes": [
                        ("Each run is the whole job into a new output file; suffix and auto start from an empty "
                         "store each run, so only that run's earlier documents help."),
                        "drafted/accepted/acceptance are summed over the job's documents from their decode stats.",
                    ]},
            warmup=methods(warm_source, warm_settings) if warmup else (), repeats=repeats,
            columns=("wall_s", "forward_passes", "tokens_per_forward", "acceptance", "tokens_per_s"),
            plot=Plot("bars", figures=("wall_s", "forward_passes", "tokens_per_forward", "acceptance")),
            rows_key=None,
        )
        return run(bench, threads=threads, progress=progress)


# ---------------------------------------------------------------------- merged forests
GENERATE, ONE, MERGED, MERGED_SUFFIX = "generate_loop", "one_at_a_time", "merged", "merged_suffix"
MERGED_LABELS = {
    GENERATE: ("HF generate, one question at a time", "generate loop"),
    ONE: ("batch job, one document at a time", "one at a time"),
    MERGED: ("batch job, merged forests", "merged"),
    MERGED_SUFFIX: ("batch job, merged forests, suffix drafts", "merged + suffix"),
}
"""Method -> (label, short label) of the merged-forests workload."""
MERGED_TARGETS = ((MERGED, ONE, 1.3), (MERGED, GENERATE, 6.0))
"""(fast, slow, speed-up) the merged job is held to."""
LOG_QUESTIONS = [
    "How many calls are in this log?",
    "Which customers called?",
    "Which routers are mentioned?",
    "Is a technician visit planned, and when?",
    "What credits were given?",
    "Which agents took the calls?",
    "What was the most common problem?",
    "Summarize the log in one sentence.",
]
"""Questions about a day's log of support calls; line i asks 4 to 8 of them."""


def call_logs(n: int) -> list[dict]:
    """n input lines, each a day's log of 3 to 12 support calls (about 300 to 1,500 tokens) with
    its own 4 to 8 questions; the same n always gives the same lines."""
    calls = similar_documents(64)
    rows = []
    for i in range(n):
        count = 3 + (i * 7) % 10
        first = (i * 7) % len(calls)
        document = "\n\n".join(calls[(first + j) % len(calls)]["document"] for j in range(count))
        asked = [LOG_QUESTIONS[(i + j) % len(LOG_QUESTIONS)] for j in range(4 + (i * 3) % 5)]
        rows.append({"id": f"log-{i + 1}", "document": f"Support line log, day {i + 1}.\n\n{document}",
                     "questions": asked})
    return rows


def run_merged_benchmark(decoder, *, documents: int = 24, max_new_tokens: int = 48, repeats: int = 1,
                         budget_s: float = 600.0, forest_tokens: int = FOREST_TOKENS, warmup: bool = True,
                         threads: int | None = None, progress: Progress | None = None) -> dict:
    """Many documents, 4-8 questions each: HF generate once per question, the batch job one
    document at a time, and the job in merged forests (with and without suffix drafts), side by side.

    Raises `AnswersDiffer` where a method's answers differ from generate's.
    """
    check_positive("documents", documents)
    check_positive("max_new_tokens", max_new_tokens)
    rows = call_logs(documents)
    settings = BatchSettings(max_new_tokens=max_new_tokens, model="bench")
    model, tokenizer = decoder.model, decoder.tokenizer
    prompts = [p for r in rows for p in decoder.question_prompts(r["document"], r["questions"])]
    lengths = [len(tokenizer(r["document"])["input_ids"]) for r in rows]
    eos_ids, pad_id = sorted(decoder.eos_ids), pad_id_of(model, tokenizer)

    def generate_loop(counter: ForwardCounter) -> RunOutput:
        started = time.perf_counter()
        out = hf_sequential(model, prompts, counter, max_new_tokens=max_new_tokens, eos_ids=eos_ids, pad_id=pad_id)
        out.extra["documents_per_s"] = len(rows) / (time.perf_counter() - started)
        return out

    with tempfile.TemporaryDirectory(prefix="multidecode-bench-batch-") as tmp:
        folder = Path(tmp)

        def lines(name: str, data: list[dict]) -> Path:
            path = folder / name
            path.write_text("".join(json.dumps(r) + "\n" for r in data), encoding="utf-8")
            return path

        source, warm = lines("documents.jsonl", rows), lines("warmup.jsonl", call_logs(2))

        def job(path: Path, job_settings: BatchSettings, budget: int, speculate) -> Runner:
            return lambda c: run_job(decoder, path, folder, job_settings, speculate() if speculate else None, c,
                                     forest_tokens=budget, forwards_from_stats=budget == 0)

        def methods(path: Path, job_settings: BatchSettings) -> dict[str, Runner]:
            return {ONE: job(path, job_settings, 0, None), MERGED: job(path, job_settings, forest_tokens, None),
                    MERGED_SUFFIX: job(path, job_settings, forest_tokens, SPECULATE[SUFFIX])}

        def method(name: str, run_it: Runner) -> Method:
            return Method(name, MERGED_LABELS[name][0], short=MERGED_LABELS[name][1], run=run_it)

        timed = {GENERATE: generate_loop, **methods(source, settings)}
        warm_settings = BatchSettings(max_new_tokens=2, model="bench")
        targets = tuple(Target(f"{MERGED_LABELS[fast][1]} over {MERGED_LABELS[slow][1]}",
                               (f"{fast}_vs", slow, "speedup"), ">=", value) for fast, slow, value in MERGED_TARGETS)
        bench = Benchmark(
            name="batch", title=f"the batch job over {documents} documents of 300-1,500 tokens, 4-8 questions each",
            model=model, reference=GENERATE,
            pairs=((MERGED, ONE), (MERGED_SUFFIX, ONE), (ONE, GENERATE), (MERGED, GENERATE), (MERGED_SUFFIX, GENERATE)),
            cases=(Case({"documents": documents}, tuple(method(n, r) for n, r in timed.items()), budget_s=budget_s,
                        targets=targets, report=lambda got: {"document_tokens": {
                            "min": min(lengths), "max": max(lengths), "mean": round(sum(lengths) / len(lengths), 1)},
                            "questions": sum(len(r["questions"]) for r in rows)}),),
            config={"workload": "merged", "documents": documents, "max_new_tokens": max_new_tokens,
                    "forest_tokens": forest_tokens, "decoding": "greedy", "notes": [
                        ("Each job run writes a new output file; merged runs keep up to forest_tokens cache tokens "
                         "(prompts + questions x max_new_tokens) in flight; one at a time is forest_tokens=0."),
                        "Forwards of merged runs are counted at the model (the lines share them).",
                        "The generate loop runs model.generate once per question, the whole prompt each time."]},
            warmup=tuple(method(n, r) for n, r in methods(warm, warm_settings).items()) if warmup else (),
            repeats=repeats,
            columns=("wall_s", "documents_per_s", "tokens_per_s", "forward_passes", "tokens_per_forward"),
            plot=Plot("bars", figures=("wall_s", "documents_per_s", "tokens_per_s", "forward_passes")),
            rows_key=None,
        )
        return run(bench, threads=threads, progress=progress)
