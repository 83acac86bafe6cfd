"""`multidecode complete` and `multidecode vote` (placeholder)."""

import click


@click.command()
def complete():
    """(not yet implemented)"""


@click.command()
def vote():
    """(not yet implemented)"""
