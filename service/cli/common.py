"""What every command shares: options that read ``GMMLSH_*``, the index location, exit codes."""

from __future__ import annotations

import argparse
import os
import re

EXIT_OK, EXIT_RUNTIME, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
ENV = "GMMLSH_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


class UsageError(Exception):
    """A command used wrongly: exit code 2, one line."""


class Formatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog: str):
        super().__init__(prog, max_help_position=34, width=100)


def env_name(dest: str) -> str:
    return ENV + dest.upper()


def opt(p, *flags: str, dest: str | None = None, env: bool = True, help: str = "", **kw) -> argparse.Action:
    """An option whose default comes from ``GMMLSH_<DEST>`` when that is set (argparse converts a
    string default with the option's ``type``, so a bad environment value is reported like a bad
    command-line value)."""
    dest = dest or flags[0].lstrip("-").replace("-", "_")
    if env:
        name = env_name(dest)
        raw = os.environ.get(name)
        if kw.get("action") in ("store_true", "store_false"):
            if raw is not None and raw.strip().lower() in _TRUE | _FALSE:
                kw["default"] = raw.strip().lower() in _TRUE
        elif raw is not None and raw != "":
            kw["default"] = raw
        help = f"{help} (env {name})" if help else f"(env {name})"
    return p.add_argument(*flags, dest=dest, help=help, **kw)


def int_at_least(low: int):
    """An argparse type: a whole number ≥ ``low``, with a one-line error otherwise."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"must be ≥ {low}, got {v}")
        return v

    return parse


positive_int = int_at_least(1)
nonneg_int = int_at_least(0)


def whole_number(text: str) -> int:
    """An argparse type: any whole number (its bounds are checked where they are defined)."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None


def add_store(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("index location (one of)")
    g.add_argument("--index", metavar="DIR", help=f"LMDB index directory (env {ENV}INDEX)")
    g.add_argument("--redis", dest="redis_url", metavar="URL",
                   help=f"Redis URL, e.g. redis://localhost:6379/0 (env {ENV}REDIS_URL)")
    opt(g, "--prefix", metavar="NAME", default="gmmlsh", help="name of the index inside Redis (default gmmlsh)")
    opt(g, "--collection", metavar="NAME", default="default", help="a named collection kept beside the index "
        "(default: the index itself)")
    from gmmlsh.index.index import DEFAULT_CACHE_DIR

    opt(g, "--cache-dir", metavar="DIR", help="where a Redis index's search mirror lives on this machine "
        f"(default {DEFAULT_CACHE_DIR})")


def location(args) -> tuple[str, str, str]:
    """(kind, location, prefix) from --index / --redis, falling back to the environment
    (where Redis wins, as in the server's settings)."""
    if args.index and args.redis_url:
        raise UsageError("give either --index DIR or --redis URL, not both")
    if args.redis_url:
        return "redis", args.redis_url, args.prefix
    if args.index:
        return "lmdb", args.index, args.prefix
    env_redis, env_index = os.environ.get(env_name("redis_url")), os.environ.get(env_name("index"))
    if env_redis:
        return "redis", env_redis, args.prefix
    if env_index:
        return "lmdb", env_index, args.prefix
    raise UsageError(f"where is the index? give --index DIR or --redis URL (or set {ENV}INDEX / {ENV}REDIS_URL)")


def describe_location(kind: str, loc: str, prefix: str) -> str:
    if kind == "lmdb":
        return f"{loc} (LMDB)"
    masked = re.sub(r"//([^:/@]*):([^@]*)@", r"//\1:***@", loc)
    return f"{masked} prefix {prefix!r} (Redis)"


def open_options(args) -> dict:
    kind, _, prefix = location(args)
    opts: dict = {"prefix": prefix}
    if kind == "redis" and getattr(args, "cache_dir", None):
        opts["cache_dir"] = args.cache_dir
    return opts


def open_index(args, *, must_exist: bool = True, **kw):
    """The index named by the arguments, or None (``must_exist=False``) when there is none."""
    from gmmlsh.index.index import Index

    kind, loc, prefix = location(args)
    name = getattr(args, "collection", "default") or "default"
    if name != "default":
        return _open_collection(args, name, must_exist, **kw)
    try:
        return Index.open(loc, None, create=False, **open_options(args), **kw)
    except FileNotFoundError:
        if not must_exist:
            return None
        raise UsageError(f"no index at {describe_location(kind, loc, prefix)}; create one with "
                         "'gmmlsh build INPUT --index DIR' (or --redis URL)") from None


def collections_of(args):
    """The :class:`~gmmlsh.index.collections.Collections` kept beside the index the arguments name."""
    from gmmlsh.index.collections import Collections

    _, loc, _ = location(args)
    return Collections(loc, **open_options(args))


def _open_collection(args, name: str, must_exist: bool, **kw):
    from gmmlsh.index.collections import UnknownCollection, check_name

    try:
        check_name(name, "--collection")
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    with collections_of(args) as cols:
        try:
            return cols.open(name, **kw)
        except UnknownCollection:
            if not must_exist:
                return None
            kind, loc, prefix = location(args)
            raise UsageError(f"no collection {name!r} at {describe_location(kind, loc, prefix)}; create one with "
                             f"'gmmlsh build INPUT --collection {name}' (or POST /collections)") from None


def describe_search(search: dict) -> str:
    """One line on the search an index uses (``Index.stats()["search"]``) and where it comes from."""
    if search["exact"]:
        how = "exact (cheaper than any sketch or postings search at the target recall)"
    elif search.get("rare"):
        how = (f"postings: coordinates held by at most {search['rare']:.2%} of the rows and the commonest, "
               f"rerank {search['candidates']}")
    else:
        how = (f"probe {search['probes'] or 'all'} lists, shortlist {search['shortlist']}, "
               f"rank on {search['rank_bits']} bits, rerank {search['candidates']}")
    if search["tuned_at_rows"]:
        how += f"; tuned at {search['tuned_at_rows']:,} vectors on {search['tuned_on']}"
    else:
        how += "; defaults (not tuned yet: too few vectors)"
    if search.get("overrides"):
        how += f"; overridden: {search['overrides']}"
    return how


