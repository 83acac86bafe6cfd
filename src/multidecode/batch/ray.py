"""Batch jobs on Ray: the same job, its lines answered by workers on one machine or a cluster.

Ray (https://docs.ray.io) is an optional extra (``pip install 'multidecode[ray]'``); it is
imported only when a job runs on it. Ray places the workers, moves the lines and the outcomes,
and tells when a worker dies; this module only decides which line goes where.

Terms: the *driver* is the process that holds the job (`BatchJob`: the output file, its lock,
resuming, the settings fingerprint); a *worker* is a Ray actor that holds a loaded model and a
`ForestAnswerer`; a line is *in flight* from its sending to a worker until its outcome arrives.

How it works: `ray_outcomes` connects to Ray (a new local Ray, or a cluster's address), starts
`workers` actors, each of which loads the model itself (the driver never loads it), and keeps up
to `lines_per_worker` lines in flight on each. A worker answers its lines concurrently (one Ray
thread per line, plus one for `ready`), so they merge into one forest on its engine thread, as
`BatchJob.run` merges them locally. Lines are pulled from `items` lazily, only when a worker has
room; each outcome is yielded as it arrives, and `BatchJob.record` appends it to the output::

    with open_batch("in.jsonl", "out.jsonl", settings) as job:
        for result in job.record(ray_outcomes(job.pending_items(), settings=settings, model=name,
                                              workers=2, stopping=lambda: job.stopping)):
            ...

What is guaranteed (on top of the job's own guarantees: one record per id, written as it
arrives, resumable from the output alone, changed settings refused):

- a worker that dies (its process killed, its node lost) has its lines in flight sent again, to
  another worker or to a replacement that Ray starts wherever there is room. A line sent again
  goes alone to an idle worker, and a line whose worker died `MAX_ATTEMPTS` times is recorded as
  failed (`WorkerDied`): a line that crashes its worker cannot crash them all in turn, nor take
  the lines that shared its worker down with it;
- no line is yielded twice: a line is yielded only from the outcome of its latest sending, and
  only once (and `BatchJob.record` drops a second outcome for a line as a second guard);
- errors come back with their class name, message and hint (`MultiDecodeError`s as themselves,
  anything else as a stand-in of the same class name), and one failed step that took several
  lines with it is still one error, so it counts once toward the job's crash limit;
- a problem with the job as a whole fails fast: Ray missing (`MissingExtra`), an address where no
  Ray answers (`RayUnavailable`, within `CONNECT_TIMEOUT_S`), a model that no worker can load
  (its own error, such as `ModelNotFound`), every worker gone and none can start (`WorkersLost`).

Answers are the local job's: each worker runs the same merged forest (`merged`), whose answers do
not depend on which lines share it. Only the order of the records differs (the order they finish).
"""

from __future__ import annotations

import heapq
import importlib
import logging
import os
import signal
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Self
from urllib.parse import urlsplit

from ..errors import InvalidArgument, MissingExtra, MultiDecodeError, check_positive
from .job import BatchAborted
from .lines import InputLine
from .merged import ForestAnswerer, LineOutcome
from .settings import BatchSettings

LINES_PER_WORKER = 4
"""Lines in flight per worker, merged into its forest (about the local default forest budget)."""
MAX_ATTEMPTS = 3
"""Sendings of one line whose worker died before the line is recorded as failed."""
MAX_FAILED_STARTS = 3
"""Workers in a row that die before answering anything: then no more are started."""
CONNECT_TIMEOUT_S = 5.0
"""How long an address may take to accept a connection before it counts as unreachable."""
INSTALL_HINT = "pip install 'multidecode[ray]'"
NO_RAY_HINT = ("start one with `ray start --head` on the head node (and `ray start --address=HEAD:6379` on the "
               "others), then pass HEAD:6379, or `--ray auto` on a node of the cluster; `--ray` alone starts a "
               "local Ray on this machine")


class RayUnavailable(MultiDecodeError):
    """No Ray cluster answers at the given address."""


class WorkersLost(BatchAborted):
    """Every Ray worker is gone and no new one could start: the job stopped (rerun to resume)."""


class WorkerDied(RuntimeError):
    """Recorded for a line whose worker died `MAX_ATTEMPTS` times while answering it."""


def import_ray():
    """The `ray` module, or `MissingExtra` saying how to install it."""
    try:
        import ray
    except ImportError as err:
        raise MissingExtra("batch jobs on Ray need Ray, which is not installed", INSTALL_HINT) from err
    return ray


# ---------------------------------------------------------------------- errors across processes
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


# ---------------------------------------------------------------------- the worker (a Ray actor)
class Worker:
    """What each Ray actor runs: the model, loaded once, and a `ForestAnswerer` whose forest
    every concurrent `answer` call joins. Never raises: a failed load is reported by `ready`."""

    def __init__(self, model: str | None, precision: str | None, device: str | None, settings: BatchSettings,
                 speculate=None, prepare: Callable | None = None, threads: int | None = None) -> None:
        self.answerer: ForestAnswerer | None = None
        self.failed: ErrorInfo | None = None
        self._lock = threading.Lock()
        self._recent: list[tuple[BaseException, int]] = []
        self._serial = 0
        try:
            if threads:
                import torch

                torch.set_num_threads(threads)
            from ..api import load

            decoder = load(model, precision=precision, device=device)
            if prepare is not None:
                speculate = prepare(decoder, speculate)
            self.answerer = ForestAnswerer(decoder, settings, speculate=speculate)
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


# ---------------------------------------------------------------------- connecting
def connect(address: str | None) -> bool:
    """Connect this process to Ray; returns whether it did (then `ray.shutdown` undoes it).

    address: None or "local" starts a new Ray on this machine; "auto" joins the cluster that
    RAY_ADDRESS names or that `ray start` started on this machine; HOST:PORT (or ray://HOST:PORT)
    joins that cluster. An address is checked first (it must accept a connection within
    `CONNECT_TIMEOUT_S`); then a process already connected (`ray.init` called before) stays as it is.
    """
    ray = import_ray()
    local = address in (None, "local")
    if not local:
        host, port = _bootstrap(address)
        try:
            socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S).close()
        except OSError as err:
            reason = "it did not answer in time" if isinstance(err, TimeoutError) else err.strerror or str(err)
            raise RayUnavailable(f"no Ray cluster answers at {address} ({host}:{port}: {reason})",
                                 NO_RAY_HINT) from err
    if ray.is_initialized():
        return False
    # ray.init sets its own SIGTERM handler (exit at once); the caller's (the command's: finish
    # the lines in flight, then stop) is put back
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    try:
        ray.init(address="local" if local else address, include_dashboard=False, logging_level=logging.WARNING)
    except ConnectionError as err:
        raise RayUnavailable(f"cannot join the Ray cluster at {address}: {err}", NO_RAY_HINT) from err
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return True


def _bootstrap(address: str) -> tuple[str, int]:
    """The host and port `ray.init(address)` will connect to, checked before it tries (it would
    wait for minutes on an address where nothing listens)."""
    if address.startswith("ray://"):
        try:
            parts = urlsplit(address)
            host, port = parts.hostname, parts.port or 10001
        except ValueError:  # a port that is not a number
            host = None
        if not host:
            raise InvalidArgument(f"{address!r} is not a Ray address", "use ray://HOST:PORT")
        return host, port
    try:
        from ray._private.services import canonicalize_bootstrap_address
    except ImportError:  # a private helper: without it, only HOST:PORT is checked
        canonicalize_bootstrap_address = None
    try:
        resolved = canonicalize_bootstrap_address(address) if canonicalize_bootstrap_address else address
    except ConnectionError as err:  # "auto" and no cluster found
        raise RayUnavailable(f"no Ray cluster found for --ray {address}", NO_RAY_HINT) from err
    except ValueError as err:
        raise InvalidArgument(f"{address!r} is not a Ray address",
                              "use HOST:PORT (the head's GCS port, 6379 by default), ray://HOST:PORT or auto") from err
    host, _, port = (resolved or "").rpartition(":")
    if not host or not port.isdigit():
        raise InvalidArgument(f"{address!r} is not a Ray address",
                              "use HOST:PORT (the head's GCS port, 6379 by default), ray://HOST:PORT or auto")
    return host.strip("[]"), int(port)


# ---------------------------------------------------------------------- the driver
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
    """

    def __init__(self, *, settings: BatchSettings, model: str | None = None, precision: str | None = None,
                 device: str | None = None, speculate=None, prepare: Callable | None = None,
                 address: str | None = None, workers: int = 2, lines_per_worker: int = LINES_PER_WORKER,
                 cpus_per_worker: int = 1, gpus_per_worker: float | None = None) -> None:
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
            self._arguments = (model, precision, device, settings, speculate, prepare, cpus_per_worker)
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
                 cpus_per_worker: int = 1, gpus_per_worker: float | None = None,
                 stopping: Callable[[], bool] = lambda: False) -> Iterator[LineOutcome]:
    """Each line's `LineOutcome` from Ray workers, as lines finish, for `BatchJob.record` (see the
    module notes; the arguments are `RayWorkers`'). Connects and starts the workers on the first
    `next()`, and stops them (and a Ray it started) when exhausted or closed."""
    with RayWorkers(settings=settings, model=model, precision=precision, device=device, speculate=speculate,
                    prepare=prepare, address=address, workers=workers, lines_per_worker=lines_per_worker,
                    cpus_per_worker=cpus_per_worker, gpus_per_worker=gpus_per_worker) as pool:
        yield from pool.outcomes(items, stopping=stopping)


__all__ = ["CONNECT_TIMEOUT_S", "LINES_PER_WORKER", "MAX_ATTEMPTS", "ErrorInfo", "RayUnavailable", "RayWorkers",
           "Worker", "WorkerDied", "WorkersLost", "connect", "import_ray", "ray_outcomes"]
