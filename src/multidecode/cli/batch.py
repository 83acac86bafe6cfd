"""`multidecode batch`: the same questions about many documents, resumable, into a JSON Lines file.

The job itself (input format, output format, resuming) lives in `multidecode.batch`; this module
parses options, shows progress on stderr and prints the summary. The first Ctrl-C (or SIGTERM)
lets the current document finish and stops; a second one stops at once. Either way, running the
same command again resumes.
"""

from __future__ import annotations

import contextlib
import json
import shlex
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Self

import click
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from ..batch import BatchJob, BatchSettings, BatchSummary, LineResult, model_identity, open_batch, total_stats
from ..batch.merged import FOREST_BRANCHES, FOREST_TOKENS, PREFILL_CHUNK
from ..errors import InvalidInput, MultiDecodeError
from ..models.loading import resolve_precision
from .common import (
    COMPILE_HELP,
    check_early,
    constraint_from,
    counted,
    decoding_options,
    in_option_terms,
    load_decoder,
    prepare_speculation,
    print_stats,
    read_lines,
    report_errors,
    sampling_from,
    speculation_from,
    stderr,
    stop_option,
)

#: failures printed as they happen; later ones are only counted (all are in the output)
SHOWN_FAILURES = 20
#: seconds between progress lines when stderr is not a terminal (a log file)
PLAIN_EVERY_S = 10.0


# ---------------------------------------------------------------------- progress
def _duration(seconds: float) -> str:
    """A wall time as a person reads it: "0.4 s", "12 s", "3 min 05 s", "2 h 10 min"."""
    if seconds < 9.95:
        return f"{seconds:.1f} s"
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {seconds:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


class ProgressView:
    """A progress bar (lines done/total, failures, tokens/s, elapsed, ETA) on a terminal, or a
    plain line every few seconds otherwise; failures are printed as they happen."""

    def __init__(self, job: BatchJob) -> None:
        self.job = job
        self.shown_failures = 0
        self.live = stderr.is_terminal
        self.progress: Progress | None = None
        self.last_plain = time.monotonic()

    def __enter__(self) -> Self:
        if self.live:
            self.progress = Progress(
                TextColumn("[bold]batch[/bold]"), BarColumn(), MofNCompleteColumn(), TextColumn("lines"),
                TextColumn("{task.fields[failed]}"), TextColumn("{task.fields[speed]}"),
                TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                # ETA from the whole run's average: rich's default (the last 30 s) has no
                # estimate at all when one document takes longer than that.
                console=stderr, transient=False, speed_estimate_period=7 * 24 * 3600,
            )
            self.progress.start()
            self.task = self.progress.add_task("batch", total=self.job.total, completed=self.job.skipped,
                                               failed="", speed="")
        return self

    def __exit__(self, *exc) -> None:
        if self.progress is not None:
            self.progress.stop()

    def note(self, text: str) -> None:
        (self.progress.console if self.progress is not None else stderr).print(text)

    def advance(self, result: LineResult) -> None:
        job = self.job
        if not result.ok:
            self.shown_failures += 1
            if self.shown_failures <= SHOWN_FAILURES:
                error = result.error
                self.note(f"[yellow]line {result.line} (id {escape(str(result.id))}) failed:[/yellow] "
                          f"{escape(error['type'])}: {escape(error['message'])}")
            if self.shown_failures == SHOWN_FAILURES + 1:
                self.note(f"[yellow]further failures are recorded in {escape(str(job.output_path))} "
                          "without being printed[/yellow]")
        speed = job.tokens / job.elapsed_s if job.elapsed_s > 0 else 0.0
        if self.progress is not None:
            failed = f"[yellow]{job.failed} failed[/yellow]" if job.failed else ""
            self.progress.update(self.task, advance=1, failed=failed, speed=f"{speed:,.1f} tok/s")
        elif job.pending and time.monotonic() - self.last_plain >= PLAIN_EVERY_S:
            self.last_plain = time.monotonic()
            finished = job.skipped + job.done
            left = len(job.pending) / (job.done / job.elapsed_s) if job.done and job.elapsed_s > 0 else None
            eta = f", about {_duration(left)} left" if left is not None else ""
            stderr.print(f"batch: {finished}/{job.total} lines, {job.failed} failed, {speed:,.1f} tokens/s{eta}")


# ---------------------------------------------------------------------- signals
@contextlib.contextmanager
def graceful_stop(job: BatchJob, view: ProgressView):
    """First SIGINT/SIGTERM: finish the documents in progress, then stop. Second: stop at once.
    Yields a list that holds the first signal's number once one arrives."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def handler(signum, frame):
        if received:
            raise KeyboardInterrupt
        received.append(signum)
        job.stop()
        with contextlib.suppress(Exception):
            again = "press Ctrl-C again" if signum == signal.SIGINT else "send SIGTERM again"
            view.note(f"[yellow]stopping after the documents in progress ({again} to stop now)[/yellow]")

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield received
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def resume_command() -> str | None:
    """The command line to run again, when this process was started as `multidecode ...`."""
    if Path(sys.argv[0]).name != "multidecode":
        return None
    return " ".join(map(shell_word, ["multidecode", *sys.argv[1:]]))


def shell_word(word: str) -> str:
    """`word` quoted for the shell, on one line: one holding a control character (`--stop $'\\n'`) in
    $'...' quoting (bash, zsh), that character escaped; any other as `shlex.quote` does."""
    if word.isprintable():
        return shlex.quote(word)
    named = {"\n": "\\n", "\t": "\\t", "\r": "\\r", "\\": "\\\\", "'": "\\'"}
    return "$'" + "".join(named.get(c) or (c if c.isprintable() else f"\\U{ord(c):08x}") for c in word) + "'"


# ---------------------------------------------------------------------- reporting
def announce(job: BatchJob) -> None:
    inp, out = escape(str(job.input_path)), escape(str(job.output_path))
    parts = [f"{inp}: {counted(job.total, 'line')}"]
    if job.skipped:
        parts.append(f"{job.skipped} already in {out}")
    parts.append(f"{len(job.pending)} to do")
    stderr.print("[dim]" + ", ".join(parts) + "[/dim]")
    if job.repaired:
        stderr.print(f"[dim]removed the unfinished last line of {out} (an interrupted write); "
                     "that line is done again[/dim]")
    if job.retried:
        stderr.print(f"[dim]redoing {counted(job.retried, 'failed line')}[/dim]")
    if job.foreign:
        stderr.print(f"[dim]{out} also holds {counted(job.foreign, 'record')} for ids "
                     "that are not in the input; they stay as they are[/dim]")


def print_summary(summary: BatchSummary, *, stopped: bool) -> None:
    out = escape(summary.output)
    finished = summary.total - summary.remaining
    if summary.complete:
        every = "the only line" if summary.total == 1 else f"all {counted(summary.total, 'line')}"
        head = f"[green]Done:[/green] {every} of {escape(summary.input)} {'is' if summary.total == 1 else 'are'} in {out}"
    else:
        head = (f"[yellow]{'Stopped' if stopped else 'Ended'}:[/yellow] {finished} of {summary.total} lines "
                f"are in {out}, {summary.remaining} to go")
    stderr.print(head)
    this_run = f"{counted(summary.done, 'line')} this run"
    if summary.failed:
        this_run += f" ([yellow]{summary.failed} failed[/yellow])"
    if summary.skipped:
        this_run += f", {summary.skipped} skipped as already done"
    if summary.retried:
        this_run += f", {summary.retried} failed before and redone"
    stderr.print(f"  {this_run}")
    if summary.done:
        stderr.print(f"  {summary.tokens:,} tokens generated in {_duration(summary.elapsed_s)} "
                     f"({summary.tokens_per_s:,.1f} tokens/s, {summary.lines_per_s:,.2f} lines/s)")
    if summary.failures:
        stderr.print("  failures:")
        for failure in summary.failures:
            stderr.print(f"    line {failure['line']} (id {escape(str(failure['id']))}): "
                         f"{escape(failure['type'])}: {escape(failure['message'])}")
        if summary.failed > len(summary.failures):
            stderr.print(f"    ... and {summary.failed - len(summary.failures)} more (records with an \"error\" "
                         f"in {out})")
    if not summary.complete and not stopped:  # the run read the input to its end: it is not what it was
        stderr.print(f"[yellow]hint:[/yellow] {escape(summary.input)} changed during the run (lines were added, "
                     "or the lines left changed, moved or removed); rerun the same command to answer the input as it is now")
    failed_in_file = summary.failed + summary.earlier_failures
    if failed_in_file:
        one = failed_in_file == 1
        stderr.print(f"[yellow]hint:[/yellow] {failed_in_file} line{'' if one else 's'} in {out} failed; fix the "
                     f"input, then rerun with --retry-failed to redo {'it' if one else 'them'}")


def on_ray(job: BatchJob, settings: BatchSettings, address: str, workers: int, model_name, precision, device,
           speculation, budget: dict):
    """The job's outcomes from Ray workers (`multidecode.batch.ray`), each with the forest `budget`
    (`ray_outcomes`' forest_tokens, forest_branches and prefill_chunk), with a status line while
    Ray starts and the workers load the model."""
    from ..batch.ray import ray_outcomes

    where = "a local Ray" if address == "local" else escape(address)
    stderr.print(f"[dim]Starting {counted(workers, 'worker')} on {where}...[/dim]")
    return ray_outcomes(job.pending_items(), settings=settings, model=model_name, precision=precision, device=device,
                        speculate=speculation, address=None if address == "local" else address,
                        workers=workers, stopping=lambda: job.stopping, **budget)


# ---------------------------------------------------------------------- the command
def check_where(output: str, ray_address: str | None, workers: int | None, compile_step: bool) -> None:
    """Refuse flags that do not fit where the job writes (a file, not standard output) and runs
    (here, or on Ray), and say how to install Ray before anything else happens when the job is for it."""
    if output == "-":
        raise InvalidInput("batch writes its results to a file, not to standard output: it appends to that file "
                           "and resumes from it", "pass --output answers.jsonl, and read that file (tail -f follows it)")
    if workers is not None and ray_address is None:
        raise InvalidInput("--workers is for jobs on Ray", "add --ray (a local Ray) or --ray ADDRESS, or leave it out")
    if compile_step and ray_address is not None:
        raise InvalidInput("--compile runs the job in this process; Ray workers load their own model eagerly",
                           "drop --compile or --ray")
    if ray_address is not None:
        from ..batch.ray import import_ray

        import_ray()


def say_if_not_compiled(results, model):
    """`results` as they come; then, if the model's forward could not be compiled exactly (it ran
    eagerly: the same records, slower), a note saying why."""
    from ..compiled import compiled_forward

    yield from results
    compiled = compiled_forward(model)
    if compiled is not None and compiled.refused:
        stderr.print(f"[yellow]note:[/yellow] --compile: ran eagerly, {escape(compiled.refused)}")


@click.command()
@click.argument("input_path", metavar="INPUT.jsonl")
@click.option("--output", "-o", required=True, metavar="OUT.jsonl",
              help="Results, one JSON line per input line; appended to, so rerunning resumes.")
@click.option("--questions-file", metavar="FILE", help="Questions for every document, one per line.")
@click.option("--question", "-q", multiple=True, metavar="TEXT", help="A question for every document (repeatable).")
@click.option("--max-new-tokens", type=int, default=48, show_default=True, help="Longest answer, in tokens.")
@stop_option("an answer")
@click.option("--retry-failed", is_flag=True, help="Redo the lines whose result in OUT is an error.")
@click.option("--forest-tokens", type=click.IntRange(min=0), default=FOREST_TOKENS, show_default=True, metavar="N",
              help="Merge documents into one forest while they reserve at most N cache tokens (0: one at a time).")
@click.option("--forest-branches", type=click.IntRange(min=1), default=FOREST_BRANCHES, show_default=True,
              metavar="N", help="...and hold at most N questions in flight.")
@click.option("--prefill-chunk", type=click.IntRange(min=0), default=PREFILL_CHUNK, show_default=True, metavar="N",
              help="Feed a document at most N tokens a step while other documents decode (0: whole).")
@click.option("--ray", "ray_address", is_flag=False, flag_value="local", default=None, metavar="[ADDRESS]",
              help="Run on Ray workers: --ray alone starts a local Ray; --ray auto joins this node's cluster; "
                   "--ray HOST:PORT joins a head node (pip install 'multidecode[ray]').")
@click.option("--workers", type=click.IntRange(min=1), default=None, metavar="N",
              help="Ray workers, each with its own model and merged forest (with --ray; default 2).")
@click.option("--compile", "compile_step", is_flag=True, help=COMPILE_HELP + " Not with --ray.")
@decoding_options()
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON on stdout.")
@report_errors
def batch(input_path, output, questions_file, question, max_new_tokens, stop, retry_failed, forest_tokens,
          forest_branches, prefill_chunk, ray_address, workers, compile_step, model_name, precision, device, as_json, speculate, draft_budget,
          show_stats, constraint, **sampling):
    """Answer questions about every document of a JSON Lines file, resumably.

    Each input line is a JSON object: {"id": ..., "document": "...", "questions": ["...", ...]}.
    "id" is optional (default: the line number); questions given with --questions-file or -q are
    asked of every document, before the line's own, which are then optional. --json-schema FILE
    (or a line's "json_schema") holds answers to a schema, each record's "parsed" their JSON.

    Each result is appended to OUT as one JSON line as soon as it is done. After Ctrl-C, a kill
    or a crash, the same command resumes: finished lines are never redone or duplicated. A line
    that fails (bad JSON, an empty question, a document too long for the model, ...) is recorded
    with its error and the job goes on; --retry-failed redoes those. Resuming needs the same
    settings (model, precision, job questions, --max-new-tokens, --stop, sampling, the
    constraint), which OUT.jsonl.meta.json records; failed records do not hold a job to theirs. Exit status: 0 when every line has a result (failed ones included),
    1 when lines are left undone (the input changed during the run, or repeated unexpected
    errors aborted it), 130 after Ctrl-C (143 after SIGTERM), 2 for a problem with the job.

    Documents share forests: the next one starts while earlier ones decode, up to --forest-tokens
    and --forest-branches (--forest-tokens 0: one at a time). --ray runs the same job on Ray
    workers (one model and forest each); the results go to the same OUT, resumable alike.

    --speculate makes answers come faster, never different, so a job may resume with another
    mode. suffix (or auto) drafts from the answers to the earlier documents of the job, which
    pays on many similar documents. --stats prints this run's forwards (a shared one once) and drafts.

    \b
    Example:
      multidecode batch calls.jsonl --questions-file questions.txt --output answers.jsonl
    """
    check_where(output, ray_address, workers, compile_step)
    questions, constraint = job_questions(question, questions_file), constraint_from(constraint)
    check_early(max_new_tokens=max_new_tokens, sampling=sampling_from(sampling), stop=stop)
    speculation = speculation_from(speculate, draft_budget)
    settings = BatchSettings(questions=tuple(questions), max_new_tokens=max_new_tokens, stop=tuple(stop),
                             sampling=sampling_from(sampling), model=model_identity(model_name),
                             precision=resolve_precision(model_name, precision, device).identity, constraint=constraint)
    with open_batch(input_path, output, settings, retry_failed=retry_failed) as job:
        announce(job)
        received, totals = [], {}
        budget = {"forest_tokens": forest_tokens, "forest_branches": forest_branches, "prefill_chunk": prefill_chunk}
        if job.pending:
            try:  # Ctrl-C while the model loads (or Ray connects) stops the job as one in progress would
                if ray_address is None:
                    decoder = load_decoder(model_name, precision, device, compile=compile_step)
                    results = job.run(decoder, speculate=prepare_speculation(decoder, speculation), **budget)
                    if compile_step:
                        results = say_if_not_compiled(results, decoder.model)
                else:
                    results = job.record(on_ray(job, settings, ray_address, workers or 2, model_name, precision,
                                                device, speculation, budget))
            except KeyboardInterrupt:
                received = [signal.SIGINT]
            else:
                received, totals = follow(job, results, as_json=as_json)
        summary = job.summary()
    conclude(summary, stopped=bool(received) and not summary.complete, signal_number=received[0] if received else 0,
             totals=totals if show_stats else None, as_json=as_json)


def job_questions(question: tuple[str, ...], questions_file: str | None) -> list[str]:
    """The questions asked of every document: -q ones, then the file's."""
    questions = list(question)
    if questions_file:
        from_file = read_lines(questions_file)
        if not from_file:
            raise InvalidInput(f"the questions file {questions_file} has no questions (it is empty or holds only "
                               "blank lines)", 'write one question per line, or leave out --questions-file and give '
                               'each line its own "questions"')
        questions += from_file
    return questions


def follow(job: BatchJob, results, *, as_json: bool) -> tuple[list[int], dict]:
    """Show each result as it comes, with a progress bar, until the job ends or is stopped.
    Returns the signals received (the first stops the job gracefully) and this run's decode
    stats, summed. An error that ends the run after lines were done comes after what they were."""
    received: list[int] = []
    totals: dict = {}
    try:
        with ProgressView(job) as view, graceful_stop(job, view) as received:
            for result in results:
                totals = total_stats([totals, result.stats])
                view.advance(result)
    except KeyboardInterrupt:
        received = received or [signal.SIGINT]
    except MultiDecodeError as error:
        if job.summary().done:
            conclude_aborted(job.summary(), error, as_json=as_json)
        raise
    return received, totals


def conclude_aborted(summary: BatchSummary, error: MultiDecodeError, *, as_json: bool) -> None:
    """The summary of a run that an error ended after lines were done (the output unwritable, repeated
    unexpected errors, every Ray worker lost): on stderr, and with --json on stdout with the error;
    the error's own line and exit status follow."""
    stopped = not summary.complete  # the errors may have struck the last lines: then the job is done
    print_summary(summary, stopped=stopped)
    if as_json:
        said = {"type": type(error).__name__, "message": in_option_terms(error.message), "hint": error.hint}
        click.echo(json.dumps(summary.as_dict() | {"stopped": stopped, "error": said}, ensure_ascii=False))


def conclude(summary: BatchSummary, *, stopped: bool, signal_number: int, totals: dict | None, as_json: bool) -> None:
    """The summary (and stats, and JSON when asked), then the exit status: 128 + the signal when
    stopped, 1 when lines are left undone."""
    print_summary(summary, stopped=stopped)
    if totals and totals.get("runs"):  # the forests' forwards, each once, not each line's summed
        forwards = summary.forward_passes
        print_stats(totals | {"forward_passes": forwards, "tokens_per_forward": totals["tokens"] / max(1, forwards)},
                    lead=f"{counted(totals['runs'], 'line')} answered in this run: ")
    if as_json:
        click.echo(json.dumps(summary.as_dict() | {"stopped": stopped}, ensure_ascii=False))
    if stopped:
        command = resume_command()
        stderr.print("[yellow]hint:[/yellow] run the same command again to resume"
                     + (f": {escape(command)}" if command else ""))
        raise SystemExit(128 + signal_number)
    if not summary.complete:
        raise SystemExit(1)
