"""The ``gmmlsh`` command line: build, serve, query, info, check, snapshot, bench.

Every command names its index with ``--index DIR`` (LMDB) or ``--redis URL``
(plus ``--prefix NAME``); every option also reads a ``GMMLSH_*`` environment
variable as its default (``GMMLSH_INDEX``, ``GMMLSH_REDIS_URL``,
``GMMLSH_PREFIX``, ``GMMLSH_CHUNK_ROWS``, ...), the same names the server's
settings use. Exit codes: 0 ok, 1 runtime failure (store down, I/O), 2 usage
or input error, 130 interrupted. Errors are one line; ``--debug`` shows the
traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

EXIT_OK, EXIT_RUNTIME, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
ENV = "GMMLSH_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}
#: Index parameters a build may set, as (option dest, IndexConfig field).
PARAMS = ("bands", "rows", "bits", "seed", "t_bits", "nrff_k", "gamma", "storage")


class UsageError(Exception):
    """A command used wrongly: exit code 2, one line."""


# ============================================================================
# argparse helpers
# ============================================================================


class _Formatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog: str):
        super().__init__(prog, max_help_position=34, width=100)


def _env_name(dest: str) -> str:
    return ENV + dest.upper()


def _opt(p: argparse.ArgumentParser | argparse._ArgumentGroup, *flags: str, dest: str | None = None,
         env: bool = True, help: str = "", **kw) -> argparse.Action:
    """An option whose default comes from ``GMMLSH_<DEST>`` when that is set.

    argparse converts a string default with the option's ``type``, so a bad
    value in the environment is reported like a bad command-line value.
    """
    dest = dest or flags[0].lstrip("-").replace("-", "_")
    if env:
        name = _env_name(dest)
        raw = os.environ.get(name)
        if kw.get("action") in ("store_true", "store_false"):
            if raw is not None and raw.strip().lower() in _TRUE | _FALSE:
                kw["default"] = raw.strip().lower() in _TRUE
        elif raw is not None and raw != "":
            kw["default"] = raw
        help = f"{help} (env {name})" if help else f"(env {name})"
    return p.add_argument(*flags, dest=dest, help=help, **kw)


def _int_at_least(low: int):
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


_positive_int = _int_at_least(1)
_nonneg_int = _int_at_least(0)


def _fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {v}")
    return v


def _add_store(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("index location (one of)")
    g.add_argument("--index", metavar="DIR", help=f"LMDB index directory (env {ENV}INDEX)")
    g.add_argument("--redis", dest="redis_url", metavar="URL",
                   help=f"Redis URL, e.g. redis://localhost:6379/0 (env {ENV}REDIS_URL)")
    _opt(g, "--prefix", metavar="NAME", default="gmmlsh", help="name of the index inside Redis (default gmmlsh)")


def _location(args) -> tuple[str, str, str]:
    """(kind, location, prefix) from --index / --redis, falling back to the environment.

    Both given on the command line is an error; from the environment Redis wins,
    as in the server's settings.
    """
    if args.index and args.redis_url:
        raise UsageError("give either --index DIR or --redis URL, not both")
    if args.redis_url:
        return "redis", args.redis_url, args.prefix
    if args.index:
        return "lmdb", args.index, args.prefix
    env_redis, env_index = os.environ.get(_env_name("redis_url")), os.environ.get(_env_name("index"))
    if env_redis:
        return "redis", env_redis, args.prefix
    if env_index:
        return "lmdb", env_index, args.prefix
    raise UsageError("where is the index? give --index DIR or --redis URL "
                     f"(or set {ENV}INDEX / {ENV}REDIS_URL)")


def _describe_location(kind: str, loc: str, prefix: str) -> str:
    if kind == "lmdb":
        return f"{loc} (LMDB)"
    masked = re.sub(r"//([^:/@]*):([^@]*)@", r"//\1:***@", loc)
    return f"{masked} prefix {prefix!r} (Redis)"


def _open_index(args, *, must_exist: bool = True):
    from gmmlsh.index.index import Index

    kind, loc, prefix = _location(args)
    try:
        return Index.open(loc, None, prefix=prefix, create=False)
    except FileNotFoundError:
        if not must_exist:
            return None
        raise UsageError(f"no index at {_describe_location(kind, loc, prefix)}; create one with "
                         "'gmmlsh build INPUT --index DIR' (or --redis URL)") from None


# ============================================================================
# build
# ============================================================================

BUILD_HELP = """\
Build (or add to, or finish) an index from vector files.

Reads .npy (memory-mapped), .npz, .csv/.tsv, LIBSVM/svmlight (.svm, .svmlight,
.libsvm; sparse, labels kept as metadata) and .fvecs/.bvecs/.ivecs; .gz text
files too. Several inputs are read in order as one stream. Rows are streamed in
chunks (memory stays bounded whatever the file size), hashed on all cores and
written one transaction per chunk, with a progress bar and a summary.

Ids are the row numbers ("0", "1", ... running on across inputs) unless --ids
FILE (one id per line) or --id-column names them.

Parameters: --bands/--rows/--bits/... as given, or chosen by the planner from
a sample of the input (--plan --target-recall 0.95). An existing index keeps
its own parameters (giving different ones is an error).

Safe to interrupt: Ctrl-C stops after the chunk being written (twice: at
once), and a kill leaves only whole chunks. Run the same command again to
finish: chunks already stored are skipped, nothing is duplicated or lost.
"""

BUILD_EXAMPLE = """\
Examples:
  gmmlsh build train.npy --index ./idx
  gmmlsh build data.svm --redis redis://localhost:6379/0 --prefix news --plan --target-recall 0.9
  gmmlsh build part1.csv part2.csv --index ./idx --id-column id --label-column label
  gmmlsh build base.fvecs --index ./idx --ids names.txt --bands 32 --rows 4 --bits 8
"""


def _add_build(sub) -> None:
    p = sub.add_parser("build", help="build an index from vector files", description=BUILD_HELP,
                       epilog=BUILD_EXAMPLE, formatter_class=_Formatter)
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="vector files, read in this order")
    _add_store(p)
    g = p.add_argument_group("input")
    _opt(g, "--format", choices=("npy", "npz", "csv", "tsv", "svmlight", "libsvm", "fvecs", "bvecs", "ivecs"),
         help="input format when the extension does not say")
    _opt(g, "--dim", type=_positive_int, help="dimension (svmlight: skips a scan for it; others: checked)")
    _opt(g, "--ids", metavar="FILE", help="text file with one id per input row")
    _opt(g, "--id-column", metavar="COL", help="csv: column (name or 0-based position) holding the ids")
    _opt(g, "--label-column", metavar="COL", help="csv: column kept as metadata {\"label\": ...}")
    _opt(g, "--delimiter", metavar="CHAR", help="csv: field separator (default: ',' or tab, detected)")
    hdr = g.add_mutually_exclusive_group()
    hdr.add_argument("--header", dest="header", action="store_const", const=True, default=None,
                     help="csv: the first line is a header (default: detected)")
    hdr.add_argument("--no-header", dest="header", action="store_const", const=False, help="csv: no header line")
    _opt(g, "--zero-based", nargs="?", const="yes", default="no", choices=("yes", "no", "auto"),
         help="svmlight: feature indices start at 0 (default: at 1, as LIBSVM writes them; auto: scan)")
    _opt(g, "--npz-key", metavar="KEY", help="npz: array to read (default: the first)")
    _opt(g, "--npz-label-key", metavar="KEY", help="npz: array of per-row labels kept as metadata")
    g = p.add_argument_group("index parameters (new index only)")
    _opt(g, "--bands", type=_positive_int, help="L: LSH bands (default 64)")
    _opt(g, "--rows", type=_positive_int, help="r: samples per band (default 4)")
    _opt(g, "--bits", type=_positive_int, help="b: bits kept per sample, 1-16 (default 8)")
    _opt(g, "--seed", type=_nonneg_int, help="hash seed (default 0)")
    _opt(g, "--t-bits", type=_nonneg_int, help="bits of t* mixed into each code (default 0)")
    _opt(g, "--nrff-k", type=_nonneg_int, help="NRFF features per vector for mode nrff (default 0: none)")
    _opt(g, "--gamma", type=float, help="NRFF kernel width γ (default 1.0)")
    _opt(g, "--storage", choices=("dense", "sparse"),
         help="how vectors are stored (default: sparse for svmlight/sparse npz input, else dense)")
    g = p.add_argument_group("planner")
    _opt(g, "--plan", action="store_true", default=False,
         help="choose bands/rows/bits/candidates from a sample of the input")
    _opt(g, "--target-recall", type=_fraction, default="0.95", help="planner: recall@10 to reach (default 0.95)")
    _opt(g, "--min-similarity", type=_fraction, default=None,
         help="planner: neighbours of interest have at least this GMM (if the planner supports it)")
    _opt(g, "--plan-sample", type=_positive_int, default="2000", help="planner: rows sampled (default 2000)")
    g = p.add_argument_group("run")
    _opt(g, "--chunk-rows", type=_positive_int, help="rows per chunk / write transaction (default: ~32 MB)")
    _opt(g, "--overwrite", action="store_true", default=False,
         help="write every chunk again, even those already stored (default: skip them)")
    _opt(g, "--skip-invalid", action="store_true", default=False,
         help="leave out rows the index refuses (all-zero, NaN) instead of stopping")
    prog = g.add_mutually_exclusive_group()
    prog.add_argument("--progress", dest="progress", action="store_const", const=True, default=None,
                      help="always show the progress bar (default: when stderr is a terminal)")
    prog.add_argument("--no-progress", dest="progress", action="store_const", const=False,
                      help="never show the progress bar")
    _opt(g, "--json", action="store_true", default=False, help="print the summary as JSON")
    p.set_defaults(func=cmd_build)


def _zero_based(v: str) -> bool | str:
    return {"yes": True, "no": False, "auto": "auto"}[v]


def _plan(reader, args, log) -> dict:
    """Parameters from :func:`index.planner.plan` on a sample of the input.

    Expected return: a mapping (or an object with ``to_dict``) with ``bands``,
    ``rows``, ``bits`` and ``candidates`` (the rerank budget, stored with the
    index as its default), plus anything else worth printing.
    """
    from gmmlsh.index import planner

    sample = reader.sample(args.plan_sample)
    if sample is None or sample.shape[0] == 0:
        raise UsageError("--plan: the input has no rows to sample")
    kw: dict = {"target_recall": args.target_recall}
    accepted = inspect.signature(planner.plan).parameters
    if args.min_similarity is not None:
        if "min_similarity" not in accepted:
            raise UsageError("--min-similarity: this planner does not take it; give --target-recall only")
        kw["min_similarity"] = args.min_similarity
    if "n_total" in accepted:
        n = reader.rows
        if n is None:
            n = max(sample.shape[0], _estimate_rows(reader, sample))
        kw["n_total"] = n
    if args.bits is not None and "bits" in accepted:
        kw["bits"] = args.bits
    print(f"planning from {sample.shape[0]:,} sampled rows (target recall {args.target_recall}) ...",
          file=log, flush=True)
    try:
        result = planner.plan(sample, **kw)
    except ValueError as exc:
        raise UsageError(f"--plan: {exc}") from None
    d = result.to_dict() if hasattr(result, "to_dict") else dict(result)
    missing = [k for k in ("bands", "rows", "bits") if k not in d]
    if missing:
        raise RuntimeError(f"planner returned no {', '.join(missing)}")
    extra = ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in d.items()
                      if k not in ("bands", "rows", "bits", "candidates") and isinstance(v, int | float))
    print(f"plan: {d['bands']} bands × {d['rows']} rows, {d['bits']} bits, rerank {d.get('candidates', '?')} "
          f"candidates{'; ' + extra if extra else ''}", file=log, flush=True)
    return d


def _estimate_rows(reader, sample) -> int:
    """Rough row count of text input from the bytes read for the first rows."""
    try:
        first = next(iter(reader.chunks()))
    except StopIteration:
        return 0
    if first.end_byte <= 0:
        return len(first)
    return int(len(first) * reader.size_bytes / first.end_byte)


def cmd_build(args) -> int:
    from gmmlsh.index.config import IndexConfig
    from gmmlsh.index.index import Index
    from gmmlsh.index.ingest.build import build
    from gmmlsh.index.ingest.readers import open_reader

    log = sys.stderr
    kind, loc, prefix = _location(args)
    reader = open_reader(args.inputs, fmt=args.format, dim=args.dim, ids_file=args.ids, chunk_rows=args.chunk_rows,
                         key=args.npz_key, label_key=args.npz_label_key, delimiter=args.delimiter, header=args.header,
                         id_column=args.id_column, label_column=args.label_column,
                         zero_based=_zero_based(args.zero_based))
    explicit = {k: getattr(args, k) for k in PARAMS if getattr(args, k) is not None}
    index = _open_index(args, must_exist=False)
    if index is not None:
        cfg = index.config
        diffs = [f"{k.replace('_', '-')} {v!r} (index has {getattr(cfg, k)!r})" for k, v in explicit.items()
                 if getattr(cfg, k) != v]
        if args.dim is not None and args.dim != cfg.dim:
            diffs.append(f"dim {args.dim} (index has {cfg.dim})")
        if diffs:
            index.close()
            raise UsageError(f"the index at {_describe_location(kind, loc, prefix)} exists with other parameters: "
                             f"{'; '.join(diffs)}. Leave them out to add to it, or build into a new location")
        if args.plan:
            print("index exists: keeping its parameters (--plan ignored)", file=log)
    else:
        if reader.needs_scan():
            print(f"scanning {', '.join(reader.paths)} for the dimension (give --dim to skip) ...", file=log,
                  flush=True)
            reader.scan()
        params: dict = {}
        extra: dict = {}
        if args.plan:
            planned = _plan(reader, args, log)
            params.update({k: planned[k] for k in ("bands", "rows", "bits")})
            if planned.get("candidates") is not None:
                extra["candidates"] = int(planned["candidates"])
            extra["plan"] = {k: v for k, v in planned.items() if isinstance(v, int | float | str)}
        params.update(explicit)
        params.setdefault("storage", "sparse" if reader.sparse else "dense")
        try:
            config = IndexConfig(dim=reader.dim, extra=extra, **params)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        index = Index.open(loc, config, prefix=prefix, create=True)
    with index:
        summary = build(index, reader, progress=args.progress, resume=not args.overwrite,
                        on_invalid="skip" if args.skip_invalid else "error", log=log)
    if args.json:
        print(json.dumps({"index": _describe_location(kind, loc, prefix), **summary.to_dict()}))
    else:
        print(summary.describe())
    return EXIT_INTERRUPTED if summary.interrupted else EXIT_OK


# ============================================================================
# serve
# ============================================================================

SERVE_HELP = """\
Serve an index over HTTP (FastAPI under uvicorn; interactive docs at /docs).

The index is the one `gmmlsh build` wrote, LMDB or Redis, used unchanged.
Every worker process opens the index itself; with Redis, any number of
servers (on any machines) can share one index.
"""

SERVE_EXAMPLE = """\
Examples:
  gmmlsh serve --index ./idx --port 8000
  gmmlsh serve --redis redis://redis:6379/0 --prefix news --host 0.0.0.0 --workers 4
  GMMLSH_INDEX=./idx gmmlsh serve
"""


def _add_serve(sub) -> None:
    p = sub.add_parser("serve", help="serve an index over HTTP", description=SERVE_HELP, epilog=SERVE_EXAMPLE,
                       formatter_class=_Formatter)
    _add_store(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", help="address to listen on (env GMMLSH_HOST; default 127.0.0.1)")
    g.add_argument("--port", type=int, help="port (env GMMLSH_PORT; default 8000)")
    g.add_argument("--workers", type=_positive_int, help="worker processes (env GMMLSH_WORKERS; default 1)")
    p.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    from gmmlsh.service.server import serve
    from gmmlsh.service.settings import Settings
    from pydantic import ValidationError

    kind, loc, prefix = _location(args)
    if kind == "lmdb" and not (Path(loc) / "data.mdb").exists() and not os.environ.get(_env_name("dim")):
        raise UsageError(f"no index at {loc}; build one with 'gmmlsh build INPUT --index {loc}'")
    try:
        if kind == "lmdb":
            settings = Settings(index=str(Path(loc).resolve()), redis_url=None, prefix=prefix)
        else:
            settings = Settings(redis_url=loc, prefix=prefix)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise UsageError(f"settings: {'.'.join(map(str, first['loc']))}: {first['msg']}") from None
    serve(settings, host=args.host, port=args.port, workers=args.workers)
    return EXIT_OK


# ============================================================================
# query
# ============================================================================

QUERY_HELP = """\
Find the nearest neighbours of a stored vector (--id) or of a vector read from
a file (--vector-file, row --row) or given inline (--vector). Prints a table,
or the server's JSON response with --json.
"""

QUERY_EXAMPLE = """\
Examples:
  gmmlsh query --index ./idx --id 42 -k 5
  gmmlsh query --index ./idx --vector-file queries.npy --row 3 --mode exact --json
  gmmlsh query --redis redis://localhost:6379/0 --vector 0,0.5,1.25,0
"""


def _add_query(sub) -> None:
    from gmmlsh.index.index import MODES

    p = sub.add_parser("query", help="nearest neighbours of an id or a vector", description=QUERY_HELP,
                       epilog=QUERY_EXAMPLE, formatter_class=_Formatter)
    _add_store(p)
    g = p.add_argument_group("what to query (one of)")
    what = g.add_mutually_exclusive_group(required=True)
    what.add_argument("--id", help="a stored vector's id (it is left out of its neighbours)")
    what.add_argument("--vector-file", metavar="FILE", help="a vector file (any build input format)")
    what.add_argument("--vector", metavar="V1,V2,...", help="a dense vector, comma-separated")
    g.add_argument("--row", type=_nonneg_int, default=0, help="row of --vector-file (0-based; default 0)")
    g.add_argument("--format", help="format of --vector-file when its extension does not say")
    g.add_argument("--zero-based", nargs="?", const="yes", default="no", choices=("yes", "no", "auto"),
                   help="svmlight --vector-file: indices start at 0")
    g = p.add_argument_group("search")
    _opt(g, "-k", "--k", dest="k", type=_positive_int, default="10", help="neighbours to return (default 10)")
    _opt(g, "--mode", choices=MODES, default="lsh", help="lsh (default), exact (brute force) or nrff")
    _opt(g, "--min-similarity", dest="query_min_similarity", metavar="S", type=float, default="0.0",
         help="drop neighbours below this similarity")
    _opt(g, "--candidates", metavar="N", type=_positive_int, help="rerank budget (default: the index's)")
    _opt(g, "--probe-bands", metavar="N", type=_positive_int, help="probe only the first N bands (default: all)")
    g.add_argument("--json", action="store_true", help="print JSON (as the REST API answers)")
    p.set_defaults(func=cmd_query)


def _query_vector(args, dim: int):
    from gmmlsh.index.ingest.readers import InputFormatError, open_reader

    if args.vector is not None:
        try:
            vals = [float(x) for x in args.vector.replace(" ", "").split(",") if x != ""]
        except ValueError:
            raise InputFormatError("--vector", "expected comma-separated numbers") from None
        return vals
    reader = open_reader(args.vector_file, fmt=args.format, dim=dim if _is_svm(args) else None,
                         zero_based=_zero_based(args.zero_based))
    if reader.dim is not None and reader.dim != dim:
        raise InputFormatError(args.vector_file, f"has dimension {reader.dim}, the index has {dim}")
    reader.dim = dim
    row = reader.read_row(args.row)
    import numpy as np

    return row if hasattr(row, "tocsr") else np.asarray(row[0])


def _is_svm(args) -> bool:
    from gmmlsh.index.ingest.readers import detect_format

    return detect_format(args.vector_file, args.format) == "svmlight"


def cmd_query(args) -> int:
    index = _open_index(args)
    with index:
        kw = {"k": args.k, "mode": args.mode, "min_similarity": args.query_min_similarity,
              "candidates": args.candidates, "bands": args.probe_bands}
        if args.id is not None:
            res = index.query(id=args.id, **kw)
        else:
            res = index.query(_query_vector(args, index.config.dim), **kw)
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


# ============================================================================
# info, check
# ============================================================================

INFO_HELP = "Show an index's parameters, vector count and size."
INFO_EXAMPLE = """\
Examples:
  gmmlsh info --index ./idx
  gmmlsh info --redis redis://localhost:6379/0 --prefix news --json
"""


def _add_info(sub) -> None:
    p = sub.add_parser("info", help="parameters, counts and size of an index", description=INFO_HELP,
                       epilog=INFO_EXAMPLE, formatter_class=_Formatter)
    _add_store(p)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_info)


def cmd_info(args) -> int:
    from gmmlsh.index.ingest.build import _human_bytes, index_size

    kind, loc, prefix = _location(args)
    index = _open_index(args)
    with index:
        stats = index.stats()
        size, size_kind = index_size(index)
    cfg = stats["config"]
    if args.json:
        print(json.dumps({"location": _describe_location(kind, loc, prefix), "bytes": size, "bytes_measure": size_kind,
                          **stats}, default=str))
        return EXIT_OK
    rows = [
        ("index", _describe_location(kind, loc, prefix)),
        ("vectors", f"{stats['count']:,}"),
        ("size", f"{_human_bytes(size)}" + (f" ({size:,} bytes, {size_kind})" if size is not None else "")),
        ("dimension", f"{cfg['dim']:,} ({cfg['storage']} storage)"),
        ("sketch", f"k = {cfg['bands'] * cfg['rows']} samples = {cfg['bands']} bands × {cfg['rows']} rows, "
                   f"{cfg['bits']} bits each" + (f", t_bits {cfg['t_bits']}" if cfg.get("t_bits") else "")),
        ("seed", str(cfg["seed"])),
        ("nrff", f"{cfg['nrff_k']} features, γ = {cfg['gamma']}" if cfg.get("nrff_k") else "off"),
        ("centre", "none" if cfg.get("center") is None else f"{len(cfg['center'])} values"),
        ("rerank", f"{stats.get('default_candidates', '?')} candidates by default"),
        ("format", f"version {cfg.get('format_version')}, generator {cfg.get('generator_version')}"),
    ]
    for k, v in rows:
        print(f"{k:<10} {v}")
    return EXIT_OK


CHECK_HELP = """\
Check an index's integrity by a full scan: every id has a vector that names it
back, a sketch equal to a re-hash of the vector and exactly its L bucket
entries; no bucket entry points at an unknown vector or repeats; no blob
outlives its vector; the count equals the scan. Exit code 0 when it is sound,
1 when problems are found. Check a quiet index (or a snapshot): a write landing
during the scan can look like a problem.

Redis: a writer killed mid-batch leaves journaled leftovers (uncommitted
attempts, retired vectors' bucket entries). Queries never see them; the check
reports them as a note, and --collect-garbage removes them first (attempts
older than --older-than seconds; 0 only when no writer is running).
"""
CHECK_EXAMPLE = """\
Examples:
  gmmlsh check --index ./idx
  gmmlsh check --redis redis://localhost:6379/0 --prefix news --json
  gmmlsh check --redis redis://localhost:6379/0 --collect-garbage --older-than 0   # after a crash, writers stopped
"""


def _add_check(sub) -> None:
    p = sub.add_parser("check", help="integrity check of an index", description=CHECK_HELP,
                       epilog=CHECK_EXAMPLE, formatter_class=_Formatter)
    _add_store(p)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--collect-garbage", action="store_true",
                   help="Redis: first clean up after interrupted writes (no-op for LMDB)")
    p.add_argument("--older-than", type=float, default=600.0, metavar="SECONDS",
                   help="with --collect-garbage: cancel write attempts journaled longer ago than this "
                        "(default 600; 0 only when no writer is running)")
    p.set_defaults(func=cmd_check)


def cmd_check(args) -> int:
    from gmmlsh.index.check import check_index

    if args.older_than < 0:
        raise UsageError(f"--older-than: must be ≥ 0, got {args.older_than:g}")
    index = _open_index(args)
    with index:
        report = check_index(index, collect_garbage=args.older_than if args.collect_garbage else None)
    ok = bool(getattr(report, "ok", True))
    if args.json:
        data = dataclasses.asdict(report) if dataclasses.is_dataclass(report) else report
        if isinstance(data, dict):
            data = {**data, "ok": ok}
        print(json.dumps(data, default=str))
    elif hasattr(report, "summary"):
        print(report.summary())
    else:
        print("ok" if ok else f"problems: {report}")
    return EXIT_OK if ok else EXIT_RUNTIME


# ============================================================================
# snapshot
# ============================================================================

SNAPSHOT_HELP = """\
Write a consistent copy of an LMDB index to a new directory while it is in
use (one read transaction: writers go on, the copy holds exactly the batches
committed when it started). The copy is complete or absent, never
partial. Restore: stop the server, then serve the snapshot directory (or move
it where the index was); `gmmlsh check --index DEST` verifies it.

Redis keeps its own backups: run BGSAVE and copy dump.rdb, or copy the AOF
directory (appendonly yes); this command exits 2 for a Redis index.
"""
SNAPSHOT_EXAMPLE = """\
Examples:
  gmmlsh snapshot --index ./idx ./backups/idx-2024-06-01
  gmmlsh snapshot --index ./idx ./backups/latest --verify
"""


def _add_snapshot(sub) -> None:
    p = sub.add_parser("snapshot", help="hot copy of an LMDB index (backup)", description=SNAPSHOT_HELP,
                       epilog=SNAPSHOT_EXAMPLE, formatter_class=_Formatter)
    p.add_argument("dest", metavar="DEST", help="new (or empty) directory for the copy")
    _add_store(p)
    p.add_argument("--verify", action="store_true", help="run the integrity check on the copy")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_snapshot)


def cmd_snapshot(args) -> int:
    import time

    from gmmlsh.index.index import Index

    kind, loc, prefix = _location(args)
    if kind == "redis":
        print("gmmlsh snapshot: a Redis index is backed up by Redis itself: run `redis-cli BGSAVE` and copy "
              "dump.rdb once `LASTSAVE` changes, or copy the append-only directory (appendonly yes); "
              "see the README's 'Backups' section", file=sys.stderr)
        return EXIT_USAGE
    dest = Path(args.dest)
    if dest.resolve() == Path(loc).resolve():
        raise UsageError("DEST is the index itself; give a new directory")
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise UsageError(f"{dest} exists and is not an empty directory; a snapshot never overwrites")
    t0 = time.monotonic()
    index = _open_index(args)
    with index:
        n = index.count()
        index.snapshot(dest)
    seconds = time.monotonic() - t0
    size = (dest / "data.mdb").stat().st_size
    out: dict = {"snapshot": str(dest), "vectors": n, "bytes": size, "seconds": round(seconds, 3)}
    if args.verify:
        with Index.open(str(dest), None, create=False) as copy:
            report = copy.check()
        out["check"] = {"ok": report.ok, "summary": report.summary()}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"snapshot of {n:,} vectors written to {dest} ({size:,} bytes, {seconds:.2f} s)")
        if args.verify:
            print("check: " + out["check"]["summary"])
    return EXIT_OK if out.get("check", {"ok": True})["ok"] else EXIT_RUNTIME


# ============================================================================
# bench
# ============================================================================

BENCH_HELP = """\
Run a benchmark script from bench/ (python -m bench.NAME ARGS...). A thin hook:
the scripts own their options (try NAME --help) and write their results.

With --data FILE (or --out/--quick/--no-peer and no NAME) it writes the benchmark
report (bench/report.py: markdown + PNG plots) for your own data; FILE is any
format `gmmlsh build` reads, labels (svmlight) give the k-NN comparison. Without
--data the report uses Fashion-MNIST. More report options go after `--`.
"""
BENCH_EXAMPLE = """\
Examples:
  gmmlsh bench --list
  gmmlsh bench NAME --help
  gmmlsh bench --data train.svm --out ./report
  gmmlsh bench --data vectors.npy --out ./report --quick -- --n 20000
  gmmlsh bench report --help
"""


def _bench_dir() -> Path:
    return Path(__file__).resolve().parents[1] / "bench"


def _bench_names() -> list[str]:
    d = _bench_dir()
    if not d.is_dir():
        return []
    return sorted(p.stem for p in d.glob("*.py") if not p.name.startswith("_"))


def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="run a benchmark script from bench/", description=BENCH_HELP,
                       epilog=BENCH_EXAMPLE, formatter_class=_Formatter)
    p.add_argument("--list", action="store_true", help="list the benchmark scripts")
    p.add_argument("--data", metavar="FILE", help="write the benchmark report for this file")
    p.add_argument("--out", metavar="DIR", help="the report's folder (default ./report)")
    p.add_argument("--quick", action="store_true", help="report: small sizes, about a minute")
    p.add_argument("--no-peer", action="store_true", help="report: skip pynndescent")
    p.add_argument("name", nargs="?", help="script name (bench/NAME.py)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="passed to the script")
    p.set_defaults(func=cmd_bench)


def _bench_report_args(args) -> list[str] | None:
    """``bench --data FILE [--out DIR] ...`` → the report's arguments (paths made absolute); None otherwise."""
    if args.list or not (args.data or args.out or args.quick or args.no_peer):
        return None
    argv = []
    if args.data:
        if not Path(args.data).exists():
            raise UsageError(f"--data: no such file: {args.data}")
        argv += ["--data", str(Path(args.data).resolve())]
    argv += ["--out", str(Path(args.out or "report").resolve())]
    argv += ["--quick"] * args.quick + ["--no-peer"] * args.no_peer
    return argv + ([args.name] if args.name else []) + list(args.args)  # anything after `--`


def cmd_bench(args) -> int:
    names = _bench_names()
    report = _bench_report_args(args)
    if report is not None:
        args.name, args.args = "report", report
    if args.list or not args.name:
        if not names:
            print(f"no benchmark scripts in {_bench_dir()}")
        for n in names:
            print(n)
        return EXIT_OK if args.list else EXIT_USAGE
    name = args.name[:-3] if args.name.endswith(".py") else args.name
    if name not in names:
        raise UsageError(f"no benchmark {name!r}; available: {', '.join(names) or 'none'}")
    root = _bench_dir().parent
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.call([sys.executable, "-m", f"bench.{name}", *args.args], cwd=root, env=env)


# ============================================================================
# main
# ============================================================================

MAIN_HELP = """\
gmmlsh: near-neighbour search for the generalized min-max (GMM) similarity.
GCWS sketches, LSH buckets in LMDB or Redis, exact rerank, a REST API.
"""
MAIN_EXAMPLE = """\
Examples:
  gmmlsh build train.npy --index ./idx
  gmmlsh query --index ./idx --id 42
  gmmlsh serve --index ./idx --port 8000

Run 'gmmlsh COMMAND --help' for a command's options.
"""


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gmmlsh", description=MAIN_HELP, epilog=MAIN_EXAMPLE,
                                formatter_class=_Formatter)
    _opt(p, "--debug", action="store_true", default=False, help="show tracebacks")
    p.add_argument("--version", action="version", version=f"gmmlsh {_version()}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_build(sub)
    _add_serve(sub)
    _add_query(sub)
    _add_info(sub)
    _add_check(sub)
    _add_snapshot(sub)
    _add_bench(sub)
    return p


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("gmmlsh")
    except Exception:  # noqa: BLE001
        return "unknown"


def _error_code(exc: BaseException) -> int:
    """Usage/input problems → 2; everything else (store down, I/O, bugs) → 1."""
    from gmmlsh.core.validate import VectorError
    from gmmlsh.index.index import UnknownIdError
    from gmmlsh.index.ingest.readers import InputFormatError
    from gmmlsh.index.store.base import ConfigConflict, StoreUnavailable

    if isinstance(exc, StoreUnavailable):
        return EXIT_RUNTIME
    if isinstance(exc, UsageError | InputFormatError | VectorError | ConfigConflict | UnknownIdError):
        return EXIT_USAGE
    return EXIT_RUNTIME


def _message(exc: BaseException) -> str:
    from gmmlsh.index.index import UnknownIdError

    if isinstance(exc, UnknownIdError):
        return str(exc)
    text = str(exc) or type(exc).__name__
    if isinstance(exc, OSError) and exc.filename and str(exc.filename) not in text:
        text = f"{exc.filename}: {text}"
    if type(exc).__module__ not in ("builtins",) and not isinstance(exc, UsageError | ValueError | KeyError):
        text = f"{type(exc).__name__}: {text}"
    return " ".join(text.split())


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``gmmlsh`` console script; returns the exit code."""
    parser = make_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print(f"gmmlsh {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        return EXIT_OK
    except Exception as exc:  # noqa: BLE001 - one clear line unless --debug
        if args.debug:
            raise
        print(f"gmmlsh {args.command}: error: {_message(exc)}", file=sys.stderr)
        return _error_code(exc)


if __name__ == "__main__":
    sys.exit(main())
