"""What every command shares: options, reading inputs, loading a model, printing errors.

The CLI is a thin shell over the library: it parses, calls, and formats. Results go to stdout,
progress and status to stderr, so `--json` output can be piped.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import click
from rich.console import Console
from rich.markup import escape

from ..errors import InvalidArgument, InvalidInput, MultiDecodeError, decode_text
from ..sampling_params import TINIEST_TEMPERATURE, divides_logits
from ..user_cache import unwritable

if TYPE_CHECKING:
    from ..speculation import SpeculationSettings, Spelling

def reader_left() -> NoReturn:
    """End the command quietly with 0 once standard output's reader has gone (`| head -1`): it has
    what it wanted, and nothing is left to flush at exit (the pipe's end points at /dev/null)."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    raise SystemExit(0)


class Output(Console):
    """A console on standard output whose reader may leave: `reader_left`, as `report_errors` does
    when click's own writes find the pipe gone (rich's default is exit 1, which a pipeline reads as
    a failure)."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        reader_left()


class Diagnostics(Console):
    """A console on standard error whose reader may leave (`2>&1 | head -1`): the command goes on
    without its messages, since what it writes elsewhere (a batch job's output file) is its work;
    rich's default ended it with status 1 before it began."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stderr.fileno())


def console_width() -> int | None:
    """None (rich reads COLUMNS, else the terminal), but 80 where COLUMNS is 0 or less (some CI
    runners, a pty sized 0x0): rich then wrote nothing at all, every `error:` line silenced."""
    value = os.environ.get("COLUMNS", "").strip()
    return 80 if value.lstrip("-").isdigit() and int(value) <= 0 else None


stderr = Diagnostics(stderr=True, highlight=False, soft_wrap=True, width=console_width())
stdout = Output(highlight=False, soft_wrap=True, width=console_width())

UNWRITABLE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO}
"""Why a write to an open stream fails where the reader did not leave: the device is full or broken."""


def end_if_output_failed(err: OSError) -> None:
    """End the command with an `error:` line and status 2 where `err` is a write to standard output
    that failed (`> /dev/full`, a full disk); return otherwise. The library turns its own files'
    failures into `MultiDecodeError`s, so a stream's write error naming no file is the command's
    output. Standard output then points at /dev/null, so that exiting flushes nothing more."""
    if err.errno not in UNWRITABLE or err.filename is not None:
        return
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    stderr.print(f"[bold red]error:[/bold red] cannot write the output: {escape(err.strerror or str(err))}")
    stderr.print("[yellow]hint:[/yellow] send standard output where there is room (> FILE on another disk)")
    raise SystemExit(2)


# ---------------------------------------------------------------------- options
def model_options(command):
    """--model, --precision (alias --dtype), --device."""
    command = click.option("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda if available).")(command)
    command = click.option(
        "--precision", "--dtype", "precision", default=None, metavar="NAME",
        help="What the weights are kept as: auto (default: a GGUF file keeps its 4- or 8-bit codes, a folder its "
             "dtype), float32, bfloat16, float16 (CUDA), int8 or int4 (packed, CPU). Output is exact at every one.",
    )(command)
    command = click.option(
        "--model", "model_name", default=None, metavar="NAME",
        help="A local HF folder, a .gguf file or a hub id (default: the embedded SmolLM2-135M-Instruct).",
    )(command)
    return command


COMPILE_HELP = ("Run the forward compiled (torch.compile): the same bits, a shorter step, for long jobs. The first "
                "steps wait for the compile (about a minute a graph on a CPU; kept in the user cache for later runs).")


SAMPLING_OPTIONS = (
    ("--temperature", float, "Sampling temperature (turns sampling on; 0 is greedy)."),
    ("--top-k", int, "Sample from the k most likely tokens."),
    ("--top-p", float, "Sample from the smallest set reaching this probability."),
    ("--min-p", float, "Drop tokens less likely than min-p times the top token."),
    ("--repetition-penalty", float, "Penalize tokens already in the sequence (1.0 = off); applies to greedy too."),
    ("--presence-penalty", float, "OpenAI's: -2 to 2, off each generated token's logit; applies to greedy too."),
    ("--frequency-penalty", float, "OpenAI's: -2 to 2, times each generated token's count; applies to greedy too."),
    ("--seed", int, ("Seed (turns sampling on, at temperature 1 unless given); branch i uses seed + i, so every "
                     "branch is reproducible.")),
)
"""The sampling options but --logit-bias: (option, type, help)."""


def sampling_options(command, temperature: str | None = None):
    """--temperature, --top-k, --top-p, --min-p, --seed (any of them turns sampling on), and the
    penalties and bias, which apply to greedy decoding too: --repetition-penalty,
    --presence-penalty, --frequency-penalty, --logit-bias TOKEN=BIAS (repeatable). temperature:
    --temperature's help where the command samples by default (what it samples at)."""
    command = click.option(
        "--logit-bias", multiple=True, metavar="TOKEN=BIAS", callback=_parse_logit_bias,
        help="Add BIAS (-100 to 100) to token id TOKEN's logit before choosing (repeatable); +100 all but forces "
             "the token, -100 bans it. Applies to greedy too.")(command)
    for name, kind, text in reversed(SAMPLING_OPTIONS):
        text = temperature if name == "--temperature" and temperature else text
        command = click.option(name, type=kind, default=None, help=text)(command)
    return command


def _parse_logit_bias(context, parameter, values: tuple[str, ...]) -> dict[int, float] | None:
    """--logit-bias TOKEN=BIAS, repeated, as {token id: bias}; a malformed one is a usage error."""
    bias: dict[int, float] = {}
    for value in values:
        token, sep, amount = value.partition("=")
        try:
            if not sep:
                raise ValueError
            key, number = int(token.strip()), float(amount)
        except ValueError:
            raise click.BadParameter(f"{value!r} is not TOKEN=BIAS (a token id and a number, e.g. 42=-100)",
                                     context, parameter) from None
        if key in bias:
            raise click.BadParameter(f"token {key} is given twice", context, parameter)
        bias[key] = number
    return bias or None


_UNUSED_SAID = "multidecode.unused_sampling_said"
"""The click context's mark that the sampling settings --temperature 0 leaves unused were named."""


def sampling_from(options: dict) -> dict:
    """The sampling settings the user gave (a command's keyword arguments from `sampling_options`),
    as keyword arguments for the library (where --temperature 0 is greedy, as OpenAI's servers and
    llama.cpp read it: sampling off, the penalties and bias kept)."""
    chosen = {k: v for k, v in options.items() if v is not None}
    temperature = chosen.get("temperature", 0)
    if not temperature >= 0:  # (nan too) the library's message speaks of do_sample, no option's
        raise InvalidArgument(f"--temperature must be 0 (greedy) or more, got {temperature:g}",
                              "use --temperature 0, or leave it out, for greedy decoding")
    if chosen.get("top_k", 0) < 0:  # -1 is "off" to some servers: here it is refused, as the library refuses it
        raise InvalidArgument(f"--top-k must be 0 (off) or a positive integer, got {chosen['top_k']}",
                              "leave it out, or give 0, to sample from the whole vocabulary")
    if temperature > 0 and not divides_logits(temperature):  # logits / it: no distribution left
        raise InvalidArgument(f"--temperature {temperature:g} cannot divide float32 logits (from "
                              f"{TINIEST_TEMPERATURE:g} to a finite number)", "use --temperature 0 for greedy decoding")
    unused = [f"--{key.replace('_', '-')}" for key in ("seed", "top_k", "top_p", "min_p") if key in chosen]
    context = click.get_current_context(silent=True)
    said = context.meta if context is not None else {}
    if "temperature" in chosen and temperature == 0 and unused and not said.get(_UNUSED_SAID):  # said once, as
        said[_UNUSED_SAID] = True  # --greedy with them is refused
        stderr.print(f"[yellow]note:[/yellow] --temperature 0 decodes greedily, so {', '.join(unused)} "
                     f"{'is' if len(unused) == 1 else 'are'} not used")
    return chosen


@functools.cache
def spelling() -> Spelling:
    """How speculation's error messages name the settings here: as the options below."""
    from ..speculation import Spelling

    return Spelling(mode="--speculate {}", current="--speculate is {}", budget="--draft-budget",
                    lookahead="--lookahead", draft_model="--draft-model", skip_layers="--draft-skip-layers",
                    head="--draft-head", assign="{} {}",
                    exact_fix="use --precision float32 (a model the exact kernels cannot run computes in float32 "
                              "exactly)")


class LateHelp(click.Option):
    """An option whose help is written only when help is shown (`late_help()`): its text comes
    from a table whose module imports torch, which a command's run may never need."""

    def __init__(self, *args, late_help, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.late_help = late_help

    def get_help_record(self, ctx: click.Context):
        self.help = self.late_help()
        return super().get_help_record(ctx)


def _speculate_help(scope: str) -> str:
    from ..speculation import MODES_HELP

    return f"Speculative decoding inside every branch: {MODES_HELP}. Never changes the output." + (
        " " + scope if scope else "")


def _draft_head_help() -> str:
    from ..speculation import FOLDER_HEADS

    return ("A learned head's folder to draft with (Medusa's layout, or an EAGLE head); default: the head "
            f"`multidecode train-drafter` trained for this model. Implies --speculate {' or '.join(FOLDER_HEADS)}, "
            "whichever the head is.")


@dataclass(frozen=True)
class SpeculateOptions:
    """The speculation options as given (`speculation_from` parses and checks them)."""

    mode: str | None
    draft_model: str | None = None
    draft_skip_layers: str | None = None
    lookahead: str | None = None
    draft_head: str | None = None


def speculate_options(default: str | None = None, *, stats: bool = True, scope: str = ""):
    """--speculate MODE (default `default`), --draft-budget N, --draft-model PATH,
    --draft-skip-layers LIST, --lookahead W,N,G and, with `stats`, --stats. The command receives
    them as one `SpeculateOptions` in `speculate` (and `draft_budget`, `show_stats`); `scope` ends
    --speculate's help."""

    def add(function):
        @functools.wraps(function)
        def bundled(*args, speculate, draft_model, draft_skip_layers, lookahead, draft_head, **kwargs):
            options = SpeculateOptions(speculate, draft_model, draft_skip_layers, lookahead, draft_head)
            return function(*args, speculate=options, **kwargs)

        command = bundled
        if stats:
            command = click.option("--stats", "show_stats", is_flag=True, help="Print forwards, tokens per forward, "
                                   "draft acceptance and budget on stderr.")(command)
        command = click.option("--lookahead", default=None, metavar="W,N,G",
                               help="Lookahead settings: window, n-gram size, guesses (default 7,5,7).")(command)
        command = click.option("--draft-head", default=None, metavar="DIR", cls=LateHelp,
                               late_help=_draft_head_help)(command)
        command = click.option("--draft-skip-layers", default=None, metavar="LIST|auto",
                               help="Draft with the model itself, skipping these layers (e.g. 4,6,8-12), or "
                                    "'auto' to pick them by measured acceptance. Implies --speculate draft.")(command)
        command = click.option("--draft-model", default=None, metavar="PATH",
                               help="A smaller model with the same tokenizer to draft with (same forms as "
                                    "--model). Implies --speculate draft.")(command)
        command = click.option("--draft-budget", type=int, default=None, metavar="N",
                               help="Draft tokens per branch per step (for auto: the most it may propose).")(command)
        return click.option("--speculate", default=default, metavar="MODE", show_default=bool(default), cls=LateHelp,
                            late_help=functools.partial(_speculate_help, scope))(command)

    return add


def speculation_from(options: SpeculateOptions | str | None, draft_budget: int | None) -> SpeculationSettings:
    """The options as `SpeculationSettings`, checked before the model loads (unknown mode, bad
    budget, settings that need another mode). The CLI loads models with exact attention, so
    speculation is exact at every precision."""
    from ..speculation import SpeculationSettings

    if not isinstance(options, SpeculateOptions):
        options = SpeculateOptions(options)
    settings = SpeculationSettings.parse(options.mode, budget=draft_budget, lookahead=options.lookahead,
                                         draft_model=options.draft_model, skip_layers=options.draft_skip_layers,
                                         head=options.draft_head,
                                         spelling=spelling())
    settings.check(exact=True, spelling=spelling())
    if settings.draft_model is not None:  # before the target loads, not after
        from ..models.loading import refuse_missing_path

        refuse_missing_path(settings.draft_model)
    if settings.head is not None and not Path(settings.head).expanduser().is_dir():
        raise InvalidInput(f"--draft-head {settings.head} is not a folder", "pass the folder train-drafter wrote")
    return settings


def prepare_speculation(decoder, settings: SpeculationSettings) -> SpeculationSettings:
    """Make what `settings` need before the run, each slow step with a status line: the layers of
    a self-draft chosen ("auto"), their draft model loaded or the self-draft built (kept by the
    decoder), and the probe of the forward cost curve that "auto" starts from, where one is due
    (at most `cost.PROBE_BUDGET_S` seconds, until a few runs have completed it; every run refines
    the curve from its own forwards), so the run itself is not silently slow. Returns the
    settings to run with (chosen layers in place of "auto")."""
    from ..cost import cost_curve, probe_due
    from ..speculation import choose_draft_layers

    start = time.perf_counter()
    if settings.skip_layers == "auto":
        with stderr.status("Choosing the layers the self-draft skips, by measured acceptance (about a minute)..."):
            settings = choose_draft_layers(settings, decoder.model, decoder.tokenizer)
    if settings.own_draft:
        named = escape(settings.draft_model) if settings.draft_model is not None else None
        with stderr.status(f"Loading the draft model {named}..." if named else "Building the self-draft..."):
            decoder.draft_for(settings)
        label = (f"the draft model {named}" if named
                 else f"a self-draft skipping layers {','.join(map(str, settings.skip_layers)) or 'none'}")
        stderr.print(f"[dim]Drafting with {label} (ready in {time.perf_counter() - start:.1f} s)[/dim]")
    elif settings.mode == "auto" and decoder.cost is None and probe_due(decoder.model):
        with stderr.status("Measuring what a forward costs on this machine, for --speculate auto (under 2 s)..."):
            decoder.cost = cost_curve(decoder.model)
        kept = ("kept, and refined by every run" if decoder.cost.kept else f"not kept: {escape(str(decoder.cost.path.parent))} "
                "cannot be written, so each run measures again (set MULTIDECODE_COSTS to a folder you can write)")
        stderr.print(f"[dim]Measuring what a forward costs on this machine took {time.perf_counter() - start:.1f} s; "
                     f"{kept}[/dim]")
    return settings


@dataclass(frozen=True)
class ConstraintOptions:
    """--json-schema FILE, --regex TEXT, --grammar FILE as given (`constraint_from` reads them)."""

    json_schema: str | None = None
    regex: str | None = None
    grammar: str | None = None
    strict: bool = True  # False: --no-strict, the schema's keywords the engine cannot enforce ignored

    def given(self) -> list[str]:
        """The options given, refusing combinations that cannot be (two constraints; --no-strict alone)."""
        given = [f"--{name.replace('_', '-')}" for name in ("json_schema", "regex", "grammar")
                 if getattr(self, name) is not None]
        if len(given) > 1:
            raise InvalidArgument(f"{' and '.join(given)} were both given", "constrain the output one way at a time")
        if not self.strict and self.json_schema is None:
            raise InvalidArgument("--no-strict applies to --json-schema only", "drop --no-strict, or give --json-schema")
        return given


def constraint_options(command):
    """--json-schema FILE (and --no-strict), --regex TEXT and --grammar FILE; the command receives
    them as one `ConstraintOptions` in `constraint`."""

    @functools.wraps(command)
    def bundled(*args, json_schema, regex, grammar, no_strict, **kwargs):
        return command(*args, constraint=ConstraintOptions(json_schema, regex, grammar, not no_strict), **kwargs)

    bundled = click.option("--no-strict", is_flag=True,
                           help="With --json-schema: best effort, ignoring the keywords the engine cannot enforce "
                                "(uniqueItems, some formats) instead of refusing the schema.")(bundled)
    bundled = click.option("--grammar", default=None, metavar="FILE",
                           help="Hold every output to this grammar: Lark (start: ...) or llama.cpp's GBNF "
                                "(root ::= ...).")(bundled)
    bundled = click.option("--regex", default=None, metavar="TEXT",
                           help="Hold every output to this regular expression (matched whole).")(bundled)
    return click.option("--json-schema", default=None, metavar="FILE",
                        help="Hold every output to this JSON schema (a JSON file; '-' for stdin); each result "
                             "carries the parsed object (with --json; a batch's records always).")(bundled)


def constraint_from(options: ConstraintOptions | None):
    """The `Constraint` the options name (None: none), read and compiled before any model loads."""
    from ..constraints import Constraint

    if options is None or not options.given():
        return None
    try:
        if options.json_schema is not None:
            return Constraint.json_schema(read_text(options.json_schema, "JSON schema"), strict=options.strict)
        if options.grammar is not None:
            return Constraint.grammar(read_text(options.grammar, "grammar"))
    except InvalidArgument as err:  # the file's name with what is wrong in it
        source = options.json_schema if options.json_schema is not None else options.grammar
        raise InvalidArgument(f"{'standard input' if source == '-' else source}: {err.message}", err.hint) from None
    return Constraint.regex(options.regex)


def note_cut_branches(branches) -> None:
    """`note_if_cut` for a run's branches (`Branch.cut_short`)."""
    note_if_cut(sum(b.cut_short for b in branches), len(branches))


def note_if_cut(cut: int, of: int = 1) -> None:
    """Say on stderr that `cut` of `of` outputs held to a grammar reached --max-new-tokens before
    matching it whole, so they may not parse."""
    if cut:
        which = "the output" if of == 1 else f"{cut} of {of} outputs"
        stderr.print(f"[yellow]note:[/yellow] {which} reached --max-new-tokens before {'its' if of == 1 else 'their'} "
                     "grammar was complete, so it may not parse; raise --max-new-tokens")


def stop_option(what: str):
    """--stop TEXT, repeatable: the text that ends `what`. A shell gives "\\n" as two characters, not a
    newline (the server and the library take a newline as it is): the help says how to type one."""
    return click.option("--stop", multiple=True, metavar="TEXT",
                        help=f"Stop {what} at this string (repeatable; a newline: --stop $'\\n' in bash).")


def decoding_options(speculate: str | None = None, temperature: str | None = None):
    """What every decoding command takes: the model's options, the sampling options (with
    --temperature's help `temperature` where the command samples by default), the speculation
    options (--speculate defaulting to `speculate`) and the constraint options."""

    def add(command):
        options = sampling_options(speculate_options(speculate)(constraint_options(command)), temperature)
        return model_options(options)

    return add


def open_run(model_name: str | None, precision: str | None, device: str | None, speculate, draft_budget: int | None, *,
             max_new_tokens: int | None, n: int = 1, sampling: dict | None = None, stop=()):
    """Check a decoding command's settings before anything loads (a typo fails at once), then
    load the decoder with a status line; returns it and what one run passes as `speculate=`."""
    check_early(max_new_tokens=max_new_tokens, n=n, sampling=sampling, stop=stop)
    from ..exact import is_exact

    settings = speculation_from(speculate, draft_budget)
    decoder = load_decoder(model_name, precision, device)
    settings.check(decoder.model.dtype, exact=is_exact(decoder.model), spelling=spelling())  # in the options' words
    return decoder, decoder.speculation(prepare_speculation(decoder, settings))


def print_stats(stats: dict, lead: str = "") -> None:
    """One dim line on stderr: forwards, tokens per forward, drafts and acceptance, mean budget."""
    line = f"{lead}{stats.get('forward_passes', 0)} forwards, {stats.get('tokens_per_forward', 0):.2f} tokens per forward"
    if stats.get("speculate"):
        acceptance = stats.get("acceptance")
        line += (f"; speculate={stats['speculate']}: {counted(stats.get('drafted', 0), 'draft token')} fed, "
                 f"{stats.get('accepted', 0)} accepted"
                 + (f" ({acceptance:.0%})" if acceptance is not None else "")
                 + f", {stats.get('mean_draft_budget', 0):.1f} per step on average,"
                 f" speculating in {stats.get('steps_speculating', 0)} of {stats.get('steps', 0)} steps")
    if stats.get("forced"):
        line += f"; {stats['forced']} draft tokens forced by the grammar (jump-forward)"
    stderr.print(f"[dim]{escape(line)}[/dim]")


def check_early(*, max_new_tokens: int | None = None, n: int = 1, sampling: dict | None = None,
                stop=()) -> None:
    """Check settings before the model loads (which can take minutes), so a typo fails at once."""
    from ..errors import check_positive, is_int
    from ..sampling_params import check_branch_seeds, per_branch_sampling
    from ..stopping import stop_strings_of

    if max_new_tokens is not None:
        check_positive("max_new_tokens", max_new_tokens)
    check_positive("n", n)
    sampling = dict(sampling or {})
    per_branch_sampling(1, sampling)  # the command line's settings are one value for every branch: the
    if is_int(sampling.get("seed")):  # first branch's, and the last one's seed (without making n settings)
        check_branch_seeds(sampling["seed"], n)
    stop_strings_of(stop)


def check_writable_folder(path: str | os.PathLike, option: str) -> None:
    """Refuse, before a long run, the folder it writes to at its end: a file in its place, or a
    place where the folder cannot be made or written. Tried by making it, and what was made here is
    removed again: the run makes it when it writes, and a run refused later leaves nothing behind."""
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise InvalidArgument(f"{option} {path} is a file, not a folder", "name a folder")
    missing = [p for p in (folder, *folder.parents) if not p.exists()]  # deepest first
    err = unwritable(folder)
    for made in missing:
        with contextlib.suppress(OSError):
            made.rmdir()
    if err is not None:
        raise InvalidInput(f"cannot write {option} {path}: {err.strerror or err}", "name a folder you can write to")


def counted(n: int, noun: str, nouns: str | None = None) -> str:
    """"1 line", "3 lines": a count with its noun in the right number (`nouns`: a plural not in -s)."""
    return f"{n:,} {noun if n == 1 else nouns or noun + 's'}"


def human_size(count: int) -> str:
    """Bytes as B, KB, MB, GB (powers of 1000, as disk tools and file managers show them)."""
    units = ("B", "KB", "MB", "GB", "TB")
    value, unit = float(count), 0
    while value >= 1000 and unit < len(units) - 1:
        value, unit = value / 1000, unit + 1
    return f"{count} B" if unit == 0 else f"{value:.1f} {units[unit]}"


# ---------------------------------------------------------------------- inputs
def read_text(path: str, what: str = "document") -> str:
    """Read a UTF-8 text file, or stdin for '-'; refuse binary files with a clear message, and a
    second '-' in one command (stdin is read once: the second would read nothing, and its
    error would be about empty text)."""
    if path == "-":
        meta = context.meta if (context := click.get_current_context(silent=True)) is not None else {}
        if (reader := meta.get(_STDIN_READER)) is not None:
            raise InvalidInput(f"the {reader} and the {what} cannot both read standard input ('-')",
                               "give one of them as a file")
        meta[_STDIN_READER] = what
        data = sys.stdin.buffer.read()
        name = "standard input"
    else:
        file = Path(path)
        if not file.exists():
            written = any(mark in path for mark in ("\n", "::=", "{"))  # the text itself, not a file's path
            raise InvalidInput(f"the {what} file {path} does not exist", f"write the {what} to a file and give its "
                               "path" if written else "check the path")
        if file.is_dir():
            raise InvalidInput(f"the {what} file {path} is a folder", "pass a text file")
        try:
            data = file.read_bytes()
        except OSError as err:
            raise InvalidInput(f"cannot read the {what} file {path}: {err.strerror or err}",
                               "check that it exists and that you may read it") from None
        name = path
    return decode_text(data, name, what)


def read_prompt(prompt: str | None, prompt_file: str | None) -> str:
    """The prompt from exactly one of --prompt TEXT and --prompt-file FILE; a file's last line
    break is not part of it (editors and `echo` end every file with one: it would change the
    prompt's ids, and in a chat template the answer), as `-p` gives none."""
    if (prompt is None) == (prompt_file is None):
        raise InvalidInput("give the prompt as --prompt TEXT or --prompt-file FILE (one of them)",
                           "for example --prompt 'Write a haiku about the sea.'")
    text = prompt if prompt is not None else read_text(prompt_file, "prompt").removesuffix("\n").removesuffix("\r")
    if not text.strip():  # said before the model loads, as the library would say it after
        raise InvalidInput("the prompt is empty", "pass some text to complete")
    return text


def prompt_options(command):
    """--prompt, --prompt-file, --no-chat."""
    command = click.option("--no-chat", is_flag=True, help="Use the raw text, without the chat template.")(command)
    command = click.option("--prompt-file", metavar="FILE", help="Read the prompt from a file ('-' for stdin; its last line break is left out).")(command)
    return click.option("--prompt", "-p", metavar="TEXT", help="The prompt.")(command)


_STDIN_READER = "multidecode.stdin_reader"
"""The key, in a command's click context, of what read standard input."""


def read_lines(path: str, what: str = "questions") -> list[str]:
    """One entry per non-blank line."""
    return [line.strip() for line in read_text(path, what).splitlines() if line.strip()]


# ---------------------------------------------------------------------- the model
def model_source(model_name: str | None) -> str | None:
    """The model as a command names it, for comparing one command's with another's: a path that
    exists as an absolute path, a hub id as it is, None for the embedded model."""
    if model_name is None:
        return None
    path = Path(model_name).expanduser()
    return str(path.resolve()) if path.exists() else model_name


def load_decoder(model_name: str | None, precision: str | None, device: str | None, *, exact: bool = True,
                 compile: bool = False):
    """Load a MultiDecoder, with a status line on stderr (saying so when a GGUF file is first read).
    exact: see `load` (False: the model's own attention, for work that needs no batch invariance);
    compile: see `load` (only where exact holds)."""
    from .. import kernels
    from ..api import load
    from ..errors import NotBitExact
    from ..exact import own_kernels_exactness
    from ..models.loading import resolve_device

    on_cpu = resolve_device(device).type == "cpu"  # a GPU's exact path is torch's (kernels.in_row_tiles)
    if exact and on_cpu and not kernels.build.built():  # setup builds them; a bare install does it here, once
        with stderr.status("Compiling multidecode's kernels for this CPU (once, about a minute)..."):
            built = kernels.status()
        if built.library is None:
            stderr.print(f"[yellow]note:[/yellow] {escape(built.reason)}; packed models run on the portable kernels")
    message = _first_read(model_name, precision) or f"Loading {escape(model_name or 'the embedded model')}..."
    start = time.perf_counter()
    with stderr.status(message):
        try:
            decoder = load(model_name, precision=precision, device=device, exact=exact, compile=compile and exact)
        except NotBitExact as err:  # said once, then the model's own kernels
            from ..models.packed import activation_dtype

            decoder = load(model_name, precision=precision, device=device, exact=False)
            exactness = own_kernels_exactness(activation_dtype(decoder.model))
            stderr.print(f"[yellow]note:[/yellow] {escape(err.message)}; running on the model's own kernels "
                         f"({exactness})")
    label = escape(_model_label(decoder, model_name))
    stderr.print(f"[dim]Loaded {label} in {time.perf_counter() - start:.1f} s[/dim]")
    return decoder


def _first_read(model_name: str | None, precision: str | None) -> str | None:
    """The status line of a GGUF model's first load, which writes a copy to the user cache: its
    config, tokenizer and packed weights (packed precisions, seconds) or all its weights in float32
    (float ones)."""
    from ..models.converted import embedded_copy, embedded_gguf, gguf_copy

    if model_name is not None and not model_name.lower().endswith(".gguf"):
        return None
    floats = precision in ("float32", "bfloat16", "float16")
    name = escape(model_name or "the embedded model")
    try:
        if model_name is None:
            missing = embedded_copy(convert=False, described=not floats) is None
        else:
            missing = Path(model_name).expanduser().is_file() and \
                gguf_copy(model_name, convert=False, described=not floats) is None
    except Exception:  # noqa: BLE001 - an unreadable file: load() reports it properly
        return None
    if not missing:
        return None
    if floats:
        return f"Converting {name} to a float32 cache (once, about 20 s for the embedded model; `multidecode cache list` shows it)..."
    size = (embedded_gguf() if model_name is None else Path(model_name).expanduser()).stat().st_size
    return (f"Reading {name} (once, about {first_read_seconds(size):.0f} s: its config, tokenizer and packed "
            "weights are kept in the user cache)...")


FIRST_READ_S, FIRST_READ_MB_PER_S = 3.0, 35.0
"""A GGUF file's first read, measured on the project's 2-core CPU (docs/benchmarks.md, `bench startup`
cold): a fixed part (transformers parses its metadata twice, for the config and the tokenizer) and
its packed weights laid out at about this rate."""


def first_read_seconds(size: int) -> float:
    """About how long the first read of a GGUF file of `size` bytes takes (the status line's estimate)."""
    return FIRST_READ_S + size / 1e6 / FIRST_READ_MB_PER_S


def _model_label(decoder, model_name) -> str:
    from ..models.packed import NOT_PACKED, weights_device

    config = decoder.model.config
    name = model_name or "SmolLM2-135M-Instruct (embedded)"
    device = weights_device(decoder.model)
    memory = decoder.memory()  # at auto "auto (int4)": the file's codes, not --precision int4's re-coding
    precision = f"auto ({memory['precision']})" if memory["reason"] else memory["precision"]  # a reason: auto chose
    floats = sum(n for became, n in memory["formats"].items() if NOT_PACKED in became)  # widths no group divides
    precision += f", {floats} weights {NOT_PACKED}" if floats else ""
    return f"{name} ({config.model_type}, {precision}, {device})"


# ---------------------------------------------------------------------- errors
def in_option_terms(message: str) -> str:
    """A library error's `message` (or hint) in the running command's words: each setting with an
    underscore that is one of its options ("lower max_new_tokens to 247") as that option
    (--max-new-tokens), and a leading one-word setting where the message says it "must" be
    something ("temperature must be ..."; "question 2 is empty" speaks of a question)."""
    context = click.get_current_context(silent=True)
    flags = {param.name: next((o for o in param.opts if o.startswith("--")), None)
             for param in (context.command.params if context is not None else ()) if isinstance(param, click.Option)}
    for field in ("draft_model", "skip_layers"):  # speculation's settings, named otherwise by the options
        if (flag := getattr(spelling(), field)) in flags.values():
            flags.setdefault(field, flag)
    message = SETTING_NAME.sub(lambda m: flags.get(m.group(0)) or m.group(0), message)
    name = message.split(" ", 1)[0]
    if message[len(name):].startswith(" must ") and flags.get(name):
        return flags[name] + message[len(name):]
    return message


SETTING_NAME = re.compile(r"(?<![\w.=-])[a-z]+(?:_[a-z]+)+(?![\w(=])")
"""A Python setting's name in prose (max_new_tokens), not in code: not after a dot or before a
parenthesis or an equals sign (SpeculationSettings.parse(...), head=DIR)."""


def report_errors(function):
    """Turn user-caused errors into `error:`/`hint:` lines and a non-zero exit, never a traceback."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        try:
            result = function(*args, **kwargs)
            sys.stdout.flush()  # a reader that went away (| head) is noticed here, not by click (exit 1)
            return result
        except MultiDecodeError as err:
            stderr.print(f"[bold red]error:[/bold red] {escape(in_option_terms(err.message))}")
            if err.hint:
                stderr.print(f"[yellow]hint:[/yellow] {escape(in_option_terms(err.hint))}")
            raise SystemExit(err.exit_code) from None
        except KeyboardInterrupt:
            stderr.print("[yellow]interrupted[/yellow]")
            raise SystemExit(130) from None
        except BrokenPipeError:
            reader_left()

    return wrapper
