"""`multidecode bench ...`: MultiDecode against the transformers alternatives, side by side in one run."""

from __future__ import annotations

import time
from pathlib import Path

import click
from rich.table import Table

from ..errors import InvalidArgument
from .common import load_decoder, model_options, report_errors, stderr, stdout


def parse_counts(text: str, flag: str) -> tuple[int, ...]:
    """A sweep given as comma-separated positive integers, e.g. "1,2,4,8"."""
    try:
        counts = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise InvalidArgument(f"{flag} must be comma-separated integers, got {text!r}",
                              f"for example {flag} 1,2,4,8") from None
    if not counts or min(counts) < 1:
        raise InvalidArgument(f"{flag} needs positive integers, got {text!r}", f"for example {flag} 1,2,4,8")
    return counts


def output_options(command):
    """--output DIR and --stem NAME (the results' file names)."""
    command = click.option("--stem", default=None, metavar="NAME",
                           help="File name for the results, without extension (default: bench_<benchmark>).")(command)
    return click.option("--output", "-o", default="bench-results", show_default=True, metavar="DIR",
                        help="Folder for the JSON results and the plot.")(command)


def run_options(command):
    """--repeats N and --threads N."""
    command = click.option("--threads", type=int, default=None,
                           help="torch threads for the run (default: torch's own).")(command)
    return click.option("--repeats", type=int, default=3, show_default=True,
                        help="Timed runs at the main point (the median is reported).")(command)


def check_run(output: str, dtype: str | None, threads: int | None, **positive: int) -> None:
    """Refuse settings a benchmark would trip on, before the model loads and the run starts."""
    if Path(output).exists() and not Path(output).is_dir():
        raise InvalidArgument(f"--output {output} is a file, not a folder", "name a folder for the results")
    if dtype not in (None, "float32"):
        raise InvalidArgument(f"the benchmarks compare outputs token for token, which holds in float32 only, "
                              f"not {dtype}", "leave --dtype unset")
    if threads is not None and threads < 1:
        raise InvalidArgument(f"--threads must be 1 or more, got {threads}", "or leave it unset")
    for name, value in positive.items():
        if value < 1:
            flag = "--" + name.replace("_", "-")
            raise InvalidArgument(f"{flag} must be 1 or more, got {value}", f"use {flag} 1 or more")


def targets_table(result: dict) -> Table:
    table = Table(title="Targets", title_justify="left")
    for column in ("target", "wanted", "measured", "met"):
        table.add_column(column)
    for row in result.get("targets", []):
        table.add_row(row["name"], row["target"], f"{row['measured']}", "[green]yes[/green]" if row["met"] else "[red]no[/red]")
    return table


SHORT_LABELS = {
    "hf_sequential": "(a) one by one",
    "hf_batched": "(b) padded batch",
    "hf_shared_prefix": "(c) shared-prefix batch",
    "multidecode": "(d) MultiDecode",
}


def methods_table(methods: dict, ratios: dict, title: str, labels: dict) -> Table:
    """One row per method: wall time, forward passes, tokens/s, peak KV, and MultiDecode's gain."""
    labels = {**labels, **SHORT_LABELS}
    table = Table(title=title, title_justify="left")
    for column in ("method", "wall s", "forwards", "tok/s", "KV MB", "(d) gain"):
        table.add_column(column, justify="right" if column != "method" else "left", no_wrap=True)
    for name, m in methods.items():
        ratio = ratios.get(name, {}).get("speedup")
        table.add_row(labels.get(name, name), f"{m['wall_s']:.2f}", str(m["forward_passes"]),
                      f"{m['tokens_per_s']:.1f}", f"{m['peak_kv_bytes'] / 1e6:.1f}",
                      f"{ratio:.2f}x" if ratio else "")
    return table


def ask_table(result: dict) -> Table:
    main = result["main"]
    title = f"{main['k']} answers, {result['config'].get('max_new_tokens')} new tokens each"
    return methods_table(main["methods"], main["multidecode_vs"], title, result.get("labels", {}))


@click.group()
def bench():
    """Benchmarks against the transformers alternatives, measured side by side in one run."""


@bench.command("ask")
@output_options
@click.option("--ks", default="1,2,4,8,16", show_default=True, help="Question counts for the sweep.")
@click.option("--max-new-tokens", type=int, default=32, show_default=True)
@run_options
@model_options
@report_errors
def bench_ask(output, stem, ks, max_new_tokens, repeats, threads, model_name, dtype, device):
    """Many questions about one document: (a) sequential generate, (b) a padded batch, (c) a shared
    prefix cache copied to a batch, (d) MultiDecode. Asserts identical answers; writes JSON and a plot."""
    from ..bench import run_ask_benchmark

    sweep = parse_counts(ks, "--ks")
    check_run(output, dtype, threads, max_new_tokens=max_new_tokens, repeats=repeats)
    decoder = load_decoder(model_name, dtype, device)
    run_and_report("ask", lambda progress: run_ask_benchmark(
        decoder, max_new_tokens=max_new_tokens, ks=sweep, repeats=repeats, threads=threads, progress=progress),
        output, stem, ask_table)


def sweep_table(result: dict, key: str, label: str, methods: dict[str, str]) -> Table:
    """One row per sweep point: each method's wall time and KV, and MultiDecode's speed-up."""
    table = Table(title=f"{result['benchmark']}: sweep over {label}", title_justify="left")
    table.add_column(label, justify="right")
    for short in methods.values():
        table.add_column(f"{short} s", justify="right", no_wrap=True)
        table.add_column(f"{short} KV MB", justify="right", no_wrap=True)
    table.add_column("speed-up", justify="right")
    for row in result["sweep"]:
        cells = [str(row[key])]
        for name in methods:
            m = row["methods"][name]
            cells += [f"{m['wall_s']:.2f}", f"{m['peak_kv_bytes'] / 1e6:.1f}"]
        table.add_row(*cells, f"{row['speedup']:.2f}x")
    return table


def run_and_report(name: str, runner, output: str, stem: str | None, table) -> None:
    """Run one benchmark with progress on stderr, then print its tables and write its files."""
    from ..bench import write_results

    start = time.perf_counter()
    with stderr.status(f"benchmarking {name}...") as status:
        def progress(message: str) -> None:
            stderr.print(f"[dim]{time.perf_counter() - start:6.1f} s  {message}[/dim]")
            status.update(f"benchmarking {name}... {message}")

        result = runner(progress)
    paths = write_results(result, Path(output), stem=stem)
    stdout.print(table(result))
    stdout.print(targets_table(result))
    if result.get("answers_identical"):
        stdout.print("All methods gave identical answers.")
    for path in paths:
        stdout.print(f"wrote {path}")


@bench.command("sample")
@output_options
@click.option("--n", "n", type=int, default=8, show_default=True, help="Completions at the main point.")
@click.option("--ns", default="1,2,4,8,16", show_default=True, help="Completion counts for the sweep.")
@click.option("--max-new-tokens", type=int, default=64, show_default=True)
@click.option("--prompt-tokens", type=int, default=200, show_default=True)
@run_options
@model_options
@report_errors
def bench_sample(output, stem, n, ns, max_new_tokens, prompt_tokens, repeats, threads, model_name, dtype, device):
    """n sampled completions of one prompt: transformers' num_return_sequences against MultiDecode."""
    from ..bench import run_sample_benchmark

    sweep = parse_counts(ns, "--ns")
    check_run(output, dtype, threads, n=n, max_new_tokens=max_new_tokens, prompt_tokens=prompt_tokens,
              repeats=repeats)
    decoder = load_decoder(model_name, dtype, device)
    run_and_report("sample", lambda progress: run_sample_benchmark(
        decoder, n=n, ns=sweep, max_new_tokens=max_new_tokens, prompt_tokens=prompt_tokens,
        repeats=repeats, threads=threads, progress=progress), output, stem,
        lambda r: sweep_table(r, "n", "n", {"hf_num_return_sequences": "HF", "multidecode": "MD"}))


@bench.command("beam")
@output_options
@click.option("--num-beams", type=int, default=4, show_default=True, help="Beams at the main point.")
@click.option("--beams", default="2,4,8", show_default=True, help="Beam counts for the sweep.")
@click.option("--max-new-tokens", type=int, default=32, show_default=True)
@click.option("--prompt-tokens", type=int, default=200, show_default=True)
@run_options
@model_options
@report_errors
def bench_beam(output, stem, num_beams, beams, max_new_tokens, prompt_tokens, repeats, threads, model_name, dtype, device):
    """Beam search: transformers' generate(num_beams=B) against beams as one tree (identical results asserted)."""
    from ..bench import run_beam_benchmark

    sweep = parse_counts(beams, "--beams")
    check_run(output, dtype, threads, num_beams=num_beams, max_new_tokens=max_new_tokens,
              prompt_tokens=prompt_tokens, repeats=repeats)
    decoder = load_decoder(model_name, dtype, device)
    run_and_report("beam", lambda progress: run_beam_benchmark(
        decoder, num_beams=num_beams, beams_sweep=sweep, max_new_tokens=max_new_tokens,
        prompt_tokens=prompt_tokens, repeats=repeats, threads=threads, progress=progress), output, stem,
        lambda r: sweep_table(r, "num_beams", "beams", {"hf_beam": "HF", "multidecode_beam": "MD"}))


@bench.command("margins")
@output_options
@click.option("--chunks", type=int, default=8, show_default=True)
@click.option("--chunk-tokens", type=int, default=300, show_default=True)
@click.option("--max-new-tokens", type=int, default=48, show_default=True, help="Tokens per margin.")
@run_options
@model_options
@report_errors
def bench_margins(output, stem, chunks, chunk_tokens, max_new_tokens, repeats, threads, model_name, dtype, device):
    """Writing in the margins: margins one chunk at a time, as one padded batch, and as one forest."""
    from ..bench import run_margins_benchmark

    check_run(output, dtype, threads, chunks=chunks, chunk_tokens=chunk_tokens, max_new_tokens=max_new_tokens,
              repeats=repeats)
    decoder = load_decoder(model_name, dtype, device)

    def table(result: dict) -> Table:
        config = result["config"]
        title = f"{config['chunks']} margins of {config['max_new_tokens']} tokens, chunks of ~{config['chunk_tokens']} tokens"
        return methods_table(result["methods"], result["multidecode_vs"], title, result.get("labels", {}))

    run_and_report("margins", lambda progress: run_margins_benchmark(
        decoder, chunks=chunks, chunk_tokens=chunk_tokens, max_new_tokens=max_new_tokens, repeats=repeats,
        threads=threads, progress=progress), output, stem, table)
