"""A batch job's output file: fsync-ed appends, the resume scan and repair, the lock, the settings file
(see `multidecode.batch` for the format and the guarantees)."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import InvalidInput
from .lines import id_key

if TYPE_CHECKING:
    from .job import BatchSettings

FORMAT = "multidecode-batch/1"


@dataclass
class _Existing:
    """What an output file already holds: its ids, which of them failed, and the fingerprints seen."""

    done: dict[str, bool] = field(default_factory=dict)  # id key -> whether its record is a failure
    fingerprints: set[str] = field(default_factory=set)
    repaired: bool = False


def _cut_short(raw: bytes) -> bool:
    """Whether an unreadable last line is what an interrupted write leaves: the start of a record
    (or zeros, from a file system that lost the data), never another file's JSON."""
    stripped = raw.strip(b"\x00 \t\r\n")
    if not stripped:
        return True
    if not stripped.startswith(b'{"id"'):
        return False
    try:
        json.loads(stripped.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return True
    return not raw.endswith(b"\n")  # whole JSON but no newline: the write did not finish


def _read_existing(fd: int, path: Path) -> _Existing:
    """Scan the output (holding its lock); truncate a cut-short last line; refuse anything else odd."""
    existing = _Existing()
    lines_at: dict[str, int] = {}
    offset = 0
    end_of_good = 0
    unreadable: tuple[int, bytes] | None = None  # a line that is not a record: allowed only last
    with os.fdopen(os.dup(fd), "rb") as handle:
        handle.seek(0)
        for number, raw in enumerate(handle, start=1):
            offset += len(raw)
            if unreadable is not None:
                _refuse_not_a_record(path, *unreadable)
            record = _parse_record(raw) if raw.endswith(b"\n") else None
            if record is None:
                if raw.strip() == b"" and raw.endswith(b"\n"):  # a blank line (an edited file): harmless
                    end_of_good = offset
                else:
                    unreadable = (number, raw)
                continue
            key = id_key(record["id"])
            if key in existing.done:
                raise InvalidInput(
                    f"{path} has two records for id {record['id']!r} (lines {lines_at[key]} and {number})",
                    "keep one of them; a batch output holds one record per id")
            lines_at[key] = number
            existing.done[key] = record["error"] is not None
            existing.fingerprints.add(record["settings"])
            end_of_good = offset
    if unreadable is not None:
        if not _cut_short(unreadable[1]):
            _refuse_not_a_record(path, *unreadable)
        os.ftruncate(fd, end_of_good)
        os.fsync(fd)
        existing.repaired = True
    return existing


def _parse_record(raw: bytes) -> dict | None:
    try:
        record = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    if (not isinstance(record, dict) or not isinstance(record.get("id"), (str, int)) or isinstance(record["id"], bool)
            or "error" not in record or not isinstance(record.get("settings"), str)):
        return None
    return record


def _refuse_not_a_record(path: Path, number: int, raw: bytes):
    raise InvalidInput(f"{path} is not a multidecode batch output: line {number} is not a result record",
                       "is it the right output file? Write results to a new file, or fix that line")


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # not every platform can open a folder
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _lock(fd: int, path: Path) -> None:
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock; do not run two jobs on one output
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise InvalidInput(f"{path} is being written by another multidecode batch run",
                           "wait for it to finish (or stop it), or write to another --output") from None


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def meta_path(output: str | os.PathLike) -> Path:
    """The settings file written beside an output: OUT.meta.json."""
    output = Path(output)
    return output.with_name(output.name + ".meta.json")


def _settings_differences(stored: Mapping, current: Mapping) -> list[str]:
    return [f"{key} was {json.dumps(stored.get(key), ensure_ascii=False)}, "
            f"now {json.dumps(current.get(key), ensure_ascii=False)}"
            for key in sorted(set(stored) | set(current)) if stored.get(key) != current.get(key)]


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _encode(record: dict) -> bytes:
    try:
        return (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate from the input: escape everything instead
        return (json.dumps(record, ensure_ascii=True) + "\n").encode("ascii")



def _check_settings(path: Path, settings: BatchSettings, existing: _Existing) -> None:
    others = existing.fingerprints - {settings.fingerprint}
    if not others:
        return
    differences: list[str] = []
    with contextlib.suppress(OSError, ValueError, AttributeError):
        meta = json.loads(meta_path(path).read_text(encoding="utf-8"))
        if meta.get("fingerprint") in others:
            differences = _settings_differences(meta.get("settings", {}), settings.as_dict())
    said = f": {'; '.join(differences)}" if differences else f" (fingerprint {', '.join(sorted(others))}, " \
                                                                 f"these settings are {settings.fingerprint})"
    raise InvalidInput(f"{path} holds results made with other settings{said}",
                       "rerun with the settings it was started with, or write these results to a new --output")


def _rewrite_without(fd: int, path: Path, drop: set[str]) -> int:
    """Atomically replace the output with a copy that lacks the records of `drop`; returns the new
    file's descriptor, already locked (the old one stays locked until it is closed)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.retry.tmp")
    new_fd = os.open(tmp, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        with contextlib.suppress(OSError):
            os.fchmod(new_fd, os.fstat(fd).st_mode & 0o7777)
        _lock(new_fd, tmp)
        with os.fdopen(os.dup(fd), "rb") as handle:
            handle.seek(0)
            for raw in handle:
                record = _parse_record(raw)
                if record is not None and id_key(record["id"]) in drop:
                    continue
                _write_all(new_fd, raw)
        os.fsync(new_fd)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        os.close(new_fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    os.close(fd)
    return new_fd


def _write_meta(path: Path, settings: BatchSettings, input_path: Path) -> None:
    meta = meta_path(path)
    with contextlib.suppress(OSError, ValueError, AttributeError):
        if json.loads(meta.read_text(encoding="utf-8")).get("fingerprint") == settings.fingerprint:
            return
    from .. import __version__

    data = {"format": FORMAT, "fingerprint": settings.fingerprint, "settings": settings.as_dict(),
            "input": str(input_path.resolve()), "multidecode": __version__}
    _write_atomically(meta, (json.dumps(data, ensure_ascii=False, indent=2) + "\n").encode("utf-8"))


