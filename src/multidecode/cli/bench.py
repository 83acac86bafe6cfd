"""`multidecode bench` (placeholder)."""
import click


@click.group()
def bench():
    """Benchmarks against the transformers alternatives, measured side by side in one run."""
