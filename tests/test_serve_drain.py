"""Draining on SIGTERM has a deadline: `--drain-timeout` seconds after the signal, every request
still running or waiting is ended with the shutting-down error (a stream gets its error event,
then `data: [DONE]`; a plain request a 503 with Retry-After) and the server stops within a few
seconds, however many tokens the requests had left (`ForestRuntime.cancel_all`, done on the
engine thread). A negative drain timeout is refused before anything binds.

The model is the fault tests' tiny Llama that sleeps before each forward and never ends a
request early, so that every request outlives the deadline by far.
"""

from __future__ import annotations

import json
import math
import signal
import socket
import sys
import threading
import time

import httpx
import pytest
from serving import MODEL, Control, assert_error_shape, controlled_loader, running_server, wait_until

from multidecode.errors import InvalidArgument
from multidecode.runtime import ForestRuntime, Job, Limits, Overloaded
from multidecode.runtime.jobs import NOTHING
from multidecode.sampling_params import SamplingParams
from multidecode.serving.app import ServeState
from multidecode.serving.launch import SHUTDOWN_GRACE_S, ServerProcess, serve_until_stopped

BODY = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 240, "temperature": 0}
MARGIN_S = 3.0
"""How long after the drain deadline a server may take to end its requests and stop (the engine's
step in progress, the responses' last bytes, uvicorn's shutdown): well under SHUTDOWN_GRACE_S."""


def events_of(lines) -> list[str]:
    return [line[6:] for line in lines if line.startswith("data: ")]


def assert_ended_by_the_drain(events: list[str]) -> None:
    """A stream cut off by the drain deadline: some tokens, then the error event, then [DONE]."""
    assert events[-1] == "[DONE]", events[-3:]
    error = json.loads(events[-2])
    assert set(error) == {"error"}, error
    assert error["error"]["type"] == "server_overloaded" and "shutting down" in error["error"]["message"]
    tokens = [json.loads(e) for e in events[:-2]]
    assert tokens and all("choices" in t for t in tokens)
    assert all(c["finish_reason"] is None for t in tokens for c in t["choices"])  # cut off, not finished


def test_past_the_drain_deadline_running_requests_end_with_the_shutting_down_error(model_dir):
    control = Control()
    control.delay = 0.03  # 240 tokens: over 7 s, far past the 1 s deadline
    with running_server(controlled_loader(model_dir, control), drain_timeout=1.0) as running:
        forest, url = running.forest, running.url
        plain: dict = {}
        waiting = threading.Thread(target=lambda: plain.setdefault(
            "reply", httpx.post(url + "/v1/completions", json=BODY, timeout=30)))
        with httpx.stream("POST", url + "/v1/completions", json={**BODY, "stream": True}, timeout=30) as response:
            lines = response.iter_lines()
            events = events_of(next(lines) for _ in range(2))  # one token event, and its blank line
            waiting.start()
            wait_until(lambda: forest.busy >= 2, 10)
            assert forest.busy == 2
            signalled = time.monotonic()
            running.uvicorn.handle_exit(signal.SIGTERM, None)
            events += events_of(lines)
        ended = time.monotonic() - signalled
        waiting.join(10)
        assert_ended_by_the_drain(events)
        assert 1.0 <= ended < 1.0 + MARGIN_S, ended
        error = assert_error_shape(plain["reply"], 503, "server_overloaded")
        assert "shutting down" in error["message"] and int(plain["reply"].headers["retry-after"]) >= 1
        wait_until(lambda: running.uvicorn.should_exit, MARGIN_S)
        assert running.uvicorn.should_exit and not forest.busy and not forest.scheduler.works
        assert (forest.admission.held, forest.admission.jobs) == (NOTHING, 0)
        assert running.uvicorn.config.timeout_graceful_shutdown == SHUTDOWN_GRACE_S  # uvicorn's own backstop


def test_cancel_all_ends_running_and_waiting_jobs_on_the_engine_thread(model_dir):
    control = Control()
    control.delay = 0.02
    model, tokenizer = controlled_loader(model_dir, control)()
    forest = ForestRuntime(model, tokenizer, limits=Limits(max_running=1)).start()  # the second job waits
    try:
        outputs: list[list] = [[], []]
        for out in outputs:
            forest.submit(Job(prompts=[[5, 6, 7, 8]], max_new_tokens=200, sampling=[SamplingParams()],
                              sink=out.append))
        wait_until(lambda: any(item[0] == "token" for item in outputs[0]), 10)
        error = Overloaded.shutting_down()
        forest.cancel_all(error)
        wait_until(lambda: not forest.busy, 5)
        assert not forest.busy and not forest.scheduler.works
        assert [out[-1] for out in outputs] == [("error", error)] * 2
        assert not any(item[0] == "token" for item in outputs[1])  # it never started
        assert len(outputs[0]) < 100 and forest.counters.cancelled == 0  # cut off, and not a client that left
        assert (forest.admission.held, forest.admission.jobs) == (NOTHING, 0)
        control.delay = 0.0
        done: list = []
        forest.submit(Job(prompts=[[5, 6, 7, 8]], max_new_tokens=3, sampling=[SamplingParams()], sink=done.append))
        wait_until(lambda: not forest.busy, 10)
        assert done[-1][0] == "done" and done[-1][1].completion_tokens == 3  # it serves on
    finally:
        forest.stop()


@pytest.mark.parametrize("drain_timeout", [-1.0, -0.5, math.nan])
def test_a_negative_drain_timeout_is_refused_before_the_port_is_bound(drain_timeout):
    loaded = []
    with socket.socket() as taken:  # a port in use: binding it first would be another error
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(InvalidArgument) as caught:
            serve_until_stopped(ServeState(MODEL), lambda: loaded.append(1), port=taken.getsockname()[1],
                                drain_timeout=drain_timeout)
    assert "--drain-timeout" in caught.value.message and caught.value.hint and not loaded


DRAINING_SERVER = """
import functools, math, sys, time
from multidecode.models.loading import load_model_and_tokenizer
from multidecode.serving.app import ServeState
from multidecode.serving.launch import serve_until_stopped

def loader():
    model, tokenizer = load_model_and_tokenizer(sys.argv[1])
    forward = model.forward

    @functools.wraps(forward)
    def slow(*args, **kwargs):
        time.sleep(0.05)
        out = forward(*args, **kwargs)
        out.logits[..., 2] = -math.inf  # never its end-of-sequence token: every request runs to max_tokens
        return out

    model.forward = slow
    return model, tokenizer

serve_until_stopped(ServeState("tiny"), loader, port=int(sys.argv[2]), drain_timeout=float(sys.argv[3]),
                    log_level="warning")
"""


@pytest.mark.slow
@pytest.mark.parametrize("drain_timeout, signals, within", [(2.0, 1, 2.0 + MARGIN_S), (60.0, 2, MARGIN_S)],
                         ids=["one signal", "a second signal"])
def test_a_served_process_ends_its_streams_and_exits_when_signalled(model_dir, drain_timeout, signals, within):
    """The real thing: uvicorn's signal handler in a process of its own, a stream of 240 tokens
    (12 s at least) running when SIGTERM comes. One signal: the stream ends at the drain deadline.
    A second one, 0.3 s later, ends it at once, long before the deadline (uvicorn waited out its
    5 s graceful shutdown while the engine decoded on, and cut the stream without a word)."""
    command = [sys.executable, "-c", DRAINING_SERVER, str(model_dir), "{port}", str(drain_timeout)]
    with ServerProcess("drain", command, env={"OMP_NUM_THREADS": "1"}) as server:
        server.wait_ready(120)
        with httpx.stream("POST", server.url + "/v1/completions", json={**BODY, "stream": True},
                          timeout=30) as response:
            lines = response.iter_lines()
            events = events_of(next(lines) for _ in range(2))
            signalled = time.monotonic()
            for n in range(signals):
                time.sleep(0.3 * bool(n))
                server.process.send_signal(signal.SIGTERM)
            events += events_of(lines)
        assert_ended_by_the_drain(events)
        assert server.process.wait(within) == 0, server.log_tail()
        assert time.monotonic() - signalled < within
