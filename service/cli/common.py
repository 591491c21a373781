"""What every command shares: options that read ``GMMLSH_*``, the index location, exit codes."""

from __future__ import annotations

import argparse

from pydantic import ValidationError

from gmmlsh.index.store.location import DEFAULT_PREFIX, describe
from gmmlsh.service.settings import ENV_PREFIX, Where, from_env

EXIT_OK, EXIT_RUNTIME, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
ENV = ENV_PREFIX


class UsageError(Exception):
    """A command used wrongly: exit code 2, one line."""


class Formatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog: str):
        super().__init__(prog, max_help_position=34, width=100)


def env_name(dest: str) -> str:
    return ENV + dest.upper()


def opt(p, *flags: str, dest: str | None = None, env: bool = True, help: str = "", **kw) -> argparse.Action:
    """An option whose default comes from ``GMMLSH_<DEST>`` when that is set: marked here, read
    for every marked option at once by :func:`env_defaults`."""
    dest = dest or flags[0].lstrip("-").replace("-", "_")
    if env:
        help = f"{help} (env {env_name(dest)})" if help else f"(env {env_name(dest)})"
    action = p.add_argument(*flags, dest=dest, help=help, **kw)
    action.from_env = env  # type: ignore[attr-defined]
    return action


def env_defaults(parsers: list[argparse.ArgumentParser]) -> None:
    """Set the defaults of the options :func:`opt` marked, in ``parsers`` (the command line's,
    the first the main one), from the ``GMMLSH_*`` environment, read the way the server's
    settings read it (:func:`gmmlsh.service.settings.from_env`). A flag's value is a boolean
    (anything else: a usage error, exit 2); any other is text that argparse converts with the
    option's ``type``, so a bad environment value is reported like a bad command-line value."""
    marked = [a for p in parsers for a in p._actions if getattr(a, "from_env", False)]
    types = {a.dest: bool if isinstance(a.const, bool) and a.nargs == 0 else str for a in marked}
    try:
        values = from_env(types)
    except ValidationError as exc:
        first = exc.errors()[0]
        parsers[0].error(f"{first['loc'][0]}: {first['msg']}")
    for a in marked:
        if a.dest in values:
            a.default = values[a.dest]


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
    """The options naming the index; unset, they come from the environment through
    :class:`~gmmlsh.service.settings.Where` (see :func:`where`)."""
    from gmmlsh.index.mirror import DEFAULT_CACHE_DIR

    g = p.add_argument_group("index location (one of)")
    g.add_argument("--index", metavar="DIR", help=f"LMDB index directory (env {ENV}INDEX)")
    g.add_argument("--redis", dest="redis_url", metavar="URL",
                   help=f"Redis URL, e.g. redis://localhost:6379/0 (env {ENV}REDIS_URL)")
    g.add_argument("--prefix", metavar="NAME",
                   help=f"name of the index inside Redis (default {DEFAULT_PREFIX}; env {ENV}PREFIX)")
    g.add_argument("--collection", metavar="NAME", help="a named collection kept beside the index "
                   f"(default: the index itself; env {ENV}COLLECTION)")
    g.add_argument("--cache-dir", metavar="DIR", help="where a Redis index's search mirror lives on this machine "
                   f"(default {DEFAULT_CACHE_DIR}; env {ENV}CACHE_DIR)")


def where(args: argparse.Namespace) -> Where:
    """The :class:`~gmmlsh.service.settings.Where` the arguments name: the options given, the
    ``GMMLSH_*`` environment for the rest (an explicit ``--index`` also beats ``GMMLSH_REDIS_URL``)."""
    if args.index and args.redis_url:
        raise UsageError("give either --index DIR or --redis URL, not both")
    given = {k: v for k in ("index", "redis_url", "prefix", "collection", "cache_dir")
             if (v := getattr(args, k, None)) is not None}
    if args.index:
        given["redis_url"] = None
    try:
        w = Where(**given)
    except ValidationError as exc:
        raise UsageError(settings_error(exc)) from None
    if not w.location:
        raise UsageError(f"where is the index? give --index DIR or --redis URL (or set {ENV}INDEX / "
                         f"{ENV}REDIS_URL)")
    return w


def settings_error(exc: ValidationError) -> str:
    """A pydantic ValidationError of the settings in one line: ``settings: <field>: <problem>``."""
    first = exc.errors()[0]
    field = ".".join(map(str, first["loc"]))
    message = first["msg"].removeprefix("Value error, ")
    if not field or message.startswith(f"{field}: "):
        return f"settings: {message}"
    return f"settings: {field}: {message}"


def location(args: argparse.Namespace) -> tuple[str, str, str]:
    """(kind, location, prefix) of :func:`where`."""
    w = where(args)
    return ("redis" if w.redis_url else "lmdb"), w.location, w.prefix


def open_options(args) -> dict:
    """The store options of :func:`where` (``Where.store_options``)."""
    return where(args).store_options


def open_index(args, *, must_exist: bool = True, **kw):
    """The index named by the arguments, or None (``must_exist=False``) when there is none."""
    from gmmlsh.index.index import Index

    kind, loc, prefix = location(args)
    name = where(args).collection
    if name != "default":
        return _open_collection(args, name, must_exist, **kw)
    try:
        return Index.open(loc, None, create=False, **open_options(args), **kw)
    except FileNotFoundError:
        if not must_exist:
            return None
        raise UsageError(f"no index at {describe(loc, prefix)}; create one with "
                         "'gmmlsh build INPUT --index DIR' (or --redis URL)") from None


def collections_of(args):
    """The :class:`~gmmlsh.index.collections.Collections` kept beside the index the arguments name."""
    from gmmlsh.index.collections import Collections

    _, loc, _ = location(args)
    return Collections(loc, **open_options(args))


def _open_collection(args, name: str, must_exist: bool, **kw):
    from gmmlsh.index.collections import UnknownCollection

    with collections_of(args) as cols:
        try:
            return cols.open(name, **kw)
        except UnknownCollection:
            if not must_exist:
                return None
            kind, loc, prefix = location(args)
            raise UsageError(f"no collection {name!r} at {describe(loc, prefix)}; create one with "
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


