"""`multidecode demo` (placeholder until the benchmark baselines land)."""
import click


@click.command()
def demo():
    """Answer 8 questions about a sample document in one pass, and compare with one by one."""
