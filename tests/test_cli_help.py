"""The command line's help: `multidecode --help` lists every command as click would, without
importing any (several import torch), and every --speculate help lists the proposer table."""

from __future__ import annotations

import subprocess
import sys

import click
import pytest
from click.testing import CliRunner

from multidecode.cli import COMMANDS, main


def test_the_command_list_is_the_one_click_makes_from_the_imported_commands():
    listed = CliRunner().invoke(main, ["--help"], terminal_width=100)
    assert listed.exit_code == 0, listed.output
    context = click.Context(main, terminal_width=100)
    formatter = context.make_formatter()
    click.Group.format_commands(main, context, formatter)  # click's own: imports every command
    assert formatter.getvalue() and formatter.getvalue() in listed.output
    assert all(name in listed.output for name in COMMANDS)


def test_listing_the_commands_imports_none_of_them():
    code = ("import sys\nfrom multidecode.cli import main\nsys.argv = ['multidecode', '--help']\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "print('torch loaded' if 'torch' in sys.modules else 'no torch')")
    run = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().endswith("no torch")


@pytest.mark.parametrize("command", ["generate", "ask", "complete", "vote", "serve", "batch"])
def test_speculate_help_lists_every_mode_of_the_proposer_table(command):
    from multidecode.speculation import PROPOSERS

    result = CliRunner().invoke(main, [command, "--help"], terminal_width=400)
    assert result.exit_code == 0, result.output
    line = " ".join(result.output.split())  # click wraps the help
    for mode in PROPOSERS:
        assert f"{mode.name} ({' '.join(mode.summary.split())})" in line, mode.name


# ---------------------------------------------------------------------- Ctrl-C before a command runs
@pytest.mark.parametrize("swallowed", [False, True])
def test_an_interrupt_while_a_command_is_imported_ends_as_interrupted(monkeypatch, swallowed):
    """Ctrl-C while a sub-command's module (and torch) is still being imported: "interrupted",
    status 130, no traceback, also where a library caught the interrupt and raised something else
    in its place (transformers' lazy imports do: an ImportError or a RecursionError follows)."""
    import importlib
    import signal

    def importing(name, package=None):
        try:
            signal.raise_signal(signal.SIGINT)
        except KeyboardInterrupt:
            if swallowed:
                raise ImportError("cannot load module more than once per process") from None
            raise
        raise AssertionError("the interrupt was not raised")

    monkeypatch.setattr(importlib, "import_module", importing)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # a new process's, whatever this worker
    try:  # ran before (a full run once left SIGINT with a handler that raised nothing here)
        result = CliRunner().invoke(main, ["generate", "-p", "hi"])
    finally:
        signal.signal(signal.SIGINT, previous)
    assert result.exit_code == 130, result.output
    assert "interrupted" in result.output and "Traceback" not in result.output


def test_an_error_with_no_interrupt_is_left_to_the_command():
    """Without an interrupt the group lets an error through as it was (`report_errors` and click
    report a command's own)."""
    import importlib

    def broken(name, package=None):
        raise ImportError("a real import error")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(importlib, "import_module", broken)
        result = CliRunner().invoke(main, ["generate", "-p", "hi"])
    assert result.exit_code == 1 and isinstance(result.exception, ImportError)


def test_a_command_started_with_ctrl_c_ignored_keeps_ignoring_it(monkeypatch):
    """A background job of a script starts with SIGINT ignored: the group leaves that as it is
    (a Ctrl-C meant for the terminal's foreground must not end it), and puts back what it found."""
    import importlib
    import signal

    seen = []

    def importing(name, package=None):
        seen.append(signal.getsignal(signal.SIGINT))
        raise ImportError("stop here")

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        monkeypatch.setattr(importlib, "import_module", importing)
        CliRunner().invoke(main, ["generate", "-p", "hi"])
        assert seen == [signal.SIG_IGN] and signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
