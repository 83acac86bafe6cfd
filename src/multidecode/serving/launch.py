"""Starting the server: the listening socket, the model loading behind it, and draining on SIGTERM.

`run` is what `multidecode serve` (and the serve benchmark, through that command) calls: it binds
the address first, so that a port out of range, in use or not this machine's is a clear error
before anything loads; then the model loads in the background while /health answers 503, and
uvicorn serves until a signal. The first SIGTERM (or Ctrl-C) drains: new requests get 503 while
running ones have up to `drain_timeout` seconds to finish; a second signal exits at once.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable

import uvicorn

from ..errors import InvalidArgument, MultiDecodeError
from ..runtime import ForestRuntime, Limits
from .app import ServeState, create_app

log = logging.getLogger("multidecode.serving")


class DrainingServer(uvicorn.Server):
    """uvicorn's server with draining on SIGTERM (or Ctrl-C): new requests get 503 while running
    ones have up to `drain_timeout` seconds to finish; a second signal exits at once."""

    def __init__(self, config: uvicorn.Config, state: ServeState, *, drain_timeout: float = 30.0) -> None:
        super().__init__(config)
        self.serve_state, self.drain_timeout = state, drain_timeout

    def handle_exit(self, sig, frame) -> None:
        forest = self.serve_state.runtime
        if forest is None or forest.draining or self.should_exit:
            super().handle_exit(sig, frame)
            return
        forest.drain()
        log.info("draining: %d running request(s), up to %.0f s", forest.busy, self.drain_timeout)
        threading.Thread(target=self._exit_when_idle, args=(forest,), daemon=True).start()

    def _exit_when_idle(self, forest: ForestRuntime) -> None:
        deadline = time.monotonic() + self.drain_timeout
        while forest.busy and time.monotonic() < deadline:
            time.sleep(0.05)
        self.should_exit = True


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


def run(state: ServeState, loader: Callable[[], tuple], *, host: str = "127.0.0.1", port: int = 8000,
        limits: Limits | None = None, drain_timeout: float = 30.0, log_level: str = "info",
        on_listening: Callable[[str], None] | None = None) -> None:
    """Serve `state` on `host`:`port` until a signal (see the module notes). loader: returns the
    model and its tokenizer, called in the background; on_listening: called with the address's
    URL once it is bound (with the real port when `port` is 0). Raises the loading error where the
    model fails to load (a `MultiDecodeError` as it is, anything else as `SystemExit(1)`)."""
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


__all__ = ["DrainingServer", "bind", "run"]
