"""`multidecode beam` (placeholder, filled in by its change)."""

import click


@click.command()
def beam():
    """(not yet implemented)"""
    raise click.ClickException("not implemented yet")
