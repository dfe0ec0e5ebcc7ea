"""``maxent-arrow view RUN``: serve the explorer on 127.0.0.1 and print its URL."""

from __future__ import annotations

import errno
import ipaddress
import socket
import sys
import warnings
from collections.abc import Callable
from typing import Any

from maxent_arrow.analytics import DEFAULT_VIEW_PORT
from maxent_arrow.arguments import check_int
from maxent_arrow.errors import MissingExtraError
from maxent_arrow.explorer.app import make_app
from maxent_arrow.explorer.data import RunData
from maxent_arrow.explorer.export import check_export_dir

__all__ = ["Viewer", "is_loopback", "serve"]

LOOPBACK = "127.0.0.1"


def is_loopback(host: str) -> bool:
    """Whether ``host`` only reaches this machine (``localhost``, 127.0.0.0/8, ``::1``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise OSError(
                exc.errno,
                f"{host}:{port}: address already in use (another maxent-arrow view?); "
                "--port N picks another, --port 0 any free one",
            ) from None
        raise
    sock.listen(128)
    return sock


class Viewer:
    """The explorer of ``run``, bound to ``host``:``port`` (0: a free port) when made;
    :meth:`run` serves until interrupted, :attr:`url` is where."""

    def __init__(
        self,
        run: Any,
        *,
        host: str = LOOPBACK,
        port: int = DEFAULT_VIEW_PORT,
        other: Any = None,
        on_error: str = "raise",
        export_dir: Any = None,
    ):
        port = check_int(port, "view: port", low=0, high=65535)
        try:
            import uvicorn  # noqa: F401
            from starlette.applications import Starlette  # noqa: F401
        except ImportError as exc:
            raise MissingExtraError(exc.name or "starlette", "view") from None
        if not is_loopback(host):
            warnings.warn(
                f"the explorer listens on {host}, not only this machine: anyone who can reach "
                f"it reads the run (it is read-only, without authentication)",
                UserWarning,
                stacklevel=2,
            )
        self.data = RunData(run, on_error=on_error)
        self.other = None if other is None else RunData(other, on_error=on_error)
        root = self.data.store().root
        export = None if export_dir is None else check_export_dir(export_dir, root)
        self.socket = _bind(host, port)
        bound = self.socket.getsockname()[1]
        wide = host in ("0.0.0.0", "::", "")
        # Listening everywhere, any Host header may be ours; otherwise only the address served.
        hosts = ("*",) if wide else (host, "localhost", LOOPBACK)
        self.app = make_app(self.data, other=self.other, hosts=hosts, export_dir=export)
        shown = LOOPBACK if wide else host
        self.url = f"http://{'[' + shown + ']' if ':' in shown else shown}:{bound}/"
        self.server: Any = None

    def run(self, *, started: Callable[[str], None] | None = None) -> None:
        import uvicorn

        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="off")
        self.server = uvicorn.Server(config)
        if started is not None:
            started(self.url)
        self.server.run(sockets=[self.socket])

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True


def serve(run: Any, *, host: str = LOOPBACK, port: int = DEFAULT_VIEW_PORT, other: Any = None,
          on_error: str = "raise", export_dir: Any = None) -> None:  # fmt: skip
    """Serve the explorer of ``run`` until interrupted, printing its URL first (and, on an
    address other than loopback, a warning on stderr before anything is served)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        viewer = Viewer(run, host=host, port=port, other=other, on_error=on_error,
                        export_dir=export_dir)  # fmt: skip
    for item in caught:
        sys.stderr.write(f"maxent-arrow view: warning: {item.message}\n")
    sys.stderr.flush()

    def say(url: str) -> None:
        sys.stdout.write(f"maxent-arrow view: {viewer.data.uri}\n  open {url}\n")
        sys.stdout.flush()

    viewer.run(started=say)
