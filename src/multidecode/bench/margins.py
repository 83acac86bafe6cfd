"""Benchmark: writing in the margins of a long document's chunks, (a) one by one, (b) one padded
batch, (d) one forest (docs/benchmarks.md, `bench margins`)."""

from __future__ import annotations

from .. import data
from ..errors import InvalidArgument, is_int
from ..prompts import common_prefix_length
from ..strategies.margins import margin_prompts, split_document, start
from .common import ForwardCounter, RunOutput, Setup, engine_output, hf_batched, hf_sequential
from .harness import Benchmark, Case, Method, Plot, Target, runs

SEQUENTIAL, BATCHED, MULTIDECODE = "hf_sequential", "hf_batched", "multidecode"
METHODS = (SEQUENTIAL, BATCHED, MULTIDECODE)
LABELS = {
    SEQUENTIAL: ("(a) HF generate, one chunk at a time", "(a) one by one"),
    BATCHED: ("(b) HF generate, left-padded batch of the chunk prompts", "(b) padded batch"),
    MULTIDECODE: ("(d) MultiDecode forest (all margins in one pass)", "(d) MultiDecode"),
}
SAMPLE_QUESTION = "Why did the backup pump at the Hillcrest booster station fail to start in August?"


def meeting_minutes() -> str:
    """The long sample document: minutes of a water board meeting (about 3,500 tokens)."""
    return data.text("water_board_meeting.txt")


def _unused(question, notes):  # the benchmark measures the margins only; nothing is classified
    return [0.0] * len(notes)


def multidecode_margins(decoder, chunk_texts, question, counter: ForwardCounter, *, max_new_tokens: int,
                        expected=None) -> RunOutput:
    """(d): the margins stage of `strategies.margins.start` on the given chunks, drained."""
    counter.prefill(1 << 30)
    run_ = start(decoder.scheduler(), decoder.tokenizer, list(chunk_texts), question, max_margin_tokens=max_new_tokens,
                 classify=_unused)
    counter.prefill(0)
    if expected is not None and run_.prompts != expected:
        raise AssertionError("the margins run built other prompts than the baselines got")
    for _ in run_.events:
        pass
    return engine_output([list(b.output.token_ids) for b in run_.margin_run.branches], run_.margin_run.engine.stats)


def margins_benchmark(decoder, *, document: str | None = None, question: str | None = None, chunks: int = 8,
                      chunk_tokens: int = 300, max_new_tokens: int = 48, repeats: int = 3, budget_s: float = 120.0,
                      warmup: bool = True) -> Benchmark:
    """(a), (b), (d) writing margins side by side, as data: the first `chunks` chunks of about
    `chunk_tokens` tokens of `document` (default: the water board minutes, with a question on them)."""
    setup = Setup.of(decoder)
    every, question = _chunks(setup.tokenizer, document, question, chunks, chunk_tokens)
    used = every[:chunks]
    prompts = margin_prompts(setup.tokenizer, used, question)

    def methods(texts, ps, new: int, expected=None) -> tuple[Method, ...]:
        return (Method.named(LABELS, SEQUENTIAL, run=setup.baseline(hf_sequential, ps, new)),
                Method.named(LABELS, BATCHED, run=setup.baseline(hf_batched, ps, new)),
                Method.named(LABELS, MULTIDECODE, run=lambda c: multidecode_margins(
                    decoder, texts, question, c, max_new_tokens=new, expected=expected)))

    def report(got: dict) -> dict:
        return {"margins": [{"chunk": c.index, "span": list(c.span), "prompt_tokens": len(p), "token_ids": ids,
                             "text": setup.text(ids)} for c, p, ids in zip(used, prompts, got[MULTIDECODE].answers)]}

    short_texts = [c.text[:200] for c in used[:2]]
    case = Case({"chunks": chunks}, methods([c.text for c in used], prompts, max_new_tokens, prompts),
                budget_s=budget_s, main=True, report=report, targets=(
                    Target("(d) speedup over (a) one chunk at a time", ("multidecode_vs", SEQUENTIAL, "speedup"),
                           ">=", 2.0),
                    Target("(d) speedup over (b) padded batch", ("multidecode_vs", BATCHED, "speedup"), ">", 1.0)))
    return Benchmark(
        name="margins", title=f"writing in the margins: {chunks} chunks of ~{chunk_tokens} tokens, "
                              f"{max_new_tokens} new tokens each, greedy",
        model=setup.model, cases=(case,), reference=SEQUENTIAL,
        pairs=((MULTIDECODE, SEQUENTIAL), (MULTIDECODE, BATCHED)), repeats=repeats, rows_key=None,
        config={"question": question, "chunks": chunks, "chunk_tokens": chunk_tokens,
                "document_chunks": len(every),
                "chunk_token_counts": [c.tokens for c in used], "chunk_spans": [list(c.span) for c in used],
                "prompt_tokens": [len(p) for p in prompts], "shared_prefix_tokens": common_prefix_length(prompts),
                "max_new_tokens": max_new_tokens, "decoding": "greedy", "eos_ids": setup.eos_ids,
                "pad_id": setup.pad_id},
        warmup=methods(short_texts, margin_prompts(setup.tokenizer, short_texts, question), 2) if warmup else (),
        columns=("wall_s", "forward_passes", "peak_kv_bytes", "prefill_s", "decode_s"),
        plot=Plot("bars", figures=("wall_s", "forward_passes", "peak_kv_bytes")),
    )


run_margins_benchmark = runs(margins_benchmark)


def _chunks(tokenizer, document: str | None, question: str | None, chunks: int, chunk_tokens: int):
    """Every chunk of the document (default: the sample), which must give `chunks`, and the question."""
    if document is None:
        document, question = meeting_minutes(), question or SAMPLE_QUESTION
    if question is None:
        raise InvalidArgument("a document was given without a question", "pass question=...")
    if not is_int(chunks) or chunks < 1:
        raise InvalidArgument(f"chunks must be a positive integer, got {chunks!r}", "pass chunks=8")
    every = split_document(tokenizer, document, chunk_tokens)
    if len(every) < chunks:
        raise InvalidArgument(
            f"the document gives {len(every)} chunks of about {chunk_tokens} tokens, not {chunks}",
            "pass a longer document, fewer chunks or a smaller chunk_tokens",
        )
    return every, question
