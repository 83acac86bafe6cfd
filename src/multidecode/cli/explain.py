"""`multidecode explain`: a picture of one verification step of a real speculative run, as a PNG.

It answers a few questions about a document with speculation (as `ask --speculate` does),
records one step, and draws the forest of that step (each branch's head with its draft tree,
accepted and rejected nodes) beside its attention mask. Defaults: an excerpt of the shipped
sample transcript, three of its questions, prompt lookup with at most four draft tokens per branch.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import tempfile
from pathlib import Path

import click
from rich.markup import escape

from .. import explain as _explain
from ..errors import InvalidArgument
from ..prompts import check_document, check_questions
from .common import (
    UNWRITABLE,
    counted,
    model_options,
    open_run,
    read_text,
    report_errors,
    speculate_options,
    speculation_from,
    stderr,
    stdout,
)


def check_output(output: str) -> Path:
    """Refuse an output path that cannot become a PNG file, before the model loads and runs.

    Writability is tried, not inferred from permission bits: root passes every `os.access` check,
    yet cannot create a file in /proc. So the existing file is opened for appending (which changes
    nothing), or a scratch file is created and removed in the nearest folder that exists (`save`
    creates the missing ones).
    """
    if not output.strip():
        raise InvalidArgument("--output is empty", "name a PNG file, e.g. --output step.png")
    path = Path(output)
    if path.is_dir():
        raise InvalidArgument(f"--output {output} is a folder", "name a PNG file, e.g. --output step.png")
    if not path.name.lower().endswith(".png"):  # (".png" alone is a name with no suffix to pathlib)
        raise InvalidArgument(f"--output {output} does not end in .png", "the picture is written as a PNG")
    folder = next(p for p in path.absolute().parents if p.exists())
    try:
        if path.exists():
            path.open("ab").close()
        elif not folder.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "not a folder", str(folder))
        else:
            tempfile.NamedTemporaryFile(dir=folder, prefix=".multidecode-", suffix=".png").close()
    except OSError as err:
        raise _unwritable(output, err, None if path.exists() else folder) from None
    return path


def _unwritable(output: str, err: OSError, folder: Path | None = None) -> InvalidArgument:
    """The error for an --output that cannot be written (checked before the run, or met saving):
    the reason, and where it was met when that is not the file itself (the folder it goes in)."""
    where = folder or (err.filename if err.filename and str(err.filename) != output else None)
    full = err.errno in UNWRITABLE  # a full (or failing) disk: the folder's permissions are not the fix
    return InvalidArgument(f"cannot write --output {output}: {err.strerror or err}" + (f" (in {where})" if where else ""),
                           "free some space there, or name a PNG file on another disk" if full else
                           "name a PNG file in a folder you may write to, e.g. --output step.png")


@click.command()
@click.option("--document", "-d", default=None, metavar="FILE",
              help="The document, a UTF-8 text file ('-' for stdin) (default: an excerpt of the sample transcript).")
@click.option("--question", "-q", multiple=True, metavar="TEXT",
              help="A question (repeatable; default: three questions about the sample transcript).")
@click.option("--max-new-tokens", type=int, default=32, show_default=True, help="Longest answer, in tokens.")
@speculate_options(None, stats=False, scope=f"Any mode that drafts; default: lookup (a --draft-head, --draft-model or "
                                            f"--draft-skip-layers implies its own); --draft-budget defaults to "
                                            f"{_explain.EXPLAIN_BUDGET} here, so the picture stays readable.")
@click.option("--step", type=int, default=None, metavar="N",
              help="The step to draw (2 or later; default: the one that shows verification best).")
@click.option("--output", "-o", default="explain_step.png", show_default=True, metavar="PNG",
              help="Where to write the picture.")
@model_options
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary of the step on stdout.")
@report_errors
def explain(document, question, max_new_tokens, speculate, draft_budget, step, output, model_name, precision, device,
            as_json):
    """Draw one verification step of a real speculative run: the forest (each branch's head with
    its draft tree, accepted and rejected) and its attention mask, as a PNG."""
    text = _explain.sample_excerpt() if document is None else read_text(document)
    questions = list(question) or _explain.sample_questions()
    check_document(text)
    check_questions(questions)
    if speculate.mode is None and not (speculate.draft_model or speculate.draft_skip_layers or speculate.draft_head):
        # left out, and no draft named implies one: explain's default, before --draft-budget or --lookahead is
        # checked (which, read without it, said "--speculate is off")
        speculate = dataclasses.replace(speculate, mode="lookahead" if speculate.lookahead else "lookup")
    if speculation_from(speculate, draft_budget).off:  # "off", said
        raise InvalidArgument(f"--speculate {speculate.mode} has no draft tokens to draw", "use lookup or auto")
    if step is not None and step < 2:
        raise InvalidArgument(f"--step must be 2 or more, got {step}",
                              "step 1 feeds the prompts; leave --step unset to pick the step that shows most")
    path = check_output(output)
    decoder, spec = open_run(model_name, precision, device, speculate,
                             _explain.EXPLAIN_BUDGET if draft_budget is None else draft_budget,
                             max_new_tokens=max_new_tokens)
    label = Path(model_name).name if model_name else "SmolLM2-135M-Instruct"
    with stderr.status("Decoding and drawing..."):
        result = _explain.explain(decoder, document=text, questions=questions, max_new_tokens=max_new_tokens,
                                  speculate=spec, draft_budget=None, step=step, model_label=label)
        try:
            _explain.save(result.figure, path)
        except OSError as err:  # the disk filled, or the folder changed since `check_output`
            raise _unwritable(output, err) from None
    s = result.summary
    line = (f"Wrote {path}: step {s['step']} of {s['steps']}, {counted(len(s['branches']), 'branch', 'branches')}, {s['drafted']} draft "
            f"tokens fed, {s['accepted']} accepted, {s['rejected']} rejected")
    if as_json:
        click.echo(json.dumps(s, ensure_ascii=False))
        stderr.print(f"[dim]{escape(line)}[/dim]")
    else:
        stdout.print(escape(line))
