"""What every command shares: options, reading inputs, loading a model, printing errors.

The CLI is a thin shell over the library: it parses, calls, and formats. Results go to stdout,
progress and status to stderr, so `--json` output can be piped.
"""

from __future__ import annotations

import functools
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import click
from rich.console import Console
from rich.markup import escape

from ..errors import InvalidArgument, InvalidInput, MultiDecodeError

stderr = Console(stderr=True, highlight=False, soft_wrap=True)
stdout = Console(highlight=False, soft_wrap=True)


# ---------------------------------------------------------------------- options
def model_options(command):
    """--model, --dtype, --device."""
    command = click.option("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda if available).")(command)
    command = click.option(
        "--dtype", default=None, type=click.Choice(["float32", "bfloat16", "float16"]),
        help="Weights dtype (default float32; exactness is guaranteed in float32).",
    )(command)
    command = click.option(
        "--model", "model_name", default=None, metavar="NAME",
        help="A local HF folder, a .gguf file or a hub id (default: the embedded SmolLM2-135M-Instruct).",
    )(command)
    return command


def sampling_options(command):
    """--temperature, --top-k, --top-p, --min-p, --repetition-penalty, --seed (any of them turns sampling on)."""
    for name, kind, text in reversed([
        ("--temperature", float, "Sampling temperature (turns sampling on)."),
        ("--top-k", int, "Sample from the k most likely tokens."),
        ("--top-p", float, "Sample from the smallest set reaching this probability."),
        ("--min-p", float, "Drop tokens less likely than min-p times the top token."),
        ("--repetition-penalty", float, "Penalize tokens already in the sequence (1.0 = off); applies to greedy too."),
        ("--seed", int, "Seed; branch i uses seed + i, so every branch is reproducible."),
    ]):
        command = click.option(name, type=kind, default=None, help=text)(command)
    return command


def sampling_from(options: dict) -> dict:
    """The sampling settings the user gave, as keyword arguments for the library."""
    keys = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed")
    return {k: options[k] for k in keys if options.get(k) is not None}


@dataclass(frozen=True)
class SpeculationChoice:
    """What the speculation options asked for (resolved once the model is loaded)."""

    mode: str | None
    draft_model: str | None = None
    draft_skip_layers: str | None = None
    lookahead: str | None = None


def speculate_options(default: str | None = None):
    """--speculate MODE (default `default`), --draft-budget N, --draft-model PATH,
    --draft-skip-layers LIST, --lookahead W,N,G, --stats. The command receives them as one
    `SpeculationChoice` in `speculate` (and `draft_budget`, `show_stats`)."""

    def add(function):
        @functools.wraps(function)
        def bundled(*args, speculate, draft_model, draft_skip_layers, lookahead, **kwargs):
            choice = SpeculationChoice(speculate, draft_model, draft_skip_layers, lookahead)
            return function(*args, speculate=choice, **kwargs)

        command = bundled
        command = click.option("--stats", "show_stats", is_flag=True,
                               help="Print forwards, tokens per forward, draft acceptance and budget on stderr.")(command)
        command = click.option("--lookahead", default=None, metavar="W,N,G",
                               help="Lookahead settings: window, n-gram size, guesses (default 7,5,7).")(command)
        command = click.option("--draft-skip-layers", default=None, metavar="LIST|auto",
                               help="Draft with the model itself, skipping these layers (e.g. 4,6,8-12), or "
                                    "'auto' to pick them by measured acceptance. Implies --speculate draft.")(command)
        command = click.option("--draft-model", default=None, metavar="PATH",
                               help="A smaller model with the same tokenizer to draft with (same forms as "
                                    "--model). Implies --speculate draft.")(command)
        command = click.option("--draft-budget", type=int, default=None, metavar="N",
                               help="Draft tokens per branch per step (for auto: the most it may propose).")(command)
        return click.option("--speculate", default=default, metavar="MODE", show_default=bool(default),
                            help="Speculative decoding inside every branch: lookup (prompt lookup), suffix (what "
                                 "this process saw before), lookahead (Jacobi window), draft (a draft model), auto "
                                 "(lookup and suffix, only where the measured cost says it pays) or off. Never "
                                 "changes the output.")(command)

    return add


@dataclass(frozen=True)
class PendingDraft:
    """Draft-model speculation, built once the target is loaded (a self-draft needs it)."""

    choice: SpeculationChoice
    budget: int | None


def speculation_from(choice: SpeculationChoice | str | None, draft_budget: int | None, dtype: str | None):
    """The `speculate=` value for the library, checked before the model loads (unknown mode, bad
    budget, settings that need another mode, a dtype where speculation cannot be exact). Draft
    models come back as a `PendingDraft` that `prepare_speculation` builds."""
    from ..models.loading import resolve_dtype
    from ..speculation import resolve

    if not isinstance(choice, SpeculationChoice):
        choice = SpeculationChoice(choice)
    mode = None if choice.mode is None else choice.mode.strip().lower()
    drafting = choice.draft_model is not None or choice.draft_skip_layers is not None
    if choice.draft_model is not None and choice.draft_skip_layers is not None:
        raise InvalidArgument("--draft-model and --draft-skip-layers both name a draft",
                              "keep one: a second model, or the target with layers skipped")
    if drafting and mode in (None, "off", "none", "auto"):
        mode = "draft"
    if mode in (None, "off", "none"):
        given = "--draft-budget" if draft_budget is not None else "--lookahead" if choice.lookahead else None
        if given:
            raise InvalidArgument(f"{given} needs speculation, and --speculate is off",
                                  "add --speculate lookup, lookahead or auto")
        return None
    if drafting and mode != "draft":
        raise InvalidArgument(f"a draft model was given but --speculate is {mode}", "use --speculate draft")
    if mode == "draft" and not drafting:
        raise InvalidArgument("--speculate draft needs a draft model",
                              "add --draft-model PATH, or --draft-skip-layers auto to draft with the model itself")
    if choice.lookahead is not None and mode != "lookahead":
        raise InvalidArgument(f"--lookahead sets lookahead decoding, but --speculate is {mode}",
                              "add --speculate lookahead")
    if mode == "draft":
        resolve("lookup", resolve_dtype(dtype), budget=draft_budget)  # the same checks of budget and dtype
        if choice.draft_skip_layers not in (None, "auto"):
            skip_layer_list(choice.draft_skip_layers)
        return PendingDraft(choice, draft_budget)
    if mode == "lookahead" and choice.lookahead is not None:
        from ..proposers.lookahead import Lookahead

        window, ngram, guesses = lookahead_settings(choice.lookahead)
        proposer = Lookahead(window=window, ngram=ngram, guesses=guesses)
        return resolve(proposer, resolve_dtype(dtype), budget=draft_budget)
    return resolve(mode, resolve_dtype(dtype), budget=draft_budget)


def lookahead_settings(text: str) -> tuple[int, int, int]:
    """'W,N,G' as three ints (window >= 1, n-gram size >= 2, guesses >= 0)."""
    try:
        window, ngram, guesses = (int(part) for part in text.split(","))
    except ValueError:
        raise InvalidArgument(f"--lookahead {text!r} is not three integers W,N,G", "write e.g. --lookahead 7,5,7") from None
    if window < 1 or ngram < 2 or guesses < 0:
        raise InvalidArgument(f"--lookahead {text}: need W >= 1, N >= 2 and G >= 0", "write e.g. --lookahead 7,5,7")
    return window, ngram, guesses


def skip_layer_list(text: str) -> list[int]:
    """'4,6,8-12' as [4, 6, 8, 9, 10, 11, 12]."""
    layers: list[int] = []
    try:
        for part in text.split(","):
            first, _, last = part.strip().partition("-")
            layers += range(int(first), int(last or first) + 1)
    except ValueError:
        raise InvalidArgument(f"--draft-skip-layers {text!r} is not a list of layer numbers",
                              "write e.g. --draft-skip-layers 4,6,8-12, or auto") from None
    return layers


def prepare_speculation(decoder, spec):
    """The speculation to run with, once the model is loaded: a draft model loaded (or the
    self-draft built, its layers chosen on the document's text when 'auto'), and the forward cost
    curve "auto" needs measured now, with a status line, if it was never measured for this model
    and machine (once, about 10 s for the embedded model on a CPU), so the run itself is not
    silently slow."""
    from ..cost import cost_curve

    if isinstance(spec, PendingDraft):
        return _build_draft(decoder, spec)
    if spec is None or not spec.auto or decoder.cost is not None:
        return spec
    if cost_curve(decoder.model, measure=False) is None:
        start = time.perf_counter()
        with stderr.status("Measuring what a forward costs on this machine, for --speculate auto (once)..."):
            decoder.cost = cost_curve(decoder.model)
        stderr.print(f"[dim]Measuring what a forward costs on this machine took {time.perf_counter() - start:.1f} s; "
                     "kept for the next runs[/dim]")
    return spec


def _build_draft(decoder, pending: PendingDraft):
    from ..data import self_draft_sample
    from ..models.loading import load_model_and_tokenizer
    from ..proposers.draft import DraftModel, check_same_tokenizer
    from ..proposers.self_draft import choose_skip, self_draft
    from ..speculation import resolve

    choice = pending.choice
    start = time.perf_counter()
    if choice.draft_model is not None:
        device = next(decoder.model.parameters()).device
        with stderr.status(f"Loading the draft model {escape(choice.draft_model)}..."):
            draft, tokenizer = load_model_and_tokenizer(choice.draft_model, dtype=decoder.model.dtype, device=device)
        check_same_tokenizer(decoder.tokenizer, tokenizer)
        label = f"the draft model {escape(choice.draft_model)}"
    else:
        if choice.draft_skip_layers == "auto":
            with stderr.status("Choosing the layers the self-draft skips, by measured acceptance (about a minute)..."):
                picked = choose_skip(decoder.model, [decoder.tokenizer(self_draft_sample())["input_ids"]])
            layers = list(picked.layers)
            if not layers:
                raise InvalidArgument(
                    "no set of skipped layers is expected to pay on this model: a self-draft agrees with it too "
                    "rarely for what it saves",
                    "name the layers yourself (--draft-skip-layers 10-14), or use --speculate auto")
        else:
            layers = skip_layer_list(choice.draft_skip_layers)
        draft = self_draft(decoder.model, layers)
        label = f"a self-draft skipping layers {','.join(map(str, layers)) or 'none'}"
    stderr.print(f"[dim]Drafting with {label} (ready in {time.perf_counter() - start:.1f} s)[/dim]")
    return resolve(DraftModel(draft), decoder.model.dtype, budget=pending.budget)




def print_stats(stats: dict, lead: str = "") -> None:
    """One dim line on stderr: forwards, tokens per forward, drafts and acceptance, mean budget."""
    line = f"{lead}{stats.get('forward_passes', 0)} forwards, {stats.get('tokens_per_forward', 0):.2f} tokens per forward"
    if stats.get("speculate"):
        acceptance = stats.get("acceptance")
        line += (f"; speculate={stats['speculate']}: {stats.get('drafted', 0)} draft tokens fed, "
                 f"{stats.get('accepted', 0)} accepted"
                 + (f" ({acceptance:.0%})" if acceptance is not None else "")
                 + f", {stats.get('mean_draft_budget', 0):.1f} per step on average,"
                 f" speculating in {stats.get('steps_speculating', 0)} of {stats.get('steps', 0)} steps")
    stderr.print(f"[dim]{escape(line)}[/dim]")


def check_early(*, max_new_tokens: int | None = None, n: int = 1, sampling: dict | None = None,
                stop=()) -> None:
    """Check settings before the model loads (which can take minutes), so a typo fails at once."""
    from ..errors import check_positive
    from ..sampling import per_branch_sampling
    from ..stopping import stop_strings_of

    if max_new_tokens is not None:
        check_positive("max_new_tokens", max_new_tokens)
    check_positive("n", n)
    per_branch_sampling(n, dict(sampling or {}))
    stop_strings_of(stop)


# ---------------------------------------------------------------------- inputs
def read_text(path: str, what: str = "document") -> str:
    """Read a UTF-8 text file, or stdin for '-'; refuse binary files with a clear message."""
    if path == "-":
        data = sys.stdin.buffer.read()
        name = "standard input"
    else:
        file = Path(path)
        if not file.exists():
            raise InvalidInput(f"the {what} file {path} does not exist", "check the path")
        if file.is_dir():
            raise InvalidInput(f"the {what} file {path} is a folder", "pass a text file")
        data = file.read_bytes()
        name = path
    if b"\x00" in data:
        raise InvalidInput(f"{name} is not a text file (it holds binary data)", f"pass the {what} as plain UTF-8 text")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise InvalidInput(
            f"{name} is not UTF-8 text (bad byte at offset {err.start})", f"convert the {what} to UTF-8 first"
        ) from err


def read_prompt(prompt: str | None, prompt_file: str | None) -> str:
    """The prompt from exactly one of --prompt TEXT and --prompt-file FILE."""
    if (prompt is None) == (prompt_file is None):
        raise InvalidInput("give the prompt as --prompt TEXT or --prompt-file FILE (one of them)",
                           "for example --prompt 'Write a haiku about the sea.'")
    return prompt if prompt is not None else read_text(prompt_file, "prompt")


def prompt_options(command):
    """--prompt, --prompt-file, --no-chat."""
    command = click.option("--no-chat", is_flag=True, help="Use the raw text, without the chat template.")(command)
    command = click.option("--prompt-file", metavar="FILE", help="Read the prompt from a file ('-' for stdin).")(command)
    return click.option("--prompt", "-p", metavar="TEXT", help="The prompt.")(command)


def read_lines(path: str, what: str = "questions") -> list[str]:
    """One entry per non-blank line."""
    return [line.strip() for line in read_text(path, what).splitlines() if line.strip()]


# ---------------------------------------------------------------------- the model
def load_decoder(model_name: str | None, dtype: str | None, device: str | None):
    """Load a MultiDecoder, with a status line on stderr (and a note when a GGUF file is converted)."""
    from ..api import load
    from ..models.converted import embedded_copy

    if model_name is None and embedded_copy(convert=False) is None:
        message = "Converting the embedded model to a float32 cache (once, about 20 s)..."
    elif _unconverted_gguf(model_name):
        message = (f"Converting {escape(model_name)} to a float32 cache (once; later loads take seconds; "
                   "`multidecode cache list` shows it)...")
    else:
        message = f"Loading {escape(model_name or 'the embedded model')}..."
    start = time.perf_counter()
    with stderr.status(message):
        decoder = load(model_name, dtype=dtype, device=device)
    label = escape(_model_label(decoder, model_name))
    stderr.print(f"[dim]Loaded {label} in {time.perf_counter() - start:.1f} s[/dim]")
    return decoder


def _unconverted_gguf(model_name: str | None) -> bool:
    from ..models.converted import gguf_copy

    if not model_name or not model_name.lower().endswith(".gguf") or not Path(model_name).expanduser().is_file():
        return False
    try:
        return gguf_copy(model_name, convert=False) is None
    except Exception:  # noqa: BLE001 - an unreadable file: load() reports it properly
        return False


def _model_label(decoder, model_name) -> str:
    config = decoder.model.config
    name = model_name or "SmolLM2-135M-Instruct (embedded)"
    device = next(decoder.model.parameters()).device
    dtype = str(decoder.model.dtype).removeprefix("torch.")
    return f"{name} ({config.model_type}, {dtype}, {device})"


# ---------------------------------------------------------------------- errors
def report_errors(function):
    """Turn user-caused errors into `error:`/`hint:` lines and a non-zero exit, never a traceback."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except MultiDecodeError as err:
            stderr.print(f"[bold red]error:[/bold red] {escape(err.message)}")
            if err.hint:
                stderr.print(f"[yellow]hint:[/yellow] {escape(err.hint)}")
            raise SystemExit(err.exit_code) from None
        except KeyboardInterrupt:
            stderr.print("[yellow]interrupted[/yellow]")
            raise SystemExit(130) from None
        except BrokenPipeError:
            raise SystemExit(0) from None

    return wrapper
