"""The `multidecode` command: one sub-command per use case, each a thin module in this package.

A sub-command's module is imported when that sub-command runs: `multidecode generate` loads no
server, benchmark, batch or training stack, and `multidecode --help` reads each command's short
help from its module's source, importing none.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import signal
import sys
from pathlib import Path

import click

from ..version import __version__

COMMANDS = {
    "ask": "decoding", "generate": "generate", "complete": "decoding", "beam": "decoding",
    "margins": "decoding", "vote": "decoding", "batch": "batch", "demo": "demo", "bench": "bench",
    "explain": "explain", "serve": "serve", "cache": "cache", "train-drafter": "train",
}
"""Each sub-command -> the module of this package that defines it (as the command's name with
"_" for "-")."""


class LazyCommands(click.Group):
    """A group whose sub-commands are imported from their modules (`COMMANDS`) when asked for."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        module = COMMANDS.get(name)
        if module is None:
            return None
        return getattr(importlib.import_module(f".{module}", __name__), name.replace("-", "_"))

    def invoke(self, ctx: click.Context):
        """Run the sub-command; Ctrl-C at any moment ends it as "interrupted" with status 130.

        A command's own errors are reported by `common.report_errors`, but an interrupt can come
        before it runs (while its module and torch are imported), and a library that catches the
        interrupt there (transformers' lazy imports do) turns it into some other error: so the
        interrupt is noted when it arrives, and whatever error follows it is reported as it."""
        interrupted: list[bool] = []

        def on_interrupt(signum, frame):
            interrupted.append(True)
            raise KeyboardInterrupt

        installed, previous = False, None
        try:
            previous = signal.getsignal(signal.SIGINT)
            if previous is not signal.SIG_IGN:  # a background job started with Ctrl-C ignored keeps ignoring it
                signal.signal(signal.SIGINT, on_interrupt)
                installed = True
        except ValueError:  # not the main thread (an embedding program's): its own handling stands
            pass
        try:
            return super().invoke(ctx)
        except (KeyboardInterrupt, Exception) as err:
            if isinstance(err, KeyboardInterrupt) or (interrupted and not isinstance(err, click.ClickException)):
                click.echo("interrupted" + ("" if isinstance(err, KeyboardInterrupt) else
                                            f" ({type(err).__name__} raised after the interrupt)"), err=True)
                sys.exit(130)
            raise
        finally:
            if installed:
                signal.signal(signal.SIGINT, signal.default_int_handler if previous is None else previous)

    def main(self, *args, **kwargs):
        """The command line's entry: standard output closed by the caller (`>&-`) is taken as
        /dev/null, and one that cannot be written (`> /dev/full`, even for --help) ends with an
        `error:` line (`common.end_if_output_failed`), not a traceback."""
        if sys.stdout is None:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - the process's stdout, open for its whole life
        try:
            return super().main(*args, **kwargs)
        except OSError as err:
            from .common import end_if_output_failed

            end_if_output_failed(err)
            raise

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The commands and their short help as click writes them, each read from its function's
        docstring in its module's source: listing them imports none (several import torch)."""
        limit = formatter.width - 6 - max(map(len, COMMANDS))
        with formatter.section("Commands"):
            formatter.write_dl([(name, click.Command(name, help=docstring(name)).get_short_help_str(limit))
                                for name in self.list_commands(ctx)])


def docstring(name: str) -> str:
    """The docstring of sub-command `name`'s function, read from its module's source with `ast`."""
    source = importlib.util.find_spec(f"{__name__}.{COMMANDS[name]}").origin
    tree = ast.parse(Path(source).read_text(encoding="utf-8"))
    function = next(node for node in tree.body if isinstance(node, ast.FunctionDef)
                    and node.name == name.replace("-", "_"))
    return ast.get_docstring(function) or ""


@click.group(cls=LazyCommands, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="multidecode")
def main() -> None:
    """Generate many things at once from one causal language model, exactly.

    MultiDecode puts many token sequences in one shared KV cache, each token at the position of
    its depth and seeing only its ancestors, so one forward pass advances them all.
    """
