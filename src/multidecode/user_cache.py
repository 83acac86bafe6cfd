"""Where multidecode keeps files between runs: converted models and measured forward costs.

`cache_dir()` is `$MULTIDECODE_CACHE`, else `$XDG_CACHE_HOME/multidecode`, else `~/.cache/multidecode`.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where multidecode keeps its files: $MULTIDECODE_CACHE, else $XDG_CACHE_HOME/multidecode, else ~/.cache/multidecode."""
    if os.environ.get("MULTIDECODE_CACHE"):
        return Path(os.environ["MULTIDECODE_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "multidecode"
    return Path.home() / ".cache" / "multidecode"
