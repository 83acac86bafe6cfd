"""`multidecode margins`: writing in the margins of a long document, every chunk's note in one pass."""

from __future__ import annotations

import json
import time

import click
from rich.table import Table
from rich.text import Text

from ..errors import InvalidInput, check_positive
from ..strategies import margins as _margins
from ..strategies.ask import check_document
from .ask import show_stream
from .common import (
    check_early,
    load_decoder,
    model_options,
    read_text,
    report_errors,
    sampling_from,
    sampling_options,
    stderr,
    stdout,
)


def result_json(result: _margins.Margins) -> dict:
    return {
        "question": result.question,
        "answer": result.answer,
        "answer_finish_reason": result.answer_finish_reason,
        "answer_token_ids": result.answer_token_ids,
        "margins": [
            {"chunk": m.chunk_index, "span": list(m.span), "margin": m.text,
             "relevant": m.relevant, "relevance_score": m.relevance_score, "finish_reason": m.finish_reason,
             "token_ids": m.token_ids, "prompt_tokens": len(m.prompt_ids)}
            for m in result.margins
        ],
        "stats": result.stats,
    }


def verdicts_table(run: _margins.MarginsRun, verdicts) -> Table:
    table = Table(title="Relevance", title_justify="left")
    for column in ("chunk", "characters", "relevant", "score"):
        table.add_column(column, justify="right" if column != "relevant" else "left")
    for chunk, (relevant, score) in zip(run.chunks, verdicts):
        mark = "[green]yes[/green]" if relevant else "[dim]no[/dim]"
        shown = "said nothing" if score is None else f"{score:+.2f}"
        table.add_row(str(chunk.index + 1), f"{chunk.start}-{chunk.end}", mark, shown)
    return table


@click.command()
@click.option("--document", "-d", required=True, metavar="FILE",
              help="The document, a UTF-8 text file ('-' for stdin).")
@click.option("--question", "-q", default=None, metavar="TEXT", help="The question the margins are about.")
@click.option("--chunk-tokens", type=int, default=300, show_default=True,
              help="Tokens per chunk at most; chunks end at paragraphs, lines or sentences.")
@click.option("--max-margin-tokens", type=int, default=48, show_default=True, help="Longest margin, in tokens.")
@click.option("--max-new-tokens", type=int, default=64, show_default=True, help="Longest final answer, in tokens.")
@click.option("--threshold", type=float, default=0.0, show_default=True,
              help="A margin is relevant when log P(yes) - log P(no) is above this.")
@model_options
@sampling_options
@click.option("--json", "as_json", is_flag=True, help="Print the margins, verdicts and answer as JSON.")
@report_errors
def margins(document, question, chunk_tokens, max_margin_tokens, max_new_tokens, threshold, model_name, dtype,
            device, as_json, **sampling):
    """Write a note about the question for every chunk of a long document (all chunks in one pass),
    keep the relevant notes, and answer from them (arXiv 2408.14906)."""
    text = read_text(document)
    if question is None or not question.strip():
        raise InvalidInput("there is no question", "pass --question TEXT")
    check_document(text)
    for name, value in (("chunk_tokens", chunk_tokens), ("max_margin_tokens", max_margin_tokens)):
        check_positive(name, value)
    check_early(max_new_tokens=max_new_tokens, sampling=sampling_from(sampling))
    decoder = load_decoder(model_name, dtype, device)
    start = time.perf_counter()
    run = _margins.start(decoder.scheduler(), decoder.tokenizer, text, question, chunk_tokens=chunk_tokens,
                         max_margin_tokens=max_margin_tokens, max_new_tokens=max_new_tokens, threshold=threshold,
                         **sampling_from(sampling))
    stderr.print(f"[dim]{len(run.chunks)} chunks of at most {chunk_tokens} tokens; "
                 "writing their margins in one pass[/dim]")
    if as_json:
        result = run.result()
        click.echo(json.dumps(result_json(result), ensure_ascii=False))
    else:
        show_stream(run.events, [f"chunk, characters {c.start}-{c.end}" for c in run.chunks])
        verdicts = run.judge()
        stdout.print(verdicts_table(run, verdicts))
        stdout.print(Text("Answer", style="bold"))
        show_stream(run.answer_events(), [question.strip()])
        result = run.result()
    elapsed = time.perf_counter() - start
    kept = sum(m.relevant for m in result.margins)
    passes = sum(s.get("forward_passes", 0) for s in result.stats.values())
    stderr.print(
        f"[dim]{len(result.margins)} margins ({kept} relevant) and the answer in {elapsed:.1f} s, "
        f"{passes} forward passes[/dim]"
    )
