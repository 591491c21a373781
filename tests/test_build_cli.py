"""The batch build and the ``gmmlsh`` command line, end to end on real files, real LMDB and a real redis-server.

Acceptance (batch build issue):
1. Fashion-MNIST as .npy, .csv and svmlight → identical sketches and query answers.
2. A LIBSVM file with 55,000+ features builds and answers queries.
3. A build killed with SIGINT and with SIGKILL mid-way, then re-run, equals an
   uninterrupted build (ids, sketches, answers).
4. Peak RSS building from a 2 GB .npy stays under 600 MB.
5. What a build writes is served by ``gmmlsh serve`` unchanged (LMDB and Redis).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
from redis_fixtures import redis_url  # noqa: F401  (session fixture)

from gmmlsh.core.validate import VectorError
from gmmlsh.index import tuner
from gmmlsh.index.config import IndexConfig
from gmmlsh.index.index import Index
from gmmlsh.index.ingest.build import build, invalid_rows
from gmmlsh.index.ingest.readers import InputFormatError, open_reader
from gmmlsh.service.cli import main

REPO = Path(__file__).resolve().parents[1]
SUBCOMMANDS = ["build", "serve", "query", "info", "check", "bench", "snapshot"]
SMALL = ["--samples", "64"]  # quick to hash, plenty for the checks here
#: One search for every index compared (each tunes its own, timing its candidates): all lists, fixed budgets.
FIXED = {"probes": 0, "shortlist": 500, "rank_bits": 8, "candidates": 200}


# --- helpers --------------------------------------------------------------------------------


def cli_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GMMLSH_")}
    env.update(extra)
    return env


def run_cli(*args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """``gmmlsh ARGS`` as a subprocess (the way users run it)."""
    return subprocess.run([sys.executable, "-m", "gmmlsh.service.cli", *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, env=env or cli_env(), timeout=timeout)


def cli(capsys, *args: str) -> tuple[int, str, str]:
    """``gmmlsh ARGS`` in this process: (exit code, stdout, stderr)."""
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def write_svm(path: Path, X, labels, fmt=lambda v: str(int(v))) -> None:
    with open(path, "w") as f:
        for i, row in enumerate(X):
            nz = np.flatnonzero(row)
            f.write(f"{labels[i]} " + " ".join(f"{j + 1}:{fmt(row[j])}" for j in nz) + "\n")


def snapshot(location: str, **kw) -> dict[str, bytes]:
    """external id → stored sketch bytes, for every vector of an index."""
    with Index.open(location, None, create=False, maintain=False, **kw) as ix:
        out: dict[str, bytes] = {}
        for ids, iids in ix.store.scan_ids():
            for name, blob in zip(ids, ix.store.read(iids, ["sketch"])["sketch"], strict=True):
                out[name] = bytes(blob)
        return out


def answers(location: str, queries, ids=(), k: int = 10, modes=("auto", "exact"), **kw) -> list:
    """(id, similarity) lists of queries by vector and by stored id in each of ``modes``, under :data:`FIXED`."""
    out = []
    with Index.open(location, None, create=False, maintain=False, search=FIXED, **kw) as ix:
        for q in queries:
            for mode in modes:
                r = ix.query(q, k=k, mode=mode, candidates=FIXED["candidates"])
                out.append([(n.id, n.similarity) for n in r.neighbors])
        for i in ids:
            for mode in modes:
                r = ix.query(id=i, k=k, mode=mode, candidates=FIXED["candidates"])
                out.append([(n.id, n.similarity) for n in r.neighbors])
    return out


def count(location: str, **kw) -> int:
    try:
        with Index.open(location, None, create=False, **kw) as ix:
            return ix.count()
    except FileNotFoundError:
        return 0


@pytest.fixture(scope="module")
def fm(fmnist):
    """3,000 training rows with labels, and 20 test rows as queries."""
    return fmnist[0][:3000], fmnist[1][:3000], fmnist[2][:20]


# --- help, usage, errors ----------------------------------------------------------------------


@pytest.mark.parametrize("command", SUBCOMMANDS + [None])
def test_help_of_every_command_says_what_it_does_with_an_example(command, capsys):
    with pytest.raises(SystemExit) as ei:
        main(([command] if command else []) + ["--help"])
    assert ei.value.code == 0
    out = capsys.readouterr().out
    assert "Example" in out and "gmmlsh" in out
    if command not in (None, "bench"):
        assert "--index" in out and "--redis" in out and "GMMLSH_" in out
    if command == "serve":  # how to start from nothing
        assert "GMMLSH_DIM=784 gmmlsh serve --index ./new-idx" in out


def test_usage_errors_exit_2_with_one_line(tmp_path):
    np.save(tmp_path / "x.npy", np.ones((3, 4)))
    r = run_cli("build", tmp_path / "x.npy")  # no index location
    assert r.returncode == 2 and "give --index DIR or --redis URL" in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = run_cli("build", tmp_path / "x.npy", "--index", tmp_path / "i", "--redis", "redis://x")
    assert r.returncode == 2 and "not both" in r.stderr
    r = run_cli("build", tmp_path / "x.npy", "--index", tmp_path / "i", "--samples", "zero")
    assert r.returncode == 2 and "--samples" in r.stderr
    r = run_cli("build", tmp_path / "x.npy", "--index", tmp_path / "i", "--bits", "17")  # IndexConfig's bounds
    assert r.returncode == 2 and "bits: must be between 1 and 16" in r.stderr and count(str(tmp_path / "i")) == 0
    r = run_cli("query", "--index", tmp_path / "none", "--id", "1")
    assert r.returncode == 2 and "no index at" in r.stderr and "Traceback" not in r.stderr


def test_first_runs_say_they_compile_kernels(tmp_path):
    """An empty numba cache is noticed (build then says "compiling kernels"); after
    ``python -m gmmlsh.index.compile`` (what the Docker image runs) it is full and nothing is said."""
    probe = "from gmmlsh.index.compile import kernels_cached; print(kernels_cached())"
    env = {**cli_env(), "NUMBA_CACHE_DIR": str(tmp_path / "cache")}

    def cached() -> str:
        r = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=120)
        return r.stdout.strip() or r.stderr

    assert cached() == "False"
    np.save(tmp_path / "x.npy", np.ones((3, 4)))
    r = run_cli("build", tmp_path / "x.npy", "--index", tmp_path / "i", "--no-progress", env=env)
    assert r.returncode == 0 and "compiling kernels (first run only" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "gmmlsh.index.compile"], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0 and "kernels compiled" in r.stdout, r.stderr
    assert cached() == "True"
    r = run_cli("build", tmp_path / "x.npy", "--index", tmp_path / "j", "--no-progress", env=env)
    assert r.returncode == 0 and "compiling kernels" not in r.stderr, r.stderr


@pytest.mark.parametrize("workers", ["1", "2"])
def test_serve_that_cannot_open_its_index_exits_1_with_one_line(tmp_path, workers):
    """A store that is down: one line naming the cause, exit 1, no traceback, whatever --workers says."""
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = run_cli("serve", "--redis", f"redis://:secret@127.0.0.1:{port}/0", "--workers", workers,
                "--port", str(_free_port()), timeout=60)
    assert r.returncode == 1, r.stderr
    assert "cannot start" in r.stderr and "Traceback" not in r.stderr and "secret" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_malformed_input_names_file_and_line_without_traceback(tmp_path):
    bad = tmp_path / "data.svm"
    bad.write_text("1 1:1 2:2\n" * 16 + "1 x3:1\n")
    r = run_cli("build", bad, "--index", tmp_path / "i", "--dim", "4", "--no-progress")
    assert r.returncode == 2, r.stderr
    # one line of error (on a machine's first build, an informational "compiling kernels" line comes before it)
    lines = [line for line in r.stderr.strip().splitlines() if not line.startswith("compiling kernels")]
    assert "data.svm:17: " in r.stderr and "'x3'" in r.stderr and len(lines) == 1, r.stderr
    assert "Traceback" not in r.stderr
    r = run_cli("--debug", "build", bad, "--index", tmp_path / "i2", "--dim", "4", "--no-progress")
    assert r.returncode != 0 and "Traceback" in r.stderr


def test_invalid_rows_stop_the_build_or_are_skipped(tmp_path, capsys):
    csv = tmp_path / "z.csv"
    csv.write_text("a,b\n1,2\n0,0\n3,4\nnan,1\n")
    code, _, err = cli(capsys, "build", csv, "--index", tmp_path / "i", *SMALL, "--no-progress")
    assert code == 2 and "z.csv:3: all-zero vector" in err
    assert count(str(tmp_path / "i")) == 0  # nothing of the bad chunk was written
    code, out, err = cli(capsys, "build", csv, "--index", tmp_path / "i", *SMALL, "--no-progress",
                         "--skip-invalid", "--json")
    assert code == 0, err
    s = json.loads(out)
    assert (s["vectors"], s["invalid"], s["count"]) == (2, 2, 2)
    assert "z.csv:5: values must be finite" in err
    assert [r for r, _ in invalid_rows(np.array([[1.0, 0], [0, 0], [np.inf, 1]]))] == [1, 2]
    assert [r for r, _ in invalid_rows(sp.csr_matrix(np.array([[1.0, 0], [0, 0]])))] == [1]


def test_existing_index_keeps_its_parameters(tmp_path, capsys):
    X = np.random.default_rng(0).random((50, 8)) + 0.1
    np.save(tmp_path / "x.npy", X)
    idx = tmp_path / "i"
    assert cli(capsys, "build", tmp_path / "x.npy", "--index", idx, *SMALL, "--no-progress")[0] == 0
    code, _, err = cli(capsys, "build", tmp_path / "x.npy", "--index", idx, "--samples", "32", "--no-progress")
    assert code == 2 and "exists with other parameters: samples 32 (index has 64)" in err
    code, out, _ = cli(capsys, "build", tmp_path / "x.npy", "--index", idx, "--no-progress", "--json")
    assert code == 0 and json.loads(out)["skipped"] == 50
    code, _, err = cli(capsys, "build", tmp_path / "x.npy", "--index", idx, "--no-progress", "--dim", "9")
    assert code == 2 and "has dimension 8, expected 9" in err


def test_a_second_file_says_what_it_replaced_or_adds_under_other_ids(tmp_path, capsys):
    """Row-number ids restart at 0 for every build: a second file replaces the first's rows,
    and the summary says so; --id-start and --id-prefix add its rows instead (issue #35, 5)."""
    rng = np.random.default_rng(3)
    np.save(tmp_path / "a.npy", rng.random((40, 6)) + 0.1)
    np.save(tmp_path / "b.npy", rng.random((30, 6)) + 0.1)
    idx = tmp_path / "i"
    assert cli(capsys, "build", tmp_path / "a.npy", "--index", idx, *SMALL, "--no-progress")[0] == 0
    code, out, err = cli(capsys, "build", tmp_path / "b.npy", "--index", idx, "--no-progress")
    assert code == 0, err
    assert "30 of them replaced vectors stored under the same ids" in out and "--id-start" in out
    assert "index now holds 40 vectors" in out
    code, out, err = cli(capsys, "build", tmp_path / "b.npy", "--index", idx, "--no-progress", "--id-start", "40",
                         "--json")
    assert code == 0, err
    assert (json.loads(out)["vectors"], json.loads(out)["replaced"], json.loads(out)["count"]) == (30, 0, 70)
    code, out, err = cli(capsys, "build", tmp_path / "b.npy", "--index", idx, "--no-progress", "--id-prefix", "b-")
    assert code == 0 and "replaced" not in out and "index now holds 100 vectors" in out, out + err
    with Index.open(str(idx), None, create=False, maintain=False) as ix:
        assert ix.contains("b-29") and ix.contains("69") and not ix.contains("70")
    code, _, err = cli(capsys, "build", tmp_path / "b.npy", "--index", idx, "--no-progress", "--id-start", "5",
                       "--ids", tmp_path / "a.npy")
    assert code == 2 and "id_start" in err


@pytest.mark.parametrize("where", ["default", "collection", "redis"])
def test_a_build_that_stores_nothing_leaves_no_index_behind(tmp_path, capsys, where, request):
    """A failed first build used to leave an empty index of its input's dimension, and the
    corrected re-run failed on it until the directory was removed by hand (issue #35, 6)."""
    bad = tmp_path / "bad.csv"  # the id column read as a feature: 3 columns, and text in the first
    bad.write_text("r1,0.5,2\nr2,1,1\n")
    good = tmp_path / "good.csv"
    good.write_text("r1,0.5,2\nr2,1,1\n")
    if where == "redis":
        target = ["--redis", request.getfixturevalue("redis_url"), "--prefix", f"t{uuid.uuid4().hex[:12]}",
                  "--cache-dir", tmp_path / "cache"]
    else:
        target = ["--index", tmp_path / "i"] + (["--collection", "pets"] if where == "collection" else [])
    code, _, err = cli(capsys, "build", bad, *target, *SMALL, "--no-progress", "--no-header")
    assert code == 2 and "bad.csv" in err
    if where == "default":
        assert not (tmp_path / "i").exists()
    code, out, err = cli(capsys, "build", good, *target, *SMALL, "--no-progress", "--id-column", "0", "--json")
    assert code == 0, err
    assert json.loads(out)["count"] == 2
    code, out, _ = cli(capsys, "info", *target, "--json")
    assert json.loads(out)["config"]["dim"] == 2


def test_environment_supplies_defaults(tmp_path, monkeypatch, capsys):
    X = np.random.default_rng(1).random((40, 6)) + 0.1
    np.save(tmp_path / "x.npy", X)
    monkeypatch.setenv("GMMLSH_INDEX", str(tmp_path / "envidx"))
    monkeypatch.setenv("GMMLSH_SAMPLES", "32")
    monkeypatch.setenv("GMMLSH_BITS", "4")
    code, _, err = cli(capsys, "build", tmp_path / "x.npy", "--no-progress")
    assert code == 0, err
    code, out, _ = cli(capsys, "info", "--json")
    info = json.loads(out)
    assert (info["count"], info["config"]["samples"], info["config"]["bits"]) == (40, 32, 4)
    assert info["config"]["seed"] == IndexConfig.__dataclass_fields__["seed"].default  # unset: IndexConfig's
    monkeypatch.setenv("GMMLSH_JSON", "yes")
    code, out, _ = cli(capsys, "build", tmp_path / "x.npy", "--no-progress")
    assert code == 0 and json.loads(out)["skipped"] == 40
    monkeypatch.setenv("GMMLSH_JSON", "")  # empty: unset, as the server's settings read it
    code, out, _ = cli(capsys, "build", tmp_path / "x.npy", "--no-progress")
    assert code == 0 and not out.startswith("{")
    monkeypatch.setenv("GMMLSH_CHUNK_ROWS", "-3")
    with pytest.raises(SystemExit) as ei:
        main(["build", str(tmp_path / "x.npy")])
    assert ei.value.code == 2


def test_the_environment_is_read_as_the_server_reads_it(tmp_path, monkeypatch, capsys):
    """One reader of GMMLSH_*: a flag that is no boolean, or a collection name the server would
    refuse, is a usage error naming it; an option given beats the environment, and an explicit
    --index beats GMMLSH_REDIS_URL."""
    X = np.random.default_rng(1).random((20, 4)) + 0.1
    np.save(tmp_path / "x.npy", X)
    assert cli(capsys, "build", tmp_path / "x.npy", "--index", tmp_path / "i", *SMALL, "--no-progress")[0] == 0
    monkeypatch.setenv("GMMLSH_JSON", "perhaps")
    with pytest.raises(SystemExit) as ei:
        main(["info", "--index", str(tmp_path / "i")])
    assert ei.value.code == 2 and "GMMLSH_JSON" in capsys.readouterr().err
    monkeypatch.delenv("GMMLSH_JSON")
    monkeypatch.setenv("GMMLSH_REDIS_URL", "redis://127.0.0.1:1/0")  # no server there: never asked
    code, out, err = cli(capsys, "info", "--index", tmp_path / "i", "--json")
    assert code == 0 and json.loads(out)["count"] == 20, err
    monkeypatch.setenv("GMMLSH_COLLECTION", "no/such name")
    code, _, err = cli(capsys, "info", "--index", tmp_path / "i")
    assert code == 2 and "collection" in err
    code, out, err = cli(capsys, "info", "--index", tmp_path / "i", "--collection", "default", "--json")
    assert code == 0 and json.loads(out)["count"] == 20, err


def test_check_and_bench_hooks(tmp_path, capsys):
    X = np.random.default_rng(2).random((30, 5)) + 0.1
    np.save(tmp_path / "x.npy", X)
    assert cli(capsys, "build", tmp_path / "x.npy", "--index", tmp_path / "i", *SMALL, "--no-progress")[0] == 0
    code, out, err = cli(capsys, "check", "--index", tmp_path / "i")
    assert code == 0 and "30 vectors, 30 ids, 30 mirror rows: OK" in out, out + err
    code, out, err = cli(capsys, "check", "--index", tmp_path / "i", "--json")
    report = json.loads(out)
    assert code == 0 and report["ok"] is True and (report["vectors"], report["problems"]) == (30, {})
    code, out, _ = cli(capsys, "bench", "--list")
    assert code == 0
    code, _, err = cli(capsys, "bench", "no-such-benchmark")
    assert code == 2 and "no benchmark 'no-such-benchmark'" in err


def test_build_tunes_on_sample_queries_refusing_bad_ones_before_writing(tmp_path, fmnist, capsys):
    """``--tune-queries``: the search is tuned on those queries, and says so; too few of them, or
    one the index could not take, stop the command before it creates anything."""
    X, Q = fmnist[0][:2000], fmnist[2][:150].astype(np.float32)
    bad = Q.copy()
    bad[100, 3] = np.nan
    np.save(tmp_path / "x.npy", X)
    np.savez(tmp_path / "q.npz", few=Q[:10], bad=bad, queries=Q)
    idx = tmp_path / "idx"
    for key, says in (("few", "10 rows: tuning needs at least 128 sample queries"),
                      ("bad", "queries[100]: values must be finite")):
        code, _, err = cli(capsys, "build", tmp_path / "x.npy", "--index", idx, "--tune-queries", tmp_path / "q.npz",
                           "--tune-queries-key", key, "--no-progress")
        assert code == 2 and f"--tune-queries {tmp_path / 'q.npz'}: " in err and says in err, err
        assert not idx.exists()
    code, out, err = cli(capsys, "build", tmp_path / "x.npy", "--index", idx, "--tune-queries", tmp_path / "q.npz",
                         "--tune-queries-key", "queries", "--no-progress", "--json")
    assert code == 0, err
    summary = json.loads(out)
    assert summary["upkeep"]["tune"][-1]["sample"] == f"{tuner.MAX_QUERIES} queries"  # the first of the 150
    assert summary["search"]["tuned_on"] == "queries"
    with Index.open(str(idx), None, create=False, maintain=False) as ix:  # the Python API: the same check
        with pytest.raises(VectorError, match=r"queries\[100\]"):
            ix.maintain(queries=bad)
        assert ix.stats()["search"] == summary["search"]


def test_ids_file_inline_vector_info_and_tuned_search(tmp_path, fm, capsys):
    X, y, Q = fm
    np.save(tmp_path / "f.npy", X[:1000])
    (tmp_path / "ids.txt").write_text("".join(f"img-{i}\n" for i in range(1000)))
    idx = tmp_path / "idx"
    code, out, err = cli(capsys, "build", tmp_path / "f.npy", "--index", idx, "--ids", tmp_path / "ids.txt",
                         "--no-progress")
    assert code == 0, err
    assert "1,000 vectors written" in out and "search: " in out and "on stored vectors" in out
    with Index.open(str(idx), None, create=False) as ix:
        assert ix.contains("img-999") and not ix.contains("999")
        tuned = ix.stats()["search"]
    code, out, _ = cli(capsys, "info", "--index", idx)
    # at 1,000 vectors brute force is cheaper than sketching a query: info says which was chosen
    chosen = "exact (cheaper than any sketch or postings search" if tuned["exact"] else f"rerank {tuned['candidates']}"
    assert code == 0 and "vectors    1,000" in out and "512 samples" in out and chosen in out, out
    assert f"tuned at 1,000 vectors on {tuned['tuned_on']}" in out and "rows not listed yet" in out
    code, out, _ = cli(capsys, "info", "--index", idx, "--json")
    info = json.loads(out)
    assert info["search"]["tuned_at_rows"] == 1000 and info["mirror"]["rows"] == 1000
    assert info["config"]["samples"] == 512  # IndexConfig's default
    code, out, _ = cli(capsys, "query", "--index", idx, "--vector", ",".join(str(int(v)) for v in X[5]),
                       "-k", "1", "--mode", "exact", "--json")
    assert code == 0 and json.loads(out)["neighbors"][0] == {"id": "img-5", "similarity": 1.0, "metadata": None}
    code, out, _ = cli(capsys, "query", "--index", idx, "--id", "img-5", "-k", "3", "--probes", "1",
                       "--candidates", "20", "--json")
    assert code == 0 and json.loads(out)["mode"] in ("sketch", "exact") and len(json.loads(out)["neighbors"]) == 3
    code, _, err = cli(capsys, "query", "--index", idx, "--vector", "1,2,3")
    assert code == 2 and "expected 784 values" in err
    # an .npz of several arrays: --npz-key picks one, --row a row of it
    np.savez(tmp_path / "q.npz", labels=y[:10], queries=X[:10])
    code, out, err = cli(capsys, "query", "--index", idx, "--vector-file", tmp_path / "q.npz", "--npz-key",
                         "queries", "--row", "7", "-k", "1", "--mode", "exact", "--json")
    assert code == 0, err
    assert json.loads(out)["neighbors"][0] == {"id": "img-7", "similarity": 1.0, "metadata": None}
    code, _, err = cli(capsys, "query", "--index", idx, "--vector-file", tmp_path / "q.npz", "--npz-key", "nope")
    assert code == 2 and "nope" in err


# --- the build as a library ---------------------------------------------------------------------


def test_build_streams_chunks_and_resumes(tmp_path):
    rng = np.random.default_rng(3)
    X = rng.random((1000, 16)) + 0.01
    np.save(tmp_path / "x.npy", X)
    cfg = IndexConfig(dim=16, samples=64)
    with Index.open(str(tmp_path / "i"), cfg) as ix:
        s = build(ix, open_reader(tmp_path / "x.npy"), chunk_rows=128, progress=False)
        assert (s.rows, s.vectors, s.skipped, s.count) == (1000, 1000, 0, 1000)
        assert s.index_bytes and s.index_bytes > 0 and s.vectors_per_s > 0 and s.upkeep is not None
        s = build(ix, open_reader(tmp_path / "x.npy"), chunk_rows=128, progress=False)
        assert (s.vectors, s.skipped) == (0, 1000)
        # a changed input is written again, not skipped
        X[500, 3] += 1.0
        np.save(tmp_path / "x.npy", X)
        s = build(ix, open_reader(tmp_path / "x.npy"), chunk_rows=128, progress=False)
        assert s.vectors == 128 and s.skipped == 872
        assert np.array_equal(ix.get("500").values, X[500].astype(np.float32))
        s = build(ix, open_reader(tmp_path / "x.npy"), chunk_rows=128, progress=False, resume=False)
        assert s.vectors == 1000 and s.count == 1000
    with Index.open(str(tmp_path / "j"), IndexConfig(dim=17)) as ix, pytest.raises(InputFormatError,
                                                                                  match="dimension 16"):
        build(ix, open_reader(tmp_path / "x.npy"), progress=False)


def test_a_build_into_an_index_with_upkeep_on_leaves_the_lists_to_its_end(tmp_path, fmnist):
    """``Index.open``'s default runs upkeep in a worker process when it falls due. A bulk load
    into such an index starts none: its mirror follower used to (each catch-up told upkeep of the
    view), and the worker rebuilt and re-tuned the lists over and over while the load ran on the
    same cores (60,000 Fashion-MNIST rows: 2,561 rows/s against 21,531 with upkeep off). The
    load's own end builds and tunes them once, in this process."""
    np.save(tmp_path / "x.npy", fmnist[0][:20_000])
    with Index.open(str(tmp_path / "i"), IndexConfig(dim=784, samples=64)) as ix:
        s = build(ix, open_reader(tmp_path / "x.npy"), chunk_rows=500, progress=False)
        upkeep = ix.upkeep.report(200)
        assert s.vectors == 20_000 and s.upkeep["fit"] and upkeep["running"] == []
        assert {e["pid"] for e in upkeep["recent"]} == {os.getpid()}
        assert ix.upkeep._worker is None  # none started (one that had not logged yet is caught here)


@pytest.mark.parametrize("backend", ["lmdb", "redis"])
def test_hashing_ahead_keeps_input_order_and_stops_at_the_bad_chunk(backend, tmp_path, request):
    """The next chunk is hashed while one is written: an id repeated in a later chunk still
    ends with the later row, and a bad row in chunk 3 stops the build with chunks 1–2 written
    and nothing of chunk 3 (its hashing-ahead error surfaces only when its turn comes)."""
    rng = np.random.default_rng(8)
    X = rng.random((40, 6)) + 0.01
    ids = [f"r{i}" for i in range(40)]
    ids[25] = ids[3]  # chunk 3 (rows 20-29) replaces a row of chunk 1
    ids[12] = ids[31]  # chunk 4 replaces a row of chunk 2
    csv = tmp_path / "x.csv"

    def reader():
        csv.write_text("id,a,b,c,d,e,f\n" + "".join(
            f"{i}," + ",".join(repr(v) for v in row.tolist()) + "\n" for i, row in zip(ids, X, strict=True)))
        return open_reader(csv, id_column="id", chunk_rows=10)

    def stored(i: int) -> np.ndarray:
        return ix.get(ids[i]).values

    _, loc, kw = _target(backend, tmp_path, request)
    cfg = IndexConfig(dim=6, samples=16)
    with Index.open(loc, cfg, **kw) as ix:
        s = build(ix, reader(), progress=False)
        assert (s.rows, s.vectors, s.count) == (40, 40, 38)
        assert np.array_equal(stored(3), X[25].astype(np.float32))
        assert np.array_equal(stored(12), X[31].astype(np.float32))
        X[5, 0] += 1.0  # chunk 1 changed: written again
        X[24] = 0.0  # chunk 3 now holds an all-zero row (CSV line 26)
        with pytest.raises(InputFormatError, match=r"x\.csv:26: all-zero vector"):
            build(ix, reader(), progress=False)
        assert np.array_equal(stored(5), X[5].astype(np.float32))
        assert np.array_equal(stored(12), X[12].astype(np.float32))  # chunk 2 written (its r31 differs)
        assert np.array_equal(stored(3), X[3].astype(np.float32))  # chunk 3 wrote nothing
        assert ix.count() == 38


# --- acceptance 1: three formats, one index ---------------------------------------------------


def test_fmnist_as_npy_csv_svmlight_builds_identical_indexes(tmp_path, fm, capsys):
    X, y, Q = fm
    np.save(tmp_path / "f.npy", X)
    np.savetxt(tmp_path / "f.csv", X, fmt="%d", delimiter=",")
    write_svm(tmp_path / "f.svm", X, y)
    locs = {}
    for name, extra in [("f.npy", []), ("f.csv", []), ("f.svm", ["--dim", "784"]),
                        ("f.svm", ["--dim", "784", "--chunk-rows", "700"])]:
        loc = str(tmp_path / f"idx-{name}-{len(extra)}-{extra[-1] if extra else ''}")
        code, out, err = cli(capsys, "build", tmp_path / name, "--index", loc, "--no-progress", "--json", *extra)
        assert code == 0, err
        assert json.loads(out)["count"] == 3000
        locs[(name, tuple(extra))] = loc
    snaps = [snapshot(loc) for loc in locs.values()]
    assert len(snaps[0]) == 3000 and set(snaps[0]) == {str(i) for i in range(3000)}
    for s in snaps[1:]:
        assert s == snaps[0]
    results = [answers(loc, Q, ids=["0", "17", "2999"]) for loc in locs.values()]
    assert all(len(a) == 10 for r in results for a in r)
    for r in results[1:]:
        assert r == results[0]
    with Index.open(locs[("f.svm", ("--dim", "784"))], None, create=False) as ix:
        assert ix.get("3").metadata == {"label": int(y[3])}


# --- acceptance 2: a wide LIBSVM file -----------------------------------------------------------


def test_libsvm_with_55000_plus_features_builds_and_answers(tmp_path, capsys):
    rng = np.random.default_rng(12)
    n, d, groups = 2000, 60000, 40
    pools = [rng.choice(d, size=150, replace=False) for _ in range(groups)]  # each group's vocabulary
    weights = [dict(zip(p.tolist(), (rng.random(150) * 10 + 0.5).tolist(), strict=True)) for p in pools]
    with open(tmp_path / "wide.libsvm", "w") as f:
        for i in range(n):
            g = i % groups
            feats = np.union1d(rng.choice(pools[g], 135, replace=False), rng.choice(d, 15, replace=False))
            vals = np.round([weights[g].get(j, 1.0) * rng.uniform(0.8, 1.25) for j in feats.tolist()], 3)
            f.write(f"{i % 5} " + " ".join(f"{j + 1}:{v:g}" for j, v in zip(feats, vals, strict=True)) + "\n")
    idx = tmp_path / "wide"
    code, out, err = cli(capsys, "build", tmp_path / "wide.libsvm", "--index", idx, "--no-progress", "--json")
    assert code == 0, err
    assert "scanning" in err
    s = json.loads(out)
    assert s["count"] == n
    with Index.open(str(idx), None, create=False) as ix:
        dim = ix.config.dim
        assert dim >= 55000 and ix.get("3").indices is not None  # given sparse, stored sparse
        chosen = "exact" if ix.stats()["search"]["exact"] else "sketch"
    # a vector from the file finds itself first, exactly: by the index's own choice (on 2,000 rows
    # of 60,000 dimensions brute force is cheaper than sketching the query), and through the lists
    for knobs, mode in (((), chosen), (("--candidates", "50"), "sketch")):
        code, out, err = cli(capsys, "query", "--index", idx, "--vector-file", tmp_path / "wide.libsvm", "--row",
                             "123", "-k", "3", "--json", *knobs)
        assert code == 0, err
        res = json.loads(out)
        assert res["mode"] == mode and res["neighbors"][0]["id"] == "123"
        assert res["neighbors"][0]["similarity"] == pytest.approx(1.0)
        assert res["neighbors"][0]["metadata"] == {"label": 123 % 5}
    code, out, _ = cli(capsys, "query", "--index", idx, "--id", "7", "-k", "5")
    assert code == 0 and "rank" in out and len(out.strip().splitlines()) == 7, out
    found = [int(line.split()[1]) for line in out.strip().splitlines()[2:]]
    assert all(i % groups == 7 % groups for i in found)  # neighbours share its vocabulary
    code, out, err = cli(capsys, "query", "--index", idx, "--id", "nope")
    assert code == 2 and "no vector with id 'nope'" in err


# --- acceptance 3: interrupted builds finish to the same index ------------------------------------


@pytest.fixture(scope="module")
def big_input(fmnist, tmp_path_factory):
    """12,000 Fashion-MNIST rows as .npy, and 10 queries."""
    tmp = tmp_path_factory.mktemp("interrupt")
    np.save(tmp / "big.npy", fmnist[0][:12000])
    return tmp / "big.npy", fmnist[2][:10]


def _target(backend: str, tmp: Path, request) -> tuple[list[str], str, dict]:
    """(CLI options, location, Index.open options) of a fresh index on ``backend``."""
    if backend == "lmdb":
        loc = str(tmp / f"idx-{uuid.uuid4().hex[:6]}")
        return ["--index", loc], loc, {}
    url = request.getfixturevalue("redis_url")
    prefix = f"i{uuid.uuid4().hex[:10]}"
    return ["--redis", url, "--prefix", prefix], url, {"prefix": prefix}


@pytest.mark.parametrize("backend, sig", [("lmdb", signal.SIGINT), ("lmdb", signal.SIGKILL), ("redis", signal.SIGKILL)],
                         ids=["lmdb-SIGINT", "lmdb-SIGKILL", "redis-SIGKILL"])
def test_interrupted_build_then_rerun_equals_uninterrupted(big_input, tmp_path, request, backend, sig):
    data, Q = big_input
    base = [sys.executable, "-m", "gmmlsh.service.cli", "build", str(data), "--chunk-rows", "500", "--no-progress",
            *SMALL]
    ref_opts, ref_loc, ref_kw = _target(backend, tmp_path, request)
    r = subprocess.run(base + ref_opts, cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr

    opts, loc, kw = _target(backend, tmp_path, request)
    proc = subprocess.Popen(base + opts, cwd=REPO, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 300
    while count(loc, **kw) < 1000:
        assert proc.poll() is None, f"build ended before it could be interrupted: {proc.communicate()}"
        assert time.monotonic() < deadline, "build wrote nothing in time"
        time.sleep(0.05)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    written = count(loc, **kw)
    assert 0 < written < 12000, "the build was not interrupted mid-way"
    if sig == signal.SIGINT:
        assert proc.returncode == 130, err
        assert "interrupted" in out and "Run the same command again" in out
    else:
        assert proc.returncode == -signal.SIGKILL
    r = subprocess.run(base + opts + ["--json"], cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["count"] == 12000 and summary["skipped"] + summary["vectors"] == 12000
    assert summary["skipped"] >= written - 500  # only the chunk in flight (if any) is written again
    assert snapshot(loc, **kw) == snapshot(ref_loc, **ref_kw)
    ids = ["0", "5000", "11999"]
    exact = answers(loc, Q, ids=ids, modes=("exact",), **kw)
    assert exact == answers(ref_loc, Q, ids=ids, modes=("exact",), **ref_kw)
    # The sketch search may break near-ties differently: the chunk in flight was written again under new row
    # numbers, so the two indexes' lists differ. Both find the true neighbours alike.
    tenth = [a[-1][1] for a in exact]
    recalls, found = [], []
    for location, options in ((loc, kw), (ref_loc, ref_kw)):
        auto = answers(location, Q, ids=ids, modes=("auto",), **options)
        recalls.append(np.mean([sum(sim >= t - 1e-12 for _, sim in a) / 10 for a, t in zip(auto, tenth, strict=True)]))
        found.append([{i for i, _ in a} for a in auto])
    shared = np.mean([len(a & b) / 10 for a, b in zip(*found, strict=True)])
    print(f"auto recall {recalls}, answers shared {shared:.3f}")
    assert min(recalls) >= 0.9 and abs(recalls[0] - recalls[1]) <= 0.05 and shared >= 0.9, (recalls, shared)


# --- acceptance 4: bounded memory -------------------------------------------------------------------


def _write_big_npy(path: Path, rows: int, dim: int, nnz: int) -> None:
    """A float32 .npy written block by block (never mapped: this process stays small)."""
    rng = np.random.default_rng(4)
    with open(path, "wb") as f:
        np.lib.format.write_array_header_1_0(f, {"descr": "<f4", "fortran_order": False, "shape": (rows, dim)})
        step = 16384
        for a in range(0, rows, step):
            n = min(step, rows - a)
            block = np.zeros((n, dim), np.float32)
            cols = rng.integers(0, dim, size=(n, nnz))
            block[np.arange(n)[:, None], cols] = rng.random((n, nnz)).astype(np.float32) + 0.1
            f.write(block.tobytes())


def _peak_memory_of(proc: subprocess.Popen, every: float = 0.01) -> tuple[int, int]:
    """The child's peak anonymous memory (RssAnon, polled) and VmHWM (bytes), until it exits.

    Anonymous memory is what the build itself holds. VmHWM also counts the pages of the
    files it maps (LMDB's data file, the search mirror): page cache, shared and reclaimed
    by the kernel under pressure, which grows with the index, not with the build's buffers.
    Not ``ru_maxrss``: a child started with vfork+exec inherits the parent's high-water mark.
    """
    anon = hwm = 0
    while proc.poll() is None:
        try:
            with open(f"/proc/{proc.pid}/status") as f:
                for line in f:
                    if line.startswith(("VmHWM:", "RssAnon:")):
                        value = int(line.split()[1]) * 1024
                        if line.startswith("VmHWM:"):
                            hwm = max(hwm, value)
                        else:
                            anon = max(anon, value)
        except OSError:
            pass
        time.sleep(every)
    return anon, hwm


@pytest.mark.slow
def test_peak_memory_building_from_a_2gb_npy_stays_under_400mb(tmp_path):
    """2 GiB float32 .npy (524,288 × 1,024; 16 nonzeros per row so hashing is quick, and stored sparse), 16 samples:
    the build's own memory stays bounded (chunks, hashing, the search mirror's lists and postings written to files)."""
    rows, dim, nnz = 524_288, 1024, 16
    need = rows * dim * 4
    if shutil.disk_usage(tmp_path).free < need + (3 << 30):
        pytest.skip(f"needs {need / 2**30 + 3:.0f} GiB free disk in {tmp_path}")
    path = tmp_path / "big.npy"
    _write_big_npy(path, rows, dim, nnz)
    assert path.stat().st_size >= 2 << 30
    cmd = [sys.executable, "-m", "gmmlsh.service.cli", "build", str(path), "--index", str(tmp_path / "idx"),
           "--samples", "16", "--no-progress", "--json"]
    with open(tmp_path / "out", "wb") as fo, open(tmp_path / "err", "wb") as fe:
        proc = subprocess.Popen(cmd, cwd=REPO, env=cli_env(), stdout=fo, stderr=fe)
    anon, hwm = _peak_memory_of(proc)
    assert proc.returncode == 0, (tmp_path / "err").read_text()
    summary = json.loads((tmp_path / "out").read_text())
    assert summary["count"] == rows
    print(f"peak anonymous memory {anon / 2**20:.0f} MiB (VmHWM with mapped files {hwm / 2**20:.0f} MiB) building "
          f"{rows:,} rows ({need / 2**30:.1f} GiB .npy) in {summary['seconds']:.0f} s; "
          f"index {summary['index_bytes'] / 2**20:.0f} MiB")
    assert 0 < anon < 400 * 2**20


# --- acceptance 5: the server serves what the build wrote ---------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("backend", ["lmdb", "redis"])
def test_built_index_is_served_unchanged(backend, tmp_path, fm, request):
    import httpx

    X, y, Q = fm
    write_svm(tmp_path / "f.svm", X[:1500], y)
    if backend == "lmdb":
        where = ["--index", str(tmp_path / "idx")]
    else:
        url = request.getfixturevalue("redis_url")
        where = ["--redis", url, "--prefix", f"b{uuid.uuid4().hex[:10]}"]
    r = run_cli("build", tmp_path / "f.svm", *where, "--dim", "784", "--no-progress", *SMALL)
    assert r.returncode == 0, r.stderr
    r = run_cli("info", *where, "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["count"] == 1500
    expected = json.loads(run_cli("query", *where, "--id", "42", "-k", "5", "--json").stdout)
    port = _free_port()
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "gmmlsh.service.cli", "serve", *where, "--port", str(port)],
                            cwd=REPO, env=cli_env(GMMLSH_LOG_LEVEL="info"), stdout=log, stderr=subprocess.STDOUT)
    log.close()
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
            time.sleep(0.2)
        got = httpx.get(f"http://127.0.0.1:{port}/neighbors", params={"id": "42", "k": 5}, timeout=30).json()
        assert [n["id"] for n in got["neighbors"]] == [n["id"] for n in expected["neighbors"]]
        assert [n["similarity"] for n in got["neighbors"]] == pytest.approx(
            [n["similarity"] for n in expected["neighbors"]], abs=1e-9)
        assert got["neighbors"][0]["metadata"] == expected["neighbors"][0]["metadata"]
        stats = httpx.get(f"http://127.0.0.1:{port}/stats", timeout=30).json()
        assert stats["count"] == 1500
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    # the start is logged with what the index holds (it once said "0 sketches loaded" here)
    text = (tmp_path / "serve.log").read_text()
    assert "1500 vectors, dim 784" in text and "up to date and mapped: 1500 vectors" in text, text
