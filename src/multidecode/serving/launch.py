"""Starting the server: the listening socket, the model loading behind it, and draining on SIGTERM.

`serve_until_stopped` is what `multidecode serve` (and the serve benchmark, through that command)
calls: it binds the address first, so that a port out of range, in use or not this machine's is a
clear error before anything loads; then the model loads in the background while /health answers 503, and
uvicorn serves until a signal. The first SIGTERM (or Ctrl-C) drains: new requests get 503 while
running ones have up to `drain_timeout` seconds to finish; those still running or waiting then are
ended with the shutting-down error (a stream gets its error event and `data: [DONE]`, a plain
request a 503), and the process exits within a few seconds (`SHUTDOWN_GRACE_S`, uvicorn's
`timeout_graceful_shutdown` too, a backstop for a client that does not read its last bytes). A
second signal exits at once.

`ServerProcess` starts a server command (this one, or `transformers serve`) in a subprocess on a
free loopback port, waits until it answers and reads its metrics: the serve benchmark and the tests
drive it so.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Self

import uvicorn

from ..errors import InvalidArgument, MultiDecodeError
from ..runtime import ForestRuntime, Limits, Overloaded
from .app import ServeState, create_app

log = logging.getLogger("multidecode.serving")

SHUTDOWN_GRACE_S = 5.0
"""Past the drain deadline, how long the requests ended then have to send their last words (an
error event, a 503), and uvicorn's connections to close, before the server stops regardless."""
ENDING_S = 1.0
"""After a second signal, how long the requests it ended have to send their error event before the
server exits, open connections or not."""


class DrainingServer(uvicorn.Server):
    """uvicorn's server with draining on SIGTERM (or Ctrl-C): new requests get 503 while running
    ones have up to `drain_timeout` seconds to finish, then are ended (see the module notes); a
    second signal exits at once. A config without `timeout_graceful_shutdown` gets
    `SHUTDOWN_GRACE_S`: uvicorn would otherwise wait for every connection however long it lasts."""

    def __init__(self, config: uvicorn.Config, state: ServeState, *, drain_timeout: float = 30.0) -> None:
        if config.timeout_graceful_shutdown is None:
            config.timeout_graceful_shutdown = SHUTDOWN_GRACE_S
        super().__init__(config)
        self.serve_state, self.drain_timeout = state, drain_timeout

    def handle_exit(self, sig, frame) -> None:
        forest = self.serve_state.runtime
        if forest is not None and (forest.draining or self.should_exit) and not self.force_exit:
            threading.Thread(target=self._exit_now, args=(forest,), daemon=True).start()  # a second signal
            return
        if forest is None or forest.draining or self.should_exit:
            super().handle_exit(sig, frame)
            return
        forest.drain()
        log.info("draining: %d running request(s), up to %.0f s", forest.busy, self.drain_timeout)
        threading.Thread(target=self._exit_when_idle, args=(forest,), daemon=True).start()

    def _exit_when_idle(self, forest: ForestRuntime) -> None:
        """Exit once nothing runs, or at the drain deadline: what still runs then is ended (setting
        `should_exit` alone would leave uvicorn waiting for the open streams, and the engine
        decoding them to their last token), and given `SHUTDOWN_GRACE_S` to say so to its client."""
        if not _idle_within(forest, self.drain_timeout):
            log.warning("drain timeout: ending %d request(s) still running or waiting", forest.busy)
            _end_running(forest, SHUTDOWN_GRACE_S)
        self.should_exit = True

    def _exit_now(self, forest: ForestRuntime) -> None:
        """A second signal: what runs is ended at once, given `ENDING_S` to say so to its client, and
        uvicorn exits without waiting for open connections (for SIGTERM it would wait out
        `timeout_graceful_shutdown`, the engine decoding all the while)."""
        _end_running(forest, ENDING_S)
        self.should_exit = self.force_exit = True


def _end_running(forest: ForestRuntime, seconds: float) -> None:
    """End every running or waiting job with the shutting-down error, and give them up to `seconds`
    to say so to their clients."""
    forest.cancel_all(Overloaded.shutting_down("the server", "retry against another replica"))
    _idle_within(forest, seconds)


def _idle_within(forest: ForestRuntime, seconds: float) -> bool:
    """Wait until `forest` runs no job, at most `seconds`; whether it is idle."""
    deadline = time.monotonic() + seconds
    while forest.busy and time.monotonic() < deadline:
        time.sleep(0.05)
    return not forest.busy


def check_drain_timeout(drain_timeout: float) -> None:
    """Refuse a drain timeout that is negative or not a number (infinity: wait for every request)."""
    if not drain_timeout >= 0:
        raise InvalidArgument(f"--drain-timeout must be 0 or more seconds, got {drain_timeout:g}",
                              "pass how long running requests may go on after SIGTERM, such as 30 (0: end them at once)")


def bind(host: str, port: int) -> socket.socket:
    """A socket listening on `host`:`port` (0: any free port), or `InvalidArgument` saying why not."""
    if not 0 <= port <= 65535:
        raise InvalidArgument(f"--port must be from 0 to 65535, got {port}", "pass a port such as 8000 (0 picks a free one)")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as err:
        raise InvalidArgument(f"cannot listen on {host}: {err.strerror}",
                              "pass --host an address of this machine, such as 127.0.0.1 or 0.0.0.0") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as err:
        sock.close()
        busy = err.errno in (98, 48, 10048)  # EADDRINUSE on Linux, macOS, Windows
        raise InvalidArgument(
            f"cannot listen on {host}:{port}: {err.strerror or err}",
            "another program is using that port: stop it, or pick another with --port" if busy
            else "pass --host an address of this machine (127.0.0.1, 0.0.0.0) and a port you may use (1024 or above)",
        ) from None
    return sock


def serve_until_stopped(state: ServeState, loader: Callable[[], tuple], *, host: str = "127.0.0.1",
                        port: int = 8000, limits: Limits | None = None, drain_timeout: float = 30.0,
                        log_level: str = "info", on_listening: Callable[[str], None] | None = None) -> None:
    """Serve `state` on `host`:`port` until a signal (see the module notes). loader: returns the
    model and its tokenizer, called in the background; on_listening: called with the address's
    URL once it is bound (with the real port when `port` is 0). Raises the loading error where the
    model fails to load (a `MultiDecodeError` as it is, anything else as `SystemExit(1)`)."""
    check_drain_timeout(drain_timeout)
    sock = bind(host, port)
    url = f"http://{host}:{sock.getsockname()[1]}"
    config = uvicorn.Config(create_app(state), log_level=log_level, access_log=False)
    server = DrainingServer(config, state, drain_timeout=drain_timeout)
    if on_listening is not None:
        on_listening(url)
    state.load(loader, limits=limits)
    threading.Thread(target=_exit_if_load_fails, args=(state, server), daemon=True).start()
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    if isinstance(state.load_error, MultiDecodeError):
        raise state.load_error
    if state.load_error is not None:
        raise SystemExit(1)


def _exit_if_load_fails(state: ServeState, server: uvicorn.Server) -> None:
    while state.runtime is None and state.load_error is None:
        time.sleep(0.1)
    if state.load_error is not None:
        server.should_exit = True


class ServerFailed(MultiDecodeError):
    """A server started in a subprocess did not come up, or died."""


def free_port() -> int:
    """A loopback port that nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class ServerProcess:
    """A server in a subprocess (its own session) on a free loopback port, its output in a
    temporary log file; a context manager: started on entry, stopped on exit (SIGTERM, then
    SIGKILL). `command` says "{port}" where the port goes; `model` is the name clients ask for."""

    def __init__(self, name: str, command: list[str], *, model: str = "", env: dict | None = None) -> None:
        port = free_port()
        self.name, self.model, self.url = name, model, f"http://127.0.0.1:{port}"
        self.command = [part.replace("{port}", str(port)) for part in command]
        self.env = {**os.environ, **(env or {})}

    @classmethod
    def multidecode(cls, name: str, served: str, **options) -> Self:
        """`multidecode serve` of this Python, named `served` to its clients, with `options` as its
        command line spells them (max_running=1: --max-running 1; None: left out)."""
        command = [sys.executable, "-m", "multidecode", "serve", "--port", "{port}", "--served-model-name", served]
        for option, value in options.items():
            command += [f"--{option.replace('_', '-')}", str(value)] if value is not None else []
        return cls(name, command, model=served)

    @classmethod
    def transformers(cls, name: str, folder: str, *, continuous_batching: bool = False) -> Self:
        """`transformers serve` on a model folder, offline, on the CPU in float32; `ServerFailed` where
        the command is not installed."""
        exe = shutil.which("transformers", path=str(Path(sys.executable).parent)) or shutil.which("transformers")
        if exe is None:
            raise ServerFailed("the `transformers` command is not installed next to this Python")
        command = [exe, "serve", folder, "--host", "127.0.0.1", "--port", "{port}", "--device", "cpu",
                   "--dtype", "float32", "--log-level", "warning"] + ["--continuous-batching"] * continuous_batching
        return cls(name, command, model=folder, env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"})

    def __enter__(self) -> Self:
        handle, log = tempfile.mkstemp(prefix=f"multidecode-{self.name}-", suffix=".log")
        self.log = Path(log)
        with open(handle, "wb") as out:  # the child keeps its own copy of the descriptor
            self.process = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        self.started = time.monotonic()
        return self

    def wait_ready(self, ready_s: float = 300.0) -> float:
        """Until /health answers 200; returns the seconds it took. Raises `ServerFailed`."""
        import httpx  # installed with openai, which drives these servers

        while True:
            self.alive("exited")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return time.monotonic() - self.started
            if time.monotonic() - self.started > ready_s:
                raise ServerFailed(f"the {self.name} server was not ready after {ready_s:.0f} s: {self.log_tail()}")
            time.sleep(0.1)

    def alive(self, died: str = "died") -> None:
        """Raise `ServerFailed` (with the log's last lines) where the process has ended."""
        if self.process.poll() is not None:
            raise ServerFailed(f"the {self.name} server {died} with code {self.process.returncode}: {self.log_tail()}")

    def metrics(self) -> dict[str, float]:
        """The server's multidecode metrics from /metrics, by short name (a counter's without "_total")."""
        import httpx

        reply = httpx.get(self.url + "/metrics", timeout=5.0)
        if reply.status_code != 200:
            raise ServerFailed(f"{self.url}/metrics answered {reply.status_code}: {reply.text[:200]}")
        found = (line.rsplit(" ", 1) for line in reply.text.splitlines() if line.startswith("multidecode_"))
        return {name.removeprefix("multidecode_").removesuffix("_total"): float(value) for name, value in found}

    def log_tail(self, lines: int = 12) -> str:
        text = self.log.read_text("utf-8", "replace").strip().splitlines()
        return " | ".join(text[-lines:]) or "(no output)"

    def __exit__(self, *exc) -> None:
        for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            if self.process.poll() is not None:
                break
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(wait)
        self.log.unlink(missing_ok=True)


@contextlib.contextmanager
def stopped_on_sigterm():
    """SIGTERM raises KeyboardInterrupt in the block (main thread only), so that the server
    processes started in it (each in its own session) are stopped on the way out."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    main = threading.current_thread() is threading.main_thread()
    before = signal.signal(signal.SIGTERM, interrupt) if main else None
    try:
        yield
    finally:
        if main:
            signal.signal(signal.SIGTERM, before)


__all__ = ["SHUTDOWN_GRACE_S", "DrainingServer", "ServerFailed", "ServerProcess", "bind", "check_drain_timeout",
           "free_port", "serve_until_stopped", "stopped_on_sigterm"]
