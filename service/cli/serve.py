"""``gmmlsh serve``: the REST API under uvicorn."""

from __future__ import annotations

from pathlib import Path

from gmmlsh.service.cli.common import (
    ENV,
    EXIT_OK,
    Formatter,
    UsageError,
    add_store,
    positive_int,
    settings_error,
    where,
)

HELP = """\
Serve an index over HTTP (FastAPI under uvicorn; interactive docs at /docs).

The index is the one `gmmlsh build` wrote, LMDB or Redis, used unchanged. To
start with an empty index, set GMMLSH_DIM (and optionally GMMLSH_SAMPLES,
GMMLSH_BITS, ...: see the README's settings) and serve a new location. Every
worker process opens the index itself; with Redis, any number of servers (on
any machines) can share one index.
"""

EXAMPLE = """\
Examples:
  gmmlsh serve --index ./idx --port 8000
  GMMLSH_DIM=784 gmmlsh serve --index ./new-idx          # an empty index
  gmmlsh serve --redis redis://redis:6379/0 --prefix news --host 0.0.0.0 --workers 4
"""


def add(sub) -> None:
    p = sub.add_parser("serve", help="serve an index over HTTP", description=HELP, epilog=EXAMPLE,
                       formatter_class=Formatter)
    add_store(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", help="address to listen on (env GMMLSH_HOST; default 127.0.0.1)")
    g.add_argument("--port", type=int, help="port (env GMMLSH_PORT; default 8000)")
    g.add_argument("--workers", type=positive_int, help="worker processes (env GMMLSH_WORKERS; default 1)")
    g = p.add_argument_group("sharded search (a search node behind `gmmlsh route`)")
    g.add_argument("--group", metavar="g/G", help="serve group g of G of the index's id-shards (env GMMLSH_GROUP)")
    g.add_argument("--snapshots", metavar="DIR", help="a directory shared by the group's nodes: the builder "
                   "publishes its mirror there, a node with an empty mirror starts from it (env GMMLSH_SNAPSHOTS)")
    g.add_argument("--advertise", metavar="URL", help="the URL the router reaches this node at (env "
                   "GMMLSH_ADVERTISE; default http://HOST:PORT)")
    p.set_defaults(func=run)


def run(args) -> int:
    from pydantic import ValidationError

    from gmmlsh.service.server import serve
    from gmmlsh.service.settings import Settings

    w = where(args)
    given = {k: v for k, v in w.model_dump().items() if v is not None or k == "redis_url"}
    if not w.redis_url:
        given["index"] = str(Path(w.index).resolve())
    for name in ("group", "advertise", "snapshots"):
        if getattr(args, name, None):
            given[name] = getattr(args, name)
    if args.port is not None:  # the advertised URL's default
        given["port"] = args.port
    if args.host is not None:
        given["host"] = args.host
    try:
        settings = Settings(**given)
    except ValidationError as exc:
        raise UsageError(settings_error(exc)) from None
    if not w.redis_url and not (Path(w.index) / "data.mdb").exists() and settings.dim is None:
        raise UsageError(f"no index at {w.index}; build one with 'gmmlsh build INPUT --index {w.index}', or set "
                         f"{ENV}DIM to create an empty one")
    _open_or_fail(settings)
    serve(settings, host=args.host, port=args.port, workers=args.workers)
    return EXIT_OK


class StartupError(RuntimeError):
    """The index cannot be opened (or created): the server does not start."""


def _open_or_fail(settings) -> None:
    """Open (or create) the index once here, before any worker starts, and close it again
    (nothing is kept across the workers' fork): a store that is down, a conflicting
    configuration or a missing index is then one line and exit 1, whatever ``--workers``
    says, instead of a traceback per worker and an exit code that depends on how many."""
    from gmmlsh.service.opening import open_index

    try:
        open_index(settings).close()
    except Exception as exc:  # noqa: BLE001 - reported in one line, credentials masked
        raise StartupError(f"cannot start: {settings.scrub(str(exc))}") from None
