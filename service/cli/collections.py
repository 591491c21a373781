"""``gmmlsh collections``: list or delete the named collections kept beside an index."""

from __future__ import annotations

import json

from gmmlsh.service.cli.common import (
    EXIT_OK,
    Formatter,
    UsageError,
    add_store,
    collections_of,
    location,
    open_options,
)


def add(sub) -> None:
    p = sub.add_parser("collections", help="list the collections, or delete one",
                       description="List the collections of an index (LMDB directory or Redis prefix): default, "
                       "the index itself, then the named ones kept beside it (as GET /collections does); or delete a "
                       "named one with everything in it. Create one with 'gmmlsh build INPUT --collection NAME' (or "
                       "POST /collections).",
                       epilog="Examples:\n  gmmlsh collections --index ./idx\n"
                       "  gmmlsh collections --index ./idx --delete old-images", formatter_class=Formatter)
    add_store(p)
    p.add_argument("--delete", metavar="NAME", help="delete this collection")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    from gmmlsh.index.collections import UnknownCollection
    from gmmlsh.index.index import Index

    with collections_of(args) as cols:
        if args.delete:
            try:
                cols.delete(args.delete)
            except (UnknownCollection, ValueError) as exc:
                raise UsageError(str(exc)) from None
            print(json.dumps({"deleted": args.delete}) if args.json else f"deleted collection {args.delete!r}")
            return EXIT_OK
        _, loc, _ = location(args)
        try:
            default = Index.open(loc, None, create=False, maintain=False, **open_options(args))
        except FileNotFoundError:  # collections only, no index of the location's own
            default = None
        try:
            entries = cols.listing(default)
        finally:
            if default is not None:
                default.close()
    if args.json:
        print(json.dumps({"collections": entries}))
    else:
        for e in entries:
            print(f"{e['name']:<24} dim {e['dim']}, indexed fields: {', '.join(e['indexed_fields']) or 'none'}")
    return EXIT_OK
