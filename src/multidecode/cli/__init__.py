"""The `multidecode` command: one sub-command per use case, each a thin module in this package."""

from __future__ import annotations

import click

from ..version import __version__
from .batch import batch
from .bench import bench
from .cache import cache
from .decoding import ask, beam, complete, generate, margins, vote
from .demo import demo
from .explain import explain
from .serve import serve
from .train import train_drafter


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="multidecode")
def main() -> None:
    """Generate many things at once from one causal language model, exactly.

    MultiDecode puts many token sequences in one shared KV cache, each token at the position of
    its depth and seeing only its ancestors, so one forward pass advances them all.
    """


for command in (ask, generate, complete, beam, margins, vote, batch, demo, bench, explain, serve, cache, train_drafter):
    main.add_command(command)
