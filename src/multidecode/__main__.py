"""`python -m multidecode ...`: the same as the `multidecode` command."""

from .cli import main

main(prog_name="multidecode")
