"""Batch jobs on Ray (`multidecode.batch.ray`), on a local Ray started once per session.

Everything here runs on one machine: the session's Ray has 2 CPUs, a worker reserves 1 and runs
torch on 1 thread, so the reference (the local job) runs on 1 thread too and the answers must
match token for token. The tests that start Ray are marked `ray` and `slow` (the fast tier skips
them) and share an xdist group; without Ray installed they skip. The tests of a missing Ray, of
the error stand-ins and of the driver's loop on a stand-in `ray` module (`FakeRay`: a line that
kills its worker, workers that cannot start) need no Ray at all and are fast.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from batch_files import by_id, documents, one_thread, records, results, write_lines
from click.testing import CliRunner

import multidecode
from multidecode.batch import BatchSettings, InputLine, open_batch, run_batch
from multidecode.batch.merged import LineOutcome
from multidecode.batch.ray import ErrorInfo, RayUnavailable, RayWorkers, Worker, WorkersLost, ray_outcomes
from multidecode.cli import main
from multidecode.errors import InvalidArgument, InvalidInput, MissingExtra, ModelNotFound

MULTIDECODE = Path(sys.executable).with_name("multidecode")
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}


def on_ray(test):
    """A test on the session's local Ray: marked ray and slow, in the xdist group that holds it."""
    for mark in (pytest.mark.usefixtures("ray_session"), pytest.mark.ray, pytest.mark.slow,
                 pytest.mark.xdist_group("ray")):
        test = mark(test)
    return test


@pytest.fixture(scope="session")
def ray_session():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    yield ray
    ray.shutdown()


def settings_for(model_dir, max_new_tokens: int) -> BatchSettings:
    return BatchSettings(max_new_tokens=max_new_tokens, model=str(Path(model_dir).resolve()), precision="float32")


def reference(model_dir, source: Path, out: Path, max_new_tokens: int) -> dict:
    """The local job's records (merged forests in this process, on 1 thread), minus timings."""
    with one_thread():
        run_batch(multidecode.load(str(model_dir)), source, out, max_new_tokens=max_new_tokens,
                  model=str(Path(model_dir).resolve()))
    return results(records(out))


def some_lines(tmp_path: Path, n: int) -> Path:
    rows = documents(n)
    rows.insert(3, {"id": "blank", "document": " ", "questions": ["why?"]})  # fails on the driver
    rows.insert(6, '{"id": "cut", "document": "no end')  # unreadable: its line number is its id
    rows.append({"id": "too-long", "document": "routers and cables " * 200, "questions": ["why?"]})  # fails in a worker
    return write_lines(tmp_path / "in.jsonl", rows)


# ---------------------------------------------------------------------- on a local Ray
@on_ray
def test_two_workers_give_the_local_jobs_records(model_dir, tmp_path):
    source = some_lines(tmp_path, 10)
    expected = reference(model_dir, source, tmp_path / "local.jsonl", 6)
    settings = settings_for(model_dir, 6)
    with open_batch(source, tmp_path / "ray.jsonl", settings) as job, \
            RayWorkers(settings=settings, model=str(model_dir), workers=2, lines_per_worker=2) as pool:
        pool.wait_ready()  # else the first worker up may answer every line before the other has loaded
        results_ = list(job.record(pool.outcomes(job.pending_items(), stopping=lambda: job.stopping)))
        summary = job.summary()
        used = pool.answered
    assert results(records(tmp_path / "ray.jsonl")) == expected
    assert (summary.done, summary.failed, summary.remaining) == (13, 3, 0)
    assert [len(r.answers) for r in results_ if r.ok] == [2] * 10  # the answers themselves came back too
    assert len(used) == 2 and min(used.values()) >= 1, used  # both workers answered lines
    failed = by_id(records(tmp_path / "ray.jsonl"))
    assert failed["blank"]["error"] == {"type": "InvalidInput", "message": "the document is empty",
                                        "hint": "pass a document with some text in it"}
    assert failed[7]["error"]["type"] == "InvalidInput" and "not valid JSON" in failed[7]["error"]["message"]
    assert failed["too-long"]["error"]["type"] == "PromptTooLong" and failed["too-long"]["error"]["hint"]


def holding_the_first_worker(holder: Path):
    """A `prepare` for `RayWorkers`: the first worker to load its model (the one that creates
    `holder`) holds every line it is sent until it is killed (5 minutes at most, so that nothing
    hangs), as a stuck worker would; the others, and any started later, answer at once."""
    def prepare(decoder, speculate):  # runs in each worker once its model is loaded
        import os
        import time

        from multidecode.strategies import ask

        try:
            os.close(os.open(holder, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return speculate
        tokenize = ask.tokenize_prompt

        def held(tokenizer, text):
            time.sleep(300)
            return tokenize(tokenizer, text)

        ask.tokenize_prompt = held
        return speculate

    return prepare


@on_ray
def test_a_killed_worker_loses_nothing_and_duplicates_nothing(model_dir, tmp_path, ray_session):
    """The first worker loaded holds its lines until it is killed, so that it has lines in flight
    when the other worker's first line is done, however fast or slow the machine."""
    source = write_lines(tmp_path / "in.jsonl", documents(12))
    expected = reference(model_dir, source, tmp_path / "local.jsonl", 16)
    settings = settings_for(model_dir, 16)
    with open_batch(source, tmp_path / "ray.jsonl", settings) as job, \
            RayWorkers(settings=settings, model=str(model_dir), workers=2, lines_per_worker=2,
                       prepare=holding_the_first_worker(tmp_path / "holder")) as pool:
        pool.wait_ready()  # both workers get 2 lines at once: the holder's stay in flight until it is killed
        killed = None
        for _ in job.record(pool.outcomes(job.pending_items(), stopping=lambda: job.stopping)):
            if killed is None:  # one line is done: kill the worker with the most lines in flight
                killed, lines = max(pool.lines_in_flight, key=lambda pair: pair[1])
                assert lines >= 1
                ray_session.kill(killed)
        lost, resent, started = pool.lost, pool.resent, pool.started
    assert (lost, started) == (1, 3)  # the dead worker was replaced
    assert resent >= 1  # its lines in flight were sent again
    assert results(records(tmp_path / "ray.jsonl")) == expected  # every line once, the same answers


def interrupt(command: list[str], out: Path, after: int, signum: int, log: Path) -> tuple[int, str]:
    """Run the command and send it `signum` once `out` holds `after` records; its exit status and
    its stdout. Ray's processes that outlive a killed driver are ended."""
    with open(log, "w") as stdout:
        driver = subprocess.Popen(command, stdout=stdout, stderr=subprocess.DEVNULL, env=ONE_THREAD,
                                  start_new_session=True)
        try:
            while driver.poll() is None and (out.read_bytes().count(b"\n") if out.exists() else 0) < after:
                time.sleep(0.05)
            driver.send_signal(signum)
            driver.wait(timeout=120)
        finally:
            if signum == signal.SIGKILL:
                time.sleep(2)
                try:  # Ray's agents outlive a killed driver: end what this test started
                    os.killpg(driver.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    return driver.returncode, log.read_text()


@on_ray
def test_a_stopped_then_killed_command_resumes_and_completes(model_dir, tmp_path):
    """`multidecode batch --ray --workers 2` (its own local Ray) is stopped with SIGTERM once 2
    lines are written (it finishes the lines in flight and exits 143), run again and killed with
    SIGKILL 2 lines later; the third run completes the job: one record per id, the local job's
    answers."""
    source = write_lines(tmp_path / "in.jsonl", documents(24))
    expected = reference(model_dir, source, tmp_path / "local.jsonl", 16)
    out = tmp_path / "ray.jsonl"
    command = [str(MULTIDECODE), "batch", str(source), "--output", str(out), "--model", str(model_dir),
               "--max-new-tokens", "16", "--ray", "--workers", "2", "--json"]

    status, printed = interrupt(command, out, 2, signal.SIGTERM, tmp_path / "first.log")
    assert status == 128 + signal.SIGTERM, printed
    summary = json.loads(printed.splitlines()[-1])
    assert summary["stopped"] and 2 <= summary["done"] < 24 and summary["remaining"] == 24 - summary["done"]
    assert len(by_id(records(out))) == summary["done"]

    status, _ = interrupt(command, out, summary["done"] + 2, signal.SIGKILL, tmp_path / "second.log")
    assert status == -signal.SIGKILL
    done = out.read_bytes().count(b"\n")  # a record cut short by the kill is repaired by the next run
    assert summary["done"] + 2 <= done < 24, "the command was not killed mid-run"

    finished = subprocess.run(command, capture_output=True, text=True, env=ONE_THREAD, timeout=300, check=False,
                              start_new_session=True)
    assert finished.returncode == 0, finished.stderr[-2000:]
    summary = json.loads(finished.stdout.splitlines()[-1])
    assert summary["complete"] and summary["skipped"] == done and summary["done"] == 24 - done
    assert results(records(out)) == expected


@on_ray
def test_a_line_that_kills_its_worker_is_recorded_as_failed(model_dir, tmp_path):
    """A line whose worker dies every time (here: the process exits on its document) is sent
    MAX_ATTEMPTS times, each time to a new worker, then recorded as failed; the others finish,
    the one that was in flight beside it too (sent again, it goes alone)."""
    from multidecode.batch.ray import MAX_ATTEMPTS

    def poison(decoder, speculate):  # runs in each worker once its model is loaded
        import os

        from multidecode.strategies import ask

        tokenize = ask.tokenize_prompt
        ask.tokenize_prompt = lambda tokenizer, text: os._exit(1) if "POISON" in text else tokenize(tokenizer, text)
        return speculate

    rows = [{"id": "poison", "document": "POISON", "questions": ["why?"]}, *documents(6)]  # line 2 is beside it
    source = write_lines(tmp_path / "in.jsonl", rows)
    expected = reference(model_dir, write_lines(tmp_path / "good.jsonl", documents(6)), tmp_path / "local.jsonl", 6)
    settings = settings_for(model_dir, 6)
    with open_batch(source, tmp_path / "ray.jsonl", settings) as job, \
            RayWorkers(settings=settings, model=str(model_dir), prepare=poison, workers=1, lines_per_worker=2) as pool:
        list(job.record(pool.outcomes(job.pending_items())))
        assert pool.lost == MAX_ATTEMPTS and pool.resent == MAX_ATTEMPTS  # the poison twice, its neighbour once
    got = by_id(records(tmp_path / "ray.jsonl"))
    error = got.pop("poison")["error"]
    assert error["type"] == "WorkerDied" and f"died {MAX_ATTEMPTS} times" in error["message"] and error["hint"]
    assert results(list(got.values())) == {k: {**v, "line": v["line"] + 1} for k, v in expected.items()}


@on_ray
def test_a_model_no_worker_can_load_is_the_jobs_error(tmp_path):
    source = write_lines(tmp_path / "in.jsonl", documents(2))
    settings = BatchSettings(max_new_tokens=4, model="missing")
    started = time.perf_counter()
    with open_batch(source, tmp_path / "out.jsonl", settings) as job, pytest.raises(ModelNotFound) as caught:
        list(job.record(ray_outcomes(job.pending_items(), settings=settings, model=str(tmp_path / "no-model"))))
    assert caught.value.hint and time.perf_counter() - started < 120
    assert not (tmp_path / "out.jsonl").exists()  # no record written: the job leaves no output behind


# ---------------------------------------------------------------------- without a Ray running
def test_without_ray_installed_it_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as if it were not installed
    with pytest.raises(MissingExtra) as caught:
        next(ray_outcomes(iter([]), settings=BatchSettings(), workers=2))
    assert "Ray" in caught.value.message and caught.value.hint == "pip install 'multidecode[ray]'"

    source = write_lines(tmp_path / "in.jsonl", documents(1))
    result = CliRunner().invoke(main, ["batch", str(source), "-o", str(tmp_path / "out.jsonl"), "--ray"])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert "Ray, which is not installed" in result.stderr and "pip install 'multidecode[ray]'" in result.stderr
    assert not (tmp_path / "out.jsonl").exists()  # refused before the job is opened


@pytest.mark.ray
def test_an_unreachable_address_fails_fast_with_a_clear_message(tmp_path, monkeypatch):
    """Fast without a clock: Ray's own connect retries for minutes, so the refusal must come from
    the bounded probe (`CONNECT_TIMEOUT_S`) before `ray.init` is ever called. (A wall-time bound
    here failed on a loaded machine: importing Ray alone took 12 s.)"""
    ray = pytest.importorskip("ray")

    def never(*args, **kwargs):
        raise AssertionError("ray.init was called: the address was not probed first")

    monkeypatch.setattr(ray, "init", never)
    source = write_lines(tmp_path / "in.jsonl", documents(1))
    result = CliRunner().invoke(main, ["batch", str(source), "-o", str(tmp_path / "out.jsonl"), "--ray", "127.0.0.1:1",
                                       "--workers", "3"])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert "no Ray cluster answers at 127.0.0.1:1" in result.stderr and "ray start --head" in result.stderr
    assert not (tmp_path / "out.jsonl").exists()  # no empty output left
    for address, error, needle in [("127.0.0.1:1", RayUnavailable, "no Ray cluster answers at 127.0.0.1:1"),
                                   ("ray://127.0.0.1:1", RayUnavailable, "no Ray cluster answers"),
                                   ("nonsense", InvalidArgument, "is not a Ray address"),
                                   ("host:port", InvalidArgument, "is not a Ray address")]:
        with pytest.raises(error) as caught:
            next(ray_outcomes(iter([]), settings=BatchSettings(), address=address))
        assert needle in caught.value.message and caught.value.hint, address


def test_errors_cross_processes_with_their_type_message_and_hint():
    class Odd(Exception):  # an error that does not pickle (a required argument, a local class)
        def __init__(self, code, text):
            super().__init__(f"{text} ({code})")

    odd = Odd(7, "the device fell over")
    infos = [pickle.loads(pickle.dumps(ErrorInfo.of(error, serial)))
             for serial, error in enumerate([InvalidInput("the document is empty", "write some"), odd, odd])]
    user, first, second = (info.rebuild() for info in infos)
    assert type(user) is InvalidInput and (user.message, user.hint) == ("the document is empty", "write some")
    assert type(first).__name__ == "Odd" and str(first) == "the device fell over (7)"
    assert not isinstance(first, multidecode.MultiDecodeError)  # it counts toward the crash limit
    assert type(first) is type(second)  # one stand-in class per original class


# ---------------------------------------------------------------------- the driver's loop on a stand-in Ray
class FakeRay:
    """Just enough of `ray` for `RayWorkers`, deterministic: an actor answers the calls queued on
    it when the driver waits, all together (one merged forest), and a line whose document is
    "POISON" kills its actor, and so every line queued beside it, as a crashing process would."""

    class RayActorError(Exception):
        pass

    def __init__(self, start_error: BaseException | None = None):
        self.start_error = start_error  # what every worker's model load fails with, if anything
        self.exceptions = self
        self.queued = []  # (actor, ref, call)
        self.values = {}
        self.arguments = []  # what each actor was started with

    def is_initialized(self):
        return True  # RayWorkers then starts no Ray of its own

    def cluster_resources(self):
        return {"CPU": 2}

    def remote(self, **options):
        ray = self

        class Actor:
            def __init__(self, *args):
                ray.arguments.append(args)
                self.dead = False
                self.ready = SimpleNamespace(remote=lambda: ray.call(self, "ready", None))
                self.answer = SimpleNamespace(remote=lambda item: ray.call(self, "answer", item))

        return lambda worker_class: SimpleNamespace(remote=Actor)

    def call(self, actor, method, item):
        ref = object()
        self.queued.append((actor, ref, method, item))
        return ref

    def kill(self, actor, no_restart=True):
        actor.dead = True

    def wait(self, refs, num_returns=1, timeout=None):
        for actor in {actor for actor, *_ in self.queued}:
            calls = [(ref, method, item) for a, ref, method, item in self.queued if a is actor]
            if any(item is not None and item.document == "POISON" for _, _, item in calls):
                actor.dead = True
            for ref, method, item in calls:
                ready = {} if self.start_error is None else {"error": ErrorInfo.of(self.start_error, 1)}
                self.values[ref] = (self.RayActorError("died") if actor.dead
                                    else ready if method == "ready" else LineOutcome(item))
        self.queued.clear()
        return [ref for ref in refs if ref in self.values], [ref for ref in refs if ref not in self.values]

    def get(self, ref):
        value = self.values.pop(ref)
        if isinstance(value, Exception):
            raise value
        return value


def test_a_line_sent_again_goes_alone_so_its_neighbours_survive_a_poison_line(monkeypatch):
    """One worker, 2 lines at a time: the poison and line 2 die together; sent again, each goes
    alone, so only the poison is recorded as failed, after MAX_ATTEMPTS deaths."""
    from multidecode.batch.ray import MAX_ATTEMPTS, WorkerDied

    fake = FakeRay()
    monkeypatch.setitem(sys.modules, "ray", fake)
    lines = [InputLine(1, "poison", "POISON", ("why?",))] + [InputLine(n, f"doc-{n}", "text", ("why?",))
                                                           for n in range(2, 6)]
    with RayWorkers(settings=BatchSettings(), workers=1, lines_per_worker=2) as pool:
        outcomes = {outcome.item.line: outcome for outcome in pool.outcomes(lines)}
        assert (pool.lost, pool.resent, pool.started) == (MAX_ATTEMPTS, MAX_ATTEMPTS, MAX_ATTEMPTS + 1)
    assert sorted(outcomes) == [1, 2, 3, 4, 5]
    assert isinstance(outcomes[1].error, WorkerDied)
    assert all(outcomes[n].error is None for n in range(2, 6))


def test_workers_that_cannot_start_stop_the_job(monkeypatch):
    """Workers whose model fails to load for a reason that is not the job's (a broken device):
    MAX_FAILED_STARTS in a row, then no more are started, and the job stops with WorkersLost."""
    from multidecode.batch.ray import MAX_FAILED_STARTS

    monkeypatch.setitem(sys.modules, "ray", FakeRay(start_error=RuntimeError("no device here")))
    lines = [InputLine(n, n, "text", ("why?",)) for n in range(1, 4)]
    with RayWorkers(settings=BatchSettings(), workers=2) as pool, pytest.raises(WorkersLost) as caught:
        list(pool.outcomes(lines))
    assert "RuntimeError: no device here" in caught.value.message and "rerun" in caught.value.hint
    assert pool.lost == pool.started == MAX_FAILED_STARTS + 1  # the last failure finds no worker left


def test_the_forest_budget_reaches_every_worker(monkeypatch, model_dir):
    """--forest-tokens, --forest-branches and --prefill-chunk were left out of what a Ray worker
    was started with: each ran the default forest, silently."""
    fake = FakeRay()
    monkeypatch.setitem(sys.modules, "ray", fake)
    budget = {"forest_tokens": 0, "forest_branches": 3, "prefill_chunk": 16}
    with RayWorkers(settings=BatchSettings(), workers=2, **budget):
        assert [args[-1] for args in fake.arguments] == [budget, budget]
    worker = Worker(str(model_dir), None, "cpu", BatchSettings(), forest_budget=budget)
    assert worker.failed is None, worker.failed
    limits = worker.answerer.runtime.limits
    assert (limits.max_live_tokens, limits.max_branches, limits.prefill_chunk) == (0, 3, 16)
    worker.answerer.close()
