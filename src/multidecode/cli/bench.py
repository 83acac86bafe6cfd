"""`multidecode bench ...`: MultiDecode against the transformers alternatives, side by side in one run."""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path

import click
from rich.markup import escape
from rich.table import Table

from ..errors import InvalidArgument, InvalidInput
from .common import (
    check_writable_folder,
    human_size,
    load_decoder,
    model_options,
    report_errors,
    spelling,
    stderr,
    stdout,
)


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
                        help="Folder for the results: JSON, a PNG plot and a markdown table.")(command)


def run_options(command):
    """--repeats N and --threads N."""
    command = click.option("--threads", type=int, default=None,
                           help="torch threads for the run (default: torch's own).")(command)
    return click.option("--repeats", type=int, default=3, show_default=True,
                        help="Timed runs at the main point (the median is reported).")(command)


def check_run(output: str, threads: int | None, stem: str | None = None) -> None:
    """Refuse settings every benchmark would trip on, before the model loads and the run starts
    (a run can take many minutes: its results must have somewhere to go); the folder is tried, not
    left made."""
    if stem is not None and (not stem.strip() or Path(stem).name != stem or stem in (".", "..")):
        raise InvalidArgument(f"--stem {stem!r} is not a file name", "give a name without folders; --output says where")
    if threads is not None and threads < 1:
        raise InvalidArgument(f"--threads must be 1 or more, got {threads}", "or leave it unset")
    check_writable_folder(output, "--output")


def check_flag_counts(**counts: int) -> None:
    """Refuse a count below 1 (--max-new-tokens 0, --repeats 0) before the model loads."""
    for name, value in counts.items():
        if value < 1:
            flag = "--" + name.replace("_", "-")
            raise InvalidArgument(f"{flag} must be 1 or more, got {value}", f"use {flag} 1 or more")


def check_seconds_budget(budget: float, example: int) -> None:
    if not budget > 0:  # nan too
        raise InvalidArgument(f"--budget must be a positive number of seconds, got {budget}",
                              f"for example --budget {example}")


def print_tables(result: dict, *, console=None) -> None:
    """The result's tables (the same as its markdown file), drawn with rich on `console` (default
    stdout) where it is a terminal; elsewhere (a log, a pipe) as markdown, whose lines rich neither
    cuts to 80 columns nor wraps, so every figure reaches the file whole."""
    from ..bench.results import markdown_table, tables

    console = console or stdout
    for text in tables(result):
        if not console.is_terminal:
            console.print("\n".join([text.title, *markdown_table(text), ""]), markup=False, soft_wrap=True, crop=False)
            continue
        table = Table(title=text.title, title_justify="left")
        for i, column in enumerate(text.header):
            table.add_column(escape(column), justify="left" if i < text.lead else "right",
                             min_width=16 if i == 0 else None)
        for row in text.rows:
            table.add_row(*(escape(c).replace("**no**", "[red]no[/red]") for c in row))
        console.print(table)


def run_and_report(name: str, runner, output: str, stem: str | None, *, as_json: bool = False) -> None:
    """Run one benchmark with progress on stderr, write its files, then print its tables, its
    findings and the files' paths (on stderr with `as_json`, which prints the result on stdout)."""
    from ..bench.results import findings, redraw, write_json

    start = time.perf_counter()
    with stderr.status(f"benchmarking {name}...") as status:
        def progress(message: str) -> None:
            stderr.print(f"[dim]{time.perf_counter() - start:6.1f} s  {escape(message)}[/dim]")
            status.update(f"benchmarking {name}... {escape(message)}")

        result = runner(progress)
    try:  # after the whole run: nothing of it is lost
        path = write_json(result, Path(output), stem=stem)
    except OSError as err:
        click.echo(json.dumps(result, indent=2))
        raise InvalidInput(f"cannot write the result in {output}: {err.strerror or err}",
                           "it is printed above as JSON: save it as a .json file and `multidecode bench redraw` it"
                           ) from None
    try:
        paths = [path, *redraw(path)]
    except OSError as err:
        raise InvalidInput(f"cannot write {err.filename or 'the table and plot beside ' + str(path)}: "
                           f"{err.strerror or err}",
                           f"the result is in {path}: free that path, then `multidecode bench redraw {path}`") from None
    console = stderr if as_json else stdout
    print_tables(result, console=console)
    said = findings(result)
    if result.get("answers_identical"):  # its first finding, said shortly
        said[0] = "All methods gave identical answers."
    for line in said + [f"wrote {path}" for path in paths]:
        console.print(escape(line))
    if as_json:
        click.echo(json.dumps(result, indent=2))


@click.group()
def bench():
    """Benchmarks against the transformers alternatives, measured side by side in one run."""


def bench_command(name: str, *options, sweeps: tuple[str, ...] = (), counts: tuple[str, ...] = ()):
    """`bench NAME` with `options` plus --output, --stem, --repeats, --threads and the model's.
    Before the model loads, the settings named in `sweeps` (comma-separated counts, "1,2,4") are
    parsed and those in `counts` refused below 1; the decorated function gets every setting,
    checks the rest and returns the library call to run as `call(decoder, repeats=, threads=,
    progress=)`."""
    def declare(prepare):
        @functools.wraps(prepare)
        def command(output, stem, repeats, threads, model_name, precision, device, **own):
            check_flag_counts(repeats=repeats, **{k: own[k] for k in counts if own[k] is not None})
            call = prepare(**{**own, **{k: parse_counts(own[k], "--" + k.replace("_", "-")) for k in sweeps}})
            check_run(output, threads, stem)
            decoder = load_decoder(model_name, precision, device)
            run_and_report(name, lambda progress: call(decoder, repeats=repeats, threads=threads, progress=progress),
                           output, stem)

        for option in (model_options, run_options, *reversed(options), output_options):
            command = option(command)
        return bench.command(name)(report_errors(command))
    return declare


def max_new_tokens(default: int | None, help: str | None = None):
    return click.option("--max-new-tokens", type=int, default=default, show_default=default is not None, help=help)


PROMPT_TOKENS = click.option("--prompt-tokens", type=int, default=200, show_default=True,
                             help="Tokens of the prompt, about (an excerpt of the sample support call).")


@bench_command(
    "ask",
    click.option("--ks", default="1,2,4,8,16", show_default=True,
                 help="Question counts for the sweep (the main point, all 8 of the sample call's questions, runs too)."),
    max_new_tokens(32),
    click.option("--speculate", default=None, metavar="MODE",
                 help="Also run (e): the forest with every branch speculating (any mode of --speculate: lookup, "
                      "suffix, lookahead, auto, eagle, ...)."),
    sweeps=("ks",), counts=("max_new_tokens",),
)
def bench_ask(speculate, **settings):
    """Many questions about one document: (a) sequential generate, (b) a padded batch, (c) a shared
    prefix cache copied to a batch, (d) MultiDecode. Asserts identical answers; writes JSON, a plot and markdown."""
    from ..bench import run_ask_benchmark
    from ..speculation import SpeculationSettings

    speculation = SpeculationSettings.parse(speculate, spelling=spelling())
    return functools.partial(run_ask_benchmark, speculate=speculation, **settings)


@bench_command(
    "sample",
    click.option("--n", "n", type=int, default=8, show_default=True, help="Completions at the main point."),
    click.option("--ns", default="1,2,4,8,16", show_default=True, help="Completion counts for the sweep."),
    max_new_tokens(64), PROMPT_TOKENS, sweeps=("ns",), counts=("n", "max_new_tokens", "prompt_tokens"),
)
def bench_sample(**settings):
    """n sampled completions of one prompt: transformers' num_return_sequences against MultiDecode."""
    from ..bench import run_sample_benchmark

    return functools.partial(run_sample_benchmark, **settings)


@bench_command(
    "beam",
    click.option("--num-beams", type=click.IntRange(min=2), default=4, show_default=True, help="Beams at the main point."),
    click.option("--beams", default="2,4,8", show_default=True, help="Beam counts for the sweep (2 or more each)."),
    max_new_tokens(32), PROMPT_TOKENS, sweeps=("beams",), counts=("max_new_tokens", "prompt_tokens"),
)
def bench_beam(beams, **settings):
    """Beam search: transformers' generate(num_beams=B) against beams as one tree (identical results asserted)."""
    from ..bench import run_beam_benchmark

    if min(beams) < 2:  # one beam is greedy: generate gives no sequence scores to compare
        raise InvalidArgument(f"--beams needs 2 beams or more each, got {','.join(map(str, beams))}",
                              "for example --beams 2,4,8; one beam is greedy decoding, which bench ask measures")

    return functools.partial(run_beam_benchmark, beams_sweep=beams, **settings)


@bench_command(
    "margins",
    click.option("--chunks", type=int, default=8, show_default=True),
    click.option("--chunk-tokens", type=int, default=300, show_default=True),
    max_new_tokens(48, "Tokens per margin."), counts=("chunks", "chunk_tokens", "max_new_tokens"),
)
def bench_margins(**settings):
    """Writing in the margins: margins one chunk at a time, as one padded batch, and as one forest."""
    from ..bench import run_margins_benchmark

    return functools.partial(run_margins_benchmark, **settings)


@bench_command(
    "speculate",
    click.option("--workloads", default="summary,code_edit,story", show_default=True,
                 help="Which shipped workloads to run, comma-separated."),
    max_new_tokens(None, "Override every workload's own (quick runs)."),
    click.option("--budget", type=float, default=90.0, show_default=True, metavar="SECONDS",
                 help="Time budget for each workload's rounds of all methods."),
    click.option("--compare-cost", is_flag=True,
                 help="Also run auto on a full measurement of the cost curve and from a fresh probe of it."),
    counts=("max_new_tokens",),
)
def bench_speculate(workloads, max_new_tokens, budget, compare_cost):
    """Speculative decoding of one sequence, greedy: plain generate, transformers' prompt lookup at 3 and
    10 tokens, and MultiDecode's lookup and auto modes. Asserts identical tokens; writes JSON, a plot and markdown."""
    from ..bench import run_speculate_benchmark
    from ..bench.speculate import choose

    names = [w.strip() for w in workloads.split(",") if w.strip()]
    choose(names)
    check_seconds_budget(budget, 90)
    return functools.partial(run_speculate_benchmark, names=names, max_new_tokens=max_new_tokens, budget_s=budget,
                             compare_cost=compare_cost)


@bench_command(
    "batch",
    click.option("--workload", type=click.Choice(["merged", "similar"]), default="merged", show_default=True,
                 help="merged: documents of 300-1,500 tokens, 4-8 questions each, one at a time against merged "
                      "forests and an HF generate loop; similar: short similar calls, with and without speculation."),
    click.option("--documents", type=int, default=None, help="Documents in the job (default: 24 merged, 16 similar)."),
    max_new_tokens(48, "Longest answer, in tokens."),
    click.option("--forest-tokens", type=int, default=None, metavar="N",
                 help="The merged forests' budget in cache tokens (default: the batch job's)."),
    click.option("--budget", type=float, default=None, metavar="SECONDS",
                 help="Time budget for the rounds of all methods (one round always runs; default 600 merged, 300 similar)."),
    counts=("documents", "max_new_tokens"),
)
def bench_batch(workload, forest_tokens, budget, **settings):
    """The batch job. merged (the default): 24 documents of 300-1,500 tokens with 4-8 questions each, answered
    one document at a time, in merged forests (with and without suffix drafts) and by a loop of HF generate.
    similar: many similar support calls, 8 questions each, without speculation, with lookup, and with suffix and
    auto learning from the job's earlier documents. Asserts identical answers; writes JSON, a plot and markdown."""
    from ..bench import run_batch_benchmark, run_merged_benchmark

    if budget is not None:
        check_seconds_budget(budget, 300)
    if forest_tokens is not None and workload == "similar":
        raise InvalidArgument("--forest-tokens is for --workload merged", "leave it out, or use --workload merged")
    if forest_tokens is not None and forest_tokens < 0:
        raise InvalidArgument(f"--forest-tokens must be 0 or more, got {forest_tokens}", "for example --forest-tokens 8192")
    given = {**settings, "budget_s": budget, "forest_tokens": forest_tokens}  # the library's defaults for the rest
    return functools.partial(run_merged_benchmark if workload == "merged" else run_batch_benchmark,
                             **{k: v for k, v in given.items() if v is not None})


def parse_shares(text: str) -> tuple[float, ...]:
    """Shared-prefix shares given as comma-separated fractions in [0, 1), e.g. "0,0.5,0.9"."""
    try:
        shares = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise InvalidArgument(f"--shared must be comma-separated fractions, got {text!r}",
                              "for example --shared 0,0.5,0.9") from None
    if not shares or any(not 0 <= s < 1 for s in shares):
        raise InvalidArgument(f"--shared needs fractions from 0 up to (not including) 1, got {text!r}",
                              "for example --shared 0,0.5,0.9")
    return shares


@bench.command("serve")
@click.option("--model", "model_name", default=None, metavar="NAME",
              help="A local HF folder or .gguf file (default: the embedded SmolLM2-135M-Instruct).")
@click.option("--requests", type=int, default=None, help="Requests per cell  [default: 32; 6 with --quick]")
@click.option("--concurrency", default=None, help="Requests in flight at most, per cell  [default: 1,4,16]")
@click.option("--shared", default=None, help="Share of each prompt common to a cell's requests  [default: 0,0.5,0.9]")
@click.option("--rate", type=float, default=8.0, show_default=True,
              help="Poisson arrivals per second (inf: all at once).")
@click.option("--max-tokens", type=int, default=None, help="Tokens generated per request  [default: 32]")
@click.option("--prompt-tokens", type=int, default=None, help="Tokens per prompt, about  [default: 300]")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the prompts and arrival times.")
@click.option("--transformers/--no-transformers", "with_transformers", default=None,
              help="Also run `transformers serve` on a subset of the grid  [default: on; off with --quick]")
@click.option("--transformers-requests", type=int, default=8, show_default=True,
              help="Requests per cell for transformers serve (the first of each cell's load).")
@click.option("--transformers-cb", is_flag=True, help="Run transformers serve with --continuous-batching.")
@click.option("--threads", type=int, default=None,
              help="torch threads in the multidecode servers (default: torch's own).")
@click.option("--gather-s", type=float, default=0.0, show_default=True,
              help="An idle multidecode server waits up to this long for the cell's `concurrency` requests before "
                   "its first step, so that requests sent at once (--rate inf) decode together even where a loaded "
                   "machine delays some on their way in (0: it starts on the first).")
@click.option("--arrival-tokens", type=int, default=None,
              help="After the grid, 8 streams decode while a prompt of this many tokens arrives, read in pieces "
                   "and whole: the streams' gaps and its TTFT (0: no arrival)  [default: 4000; 0 with --quick]")
@click.option("--quick", is_flag=True,
              help="A small grid for a smoke test: concurrency 1,4, shared 0,0.9, 6 requests of 8 tokens, "
                   "120-token prompts, no transformers serve, no arrival (each option given still wins).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout (the tables go to stderr).")
@output_options
@report_errors
def bench_serve(model_name, requests, concurrency, shared, rate, max_tokens, prompt_tokens, arrival_tokens, quick,
                as_json, with_transformers, transformers_cb, output, stem, **settings):
    """The OpenAI-compatible server under load: a seeded Poisson load of streamed greedy completions
    (openai.AsyncOpenAI) against `multidecode serve` as one forest and one request at a time, and
    transformers serve, each in a subprocess on a free loopback port. Reports TTFT, ITL, TPOT and
    end-to-end latency (p50/p95/p99), requests/s, tokens/s, cache hit rate and branches per forward
    per cell (concurrency x shared-prefix share); writes JSON, a plot and markdown."""
    from ..bench.serve import GRID, QUICK, run_serve_benchmark

    given = {"requests": requests, "max_tokens": max_tokens, "prompt_tokens": prompt_tokens, "arrival_tokens": arrival_tokens,
             "concurrency": None if concurrency is None else parse_counts(concurrency, "--concurrency"),
             "shared": None if shared is None else parse_shares(shared)}
    load = {**(QUICK if quick else GRID), **{k: v for k, v in given.items() if v is not None}}
    check_flag_counts(requests=load["requests"], max_tokens=load["max_tokens"], prompt_tokens=load["prompt_tokens"],
                 transformers_requests=settings["transformers_requests"])
    if not rate > 0:
        raise InvalidArgument(f"--rate must be positive, got {rate}", "for example --rate 8, or --rate inf")
    if not settings["gather_s"] >= 0:
        raise InvalidArgument(f"--gather-s must be 0 or more, got {settings['gather_s']}", "for example --gather-s 30")
    if load["arrival_tokens"] < 0:
        raise InvalidArgument(f"--arrival-tokens must be 0 or more, got {load['arrival_tokens']}",
                              "for example --arrival-tokens 4000, or 0 for no arrival")
    check_run(output, settings["threads"], stem)
    transformers = (not quick) if with_transformers is None else with_transformers
    run_and_report("serve", lambda progress: run_serve_benchmark(
        model=model_name, rate=rate, transformers=transformers, transformers_cb=transformers_cb, progress=progress,
        **load, **settings), output, stem, as_json=as_json)


@bench.command("unrelated")
@click.option("--requests", default="1,4,16", show_default=True,
              help="Unrelated requests decoding together (R), comma-separated.")
@click.option("--prompt-tokens", default="300,1000", show_default=True,
              help="Prompt tokens per request (P), comma-separated.")
@click.option("--steps", type=int, default=7, show_default=True, help="Timed decode steps per cell (median reported).")
@click.option("--warmup", type=int, default=2, show_default=True, help="Untimed (but checked) steps first.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the prompts and the variants' order.")
@click.option("--threads", type=int, default=None, help="torch threads for the run (default: torch's own).")
@click.option("--model", "model_name", default=None, metavar="NAME",
              help="A local HF folder, a .gguf file or a hub id (default: the embedded SmolLM2-135M-Instruct).")
@click.option("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda if available).")
@output_options
@report_errors
def bench_unrelated(requests, prompt_tokens, steps, warmup, seed, threads, model_name, device, output, stem):
    """Attention over unrelated requests: one decode step of R requests of P tokens as one forest
    (one row, masked), as one forest over a shared prompt, as R separate forwards and as R batch rows.
    Checks that every variant gives the same logits (float32), then writes JSON, a plot and markdown."""
    from ..bench.unrelated import run_unrelated

    levels, lengths = parse_counts(requests, "--requests"), parse_counts(prompt_tokens, "--prompt-tokens")
    check_flag_counts(steps=steps)
    if warmup < 0:
        raise InvalidArgument(f"--warmup must be 0 or more, got {warmup}", "use --warmup 0 or more")
    check_run(output, threads, stem)
    model = load_decoder(model_name, "float32", device).model
    run_and_report("unrelated", lambda progress: run_unrelated(
        model, requests=levels, prompt_tokens=lengths, steps=steps, warmup=warmup, seed=seed, threads=threads,
        progress=progress), output, stem)


@bench.command("precision")
@click.option("--model", "model_name", default=None, metavar="FILE.gguf",
              help="A GGUF file (default: the embedded SmolLM2-135M-Instruct's); `bench random-gguf` writes one "
                   "of Llama-3.2-1B's shape.")
@click.option("--precisions", default="auto,bfloat16,float32", show_default=True,
              help="Precisions to load the file at, comma-separated (auto always runs).")
@click.option("--workloads", default="summary,code_edit,story", show_default=True,
              help="One-stream workloads of `bench speculate`, comma-separated (none: '').")
@max_new_tokens(None, "Override every workload's own.")
@click.option("--context-tokens", type=int, default=1400, show_default=True,
              help="Tokens of the long-context case's prompt (0: leave it out).")
@click.option("--context-new-tokens", type=int, default=64, show_default=True,
              help="Tokens generated in the long-context case.")
@click.option("--questions", type=int, default=8, show_default=True,
              help="Questions about the sample call in the questions case (0: leave it out).")
@click.option("--question-tokens", type=int, default=32, show_default=True, help="Longest answer, in tokens.")
@click.option("--document-tokens", type=int, default=None, metavar="N",
              help="Ask about the sample call's opening lines, about N tokens (default: the whole call).")
@click.option("--transformers/--no-transformers", default=True, show_default=True,
              help="Also run transformers' generate one question at a time (the slowest method).")
@click.option("--budget", type=float, default=60.0, show_default=True, metavar="SECONDS",
              help="Time budget for each case's rounds of all methods.")
@click.option("--llama/--no-llama", "with_llama", default=True, show_default=True,
              help="Measure llama.cpp on the same file (needs pip install 'multidecode[peers]').")
@run_options
@output_options
@report_errors
def bench_precision(model_name, precisions, workloads, max_new_tokens, context_tokens, context_new_tokens, questions,
                    question_tokens, document_tokens, transformers, budget, with_llama, repeats, threads, output, stem):
    """One GGUF file at each precision and in llama.cpp: one stream on the speculate workloads and a long
    context, and 8 questions about the sample call. Reports per decode step the bytes of weights read, ms, GB/s
    and the memory floor at the measured bandwidth; writes JSON, a plot and markdown."""
    import torch

    from ..bench.precision import run_precision_benchmark
    from ..bench.speculate import choose
    from ..models.converted import embedded_gguf
    from ..models.precision import parse_all

    chosen = parse_all([p.strip() for p in precisions.split(",") if p.strip()] + ["auto"], torch.device("cpu"))
    names = [w.strip() for w in workloads.split(",") if w.strip()]
    if names:
        choose(names)
    check_flag_counts(repeats=repeats, context_new_tokens=context_new_tokens, question_tokens=question_tokens,
                      **({"max_new_tokens": max_new_tokens} if max_new_tokens is not None else {}))
    check_seconds_budget(budget, 60)
    if document_tokens is not None:
        check_flag_counts(document_tokens=document_tokens)
    if context_tokens < 0 or questions < 0:
        raise InvalidArgument("--context-tokens and --questions must be 0 or more", "0 leaves that case out")
    check_run(output, threads, stem)
    path = model_name or embedded_gguf()
    run_and_report("precision", lambda progress: run_precision_benchmark(
        path, precisions_to_run=chosen, threads=threads, with_llama=with_llama, progress=progress, names=names,
        max_new_tokens=max_new_tokens, context_tokens=context_tokens, context_new_tokens=context_new_tokens,
        questions=questions, question_tokens=question_tokens, document_tokens=document_tokens,
        transformers=transformers, repeats=repeats, budget_s=budget), output, stem)


@bench.command("startup")
@click.option("--model", "model_name", default=None, metavar="FILE.gguf",
              help="A GGUF file (default: the embedded SmolLM2-135M-Instruct's).")
@click.option("--threads", type=int, default=2, show_default=True, help="Threads of every process.")
@click.option("--repeats", type=int, default=3, show_default=True, help="Processes per start and method (median).")
@click.option("--llama/--no-llama", "with_llama", default=True, show_default=True,
              help="Measure llama.cpp on the same file (needs pip install 'multidecode[peers]').")
@output_options
@report_errors
def bench_startup(model_name, threads, repeats, with_llama, output, stem):
    """The wait before the first token, cold (an empty user cache) and warm: import, load, first token and
    the whole `multidecode generate` command, against llama.cpp on the same file; each run its own process."""
    from ..bench.startup import run_startup_benchmark

    check_flag_counts(repeats=repeats)
    check_run(output, threads, stem)
    run_and_report("startup", lambda progress: run_startup_benchmark(
        model_name, threads=threads, repeats=repeats, with_llama=with_llama, progress=progress), output, stem)


@bench.command("redraw")
@click.argument("results", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False), metavar="FILE.json...")
@report_errors
def bench_redraw(results):
    """Draw each result's markdown table and PNG plot again, beside its JSON and from it alone (after a
    change to how results are drawn: docs/results stays in step with the code)."""
    from ..bench.results import redraw

    failed = []
    for path in results:  # every file that can be drawn is, whatever the others are
        try:
            written_paths = redraw(path)
        except OSError as err:
            verb = "read" if err.filename == str(path) else "write"
            failed.append(f"{path}: cannot {verb} {err.filename or ''} ({err.strerror or err})")
            continue
        except (ValueError, LookupError, TypeError, AttributeError, ArithmeticError) as err:  # not JSON, not a result
            failed.append(f"{path} is not a multidecode benchmark result ({type(err).__name__}: {err})")
            continue
        for written in written_paths:
            stdout.print(f"wrote {escape(str(written))}")
    if failed:
        for line in failed[:-1]:
            stderr.print(f"[bold red]error:[/bold red] {escape(line)}")
        raise InvalidInput(failed[-1], "give the .json files `multidecode bench` runs wrote, where their .md and "
                                       ".png can be written beside them")


@bench.command("random-gguf")
@click.argument("path", type=click.Path(dir_okay=False))
@click.option("--shape", default="llama-3.2-1b", show_default=True, help="The model's dimensions: llama-3.2-1b or tiny.")
@click.option("--quant", default="Q4_0", show_default=True, help="The GGUF type of the matrices (Q4_0, Q8_0, ...).")
@click.option("--seed", type=int, default=0, show_default=True)
@report_errors
def bench_random_gguf(path, shape, quant, seed):
    """Write a GGUF file of a real model's shape with random weights (for timing: nothing is downloaded)."""
    from ..models.random_gguf import SHAPES, write_random_gguf

    if shape not in SHAPES:
        raise InvalidArgument(f"unknown shape {shape!r}", f"use one of {', '.join(SHAPES)}")
    import gguf

    if quant not in gguf.GGMLQuantizationType.__members__:
        raise InvalidArgument(f"unknown GGUF type {quant!r}", "for example --quant Q4_0 or --quant Q8_0")
    with stderr.status(f"writing {path}...") as status:
        written = write_random_gguf(path, shape=shape, quant=quant, seed=seed,
                                    progress=lambda message: status.update(f"writing {path}... {escape(message)}"))
    stdout.print(f"wrote {written['path']}: {written['parameters']:,} parameters, "
                 f"{human_size(written['file_bytes'])}, in {written['seconds']:.1f} s")


@bench.command("structured")
@click.option("--documents", type=int, default=6, show_default=True,
              help="Support calls to extract a record from (the 6 shipped ones, cycled).")
@max_new_tokens(320, "Longest record, in tokens (a record takes 50 to about 130; the schema allows about 300 "
                     "at worst: three 60-character summaries at a token a character).")
@click.option("--mask-tokens", type=int, default=32, show_default=True,
              help="Tokens per branch in (a), the masks' cost on 8 branches.")
@click.option("--llama/--no-llama", "with_llama", default=True, show_default=True,
              help="Measure llama.cpp with the schema's grammar on the same GGUF file (needs pip install "
                   "'multidecode[peers]').")
@click.option("--quick", is_flag=True, help="A smoke run: 2 calls, 8 tokens per branch in (a), one round (overrides those).")
@model_options
@run_options
@output_options
@report_errors
def bench_structured(documents, max_new_tokens, mask_tokens, with_llama, quick, model_name, precision, device, repeats,
                     threads, output, stem):
    """Structured output: a support-call record (a JSON schema) from short calls. (a) the masks' cost per step,
    constrained against unconstrained on 8 branches; (b) jump-forward against none, and with speculate=auto (same
    outputs asserted); (c) llama.cpp with the schema's grammar on the same GGUF, one call at a time and the calls as
    parallel sequences, against MultiDecode one at a time and the calls as one forest; (d) transformers' generate
    with outlines' masks (where installed); (e) the share of valid outputs."""
    from ..bench.structured import QUICK, run_structured_benchmark
    from ..models.converted import embedded_gguf

    check_flag_counts(repeats=repeats, documents=documents, max_new_tokens=max_new_tokens, mask_tokens=mask_tokens)
    check_run(output, threads, stem)
    settings = {"documents": documents, "max_new_tokens": max_new_tokens, "mask_tokens": mask_tokens,
                "repeats": repeats} | (QUICK if quick else {})
    gguf = embedded_gguf() if model_name is None else model_name if model_name.endswith(".gguf") else None
    decoder = load_decoder(model_name, precision, device)
    run_and_report("structured", lambda progress: run_structured_benchmark(
        decoder, gguf=gguf, with_llama=with_llama, threads=threads, progress=progress, **settings), output, stem)
