"""A batch job's output: the lock, the resume scan and repair, fsync-ed appends, the atomic rewrite
for retries, and the settings file (see `multidecode.batch` for the format and its guarantees)."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from filelock import FileLock, Timeout

from ..errors import InvalidInput, OutputUnwritable, changed_settings
from ..user_cache import fsync_folder, replace_atomically
from .lines import id_key
from .settings import BatchSettings

FORMAT = "multidecode-batch/1"


def meta_path(output: str | os.PathLike) -> Path:
    """The settings file written beside an output: OUT.jsonl.meta.json (its name with .meta.json added)."""
    return Path(output).with_name(Path(output).name + ".meta.json")


def lock_path(output: str | os.PathLike) -> Path:
    """The lock file beside an output: OUT.jsonl.lock (it stays; the lock is on it, not its existence)."""
    return Path(output).with_name(Path(output).name + ".lock")


class OutputFile:
    """An output, locked and open for appending, scanned and repaired on opening.

    recorded: id key -> whether its record is a failure; fingerprints: the settings of its results
    (the records that are not failures);
    repaired: whether a cut-short last line was removed. The lock is an flock on OUT.jsonl.lock (so the
    kernel drops it when the process dies, and it outlives the rewrite of the output itself).
    """

    def __init__(self, path: Path) -> None:
        # Through any symbolic link: two runs reaching one file by two names take one lock, and the
        # atomic rewrite replaces the file, not the link.
        self.given = Path(path)  # as the user named it, for reports
        self.path, self.fd = Path(path).resolve(), -1
        self.created = False  # whether this opening made the output (then `discard` may remove it)
        self.lock = FileLock(lock_path(self.path), timeout=0, thread_local=False)
        try:
            self.lock.acquire()
            self._open()
            self.recorded, self.fingerprints, self.repaired = self._scan()
        except BaseException as err:
            self.close()
            if isinstance(err, Timeout) and not Path(self.lock.lock_file).exists():  # not held: it could not be made
                raise InvalidInput(f"cannot write {self.lock.lock_file} (the output's lock file)",
                                   "check that the output's folder is writable, or write to another --output") from None
            if isinstance(err, Timeout):
                busy = f"{path} is being written by another multidecode batch run, which holds {self.lock.lock_file}"
                raise InvalidInput(busy, "wait for it to finish (or stop it), or write to another --output") from None
            if isinstance(err, OSError):
                raise InvalidInput(f"cannot write {err.filename or path}: {err.strerror or err}",
                                   "check the permissions of the output and its folder, or write to another --output")
            raise

    def _open(self) -> None:
        created = not self.path.exists()
        self.fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o666)
        if created:
            self.created = True
            fsync_folder(self.path.parent)

    def _scan(self) -> tuple[dict[str, bool], set[str], bool]:
        """Read every record; truncate a cut-short last line (a whole record that lacks only its
        newline keeps it, the newline added); refuse anything else that is not a record."""
        recorded: dict[str, bool] = {}
        fingerprints: set[str] = set()
        first_line: dict[str, int] = {}
        offset = good_end = 0
        unreadable: tuple[int, bytes] | None = None  # a line that is not a record: allowed only last, cut short

        def take(record: dict, number: int) -> None:
            key = id_key(record["id"])
            if key in recorded:
                raise InvalidInput(
                    f"{self.path} has two records for id {record['id']!r} (lines {first_line[key]} and {number})",
                    "keep one of them; a batch output holds one record per id")
            first_line[key], recorded[key] = number, record["error"] is not None
            if record["error"] is None:
                fingerprints.add(record["settings"])

        with open(self.path, "rb") as handle:
            for number, raw in enumerate(handle, start=1):
                if unreadable is not None:
                    self._refuse(*unreadable)
                offset += len(raw)
                record = _parse_record(raw)
                if record is None:
                    if raw.strip() or not raw.endswith(b"\n"):
                        unreadable = (number, raw)
                    else:  # a blank line (an edited file): harmless
                        good_end = offset
                    continue
                take(record, number)
                good_end = offset
        if unreadable is None:
            return recorded, fingerprints, False
        number, raw = unreadable
        if not raw.endswith(b"\n") and (record := _parse_record(raw + b"\n")) is not None:
            take(record, number)  # whole, but its newline never reached the file
            os.write(self.fd, b"\n")
            os.fsync(self.fd)
            return recorded, fingerprints, False
        if not _cut_short(raw):
            self._refuse(number, raw)
        os.ftruncate(self.fd, good_end)
        os.fsync(self.fd)
        return recorded, fingerprints, True

    def _refuse(self, number: int, raw: bytes):
        raise InvalidInput(f"{self.path} is not a multidecode batch output: line {number} is not a result record",
                           "is it the right output file? Write results to a new file, or fix that line")

    def append(self, record: dict) -> None:
        """One write of the whole line, then fsync: a crash leaves at worst a cut-short last line."""
        try:
            data = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate from the input: escape everything instead
            data = (json.dumps(record, ensure_ascii=True) + "\n").encode("ascii")
        view = memoryview(data)
        with _writing(self.path):  # a line cut short here is repaired when the job resumes
            while view:  # one write in practice
                view = view[os.write(self.fd, view):]
            os.fsync(self.fd)

    def drop(self, keys: set[str]) -> None:
        """Replace the output, atomically, with a copy that lacks the records of `keys`."""
        with open(self.path, "rb") as handle, _writing(self.path):
            replace_atomically(self.path, (raw for raw in handle
                                 if (record := _parse_record(raw)) is None or id_key(record["id"]) not in keys))
        os.close(self.fd)
        self._open()
        for key in keys:
            del self.recorded[key]

    def check_settings(self, settings: BatchSettings) -> None:
        """Refuse results made with other settings, naming what changed when the settings file
        tells. Failed records do not bind: a job whose lines all failed (no questions given, a
        prompt too long for max_new_tokens) can go on with the settings that mend it, and
        --retry-failed redoes those lines with them."""
        others = self.fingerprints - {settings.fingerprint}
        if not others:
            return
        meta, differences = self._settings_file(), []
        if meta.get("fingerprint") in others:
            with contextlib.suppress(AttributeError):
                differences = changed_settings(meta.get("settings", {}), settings.as_dict())
        said = (f": {'; '.join(differences)}" if differences else
                f" (fingerprint {', '.join(sorted(others))}, these settings are {settings.fingerprint})")
        raise InvalidInput(f"{self.path} holds results made with other settings{said}",
                           "rerun with the settings it was started with, or write these results to a new output file")

    def check_input(self, input_path: Path, keys: set[str]) -> None:
        """Refuse to resume from another input file whose ids (`keys`; line numbers where a line has
        none) have results here: its lines would be taken as done, with the other file's answers.
        Only while a file that wrote here is still there (an input moved or renamed resumes), and only
        where ids meet (another file of new ids adds to the output, and resumes as one of its inputs)."""
        shared = len(keys & self.recorded.keys())
        inputs = self._inputs()
        if not shared or _among(input_path, inputs):
            return
        present = [str(path) for path in inputs if path.is_file()]  # records do not say which one wrote them
        if present:
            raise InvalidInput(f"{self.path} holds the results of {' and '.join(present)}, not of {input_path}, and "
                               f"{shared} of its ids (line numbers, for lines without one) have results there",
                               f"rerun with {' or '.join(present)} to resume it, or write these results to a new --output")

    def _settings_file(self) -> dict:
        """What the settings file holds ({} where there is none, or it is not a JSON object)."""
        with contextlib.suppress(OSError, ValueError):
            meta = json.loads(meta_path(self.path).read_text(encoding="utf-8"))
            return meta if isinstance(meta, dict) else {}
        return {}

    def _inputs(self, meta: dict | None = None) -> list[Path]:
        """The input files that wrote here, as the settings file (`meta`, default: read) names them."""
        meta = self._settings_file() if meta is None else meta
        with contextlib.suppress(KeyError, TypeError):
            return [Path(name) for name in (meta["inputs"] if "inputs" in meta else [meta["input"]])]
        return []

    def write_meta(self, settings: BatchSettings, input_path: Path) -> None:
        """The settings file: these settings, the input the output was started from ("input") and
        every input that has written here since ("inputs"), each one resuming as its own."""
        meta = self._settings_file()
        inputs = self._inputs(meta)
        known = _among(input_path, inputs)
        if meta.get("fingerprint") == settings.fingerprint and known:
            return
        from ..version import __version__

        inputs = [str(path) for path in inputs] + ([] if known else [str(input_path.resolve())])
        data = {"format": FORMAT, "fingerprint": settings.fingerprint, "settings": settings.as_dict(),
                "input": inputs[0], "inputs": inputs, "multidecode": __version__}
        with _writing(meta_path(self.path)):
            replace_atomically(meta_path(self.path), [(json.dumps(data, ensure_ascii=False, indent=2) + "\n").encode("utf-8")])

    def discard(self) -> None:
        """Remove the output and its settings file where this opening made the output and nothing was
        written to it: a job that fails before its first record (the model would not load, a setting
        only the model can check) leaves no empty output behind. The lock file stays, as always."""
        if self.created and self.fd >= 0 and os.fstat(self.fd).st_size == 0:
            self.path.unlink(missing_ok=True)
            meta_path(self.path).unlink(missing_ok=True)

    @property
    def closed(self) -> bool:
        return self.fd < 0

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.lock.release()


def _among(path: Path, inputs: list[Path]) -> bool:
    """Whether `path` is one of `inputs` (the same file, by any name)."""
    return any(other.is_file() and os.path.samefile(other, path) for other in inputs)


def _parse_record(raw: bytes) -> dict | None:
    """The record on a whole line (ending in a newline), or None if it is not one."""
    try:
        record = json.loads(raw.decode("utf-8")) if raw.endswith(b"\n") else None
    except ValueError:  # UnicodeDecodeError, JSONDecodeError
        return None
    if (not isinstance(record, dict) or not isinstance(record.get("id"), (str, int)) or isinstance(record["id"], bool)
            or "error" not in record or not isinstance(record.get("settings"), str)):
        return None
    return record


@contextlib.contextmanager
def _writing(path: Path):
    """Turn a failed write of the output or its settings file into `OutputUnwritable` naming the file:
    what is written stays (a replaced file is whole or untouched), so the same command resumes."""
    try:
        yield
    except OSError as error:
        raise OutputUnwritable(f"cannot write {path}: {error.strerror or error}",
                               "free some space (or mend the cause), then rerun the same command: it "
                               "resumes after the last whole record") from error


RECORD_START = b'{"id"'
"""What every record's line starts with (`id` is written first)."""


def _cut_short(raw: bytes) -> bool:
    """Whether an unreadable last line is what an interrupted write leaves: the start of a record
    that does not parse (or zeros, from a file system that lost the data), never another file's
    JSON (whole JSON that is not a record, with or without its newline, is someone's data)."""
    stripped = raw.strip(b"\x00 \t\r\n")
    if not stripped or RECORD_START.startswith(stripped):  # cut within a record's first bytes
        return True
    if not stripped.startswith(RECORD_START):
        return False
    try:
        json.loads(stripped.decode("utf-8"))
    except ValueError:
        return True
    return False
