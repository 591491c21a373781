"""``gmmlsh route``: the router of a sharded deployment under uvicorn."""

from __future__ import annotations

from gmmlsh.service.cli.common import EXIT_OK, Formatter, UsageError, opt, positive_int

HELP = """\
Route the REST API over search nodes (`gmmlsh serve --group g/G`) that each serve one group
of an index's id-shards in Redis: a query goes to one node of every group and their answers
are merged by exact similarity; writes go straight to Redis. Clients see the API of
`gmmlsh serve`. The nodes announce themselves in Redis: the router needs only its address.
"""

EXAMPLE = """\
Examples:
  gmmlsh serve --redis redis://r1:7000/0 --group 0/2 --port 8101 &
  gmmlsh serve --redis redis://r1:7000/0 --group 1/2 --port 8102 &
  gmmlsh route --redis redis://r1:7000/0 --port 8000
"""


def add(sub) -> None:
    p = sub.add_parser("route", help="route queries over search nodes that serve groups of id-shards",
                       description=HELP, epilog=EXAMPLE, formatter_class=Formatter)
    opt(p, "--redis", dest="redis_url", metavar="URL", help="the index's Redis (a node of its Cluster)")
    opt(p, "--prefix", metavar="NAME", default="gmmlsh", help="name of the index inside Redis (default gmmlsh)")
    g = p.add_argument_group("router")
    g.add_argument("--groups", type=positive_int, help="answer through the layout of this many groups (env "
                   "GMMLSH_ROUTE_GROUPS; default: the largest layout every group of which has a live node)")
    g.add_argument("--host", help="address to listen on (env GMMLSH_HOST; default 127.0.0.1)")
    g.add_argument("--port", type=int, help="port (env GMMLSH_PORT; default 8000)")
    g.add_argument("--workers", type=positive_int, help="worker processes (env GMMLSH_WORKERS; default 1)")
    p.set_defaults(func=run)


def run(args) -> int:
    from pydantic import ValidationError

    from gmmlsh.service.server import ROUTER_APP, serve
    from gmmlsh.service.settings import Settings

    if not args.redis_url:
        raise UsageError("the router serves an index in Redis: give --redis URL (or set GMMLSH_REDIS_URL)")
    given = {"redis_url": args.redis_url, "prefix": args.prefix}
    if args.groups:
        given["route_groups"] = args.groups
    try:
        settings = Settings(**given)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise UsageError(f"settings: {'.'.join(map(str, first['loc']))}: {first['msg']}") from None
    serve(settings, host=args.host, port=args.port, workers=args.workers, app=ROUTER_APP)
    return EXIT_OK
