"""`multidecode demo`: 8 questions about a sample document in one pass, timed against one by one."""

from __future__ import annotations

import time

import click
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from .common import check_early, load_decoder, model_options, report_errors, stderr, stdout
from .decoding import show_stream


@click.command()
@click.option("--max-new-tokens", type=int, default=32, show_default=True)
@click.option("--no-compare", is_flag=True, help="Skip asking the questions one by one.")
@model_options
@report_errors
def demo(max_new_tokens, no_compare, model_name, precision, device):
    """Answer 8 questions about a sample support call in one MultiDecode pass, then one by one
    with transformers' generate, and compare the times and the answers."""
    from ..bench.common import ForwardCounter, hf_sequential, pad_id_of, trim_at_eos
    from ..data import sample_document, sample_questions
    from ..models.reading import quiet_transformers

    check_early(max_new_tokens=max_new_tokens)  # before the model loads and the header is printed
    decoder = load_decoder(model_name, precision, device)
    document, questions = sample_document(), sample_questions()
    prompts = decoder.question_prompts(document, questions)
    with stderr.status("warming up..."):  # first-use costs (kernels, lazily loaded libraries) off the clock
        decoder.ask(document[:400], questions[:2], max_new_tokens=2)
    stdout.print(f"[bold]A support-call transcript ({len(decoder.tokenizer(document)['input_ids'])} tokens), "
                 f"{len(questions)} questions, answered together in one MultiDecode pass:[/bold]\n")
    start = time.perf_counter()
    board = show_stream(decoder.stream(document, questions, max_new_tokens=max_new_tokens), questions)
    together = time.perf_counter() - start
    stdout.print(f"\nMultiDecode, all {len(questions)} at once: [bold]{together:.1f} s[/bold]")
    if no_compare:
        return

    eos = sorted(decoder.eos_ids)
    pad_id = pad_id_of(decoder.model, decoder.tokenizer)
    singles = []
    start = time.perf_counter()
    columns = [TextColumn("one by one (transformers generate)"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
               TimeElapsedColumn()]
    with quiet_transformers(loading=False), Progress(*columns, console=stderr, transient=True) as bar:
        task = bar.add_task("", total=len(prompts))
        for prompt in prompts:
            with ForwardCounter(decoder.model) as counter:
                out = hf_sequential(decoder.model, [prompt], counter, max_new_tokens=max_new_tokens, eos_ids=eos,
                                    pad_id=pad_id)
            singles.append(out.answers[0])
            bar.advance(task)
    alone = time.perf_counter() - start
    ours = [trim_at_eos(ids, eos) for ids in board.token_ids]
    same = ours == singles
    stdout.print(f"One by one, with transformers' generate: [bold]{alone:.1f} s[/bold]")
    stdout.print(f"Speed-up: [bold green]{alone / together:.1f}x[/bold green]; "
                 f"answers identical token for token: {'[green]yes[/green]' if same else '[red]NO[/red]'}")
    if not same:
        raise SystemExit(1)

