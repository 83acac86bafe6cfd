"""`multidecode batch` (placeholder, filled in by its change)."""

import click


@click.command()
def batch():
    """(not yet implemented)"""
    raise click.ClickException("not implemented yet")
