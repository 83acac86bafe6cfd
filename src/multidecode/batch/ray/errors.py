"""A line's error carried from a Ray worker to the driver: in a form that always pickles, rebuilt
on the driver as its own class where it can be (a `MultiDecodeError`: the line's fault) or as a
stand-in of the same name (anything else: it counts toward the job's crash limit), with a serial
number so that one error that failed several lines is still one error."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from ...errors import MultiDecodeError


@dataclass(frozen=True)
class ErrorInfo:
    """A line's error in a form that always pickles: its class (module and name), message and
    hint, and a serial number that is the same for one error object shared by several lines."""

    module: str
    name: str
    message: str
    hint: str | None
    user: bool
    serial: int

    @classmethod
    def of(cls, error: BaseException, serial: int) -> ErrorInfo:
        user = isinstance(error, MultiDecodeError)
        message = error.message if user else str(error)
        return cls(type(error).__module__, type(error).__qualname__, message, error.hint if user else None, user,
                   serial)

    def rebuild(self) -> BaseException:
        """The error again: a `MultiDecodeError` as its own class where it can be imported (so it
        counts as the line's fault, not a crash), anything else as a stand-in of the same name."""
        cls = _error_class(self.module, self.name, self.user)
        error = cls.__new__(cls)
        error.args = (self.message,)
        if self.user:
            error.message, error.hint = self.message, self.hint
        return error


class RemoteError(Exception):
    """Base of the stand-ins for errors raised in a worker whose class the driver does not rebuild."""


_STAND_INS: dict[tuple[str, str, bool], type] = {}


def _error_class(module: str, name: str, user: bool) -> type:
    if user:
        found: Any = None
        try:
            found = importlib.import_module(module)
            for part in name.split("."):
                found = getattr(found, part)
        except (ImportError, AttributeError):
            found = None
        if isinstance(found, type) and issubclass(found, MultiDecodeError):
            return found
    key = (module, name, user)
    if key not in _STAND_INS:
        base = MultiDecodeError if user else RemoteError
        _STAND_INS[key] = type(name.rpartition(".")[2], (base,), {"__module__": module, "__qualname__": name})
    return _STAND_INS[key]


__all__ = ["ErrorInfo", "RemoteError"]
