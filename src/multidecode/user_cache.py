"""Where multidecode keeps files between runs: converted models and measured forward costs.

`cache_dir()` is `$MULTIDECODE_CACHE`, else `$XDG_CACHE_HOME/multidecode`, else `~/.cache/multidecode`.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def cache_dir() -> Path:
    """Where multidecode keeps its files: $MULTIDECODE_CACHE, else $XDG_CACHE_HOME/multidecode, else ~/.cache/multidecode."""
    if os.environ.get("MULTIDECODE_CACHE"):
        return Path(os.environ["MULTIDECODE_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "multidecode"
    return Path.home() / ".cache" / "multidecode"


def unwritable(folder: Path) -> OSError | None:
    """Why `folder` cannot be made or written (made here if missing), or None: tried, not read from
    permission bits (root passes every `os.access` check, even on a read-only bind mount's
    folders)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tempfile.NamedTemporaryFile(dir=folder, prefix=".multidecode-").close()
    except OSError as err:
        return err
    return None
