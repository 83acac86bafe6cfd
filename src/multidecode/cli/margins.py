"""`multidecode margins` (placeholder, filled in by its change)."""

import click


@click.command()
def margins():
    """(not yet implemented)"""
    raise click.ClickException("not implemented yet")
