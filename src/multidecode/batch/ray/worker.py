"""What each Ray actor runs: a model, loaded once in the actor, and one merged forest that every
line sent to it joins (`merged.ForestAnswerer`, admitted by the runtime as the local job's lines
are); its lines' errors go back as `ErrorInfo`."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable
from dataclasses import replace

from ..lines import InputLine
from ..merged import ForestAnswerer, LineOutcome
from ..settings import BatchSettings
from .errors import ErrorInfo


class Worker:
    """What each Ray actor runs: the model, loaded once, and a `ForestAnswerer` whose forest
    every concurrent `answer` call joins (`forest_budget`: its keywords forest_tokens,
    forest_branches and prefill_chunk, as `ForestAnswerer` takes them). Never
    raises: a failed load is reported by `ready`."""

    def __init__(self, model: str | None, precision: str | None, device: str | None, settings: BatchSettings,
                 speculate=None, prepare: Callable | None = None, threads: int | None = None,
                 forest_budget: dict | None = None) -> None:
        self.answerer: ForestAnswerer | None = None
        self.failed: ErrorInfo | None = None
        self._lock = threading.Lock()
        self._recent: list[tuple[BaseException, int]] = []
        self._serial = 0
        try:
            if threads:
                import torch

                torch.set_num_threads(threads)
            from ...api import load

            decoder = load(model, precision=precision, device=device)
            if prepare is not None:
                speculate = prepare(decoder, speculate)
            self.answerer = ForestAnswerer(decoder, settings, speculate=speculate, **(forest_budget or {}))
        except Exception as error:  # noqa: BLE001 - reported to the driver by ready()
            self.failed = self._info(error)

    def ready(self) -> dict:
        """{"pid", "node"} of a worker that can answer, or {"error": ErrorInfo} if loading failed."""
        if self.failed is not None:
            return {"error": self.failed}
        return {"pid": os.getpid(), "node": socket.gethostname()}

    def answer(self, item: InputLine) -> LineOutcome:
        """One line's `LineOutcome` (blocks until done; lines answered at once share forwards), its
        error, if any, as an `ErrorInfo`."""
        try:
            outcome = self.answerer.answer(item)
        except Exception as error:  # noqa: BLE001 - the line's failure
            outcome = LineOutcome(item, error=error)
        return outcome if outcome.error is None else replace(outcome, error=self._info(outcome.error))

    def _info(self, error: BaseException) -> ErrorInfo:
        with self._lock:  # one error object failing several lines keeps one serial number
            for seen, serial in self._recent:
                if seen is error:
                    break
            else:
                self._serial += 1
                serial = self._serial
                self._recent = [*self._recent[-15:], (error, serial)]
        return ErrorInfo.of(error, serial)


__all__ = ["Worker"]
