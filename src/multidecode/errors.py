"""Errors a user can cause, each with a message that names the problem and a hint that names the fix.

The CLI prints `error: <message>` and `hint: <hint>` and exits non-zero for any `MultiDecodeError`;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from numbers import Integral


class MultiDecodeError(Exception):
    """Base class: a problem with the user's input, model or environment, not a bug."""

    exit_code = 2

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message} ({self.hint})"


class InvalidArgument(MultiDecodeError, ValueError):
    """An argument is out of range or of the wrong kind."""


class InvalidInput(MultiDecodeError, ValueError):
    """A document, question or input file cannot be used."""


class PromptTooLong(MultiDecodeError, ValueError):
    """A prompt plus its new tokens does not fit in the model's positions. fits: the most new
    tokens the prompt leaves room for (None: the prompt alone does not fit), for a driver that
    words the fix in its own terms."""

    def __init__(self, message: str, hint: str | None = None, *, fits: int | None = None) -> None:
        super().__init__(message, hint)
        self.fits = fits


class ModelNotFound(MultiDecodeError, FileNotFoundError):
    """The named model is not a folder, a .gguf file, or a reachable hub id."""


class CacheUnwritable(MultiDecodeError, OSError):
    """The folder for the converted embedded model cannot be written."""


class OutputUnwritable(MultiDecodeError, OSError):
    """A job's output cannot be written (a full disk, lost permissions): what is written stays."""


class UnsupportedModel(MultiDecodeError):
    """The model cannot be decoded exactly as a forest (architecture or attention kind)."""


class NotBitExact(UnsupportedModel):
    """The model runs as a forest, but some of its products cannot run on the exact kernels (a
    mixture of experts' stacked weights, attention outside transformers' interface, float weights
    without a compiler): with the model's own kernels (`exact=False`) its output is exact to the
    token, not the bit."""


class NotEnoughMemory(MultiDecodeError, MemoryError):
    """A request needs more memory than the machine (or the budget the user set) has."""


class MissingExtra(MultiDecodeError, ImportError):
    """A feature needs an optional dependency that is not installed; the hint says how to install it."""


def is_int(value) -> bool:
    """An integer (Python or NumPy), but not a bool."""
    return isinstance(value, Integral) and not isinstance(value, bool)


def as_list(items):
    """A list of questions or prompts as a list, read once: a generator or a `map` is not consumed
    by a check before its use, and a NumPy array or a tensor is not asked its truth value (a 2-d
    array of ids becomes one list per row). Text, and what is not iterable, comes back as it is,
    for the caller's own refusal."""
    if isinstance(items, (str, bytes)):
        return items
    if hasattr(items, "tolist") and hasattr(items, "dtype"):  # a NumPy array or a torch tensor
        return items.tolist()
    try:
        return list(items)
    except TypeError:
        return items


COUNT_LIMIT = 2**63
"""Counts (branches, beams, tokens) stay below it: Python's lists and torch's int64 stop there."""


def check_positive(name: str, value) -> None:
    """Refuse anything but a positive integer (below `COUNT_LIMIT`) for the setting `name`."""
    if not is_int(value) or value < 1:
        raise InvalidArgument(f"{name} must be a positive integer, got {value!r}", "use 1 or more")
    if value >= COUNT_LIMIT:
        raise InvalidArgument(f"{name} {value} is past 2**63 - 1, the most any count can be", "use a smaller number")


def check_flag(name: str, value) -> None:
    """Refuse anything but True or False for the switch `name` ("no" is a true string)."""
    if not isinstance(value, bool):
        raise InvalidArgument(f"{name} must be True or False, got {value!r}", f"pass {name}=True or {name}=False")


def check_counts(what: str, counts, hint: str) -> None:
    """Refuse a list of counts with one that is not a positive integer."""
    if any(not is_int(k) or k < 1 for k in counts):
        raise InvalidArgument(f"every {what} must be a positive integer, got {list(counts)}", hint)


def check_known(names, known, what: str) -> None:
    """Refuse names outside `known` (a typo in a list of methods or workloads)."""
    unknown = [n for n in names if n not in known]
    if unknown:
        raise InvalidArgument(f"unknown {what}: {', '.join(unknown)}", f"use {', '.join(known)}")


def check_text_bytes(head: bytes, name: str, what: str) -> None:
    """Refuse a file whose first bytes `head` are no UTF-8 text, saying what it is instead: compressed,
    UTF-16 (or UTF-32: zeros in every other byte of ASCII text, or their byte-order mark), or binary."""
    if head.startswith(b"\x1f\x8b"):
        raise InvalidInput(f"{name} is not a text file (it is gzip-compressed)", f"decompress the {what} first (gunzip)")
    sample = head[:8192]  # (a whole document may be given: its start tells)
    wide = sample.startswith((b"\xff\xfe", b"\xfe\xff")) or any(
        sample[start::2].count(0) == 0 and sample[1 - start::2].count(0) > len(sample) // 4 for start in (0, 1))
    if wide:
        raise InvalidInput(f"{name} is UTF-16 (or UTF-32) text, not UTF-8",
                           f"save the {what} as UTF-8 (iconv -f UTF-16 -t UTF-8 FILE > NEW_FILE)")
    if b"\x00" in head:
        raise InvalidInput(f"{name} is not a text file (it holds binary data)", f"pass the {what} as plain UTF-8 text")


def decode_text(data: bytes, name: str, what: str) -> str:
    """A file's bytes as text: UTF-8, a leading byte-order mark dropped (Windows editors write one);
    anything else refused naming the file (`check_text_bytes`), or the first byte that is not UTF-8."""
    check_text_bytes(data, name, what)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise InvalidInput(f"{name} is not UTF-8 text (bad byte at offset {err.start})",
                           f"convert the {what} to UTF-8 first") from None


def changed_settings(stored: Mapping, current: Mapping) -> list[str]:
    """What differs between the settings a saved result was made with and these ("epochs was 2.0,
    now 3.0"), for the refusal to go on with it (a batch output, a drafter's checkpoint)."""
    return [f"{key} was {json.dumps(stored.get(key), ensure_ascii=False)}, now {json.dumps(current.get(key), ensure_ascii=False)}"
            for key in sorted(set(stored) | set(current)) if stored.get(key) != current.get(key)]
