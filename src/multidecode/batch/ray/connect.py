"""Finding Ray: the `ray` module (an optional extra), and a cluster at an address, checked
quickly so that a wrong address fails in seconds rather than after Ray's own minutes of retries."""

from __future__ import annotations

import logging
import signal
import socket
import threading
from urllib.parse import urlsplit

from ...errors import InvalidArgument, MissingExtra, MultiDecodeError

CONNECT_TIMEOUT_S = 5.0
"""How long an address may take to accept a connection before it counts as unreachable."""
INSTALL_HINT = "pip install 'multidecode[ray]'"
NO_RAY_HINT = ("start one with `ray start --head` on the head node (and `ray start --address=HEAD:6379` on the "
               "others), then pass HEAD:6379, or `--ray auto` on a node of the cluster; `--ray` alone starts a "
               "local Ray on this machine")


class RayUnavailable(MultiDecodeError):
    """No Ray cluster answers at the given address."""


def import_ray():
    """The `ray` module, or `MissingExtra` saying how to install it."""
    try:
        import ray
    except ImportError as err:
        raise MissingExtra("batch jobs on Ray need Ray, which is not installed", INSTALL_HINT) from err
    return ray



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


__all__ = ["CONNECT_TIMEOUT_S", "INSTALL_HINT", "NO_RAY_HINT", "RayUnavailable", "connect", "import_ray"]
