"""``gmmlsh query``: nearest neighbours of a stored vector or of a vector from a file or the command line."""

from __future__ import annotations

import json

from gmmlsh.service.cli.build import zero_based
from gmmlsh.service.cli.common import (
    EXIT_OK,
    Formatter,
    UsageError,
    add_store,
    nonneg_int,
    open_index,
    opt,
    positive_int,
)

HELP = """\
Find the nearest neighbours of a stored vector (--id) or of a vector read from a
file (--vector-file, row --row; .npz: --npz-key) or given inline (--vector).
Prints a table, or the REST API's JSON answer with --json.
"""

EXAMPLE = """\
Examples:
  gmmlsh query --index ./idx --id 42 -k 5
  gmmlsh query --index ./idx --vector-file queries.npy --row 3 --mode exact --json
  gmmlsh query --index ./idx --vector-file data.npz --npz-key test --row 0
  gmmlsh query --redis redis://localhost:6379/0 --vector 0,0.5,1.25,0
"""


def add(sub) -> None:
    from gmmlsh.index.config import DEFAULT_K
    from gmmlsh.index.search import MODE_ALIASES, MODES

    p = sub.add_parser("query", help="nearest neighbours of an id or a vector", description=HELP, epilog=EXAMPLE,
                       formatter_class=Formatter)
    add_store(p)
    g = p.add_argument_group("what to query (one of)")
    what = g.add_mutually_exclusive_group(required=True)
    what.add_argument("--id", help="a stored vector's id (it is left out of its neighbours)")
    what.add_argument("--vector-file", metavar="FILE", help="a vector file (any build input format)")
    what.add_argument("--vector", metavar="V1,V2,...", help="a dense vector, comma-separated")
    g.add_argument("--row", type=nonneg_int, default=0, help="row of --vector-file (0-based; default 0)")
    g.add_argument("--format", help="format of --vector-file when its extension does not say")
    g.add_argument("--npz-key", metavar="KEY", help="array of an .npz --vector-file (default: the first)")
    g.add_argument("--zero-based", nargs="?", const="yes", default="no", choices=("yes", "no", "auto"),
                   help="svmlight --vector-file: indices start at 0")
    g = p.add_argument_group("search")
    opt(g, "-k", "--k", dest="k", type=positive_int, default=str(DEFAULT_K),
        help=f"neighbours to return (default {DEFAULT_K})")
    opt(g, "--mode", choices=(*MODES, *MODE_ALIASES), default="auto",
        help="auto (default: the search the index tuned for itself), sketch, postings, exact (brute force) or nrff")
    opt(g, "--min-similarity", dest="query_min_similarity", metavar="S", type=float, default="0.0",
        help="drop neighbours below this similarity")
    opt(g, "--candidates", metavar="N", type=positive_int, help="rerank budget (default: the index's tuning)")
    opt(g, "--probes", metavar="N", type=nonneg_int, help="inverted lists scanned (default: the index's tuning; "
        "0: all)")
    g.add_argument("--filter", metavar="JSON", help="only neighbours whose metadata pass this filter, e.g. "
                   "'{\"must\": [{\"key\": \"label\", \"match\": {\"value\": 3}}]}'")
    g.add_argument("--json", action="store_true", help="print JSON (as the REST API answers)")
    p.set_defaults(func=run)


def _query_vector(args, dim: int):
    from gmmlsh.index.ingest.readers import InputFormatError, detect_format, open_reader

    if args.vector is not None:
        try:
            return [float(x) for x in args.vector.replace(" ", "").split(",") if x != ""]
        except ValueError:
            raise InputFormatError("--vector", "expected comma-separated numbers") from None
    svm = detect_format(args.vector_file, args.format) == "svmlight"
    reader = open_reader(args.vector_file, fmt=args.format, dim=dim if svm else None, key=args.npz_key,
                         zero_based=zero_based(args.zero_based))
    if reader.dim is not None and reader.dim != dim:
        raise InputFormatError(args.vector_file, f"has dimension {reader.dim}, the index has {dim}")
    reader.dim = dim
    row = reader.read_row(args.row)
    return row if hasattr(row, "tocsr") else row[0]


def _filter(text: str | None):
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError as exc:
        raise UsageError(f"--filter: not valid JSON: {exc}") from None


def run(args) -> int:
    with open_index(args) as index:
        kw = {"k": args.k, "mode": args.mode, "min_similarity": args.query_min_similarity,
              "candidates": args.candidates, "probes": args.probes, "filter": _filter(args.filter)}
        res = index.query(id=args.id, **kw) if args.id is not None else \
            index.query(_query_vector(args, index.config.dim), **kw)
    out = {"mode": res.mode, "k": res.k, "candidates": res.candidates,
           "neighbors": [{"id": n.id, "similarity": n.similarity, "metadata": n.metadata} for n in res.neighbors]}
    if args.json:
        print(json.dumps(out))
        return EXIT_OK
    print(f"mode {res.mode}: {len(res.neighbors)} of k={res.k} neighbours, {res.candidates:,} candidates scored")
    if res.neighbors:
        width = max(4, max(len(n.id) for n in res.neighbors))
        print(f"{'rank':>4}  {'id':<{width}}  {'similarity':>10}  metadata")
        for i, n in enumerate(res.neighbors, 1):
            meta = json.dumps(n.metadata, separators=(",", ":")) if n.metadata is not None else ""
            print(f"{i:>4}  {n.id:<{width}}  {n.similarity:>10.6f}  {meta}")
    return EXIT_OK
