"""Where multidecode keeps files between runs (converted models, measured forward costs), and how
a file it keeps is written: whole or not at all (`replace_atomically`).

`cache_dir()` is `$MULTIDECODE_CACHE`, else `$XDG_CACHE_HOME/multidecode`, else `~/.cache/multidecode`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterable
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


def replace_atomically(path: Path, chunks: Iterable[bytes], *, durable: bool = True) -> None:
    """Write a file whole or not at all: a temporary file beside it, renamed over it (its mode
    kept); a failure leaves the old file and no temporary one. durable: the file and its folder
    fsync-ed, so a crash keeps it too (off for what is cheaply made again, written while decoding)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as handle:
            handle.writelines(chunks)
            if durable:
                handle.flush()
                os.fsync(handle.fileno())
        with contextlib.suppress(OSError):
            shutil.copymode(path, tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_folder(path.parent)


def fsync_folder(path: Path) -> None:
    """fsync a folder, so that a file made or renamed in it survives a crash (where the platform can)."""
    with contextlib.suppress(OSError):  # not every platform can open a folder
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
