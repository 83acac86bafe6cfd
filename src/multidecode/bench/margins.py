"""Benchmark: writing in the margins, MultiDecode against transformers.

A long document is cut into chunks (`strategies.margins.split_document`) and a margin is written
for each of the first `chunks` chunks, from the same whole-prompt ids
(`strategies.margins.margin_prompts`), greedy, in one process, three ways:

- (a) `hf_sequential`: `model.generate` once per chunk, the whole chunk prompt each time;
- (b) `hf_batched`: one `generate` over all chunk prompts, left-padded;
- (d) `multidecode`: the margins stage of `strategies.margins.start` (one forest: the prompts'
  common start once, every chunk's own ids in one more pass, then one pass per step for all
  margins), drained to the end.

All three must give identical margin ids (compared up to and including the first eos); a
difference raises `AnswersDiffer`. The methods run in interleaved rounds, so that they see the
same machine conditions; the median run of each is kept. Only the margins are measured: the
relevance pass and the final answer are the same small extra work for every method.
"""

from __future__ import annotations

import time
from importlib import resources
from pathlib import Path

from ..errors import InvalidArgument
from ..prompts import common_prefix_length
from ..strategies.margins import margin_prompts, split_document, start
from .common import (
    ForwardCounter,
    Measurement,
    Progress,
    RunOutput,
    check_identical,
    environment,
    hf_batched,
    hf_sequential,
    load_average,
    measure,
    measure_together,
    pad_id_of,
    quiet_transformers,
    torch_threads,
)

SEQUENTIAL, BATCHED, MULTIDECODE = "hf_sequential", "hf_batched", "multidecode"
METHODS = (SEQUENTIAL, BATCHED, MULTIDECODE)
LABELS = {
    SEQUENTIAL: "(a) HF generate, one chunk at a time",
    BATCHED: "(b) HF generate, left-padded batch of the chunk prompts",
    MULTIDECODE: "(d) MultiDecode forest (all margins in one pass)",
}
TARGETS = {"speedup_vs_hf_sequential": 2.0, "speedup_vs_hf_batched": 1.0}
"""(d) at least 2x faster than (a), and faster than (b) (strictly above 1x)."""

SAMPLE_QUESTION = "Why did the backup pump at the Hillcrest booster station fail to start in August?"


def sample_document() -> str:
    """The long sample document shipped with the package (minutes of a water board meeting,
    about 3,500 tokens with SmolLM2's tokenizer)."""
    return resources.files("multidecode").joinpath("data/water_board_meeting.txt").read_text(encoding="utf-8")


def _unused(question, notes):  # the benchmark measures the margins only; nothing is classified
    return [0.0] * len(notes)


def multidecode_margins(decoder, chunk_texts, question, counter: ForwardCounter, *, max_new_tokens: int,
                        expected=None) -> RunOutput:
    """(d): the margins stage of `strategies.margins.start` on the given chunks, drained."""
    counter.prefill(1 << 30)
    run = start(decoder.scheduler(), decoder.tokenizer, list(chunk_texts), question, max_margin_tokens=max_new_tokens, classify=_unused)
    counter.prefill(0)
    if expected is not None and run.prompts != expected:
        raise AssertionError("the margins run built other prompts than the baselines got")
    for _ in run.events:
        pass
    stats = run.margin_run.engine.stats
    answers = [list(b.output.token_ids) for b in run.margin_run.branches]
    return RunOutput(answers, stats.peak_cache_bytes, forward_passes=stats.forward_passes,
                     extra={"peak_slots": stats.peak_slots, "tokens_fed": stats.tokens_fed,
                            "compactions": stats.compactions})


def run_margins_benchmark(
    decoder,
    *,
    document: str | None = None,
    question: str | None = None,
    chunks: int = 8,
    chunk_tokens: int = 300,
    max_new_tokens: int = 48,
    repeats: int = 3,
    budget_s: float = 120.0,
    warmup: bool = True,
    threads: int | None = None,
    progress: Progress | None = None,
) -> dict:
    """Measure (a), (b), (d) writing the margins of `chunks` chunks side by side; a JSON-ready dict.

    decoder: a `MultiDecoder` (its model and tokenizer are used by every method).
    document, question: default to the sample water board minutes and a question about them.
    chunks, chunk_tokens: the first `chunks` chunks of the document cut at about `chunk_tokens`
        tokens (the document must give that many).
    max_new_tokens: the longest margin.
    repeats, budget_s: rounds of all three methods, interleaved; a new round starts while fewer
        than `repeats` ran and all of them took under `budget_s` seconds. The median run is kept.
    threads: torch intra-op threads for the run (restored afterwards); None keeps the setting.
    Raises `AnswersDiffer` if any method's margins differ from (a)'s.
    """
    with torch_threads(threads):
        return _run(decoder, document, question, chunks, chunk_tokens, max_new_tokens, repeats, budget_s, warmup,
                    progress)


def _run(decoder, document, question, n_chunks, chunk_tokens, max_new_tokens, repeats, budget_s, warmup,
         progress) -> dict:
    say = progress or (lambda message: None)
    started = time.perf_counter()
    model, tokenizer = decoder.model, decoder.tokenizer
    if document is None:
        document = sample_document()
        question = question or SAMPLE_QUESTION
    if question is None:
        raise InvalidArgument("a document was given without a question", "pass question=...")
    if not isinstance(n_chunks, int) or isinstance(n_chunks, bool) or n_chunks < 1:
        raise InvalidArgument(f"chunks must be a positive integer, got {n_chunks!r}", "pass chunks=8")
    all_chunks = split_document(tokenizer, document, chunk_tokens)
    if len(all_chunks) < n_chunks:
        raise InvalidArgument(
            f"the document gives {len(all_chunks)} chunks of about {chunk_tokens} tokens, not {n_chunks}",
            "pass a longer document, fewer chunks or a smaller chunk_tokens",
        )
    chunks = all_chunks[:n_chunks]
    texts = [c.text for c in chunks]
    prompts = margin_prompts(tokenizer, chunks, question)
    eos_ids = sorted(decoder.eos_ids)
    pad_id = pad_id_of(model, tokenizer)
    hf = dict(max_new_tokens=max_new_tokens, eos_ids=eos_ids, pad_id=pad_id)
    runs = {
        SEQUENTIAL: lambda c: hf_sequential(model, prompts, c, **hf),
        BATCHED: lambda c: hf_batched(model, prompts, c, **hf),
        MULTIDECODE: lambda c: multidecode_margins(decoder, texts, question, c, max_new_tokens=max_new_tokens,
                                                   expected=prompts),
    }
    meta = environment(model)
    with quiet_transformers():
        if warmup:
            say("warming up")
            short_texts = [t[:200] for t in texts[:2]]
            short = margin_prompts(tokenizer, short_texts, question)
            warm = dict(max_new_tokens=2, eos_ids=eos_ids, pad_id=pad_id)
            measure(SEQUENTIAL, 2, lambda c: hf_sequential(model, short[:1], c, **warm), model, repeats=1)
            measure(BATCHED, 2, lambda c: hf_batched(model, short, c, **warm), model, repeats=1)
            measure(MULTIDECODE, 2, lambda c: multidecode_margins(decoder, short_texts, question, c,
                                                                 max_new_tokens=2), model, repeats=1)
        say(f"measuring {n_chunks} margins three ways")
        row = measure_together(runs, n_chunks, model, repeats=repeats, budget_s=budget_s)
        for m in row.values():
            say(_line(m))
        check_identical({name: m.answers for name, m in row.items()}, reference=SEQUENTIAL)

    d = row[MULTIDECODE]
    ratios = {
        name: {
            "speedup": m.wall_s / d.wall_s,
            "forward_passes_ratio": d.forward_passes / m.forward_passes,
            "kv_bytes_ratio": d.peak_kv_bytes / m.peak_kv_bytes if m.peak_kv_bytes else None,
        }
        for name, m in row.items() if name != MULTIDECODE
    }
    result = {
        "benchmark": "margins",
        "metadata": {**meta, "load_average_at_end": load_average(),
                     "elapsed_s": round(time.perf_counter() - started, 2)},
        "config": {
            "question": question,
            "chunks": n_chunks,
            "chunk_tokens": chunk_tokens,
            "document_chunks": len(all_chunks),
            "chunk_token_counts": [c.tokens for c in chunks],
            "chunk_spans": [list(c.span) for c in chunks],
            "prompt_tokens": [len(p) for p in prompts],
            "shared_prefix_tokens": common_prefix_length(prompts),
            "max_new_tokens": max_new_tokens,
            "decoding": "greedy",
            "repeats": repeats,
            "budget_s": budget_s,
            "eos_ids": eos_ids,
            "pad_id": pad_id,
            "notes": [
                "Margins are compared token for token, up to and including the first eos.",
                "The three methods run in interleaved rounds; wall_s is the median of runs_s.",
                "KV bytes: for HF, the cache tensors held at the end of generate; for MultiDecode, "
                "the engine's peak allocated (preallocated) cache buffer.",
            ],
        },
        "labels": LABELS,
        "methods": {name: m.as_dict() for name, m in row.items()},
        "multidecode_vs": ratios,
        "margins": [
            {"chunk": c.index, "span": list(c.span), "prompt_tokens": len(p), "token_ids": ids,
             "text": tokenizer.decode(ids, skip_special_tokens=True) if tokenizer is not None else None}
            for c, p, ids in zip(chunks, prompts, d.answers)
        ],
        "answers_identical": True,
    }
    result["targets"] = _targets(ratios)
    return result


def _line(m: Measurement) -> str:
    runs = f" (median of {len(m.runs_s)})" if len(m.runs_s) > 1 else ""
    return f"{LABELS[m.method]}: {m.wall_s:.2f} s{runs}, {m.forward_passes} forwards"


def _targets(ratios: dict) -> list[dict]:
    rows = []
    got = ratios[SEQUENTIAL]["speedup"]
    want = TARGETS["speedup_vs_hf_sequential"]
    rows.append({"name": "(d) speedup over (a) one chunk at a time", "target": f">= {want}x",
                 "measured": round(got, 3), "met": got >= want})
    got = ratios[BATCHED]["speedup"]
    want = TARGETS["speedup_vs_hf_batched"]
    rows.append({"name": "(d) speedup over (b) padded batch", "target": f"> {want}x",
                 "measured": round(got, 3), "met": got > want})
    return rows


def plot_margins(result: dict, path: str | Path) -> Path:
    """Wall time, forward passes and peak KV memory of each method, as bars (PNG at `path`)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from .plot import machine_label

    path = Path(path)
    methods = result["methods"]
    names = [n for n in METHODS if n in methods]
    short = {SEQUENTIAL: "(a) one by one", BATCHED: "(b) padded batch", MULTIDECODE: "(d) MultiDecode"}
    colors = {SEQUENTIAL: "tab:red", BATCHED: "tab:orange", MULTIDECODE: "tab:green"}
    fig = Figure(figsize=(12, 4.2), dpi=120)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 3)
    panels = [
        ("wall_s", "wall time (s)", lambda v: f"{v:.2f} s"),
        ("forward_passes", "forward passes", lambda v: f"{int(v)}"),
        ("peak_kv_bytes", "peak KV cache (MB)", lambda v: f"{v:.1f} MB"),
    ]
    for ax, (key, title, fmt) in zip(axes, panels):
        values = [methods[n][key] / (1e6 if key == "peak_kv_bytes" else 1) for n in names]
        bars = ax.bar([short[n] for n in names], values, color=[colors[n] for n in names])
        for bar, name, value in zip(bars, names, values):
            label = fmt(value)
            if key == "wall_s" and name != MULTIDECODE:
                label += f"\nspeed-up of (d): {result['multidecode_vs'][name]['speedup']:.2f}x"
            ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                        fontsize=7, textcoords="offset points", xytext=(0, 2))
        ax.set_title(title, fontsize=9)
        ax.tick_params(axis="x", labelsize=7)
        ax.margins(y=0.2)
        ax.grid(alpha=0.3, axis="y")
    config = result.get("config", {})
    fig.suptitle(
        f"Writing in the margins: {config.get('chunks', '?')} chunks of ~{config.get('chunk_tokens', '?')} tokens, "
        f"{config.get('max_new_tokens', '?')} new tokens each, greedy - {machine_label(result)}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path)
    return path
