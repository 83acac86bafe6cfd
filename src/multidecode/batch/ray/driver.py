"""The driver's side of a job on Ray: `RayWorkers` starts the actors, sends each line to the
worker with the most room, sends a line again when its worker dies (alone, to an idle one), and
yields each line's outcome once (see `multidecode.batch.ray` for the guarantees)."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Self

from ...errors import check_positive
from ..job import BatchAborted
from ..lines import InputLine
from ..merged import FOREST_BRANCHES, FOREST_TOKENS, PREFILL_CHUNK, LineOutcome
from ..settings import BatchSettings
from .connect import connect, import_ray
from .errors import ErrorInfo
from .worker import Worker

LINES_PER_WORKER = 4
"""Lines in flight per worker, merged into its forest (about the local default forest budget)."""
MAX_ATTEMPTS = 3
"""Sendings of one line whose worker died before the line is recorded as failed."""
MAX_FAILED_STARTS = 3
"""Workers in a row that die before answering anything: then no more are started."""


class WorkersLost(BatchAborted):
    """Every Ray worker is gone and no new one could start: the job stopped (rerun to resume)."""


class WorkerDied(RuntimeError):
    """Recorded for a line whose worker died `MAX_ATTEMPTS` times while answering it."""


@dataclass(eq=False)
class _Slot:
    """One worker as the driver sees it."""

    actor: Any
    number: int  # 0, 1, ... in the order workers were started
    starting: Any = None  # the ready() reference until it answers
    lines: int = 0  # in flight
    alone: bool = False  # answering a line sent again, and nothing else
    dead: bool = False


class _LineQueue:
    """The lines still to send: those to send again first (lowest line first), then the input's,
    read lazily; nothing more once `stopping()` is true."""

    def __init__(self, items: Iterable[InputLine], stopping: Callable[[], bool]) -> None:
        self.items, self.stopping = iter(items), stopping
        self.retry: list[tuple[int, InputLine]] = []  # a heap by line number
        self.exhausted = False

    def next(self) -> InputLine | None:
        if self.stopping():
            return None
        if self.retry:
            return heapq.heappop(self.retry)[1]
        if not self.exhausted:
            item = next(self.items, None)
            self.exhausted = item is None
            return item
        return None

    def again(self, item: InputLine) -> None:
        heapq.heappush(self.retry, (item.line, item))

    @property
    def done(self) -> bool:
        return self.exhausted and not self.retry


class RayWorkers:
    """Ray workers answering one job's lines (see the module notes). `ray_outcomes` is the usual
    way in; this class also lets a caller see the workers (`actors`) while they run.

    model, precision, device: as `multidecode.load` takes them, in each worker (a local path is made
    absolute, and must exist on every node). speculate: `MultiDecoder.ask`'s; prepare(decoder, speculate), if given,
    runs in each worker once the model is loaded and returns the speculation to use. workers:
    how many actors; cpus_per_worker: the CPUs each reserves (and its torch threads);
    gpus_per_worker: the GPUs each reserves (default: 1 when device is "cuda..." or, with no
    device, when the cluster has GPUs, as `load` picks cuda where there is one; else 0).
    forest_tokens, forest_branches, prefill_chunk: each worker's forest budget, as `ForestAnswerer`
    takes it (as `BatchJob.run` does locally).
    """

    def __init__(self, *, settings: BatchSettings, model: str | None = None, precision: str | None = None,
                 device: str | None = None, speculate=None, prepare: Callable | None = None,
                 address: str | None = None, workers: int = 2, lines_per_worker: int = LINES_PER_WORKER,
                 cpus_per_worker: int = 1, gpus_per_worker: float | None = None, forest_tokens: int = FOREST_TOKENS,
                 forest_branches: int = FOREST_BRANCHES, prefill_chunk: int = PREFILL_CHUNK) -> None:
        check_positive("workers", workers)
        check_positive("lines_per_worker", lines_per_worker)
        check_positive("cpus_per_worker", cpus_per_worker)
        self.ray = import_ray()
        self.workers, self.lines_per_worker = workers, lines_per_worker
        self._slots: list[_Slot] = []
        self._flight: dict[Any, tuple[_Slot, InputLine]] = {}
        self._failed_starts = 0
        self._errors: dict[tuple[int, int], tuple[ErrorInfo, BaseException]] = {}
        self._last_loss: str | None = None
        #: workers started (replacements included), workers lost, lines sent again after a loss
        self.started = self.lost = self.resent = 0
        #: lines answered by each worker (by its number, in the order workers were started)
        self.answered: dict[int, int] = {}
        self._started = connect(address)
        try:
            if gpus_per_worker is None:  # as `load` does: cuda if any
                cuda = str(device).startswith("cuda") if device else self.ray.cluster_resources().get("GPU", 0) > 0
                gpus_per_worker = 1 if cuda else 0
            if model is not None and Path(model).expanduser().exists():  # the same file for every worker
                model = str(Path(model).expanduser().resolve())
            budget = {"forest_tokens": forest_tokens, "forest_branches": forest_branches, "prefill_chunk": prefill_chunk}
            self._arguments = (model, precision, device, settings, speculate, prepare, cpus_per_worker, budget)
            self._actor_class = self.ray.remote(num_cpus=cpus_per_worker, num_gpus=gpus_per_worker,
                                                max_concurrency=lines_per_worker + 1)(Worker)
            for _ in range(workers):
                self._start_worker()
        except BaseException:
            self.close()
            raise

    @property
    def actors(self) -> list:
        """The handles of the workers alive now (or starting)."""
        return [slot.actor for slot in self._slots if not slot.dead]

    @property
    def lines_in_flight(self) -> list[tuple[Any, int]]:
        """(handle, lines in flight) of each worker alive now."""
        return [(slot.actor, slot.lines) for slot in self._slots if not slot.dead]

    def wait_ready(self) -> None:
        """Wait until every worker started so far has loaded its model (or failed to). Optional:
        `outcomes` sends lines to each worker as soon as it is ready."""
        for slot in list(self._slots):
            if slot.starting is not None and not slot.dead:
                self.ray.wait([slot.starting])
                self._started_or_not(slot)

    def _start_worker(self) -> None:
        actor = self._actor_class.remote(*self._arguments)
        self._slots.append(_Slot(actor, self.started, starting=actor.ready.remote()))
        self.started += 1

    # -------------------------------------------------------------- the loop
    def outcomes(self, items: Iterable[InputLine], *, stopping: Callable[[], bool] = lambda: False
                 ) -> Iterator[LineOutcome]:
        """Each line's `LineOutcome` as it arrives (any order), at most once per line; ends when every
        line is done, or after `stopping()` once the lines in flight are done."""
        lines = _LineQueue(items, stopping)
        attempts: dict[int, int] = {}  # line -> times its worker died under it
        yielded: set[int] = set()
        while True:
            # a line sent again goes to an idle worker, alone, so that a line that kills its
            # worker cannot take the lines beside it down with it every time
            while (slot := self._free_slot(alone=bool(lines.retry))) is not None and (item := lines.next()) is not None:
                if item.error is not None:  # unreadable: recorded as it is, by the driver
                    yielded.add(item.line)
                    yield LineOutcome(item, error=item.error)
                    continue
                self._flight[slot.actor.answer.remote(item)] = (slot, item)
                slot.lines, slot.alone = slot.lines + 1, item.line in attempts
            starting = [slot.starting for slot in self._slots if slot.starting is not None and not slot.dead]
            if not self._flight:
                if stopping() or lines.done:
                    return
                if not starting:
                    raise WorkersLost(f"every Ray worker is gone and no new one could start (last: {self._last_loss})",
                                      "check the Ray cluster (`ray status`), then rerun the same command to resume")
            for slot, item, outcome in self._arrivals(starting, attempts, lines):
                if item.line not in yielded:
                    yielded.add(item.line)
                    self.answered[slot.number] = self.answered.get(slot.number, 0) + 1
                    yield self._local(outcome, slot)

    def _arrivals(self, starting: list, attempts: dict[int, int],
                  lines: _LineQueue) -> list[tuple[_Slot, InputLine, LineOutcome]]:
        """Wait for a line's answer or a worker's start; returns the lines answered, by line. A
        line whose worker died is queued to be sent again, until it has killed `MAX_ATTEMPTS`."""
        refs = list(self._flight) + starting
        self.ray.wait(refs, num_returns=1)
        done, _ = self.ray.wait(refs, num_returns=len(refs), timeout=0)
        done_set = set(done)
        for slot in [slot for slot in self._slots if slot.starting in done_set]:
            self._started_or_not(slot)
        arrived = []
        for ref in sorted((ref for ref in done if ref in self._flight), key=lambda ref: self._flight[ref][1].line):
            slot, item = self._flight.pop(ref)
            slot.lines, slot.alone = slot.lines - 1, False
            try:
                outcome = self.ray.get(ref)
            except self.ray.exceptions.RayActorError as err:
                self._lose(slot, err)
                attempts[item.line] = attempts.get(item.line, 0) + 1
                if attempts[item.line] < MAX_ATTEMPTS:
                    lines.again(item)
                    self.resent += 1
                    continue
                outcome = LineOutcome(item, error=WorkerDied(
                    f"the Ray worker answering this line died {MAX_ATTEMPTS} times (last: {self._last_loss})"))
            except Exception as err:  # noqa: BLE001 - a Ray error about this line only: its failure
                outcome = LineOutcome(item, error=err)
            arrived.append((slot, item, outcome))
        return arrived

    def _free_slot(self, *, alone: bool = False) -> _Slot | None:
        """The ready worker with the fewest lines in flight, if it has room (alone: if it is idle)."""
        ready = [slot for slot in self._slots if not slot.dead and slot.starting is None and not slot.alone]
        slot = min(ready, key=lambda s: s.lines, default=None)
        room = 1 if alone else self.lines_per_worker
        return slot if slot is not None and slot.lines < room else None

    def _started_or_not(self, slot: _Slot) -> None:
        ref, slot.starting = slot.starting, None
        try:
            info = self.ray.get(ref)
        except self.ray.exceptions.RayActorError as err:
            info = {"lost": err}
        error = info.get("error")
        if error is not None and error.user:
            raise error.rebuild()  # the model cannot load (not found, not supported): no worker could
        if error is not None or "lost" in info:
            self._failed_starts += 1
            self._lose(slot, info.get("lost") or f"{error.name}: {error.message}")
        else:
            self._failed_starts = 0

    def _lose(self, slot: _Slot, why) -> None:
        """A worker is gone: forget it (its lines come back from `ray.wait` as failures) and start
        another, unless workers keep dying before they answer anything."""
        if slot.dead:
            return
        slot.dead = True
        self.lost += 1
        self._last_loss = _describe(why)
        try:
            self.ray.kill(slot.actor, no_restart=True)
        except Exception:  # noqa: BLE001, S110 - already gone
            pass
        if self._failed_starts < MAX_FAILED_STARTS:
            self._start_worker()

    def _local(self, outcome: LineOutcome, slot: _Slot) -> LineOutcome:
        """The outcome with its error rebuilt; one error object stays one object (one crash)."""
        info = outcome.error
        if not isinstance(info, ErrorInfo):
            return outcome
        key = (id(slot), info.serial)
        known = self._errors.get(key)
        error = known[1] if known is not None and known[0] == info else info.rebuild()
        self._errors[key] = (info, error)
        if len(self._errors) > 64:
            del self._errors[next(iter(self._errors))]
        return replace(outcome, error=error)

    # -------------------------------------------------------------- cleanup
    def close(self) -> None:
        """Stop the workers, and Ray itself if this object started it."""
        for slot in self._slots:
            if not slot.dead:
                slot.dead = True
                try:
                    self.ray.kill(slot.actor, no_restart=True)
                except Exception:  # noqa: BLE001, S110 - already gone
                    pass
        self._flight.clear()
        if self._started:
            self._started = False
            self.ray.shutdown()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _describe(why) -> str:
    text = str(why).strip()
    first = text.splitlines()[0] if text else ""
    return f"{type(why).__name__}: {first}" if isinstance(why, BaseException) else first or "unknown"


def ray_outcomes(items: Iterable[InputLine], *, settings: BatchSettings, model: str | None = None,
                 precision: str | None = None, device: str | None = None, speculate=None, prepare: Callable | None = None,
                 address: str | None = None, workers: int = 2, lines_per_worker: int = LINES_PER_WORKER,
                 cpus_per_worker: int = 1, gpus_per_worker: float | None = None, forest_tokens: int = FOREST_TOKENS,
                 forest_branches: int = FOREST_BRANCHES, prefill_chunk: int = PREFILL_CHUNK,
                 stopping: Callable[[], bool] = lambda: False) -> Iterator[LineOutcome]:
    """Each line's `LineOutcome` from Ray workers, as lines finish, for `BatchJob.record` (see the
    module notes; the arguments are `RayWorkers`'). Connects and starts the workers on the first
    `next()`, and stops them (and a Ray it started) when exhausted or closed."""
    with RayWorkers(settings=settings, model=model, precision=precision, device=device, speculate=speculate,
                    prepare=prepare, address=address, workers=workers, lines_per_worker=lines_per_worker,
                    cpus_per_worker=cpus_per_worker, gpus_per_worker=gpus_per_worker, forest_tokens=forest_tokens,
                    forest_branches=forest_branches, prefill_chunk=prefill_chunk) as pool:
        yield from pool.outcomes(items, stopping=stopping)


__all__ = ["LINES_PER_WORKER", "MAX_ATTEMPTS", "MAX_FAILED_STARTS", "RayWorkers", "WorkerDied", "WorkersLost",
           "ray_outcomes"]
