"""``gmmlsh build``: vector files → an index (LMDB or Redis)."""

from __future__ import annotations

import gc
import json
import sys
from typing import get_type_hints

from gmmlsh.index.store.location import describe
from gmmlsh.service.cli.common import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    Formatter,
    UsageError,
    add_store,
    collections_of,
    describe_search,
    location,
    nonneg_int,
    open_index,
    open_options,
    opt,
    positive_int,
    where,
    whole_number,
)

HELP = """\
Build (or add to, or finish) an index from vector files.

Reads .npy (memory-mapped), .npz, .csv/.tsv, .parquet, LIBSVM/svmlight (.svm,
.svmlight, .libsvm; sparse, labels kept as metadata) and .fvecs/.bvecs/.ivecs;
.gz text files too. Several inputs are read in order as one stream, in chunks
(memory stays bounded whatever the file size), hashed on all cores and written
one transaction per chunk, with a progress bar and a summary. At the end the
index builds its search lists and tunes its search for the data: on stored
vectors, or on --tune-queries, sample queries like those it will serve (better
where the data hold near-copies, which make stored vectors easy queries).

Ids are the row numbers ("0", "1", ... running on across inputs; from --id-start)
unless --ids FILE (one id per line) or --id-column names them; --id-prefix goes in
front of each. A vector whose id is stored already replaces the stored one: the
summary says how many did (building a second file with row-number ids replaces
the first's rows unless --id-start or --id-prefix tells them apart). A new index
takes the parameters given (defaults shown below); an existing one keeps its own
(giving different ones is an error).

Safe to interrupt: Ctrl-C stops after the chunk being written (twice: at once),
and a kill leaves only whole chunks. Run the same command again to finish:
chunks already stored are skipped, nothing is duplicated or lost.
"""

EXAMPLE = """\
Examples:
  gmmlsh build train.npy --index ./idx
  gmmlsh build data.svm --redis redis://localhost:6379/0 --prefix news
  gmmlsh build part1.csv part2.csv --index ./idx --id-column id --label-column label
  gmmlsh build base.fvecs --index ./idx --ids names.txt --samples 256
  gmmlsh build more.npy --index ./idx --id-start 60000      # rows added after a first file's 60,000
  gmmlsh build docs.svm --index ./idx --tune-queries held-out.svm
"""


def add(sub) -> None:
    from gmmlsh.index.config import CREATION_FIELDS, IndexConfig, describe
    from gmmlsh.index.tuner import MAX_QUERIES, MIN_QUERIES

    p = sub.add_parser("build", help="build an index from vector files", description=HELP, epilog=EXAMPLE,
                       formatter_class=Formatter)
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="vector files, read in this order")
    add_store(p)
    g = p.add_argument_group("input")
    opt(g, "--format", choices=("npy", "npz", "csv", "tsv", "parquet", "svmlight", "libsvm", "fvecs", "bvecs",
                                "ivecs"), help="input format when the extension does not say")
    opt(g, "--dim", type=positive_int, help="dimension (svmlight: skips a scan for it; others: checked)")
    opt(g, "--ids", metavar="FILE", help="text file with one id per input row")
    opt(g, "--id-start", type=nonneg_int, default=0, metavar="N",
        help="row-number ids start at N (default 0): rows of a second file added after a first")
    opt(g, "--id-prefix", default="", metavar="TEXT", help="put TEXT in front of every id (e.g. part2-)")
    opt(g, "--id-column", metavar="COL", help="csv/parquet: column (name or 0-based position) holding the ids")
    opt(g, "--label-column", metavar="COL", help="csv/parquet: column kept as metadata {\"label\": ...}")
    opt(g, "--delimiter", metavar="CHAR", help="csv: field separator (default: ',' or tab, detected)")
    hdr = g.add_mutually_exclusive_group()
    hdr.add_argument("--header", dest="header", action="store_const", const=True, default=None,
                     help="csv: the first line is a header (default: detected)")
    hdr.add_argument("--no-header", dest="header", action="store_const", const=False, help="csv: no header line")
    opt(g, "--zero-based", nargs="?", const="yes", default="no", choices=("yes", "no", "auto"),
        help="svmlight: feature indices start at 0 (default: at 1, as LIBSVM writes them; auto: scan)")
    opt(g, "--npz-key", metavar="KEY", help="npz: array to read (default: the first)")
    opt(g, "--npz-label-key", metavar="KEY", help="npz: array of per-row labels kept as metadata")
    opt(g, "--indexed-field", dest="indexed_fields", action="append", metavar="FIELD", env=False,
        help="a new --collection: a metadata field to keep indexed for filters (repeat for more)")
    g = p.add_argument_group("index parameters (new index only)")
    types = get_type_hints(IndexConfig)
    for name in CREATION_FIELDS:
        if name != "dim":
            opt(g, "--" + name.replace("_", "-"), type=whole_number if types[name] is int else float,
                metavar=name.upper(), help=describe(name))
    opt(g, "--shards", type=positive_int, metavar="S", help="Redis: id-shards of a new index (default 16, at most "
        "1,024; fixed at creation): an index meant to grow over a Redis Cluster and search groups takes many")
    g = p.add_argument_group("tuning")
    opt(g, "--tune-queries", metavar="FILE",
        help=f"sample queries to tune the search on (any input format; at least {MIN_QUERIES} rows, "
        f"the first {MAX_QUERIES} used)")
    opt(g, "--tune-queries-key", metavar="KEY", help="npz --tune-queries: array to read (default: the first)")
    g = p.add_argument_group("run")
    opt(g, "--chunk-rows", type=positive_int, help="rows per chunk / write transaction (default: ~32 MB)")
    opt(g, "--overwrite", action="store_true", default=False,
        help="write every chunk again, even those already stored (default: skip them)")
    opt(g, "--skip-invalid", action="store_true", default=False,
        help="leave out rows the index refuses (all-zero, NaN) instead of stopping")
    prog = g.add_mutually_exclusive_group()
    prog.add_argument("--progress", dest="progress", action="store_const", const=True, default=None,
                      help="always show the progress bar (default: when stderr is a terminal)")
    prog.add_argument("--no-progress", dest="progress", action="store_const", const=False,
                      help="never show the progress bar")
    opt(g, "--json", action="store_true", default=False, help="print the summary as JSON")
    p.set_defaults(func=run)


def zero_based(v: str) -> bool | str:
    return {"yes": True, "no": False, "auto": "auto"}[v]


def _tune_queries(args, dim: int):
    """The first :data:`tuner.MAX_QUERIES` rows of ``--tune-queries`` (dense or CSR), checked as
    sample queries; None without the option."""
    from gmmlsh.core.validate import VectorError
    from gmmlsh.index.ingest.base import stack
    from gmmlsh.index.ingest.readers import InputFormatError, detect_format, open_reader
    from gmmlsh.index.tuner import MAX_QUERIES, sample_queries

    if not args.tune_queries:
        return None
    svm = detect_format(args.tune_queries) == "svmlight"
    reader = open_reader(args.tune_queries, dim=dim if svm else None, key=args.tune_queries_key,
                         zero_based=zero_based(args.zero_based))
    parts, rows = [], 0
    for chunk in reader.chunks():
        parts.append(chunk.X[:MAX_QUERIES - rows])
        rows += parts[-1].shape[0]
        if rows == MAX_QUERIES:
            break
    if reader.dim != dim:
        raise InputFormatError(args.tune_queries, f"has dimension {reader.dim}, the index has {dim}")
    Q = stack(parts)
    try:
        sample_queries(Q, dim)
    except VectorError as exc:
        raise UsageError(f"--tune-queries {args.tune_queries}: {exc}") from None
    return Q


def _undoing(args, kind: str, loc: str):
    """How to take back the index this build is about to create, should the build fail (or be
    interrupted) before it stores a vector: a corrected re-run then starts afresh, with a new
    dimension if need be, instead of meeting an empty index of the wrong one."""
    import os
    import shutil

    before = set(os.listdir(loc)) if kind == "lmdb" and os.path.isdir(loc) else None
    collection = where(args).collection

    def undo(index) -> None:
        try:
            if index.count():
                return  # something is stored: the index stays, a re-run resumes it
            if collection != "default":
                with collections_of(args) as cols:
                    cols.delete(collection)
            elif kind == "redis":
                index.store.drop()
                shutil.rmtree(index.mirror.dir, ignore_errors=True)
            elif before is None:
                shutil.rmtree(loc, ignore_errors=True)
            else:  # a directory that was there already: what the creation added
                for name in set(os.listdir(loc)) - before:
                    path = os.path.join(loc, name)
                    if os.path.isdir(path):
                        shutil.rmtree(path)
                    else:
                        os.unlink(path)
        except Exception as exc:  # noqa: BLE001 - the build's own error is the one to report
            print(f"gmmlsh build: the empty index it created is left at {loc}: {exc}", file=sys.stderr)

    return undo


def run(args) -> int:
    from gmmlsh.index.columns import refold_tree
    from gmmlsh.index.compile import kernels_cached
    from gmmlsh.index.config import CREATION_FIELDS, IndexConfig
    from gmmlsh.index.index import Index
    from gmmlsh.index.ingest.build import build
    from gmmlsh.index.ingest.readers import open_reader

    log = sys.stderr
    kind, loc, prefix = location(args)
    try:
        reader = open_reader(args.inputs, fmt=args.format, dim=args.dim, ids_file=args.ids,
                             chunk_rows=args.chunk_rows, key=args.npz_key, label_key=args.npz_label_key,
                             delimiter=args.delimiter, header=args.header, id_column=args.id_column,
                             label_column=args.label_column, zero_based=zero_based(args.zero_based),
                             id_prefix=args.id_prefix, id_start=args.id_start)
    except ValueError as exc:  # options that do not go together
        raise UsageError(str(exc)) from None
    given = {k: getattr(args, k) for k in CREATION_FIELDS if k != "dim" and getattr(args, k) is not None}
    undo = None  # the creation of the index, undone if the build stores nothing in it
    index = open_index(args, must_exist=False, maintain=False)
    if index is not None:
        cfg = index.config
        diffs = [f"{k.replace('_', '-')} {v!r} (index has {getattr(cfg, k)!r})" for k, v in given.items()
                 if getattr(cfg, k) != v]
        if args.dim is not None and args.dim != cfg.dim:
            diffs.append(f"dim {args.dim} (index has {cfg.dim})")
        if diffs:
            index.close()
            raise UsageError(f"the index at {describe(loc, prefix)} exists with other parameters: "
                             f"{'; '.join(diffs)}. Leave them out to add to it, or build into a new location")
        try:
            queries = _tune_queries(args, cfg.dim)
        except Exception:
            index.close()
            raise
    else:
        if reader.needs_scan():
            print(f"scanning {', '.join(reader.paths)} for the dimension (give --dim to skip) ...", file=log,
                  flush=True)
            reader.scan()
        try:
            config = IndexConfig(dim=reader.dim, **given)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        queries = _tune_queries(args, config.dim)  # checked before anything is created
        undo = _undoing(args, kind, loc)
        collection = where(args).collection
        if collection != "default":
            with collections_of(args) as cols:
                cols.create(collection, config, args.indexed_fields or [])
            index = open_index(args, maintain=False)
        else:
            if args.shards and kind != "redis":
                raise UsageError("--shards: only an index in Redis has id-shards")
            shards = {"shards": args.shards} if args.shards else {}
            index = Index.open(loc, config, create=True, maintain=False, **open_options(args), **shards)
    if not kernels_cached():
        print("compiling kernels (first run only: numba keeps them for the next runs) ...", file=log, flush=True)
    with index:
        try:
            summary = build(index, reader, progress=args.progress, resume=not args.overwrite,
                            on_invalid="skip" if args.skip_invalid else "error", log=log, tune_queries=queries)
        except BaseException:
            if undo is not None:
                undo(index)
            raise
        if summary.interrupted and undo is not None:
            undo(index)
        search = index.stats()["search"]
    mirror = index.mirror_path
    del index  # its mappings of the mirror's files, so that they can be read again in 2 MiB pages
    gc.collect()
    refold_tree(mirror)
    if args.json:
        print(json.dumps({"index": describe(loc, prefix), **summary.to_dict(), "search": search}))
    else:
        print(summary.describe())
        if not summary.interrupted:
            print("search: " + describe_search(search))
    advice = next((t["advice"] for t in (summary.upkeep or {}).get("tune", []) if t.get("advice")), None)
    if advice:
        print(f"note: {advice}", file=log)
    return EXIT_INTERRUPTED if summary.interrupted else EXIT_OK
