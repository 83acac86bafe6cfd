"""`multidecode cache list|clear`: what the cache folder holds (GGUF models read once into the
kernels' layout or converted to float32, conversions under way, cost curves, the compiled
kernels), and removing those copies to free the disk."""

from __future__ import annotations

import json

import click
from rich.markup import escape

from .common import counted, human_size, report_errors, stderr, stdout


@click.group()
def cache() -> None:
    """List or clear the cache folder: the copies of GGUF models (the embedded one and any .gguf
    file loaded; their packed weights in the kernels' layout, or float32), measured cost curves and
    the compiled kernels. $MULTIDECODE_CACHE sets where it is."""


@cache.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
@report_errors
def list_(as_json):
    """Show each converted model (name, source, size, created), the cost curves and anything else
    in the cache folder, with the total size."""
    from ..models.converted import cache_entries
    from ..user_cache import cache_dir

    entries = cache_entries()
    total = sum(e.bytes for e in entries)
    if as_json:
        click.echo(json.dumps({"folder": str(cache_dir()), "entries": [e.as_dict() for e in entries],
                               "total_bytes": total}, indent=1, ensure_ascii=False))
        return
    rows = [(e.name, e.kind, human_size(e.bytes), (e.created or "")[:16].replace("T", " "), e.state) for e in entries]
    rows.append(("total", "", human_size(total), "", counted(len(entries), 'item')))
    header = ("name", "kind", "size", "created (UTC)", "state")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(4)]

    def line(row) -> str:
        name, kind, size, created, state = row
        return f"{name:<{widths[0]}}  {kind:<{widths[1]}}  {size:>{widths[2]}}  {created:<{widths[3]}}  {state}".rstrip()

    stdout.print(f"Cache folder {escape(str(cache_dir()))}")
    stdout.print(f"[bold]{escape(line(header))}[/bold]")
    for entry, row in zip(entries, rows):
        stdout.print(escape(line(row)))
        if entry.source:  # a line of its own: a path is too long for a column
            stdout.print(f"[dim]    from {escape(entry.source)}[/dim]")
        if entry.weights:  # each precision asked for keeps its own copy of the weights
            held = ", ".join(f"{name} {human_size(size)}" for name, size in entry.weights.items())
            stdout.print(f"[dim]    weights: {escape(held)}[/dim]")
    stdout.print(escape(line(rows[-1])))


@cache.command("clear")
@click.argument("names", nargs=-1, metavar="[NAME]...")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@report_errors
def clear(names, yes):
    """Remove converted models: those NAMEd (as `cache list` shows them; `costs` for the cost
    curves, `kernels` for the compiled kernels), or every converted model and abandoned partial
    conversion. A conversion or a kernels' build another process is running is left alone."""
    from ..models.converted import clear_cache, select_entries
    from ..user_cache import cache_dir

    chosen = select_entries(names)
    if not chosen:
        stdout.print(f"Nothing to clear in {escape(str(cache_dir()))}.")
        return
    size = sum(e.bytes for e in chosen)
    if not yes:
        listing = "\n".join(f"  {e.name} ({human_size(e.bytes)})" for e in chosen)
        try:
            confirmed = click.confirm(f"Remove from {cache_dir()}:\n{listing}\nfreeing {human_size(size)}?", err=True)
        except click.Abort:  # no answer to read: stdin closed, or ^C
            stderr.print()
            confirmed = False
        if not confirmed:
            stderr.print("Nothing removed (--yes clears without asking).")
            raise SystemExit(1)
    removed, busy = clear_cache(chosen)
    for e in removed:
        stdout.print(f"removed {escape(e.name)} ({human_size(e.bytes)})")
    for e in busy:
        doing = "building them" if e.kind == "kernels" else "converting it"
        stderr.print(f"[yellow]skipped[/yellow] {escape(e.name)}: another process is {doing}")
    stdout.print(f"Freed {human_size(sum(e.bytes for e in removed))}.")
