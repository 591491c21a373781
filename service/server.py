"""Run the API under uvicorn: what ``gmmlsh serve`` calls.

Usage (from the CLI or any script)::

    from gmmlsh.service.server import serve
    from gmmlsh.service.settings import Settings
    serve(Settings(index="./idx"), host="0.0.0.0", port=8000, workers=4)

uvicorn spawns its workers as fresh processes that import the app from a string
(``gmmlsh.service.app:create_app``, ``factory=True``); a Python object cannot follow
them. So the settings travel as ``GMMLSH_*`` environment variables
(:meth:`Settings.to_env`), and each worker rebuilds them with ``Settings()`` and
opens its own index in the app's lifespan.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from typing import TYPE_CHECKING

from gmmlsh.service.settings import Settings

if TYPE_CHECKING:
    import uvicorn

APP = "gmmlsh.service.app:create_app"
#: The router of a sharded deployment (``gmmlsh route``).
ROUTER_APP = "gmmlsh.service.router.app:create_router_app"
#: uvicorn's httptools protocol with a bounded request head (see the module).
HTTP_PROTOCOL = "gmmlsh.service.protocol:BoundedHttpToolsProtocol"


def serve(settings: Settings | None = None, host: str | None = None, port: int | None = None,
          workers: int | None = None, app: str = APP) -> None:
    """Serve until interrupted. ``host``/``port``/``workers`` override ``settings``'s.

    Blocks; returns after a clean shutdown (Ctrl-C / SIGTERM). The index must exist,
    or ``settings.dim`` must be set to create it (otherwise startup fails with a
    message saying so).
    """
    import uvicorn

    settings = settings or Settings()
    overrides = {k: v for k, v in (("host", host), ("port", port), ("workers", workers))
                 if v is not None}
    if overrides:
        settings = settings.model_copy(update=overrides)

    # The workers' environment is exactly these settings: drop any GMMLSH_* left in
    # ours for a field that is unset here (e.g. GMMLSH_REDIS_URL when --index is given).
    for name in Settings.model_fields:
        os.environ.pop(f"GMMLSH_{name.upper()}", None)
    os.environ.update(settings.to_env())

    # Several workers: share Prometheus values through files so /metrics shows the
    # whole server, whichever worker answers the scrape.
    own_metrics_dir = None
    if settings.workers > 1 and not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        own_metrics_dir = tempfile.mkdtemp(prefix="gmmlsh-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = own_metrics_dir
    try:
        options = dict(
            factory=True,
            http=HTTP_PROTOCOL,
            host=settings.host,
            port=settings.port,
            workers=settings.workers,
            log_level=settings.log_level,
            log_config=log_config(settings.log_level),
            access_log=settings.access_log,
            timeout_graceful_shutdown=10,
        )
        if settings.workers > 1:
            # uvicorn.run's multi-worker branch, with a listener asyncio knows is TCP.
            from uvicorn.supervisors import Multiprocess

            config = uvicorn.Config(app, **options)
            Multiprocess(config, sockets=[tcp_listener(config)]).run()
        else:
            uvicorn.run(app, **options)
    finally:
        if own_metrics_dir is not None:
            shutil.rmtree(own_metrics_dir, ignore_errors=True)
            os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)


def tcp_listener(config: uvicorn.Config) -> socket.socket:
    """``config.bind_socket()`` re-wrapped with ``proto=IPPROTO_TCP``.

    uvicorn binds the shared listener of ``--workers N`` with ``proto`` 0; accepted
    connections inherit it and asyncio then skips ``TCP_NODELAY`` (uvicorn issue
    #3149), so every keep-alive response after the first waits ~40 ms on the
    client's delayed ACK (Nagle). Same descriptor, same address: only the protocol
    number the workers see changes.
    """
    sock = config.bind_socket()
    if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.proto != socket.IPPROTO_TCP:
        sock = socket.socket(sock.family, sock.type, socket.IPPROTO_TCP, fileno=sock.detach())
        sock.set_inheritable(True)
    return sock


def log_config(level: str) -> dict:
    """uvicorn's logging setup plus the ``gmmlsh`` loggers (startup facts, store errors)."""
    import copy

    from uvicorn.config import LOGGING_CONFIG

    cfg = copy.deepcopy(LOGGING_CONFIG)
    cfg["loggers"]["gmmlsh"] = {"handlers": ["default"], "level": level.upper(), "propagate": False}
    return cfg


def main() -> None:
    """``python -m gmmlsh.service.server``: serve with settings from the environment only."""
    serve()


if __name__ == "__main__":
    main()
