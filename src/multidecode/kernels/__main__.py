"""`python -m multidecode.kernels`: build the compiled kernels for this CPU (setup runs it), and say
what the forward's products run on here."""

from __future__ import annotations

import sys

from . import describe, status


def main() -> int:
    built = status(progress=lambda message: print(message + " ...", flush=True))
    print(f"multidecode kernels: {describe()}")
    if built.library is not None:
        print(f"  {built.library}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
