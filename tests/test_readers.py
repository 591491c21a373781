"""File readers (issue: batch build): every format from real files, exact values, and errors that name file + line."""

from __future__ import annotations

import gzip
import io
import re

import numpy as np
import pytest
import scipy.sparse as sp

from gmmlsh.index.ingest.readers import InputFormatError, detect_format, open_reader

# --- helpers ------------------------------------------------------------------------


def dense(X) -> np.ndarray:
    return X.toarray() if sp.issparse(X) else np.asarray(X)


def read_all(reader):
    chunks = list(reader)
    X = np.concatenate([dense(c.X) for c in chunks]) if chunks else np.zeros((0, reader.dim))
    ids = [i for c in chunks for i in c.ids]
    meta = [m for c in chunks for m in (c.metadata or [None] * len(c))]
    return chunks, X, ids, meta


def write_svm(path, X, labels=None, *, base=1, fmt=lambda v: repr(float(v)), extra=""):
    with open(path, "w") as f:
        for i, row in enumerate(X):
            nz = np.flatnonzero(row)
            lab = "" if labels is None else f"{labels[i]} "
            f.write(lab + " ".join(f"{j + base}:{fmt(row[j])}" for j in nz) + extra + "\n")


def write_csv(path, X, *, delimiter=",", header=None, fmt="%.17g"):
    with open(path, "w") as f:
        if header:
            f.write(delimiter.join(header) + "\n")
        np.savetxt(f, X, delimiter=delimiter, fmt=fmt)


def expect_error(match: str, fn, *args, **kw) -> InputFormatError:
    """``fn(*args)`` (or iterating it, or the result) raises an InputFormatError matching ``match``."""
    with pytest.raises(InputFormatError) as ei:
        out = fn(*args, **kw) if callable(fn) else fn
        if hasattr(out, "__iter__"):
            list(out)
    assert re.search(match, str(ei.value)), str(ei.value)
    return ei.value


@pytest.fixture(scope="module")
def sub(fmnist):
    """3,000 Fashion-MNIST training rows and labels (uint8)."""
    return fmnist[0][:3000], fmnist[1][:3000]


# --- numbers parse as Python (and numpy) parse them ---------------------------------------


def _decimals() -> list[str]:
    """Decimal strings over the whole double range, in many formats, plus hard cases."""
    rng = np.random.default_rng(7)
    bits = rng.integers(0, 0x7FF0000000000000, size=3000, dtype=np.int64).view(np.float64)  # every finite double
    vals = np.concatenate([bits, rng.standard_normal(2000) * 10.0 ** rng.integers(-12, 12, 2000), rng.random(500),
                           np.array([5e-324, 2.2250738585072014e-308, 1.7976931348623157e308, 2**53, 2**53 + 2])])
    out = [s for v in vals.tolist()
           for s in (repr(v), f"{v:.18e}", f"{v:.6g}", f"{v:.15g}", f"{v:.25e}", f"{v:.3f}", f"{v:.4e}")]
    return out + ["9007199254740993", "2.4703282292062328e-324", "2.4703282292062327e-324", "1e-400", "-0.0",
                  "3.921568627450980338e-03", "1.00000000000000011102230246251565404236316680908203125",
                  "0.1234567890123456789", "00012.50", "+3", ".5", "5.", "1E+05", "100e-2"]


def test_csv_and_svmlight_values_equal_python_float(tmp_path):
    """Every decimal reads as Python's correctly rounded float() (so as numpy.float32 of it, once stored)."""
    strs = _decimals()
    want = np.array([float(s) for s in strs])
    (tmp_path / "v.csv").write_text("".join(f"{s},1\n" for s in strs))
    (tmp_path / "v.svm").write_text("".join(f"0 1:{s} 2:1\n" for s in strs))
    for name in ("v.csv", "v.svm"):
        _, got, _, _ = read_all(open_reader(tmp_path / name, dim=2, chunk_rows=4096))
        assert np.array_equal(got[:, 0], want), name
        if name == "v.csv":  # (a sparse matrix keeps no -0.0)
            assert np.array_equal(np.signbit(got[:, 0]), np.signbit(want))
        with np.errstate(over="ignore"):
            assert np.array_equal(got[:, 0].astype(np.float32), want.astype(np.float32))


# --- format detection -------------------------------------------------------------------


def test_detect_format():
    assert detect_format("a.npy") == "npy"
    assert detect_format("a.CSV") == "csv"
    assert detect_format("a.tsv.gz") == "tsv"
    assert detect_format("a.libsvm") == "svmlight"
    assert detect_format("x.dat", "libsvm") == "svmlight"
    assert detect_format("x.fvecs") == "fvecs"
    assert detect_format("x.parquet") == "parquet" and detect_format("x.dat", "pq") == "parquet"
    expect_error(r"x\.dat: cannot tell the format", detect_format, "x.dat")
    expect_error("unknown format 'xlsx'", detect_format, "x.dat", "xlsx")


def test_missing_file_is_named(tmp_path):
    expect_error(r"nope\.npy: file not found", open_reader, tmp_path / "nope.npy")


# --- .npy ---------------------------------------------------------------------------------


def test_npy_memmapped_chunks_and_row_ids(tmp_path, sub):
    X = sub[0]
    p = tmp_path / "x.npy"
    np.save(p, X)
    r = open_reader(p, chunk_rows=700)
    assert (r.dim, r.rows, r.sparse) == (784, 3000, False)
    chunks, got, ids, _ = read_all(r)
    assert [len(c) for c in chunks] == [700, 700, 700, 700, 200]
    assert [c.start_row for c in chunks] == [0, 700, 1400, 2100, 2800]
    assert np.array_equal(got, X) and got.dtype == np.float64
    assert ids == [str(i) for i in range(3000)]


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int16, np.uint8, np.float16, ">f4"])
def test_npy_dtypes_keep_values_exactly(tmp_path, dtype):
    rng = np.random.default_rng(1)
    X = (rng.standard_normal((50, 7)) * 100).astype(dtype)
    p = tmp_path / "x.npy"
    np.save(p, X)
    _, got, _, _ = read_all(open_reader(p))
    assert np.array_equal(got, X.astype(np.float64))
    assert got.dtype == (np.float32 if np.dtype(dtype) == np.float32 or str(dtype) == ">f4" else np.float64)


def test_npy_images_are_flattened_and_fortran_order_works(tmp_path):
    X = np.arange(5 * 3 * 4, dtype=np.float32).reshape(5, 3, 4) + 1
    np.save(tmp_path / "img.npy", X)
    _, got, _, _ = read_all(open_reader(tmp_path / "img.npy", chunk_rows=2))
    assert np.array_equal(got, X.reshape(5, 12))
    F = np.asfortranarray(np.arange(40, dtype=np.float64).reshape(8, 5) + 1)
    np.save(tmp_path / "f.npy", F)
    _, got, _, _ = read_all(open_reader(tmp_path / "f.npy", chunk_rows=3))
    assert np.array_equal(got, F)


def test_npy_errors(tmp_path):
    np.save(tmp_path / "one.npy", np.arange(5.0))
    expect_error(r"one\.npy: expected a 2-D array", open_reader, tmp_path / "one.npy")
    np.save(tmp_path / "obj.npy", np.array([[1, "a"]], dtype=object), allow_pickle=True)
    expect_error(r"obj\.npy: holds Python objects", open_reader, tmp_path / "obj.npy")
    np.save(tmp_path / "s.npy", np.array([["a", "b"]]))
    expect_error(r"s\.npy: array of dtype <U1 is not numeric", open_reader, tmp_path / "s.npy")
    np.save(tmp_path / "t.npy", np.ones((100, 10)))
    raw = (tmp_path / "t.npy").read_bytes()
    (tmp_path / "t.npy").write_bytes(raw[:-80])
    expect_error(r"t\.npy: truncated", open_reader, tmp_path / "t.npy")
    (tmp_path / "junk.npy").write_bytes(b"not numpy at all")
    expect_error(r"junk\.npy: not a \.npy file", open_reader, tmp_path / "junk.npy")


def test_npy_sample_is_spread_and_read_row(tmp_path):
    X = np.arange(1000 * 3, dtype=np.float64).reshape(1000, 3) + 1
    np.save(tmp_path / "x.npy", X)
    r = open_reader(tmp_path / "x.npy")
    s = r.sample(10)
    assert s.shape == (10, 3) and s[0, 0] == 1 and s[-1, 0] == X[-1, 0]
    assert np.array_equal(r.read_row(537), X[537:538])
    expect_error("row 1000 does not exist", r.read_row, 1000)


# --- .npz ---------------------------------------------------------------------------------


@pytest.mark.parametrize("compressed", [False, True])
def test_npz_dense_member_streams_with_labels(tmp_path, sub, compressed):
    X, y = sub
    p = tmp_path / "d.npz"
    (np.savez_compressed if compressed else np.savez)(p, train=X, train_labels=y, other=np.zeros(3))
    r = open_reader(p, chunk_rows=1000, label_key="train_labels")
    assert (r.dim, r.rows) == (784, 3000)
    chunks, got, ids, meta = read_all(r)
    assert np.array_equal(got, X) and len(chunks) == 3
    assert meta[:3] == [{"label": int(v)} for v in y[:3]]
    expect_error(r"d\.npz: array 'other' has shape \(3,\)", open_reader, p, key="other")
    expect_error(r"no array 'nope'", open_reader, p, key="nope")


def test_npz_scipy_sparse_csr_streams(tmp_path):
    A = sp.random(500, 60000, density=0.002, format="csr", random_state=4, dtype=np.float64)
    A.data += 0.5
    A = A[np.diff(A.indptr) > 0]
    sp.save_npz(tmp_path / "s.npz", A)
    r = open_reader(tmp_path / "s.npz", chunk_rows=128)
    assert r.sparse and r.dim == 60000 and r.rows == A.shape[0]
    chunks = list(r)
    got = sp.vstack([c.X for c in chunks]).tocsr()
    assert (got != A).nnz == 0
    sp.save_npz(tmp_path / "c.npz", A.tocsc())
    expect_error(r"c\.npz: sparse matrix in 'csc' format", open_reader, tmp_path / "c.npz")


# --- .csv / .tsv ----------------------------------------------------------------------------


def test_csv_header_ids_labels_comments_and_line_numbers(tmp_path):
    text = (
        "# a comment line\n"
        "id,label,a,b,c\n"
        "\n"
        'x1,3,1.5,0,"2"\n'
        "x2,7, -1 ,2e3,0.25\r\n"
        "# another comment\n"
        "x3,0,4,5,6"  # no final newline
    )
    p = tmp_path / "t.csv"
    p.write_text(text)
    r = open_reader(p, id_column="id", label_column="label")
    assert r.dim == 3
    chunks, X, ids, meta = read_all(r)
    assert ids == ["x1", "x2", "x3"]
    assert meta == [{"label": 3}, {"label": 7}, {"label": 0}]
    assert np.array_equal(X, [[1.5, 0, 2], [-1, 2000, 0.25], [4, 5, 6]])
    assert chunks[0].lines.tolist() == [4, 5, 7]


def test_csv_no_header_positional_id_and_tsv(tmp_path):
    p = tmp_path / "t.tsv"
    p.write_text("a\t1\t2\nb\t3\t4\n")
    r = open_reader(p, id_column=0)
    _, X, ids, _ = read_all(r)
    assert ids == ["a", "b"] and np.array_equal(X, [[1, 2], [3, 4]])
    # a semicolon file is recognised by its first line
    q = tmp_path / "semi.csv"
    q.write_text("1;2;3\n4;5;6\n")
    _, X, _, _ = read_all(open_reader(q))
    assert np.array_equal(X, [[1, 2, 3], [4, 5, 6]])


def test_csv_quoted_fields(tmp_path):
    p = tmp_path / "q.csv"
    p.write_text('id,v1,v2\n"a,b",1,2\n"say ""hi""",3,4\n')
    _, X, ids, _ = read_all(open_reader(p, id_column="id"))
    assert ids == ["a,b", 'say "hi"'] and np.array_equal(X, [[1, 2], [3, 4]])


def test_csv_gzip(tmp_path):
    X = np.arange(1, 31, dtype=np.float64).reshape(10, 3)
    buf = io.StringIO()
    np.savetxt(buf, X, delimiter=",")
    with gzip.open(tmp_path / "x.csv.gz", "wt") as f:
        f.write(buf.getvalue())
    _, got, _, _ = read_all(open_reader(tmp_path / "x.csv.gz"))
    assert np.array_equal(got, X)


@pytest.mark.parametrize("fmt", ["%.17g", "%.18e", "%.6g", "%d"])
def test_csv_float_formats_parse_like_python(tmp_path, fmt):
    rng = np.random.default_rng(5)
    X = rng.standard_normal((300, 20)) * 1000
    if fmt == "%d":
        X = np.round(X)
    p = tmp_path / "f.csv"
    write_csv(p, X, fmt=fmt)
    _, got, _, _ = read_all(open_reader(p, chunk_rows=64))
    want = np.array([[float(fmt % v) for v in row] for row in X])
    assert np.array_equal(got, want)


def test_csv_errors_name_file_line_and_problem(tmp_path):
    p = tmp_path / "bad.csv"
    p.write_text("a,b,c\n1,2,3\n4,x,6\n")
    expect_error(r"bad\.csv:3: column 2 \('b'\): 'x' is not a number", open_reader, p)
    p.write_text("1,2,3\n4,5,6\n7,8\n")
    expect_error(r"bad\.csv:3: expected 3 fields, found 2", open_reader, p)
    p.write_text("1,2,3\n4,,6\n")
    expect_error(r"bad\.csv:2: column 2 \('1'\) is empty", open_reader, p)
    p.write_text("1,2,3\n" * 10 + "1,2,1e99999999999999999999q\n")
    expect_error(r"bad\.csv:11: .*'1e99999999999999999999q'.* not a number", open_reader, p)
    p.write_text("id,a\nx,1\nx,2\n")
    expect_error(r"bad\.csv:3: id 'x' repeats line 2", open_reader, p, id_column="id")
    p.write_text("a,b\n1,2\n")
    expect_error(r"bad\.csv:1: id column 'nope' is not in the header", open_reader, p, id_column="nope")
    expect_error(r"has 2 value columns, expected dim 3", open_reader, p, dim=3)
    p.write_text("")
    expect_error(r"bad\.csv: no data rows", open_reader, p)


@pytest.mark.parametrize("block", [1000, 4 << 20])
def test_text_chunks_do_not_depend_on_blocks(tmp_path, monkeypatch, block):
    """Blocks end at line ends (rows never split, line numbers run on across blocks), and chunks hold
    exactly chunk_rows rows whatever the block size: the same chunks on every run, as resuming needs."""
    import gmmlsh.index.ingest.base as base

    monkeypatch.setattr(base, "BLOCK_BYTES", block)
    X = np.arange(1, 200 * 30 + 1, dtype=np.float64).reshape(200, 30)
    lines = [",".join(str(int(v)) for v in row) for row in X]
    for i in (150, 100, 50, 3):
        lines.insert(i, "# comment" if i % 100 else "")
    (tmp_path / "x.csv").write_text("\n".join(lines) + "\n")
    write_svm(tmp_path / "x.svm", X, np.arange(200), fmt=lambda v: str(int(v)))
    for name in ("x.csv", "x.svm"):
        chunks, got, ids, _ = read_all(open_reader(tmp_path / name, chunk_rows=7, dim=30))
        assert np.array_equal(got, X) and ids == [str(i) for i in range(200)]
        assert [len(c) for c in chunks] == [7] * 28 + [4] and [c.file_row for c in chunks] == list(range(0, 200, 7))
    want = [i + 1 + sum(i >= j for j in (3, 50, 100, 150)) for i in range(200)]  # rows after the inserted lines
    chunks = list(open_reader(tmp_path / "x.csv", chunk_rows=7))
    assert np.concatenate([c.lines for c in chunks]).tolist() == want


def test_csv_bom_crlf_blank_lines_and_errors_deep_in_the_file(tmp_path, monkeypatch):
    """A bad line far from the start is named exactly, whichever block pyarrow was reading."""
    import gmmlsh.index.ingest.base as base

    monkeypatch.setattr(base, "BLOCK_BYTES", 4096)
    p = tmp_path / "big.csv"
    body = "".join(f"{i},{i + 1}\r\n" for i in range(1, 20001))
    p.write_bytes(b"\xef\xbb\xbf" + ("a,b\r\n \r\n" + body).encode())
    _, X, _, _ = read_all(open_reader(p, chunk_rows=3000))
    assert X.shape == (20000, 2) and X[0, 0] == 1 and X[-1, 1] == 20001
    rows = body.splitlines(keepends=True)
    for bad, msg in [("7,x\r\n", r"big\.csv:12347: column 2 \('b'\): 'x' is not a number"),
                     ("7\r\n", r"big\.csv:12347: expected 2 fields, found 1"),
                     ("7,\r\n", r"big\.csv:12347: column 2 \('b'\) is empty")]:
        p.write_text("a,b\n \n" + "".join(rows[:12344]) + bad + "".join(rows[12344:]))
        expect_error(msg, open_reader, p, chunk_rows=3000)


def test_csv_crlf_rows_all_read_whatever_the_block_boundaries(tmp_path, monkeypatch):
    """A block may end between CR and LF: no row is lost (pyarrow ends early on a short read of the LF)."""
    import gmmlsh.index.ingest.base as base

    p = tmp_path / "crlf.csv"
    p.write_bytes(b"a,b\r\n" + b"".join(b"%d,%d\r\n" % (i, i) for i in range(2000)))
    for size in range(1000, 1024):
        monkeypatch.setattr(base, "BLOCK_BYTES", size)
        _, X, _, _ = read_all(open_reader(p, chunk_rows=500))
        assert np.array_equal(X[:, 0], np.arange(2000)), size


def test_csv_ids_file_read_row_and_sample(tmp_path):
    p = tmp_path / "x.csv"
    write_csv(p, np.arange(1, 31, dtype=np.float64).reshape(10, 3), fmt="%d")
    (tmp_path / "ids.txt").write_text("".join(f"r{i}\n" for i in range(10)))
    r = open_reader(p, ids_file=tmp_path / "ids.txt", chunk_rows=4)
    assert read_all(r)[2] == [f"r{i}" for i in range(10)]
    assert np.array_equal(r.read_row(7), [[22, 23, 24]]) and r.sample(5).shape == (5, 3)
    assert r.rows is None and r.chunk_rows == 4


# --- svmlight -----------------------------------------------------------------------------


def test_svmlight_labels_qid_comments_and_base(tmp_path):
    p = tmp_path / "d.svm"
    p.write_text(
        "# header comment\n"
        "1 qid:4 1:0.5 3:2 # trailing comment\n"
        "\n"
        "-1 2:1e-3 4:7\n"
        "2.5 1:4 3:1\n"
        "3,1 1:1\n"  # multi-label
        "4:9\n"  # no label
    )
    r = open_reader(p, dim=4)
    chunks, X, ids, meta = read_all(r)
    assert np.array_equal(X, [[0.5, 0, 2, 0], [0, 1e-3, 0, 7], [4, 0, 1, 0], [1, 0, 0, 0], [0, 0, 0, 9]])
    assert meta == [{"label": 1, "qid": 4}, {"label": -1}, {"label": 2.5}, {"label": [1, 3]}, None]
    assert chunks[0].lines.tolist() == [2, 4, 5, 6, 7]
    assert ids == ["0", "1", "2", "3", "4"]
    assert sp.issparse(chunks[0].X) and chunks[0].X.has_sorted_indices


def test_svmlight_scan_dimension_zero_based_and_auto(tmp_path):
    p = tmp_path / "d.svm"
    p.write_text("0 1:1 7:2\n1 3:5\n")
    r = open_reader(p)
    assert r.dim is None and r.needs_scan()
    assert r.scan() == 7
    _, X, _, _ = read_all(r)
    assert X.shape == (2, 7) and X[0, 6] == 2
    r0 = open_reader(p, zero_based=True)
    assert r0.scan() == 8
    q = tmp_path / "z.svm"
    q.write_text("0 0:1 7:2\n")
    ra = open_reader(q, zero_based="auto")
    assert ra.scan() == 8
    _, X, _, _ = read_all(ra)
    assert X[0, 0] == 1
    rb = open_reader(p, zero_based="auto")  # no index 0 anywhere: 1-based
    assert rb.scan() == 7


def test_svmlight_errors_name_file_line_and_problem(tmp_path):
    p = tmp_path / "data.svm"
    good = "1 1:1 2:2\n" * 16
    for bad, msg in [
        ("1 x3:1\n", r"data\.svm:17: 'x3' is not an integer"),
        ("1 3:abc\n", r"data\.svm:17: 'abc' is not a number"),
        ("x 3:1\n", r"data\.svm:17: 'x' is not a number"),
        ("1 3\n", r"data\.svm:17: expected index:value, got '3'"),
        ("1 2:1 2:3\n", r"data\.svm:17: indices must increase along the line"),
        ("1 3:1 1:4\n", r"data\.svm:17: indices must increase along the line"),
        ("1 -2:1\n", r"data\.svm:17: index -2 is negative"),
        ("1 qid:a 1:1\n", r"data\.svm:17: 'a' is not an integer"),
        ("1 0:1\n", r"data\.svm:17: index 0 is not valid with 1-based indices"),
        ("1 9:1\n", r"data\.svm:17: index 9 is out of range for dimension 4"),
    ]:
        p.write_text(good + bad + good)
        expect_error(msg, open_reader, p, dim=4)


def test_svmlight_many_features(tmp_path):
    rng = np.random.default_rng(11)
    n, d = 300, 60000
    rows = [np.sort(rng.choice(d, size=150, replace=False)) for _ in range(n)]
    vals = [rng.random(150) + 0.01 for _ in range(n)]
    with open(tmp_path / "wide.svm", "w") as f:
        for i in range(n):
            pairs = zip(rows[i], vals[i].tolist(), strict=True)
            f.write(f"{i % 3} " + " ".join(f"{j + 1}:{v!r}" for j, v in pairs) + "\n")
    r = open_reader(tmp_path / "wide.svm")
    dim = r.scan()
    assert dim == max(int(x.max()) for x in rows) + 1
    chunks = list(r)
    X = sp.vstack([c.X for c in chunks]).tocsr()
    assert X.shape == (n, dim) and X.nnz == n * 150
    assert np.array_equal(X[5].indices, rows[5]) and np.array_equal(X[5].data, vals[5])


def test_svmlight_auto_base_is_decided_for_the_whole_file(tmp_path):
    """Index 0 only in the last chunk: "auto" still reads every chunk zero-based (one scan decides)."""
    p = tmp_path / "z.svm"
    p.write_text("1 1:1 2:2\n" * 10 + "2 0:5\n")
    r = open_reader(p, zero_based="auto", chunk_rows=4)
    assert r.needs_scan() and r.scan() == 3 and not r.needs_scan()
    chunks, X, _, meta = read_all(r)
    assert [len(c) for c in chunks] == [4, 4, 3]
    assert np.array_equal(X[0], [0, 1, 2]) and np.array_equal(X[-1], [5, 0, 0]) and meta[-1] == {"label": 2}


def test_svmlight_gzip_qid_on_some_rows_and_bad_line_in_a_late_block(tmp_path, monkeypatch):
    import gmmlsh.index.ingest.base as base

    monkeypatch.setattr(base, "BLOCK_BYTES", 2048)
    lines = [f"{i % 3} {f'qid:{i // 10} ' if i % 2 else ''}1:{i + 1} 5:0.5" for i in range(3000)]
    with gzip.open(tmp_path / "d.svm.gz", "wt") as f:
        f.write("\n".join(lines) + "\n")
    chunks, X, _, meta = read_all(open_reader(tmp_path / "d.svm.gz", chunk_rows=1000))
    assert X.shape == (3000, 5) and X[2999, 0] == 3000 and chunks[-1].lines[-1] == 3000
    assert meta[:2] == [{"label": 0}, {"label": 1, "qid": 0}] and meta[2999] == {"label": 2, "qid": 299}
    lines[2500] = "1 1:1 4:oops"
    with gzip.open(tmp_path / "d.svm.gz", "wt") as f:
        f.write("\n".join(lines) + "\n")
    expect_error(r"d\.svm\.gz:2501: 'oops' is not a number", open_reader, tmp_path / "d.svm.gz", dim=5)


# --- parquet ----------------------------------------------------------------------------


def test_parquet_numeric_columns_ids_labels_and_chunks(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(3)
    X = rng.random((95, 4)).astype(np.float32) + 0.1
    t = pa.table({"id": [f"v{i}" for i in range(95)], "a": X[:, 0], "b": X[:, 1], "note": ["x"] * 95,
                  "c": X[:, 2], "label": [i % 5 for i in range(95)], "d": X[:, 3]})
    pq.write_table(t, tmp_path / "t.parquet", row_group_size=10)
    r = open_reader(tmp_path / "t.parquet", id_column="id", label_column="label", chunk_rows=25)
    assert (r.dim, r.rows, r.sparse, r.fmt) == (4, 95, False, "parquet")
    chunks, got, ids, meta = read_all(r)
    assert [len(c) for c in chunks] == [25, 25, 25, 20] and [c.file_row for c in chunks] == [0, 25, 50, 75]
    assert np.array_equal(got, X) and got.dtype == np.float32  # float32 stays float32; "note" is not numeric
    assert ids[:2] == ["v0", "v1"] and meta[:3] == [{"label": 0}, {"label": 1}, {"label": 2}]
    assert chunks[-1].lines is None and chunks[-1].end_byte == (tmp_path / "t.parquet").stat().st_size
    # positions work too, and integer ids become text
    pq.write_table(pa.table({"k": list(range(5)), "x": [1, 2, 3, 4, 5], "y": [1.5] * 5}), tmp_path / "u.parquet")
    _, got, ids, _ = read_all(open_reader(tmp_path / "u.parquet", id_column=0))
    assert ids == ["0", "1", "2", "3", "4"] and np.array_equal(got, [[v, 1.5] for v in range(1, 6)])
    assert got.dtype == np.float64


@pytest.mark.parametrize("kind", ["list", "large_list", "fixed"])
def test_parquet_list_column(tmp_path, kind, sub):
    import pyarrow as pa
    import pyarrow.parquet as pq

    X, y = sub
    X = X[:300].astype(np.float32)
    flat = pa.array(X.reshape(-1))
    emb = {"list": pa.ListArray.from_arrays(np.arange(0, 301 * 784, 784, dtype=np.int32), flat),
           "large_list": pa.LargeListArray.from_arrays(np.arange(0, 301 * 784, 784, dtype=np.int64), flat),
           "fixed": pa.FixedSizeListArray.from_arrays(flat, 784)}[kind]
    pq.write_table(pa.table({"emb": emb, "y": y[:300].astype(np.int64)}), tmp_path / "e.parquet",
                   row_group_size=128)
    r = open_reader(tmp_path / "e.parquet", label_column="y", chunk_rows=100)
    assert (r.dim, r.rows) == (784, 300)
    chunks, got, ids, meta = read_all(r)
    assert [len(c) for c in chunks] == [100, 100, 100] and np.array_equal(got, X)
    assert ids[-1] == "299" and meta[:2] == [{"label": int(y[0])}, {"label": int(y[1])}]
    assert np.array_equal(r.read_row(250), X[250:251])


def test_parquet_errors_name_the_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"a": [1.0, 2.0, None, 4.0], "b": [1.0] * 4}), p)
    expect_error(r"bad\.parquet: row 2: column 'a' is null", open_reader, p, chunk_rows=3)
    pq.write_table(pa.table({"e": [[1.0, 2.0], [3.0, 4.0], [5.0]]}), p)
    expect_error(r"bad\.parquet: row 2: 'e' has 1 values, expected 2", open_reader, p)
    pq.write_table(pa.table({"e": [[1.0, 2.0], [3.0, None]]}), p)
    expect_error(r"bad\.parquet: row 1: 'e' holds a null value", open_reader, p)
    pq.write_table(pa.table({"e": [[1.0]], "f": [[2.0]]}), p)
    expect_error(r"bad\.parquet: several list columns \(e, f\)", open_reader, p)
    pq.write_table(pa.table({"s": ["a"]}), p)
    expect_error(r"bad\.parquet: no numeric columns", open_reader, p)
    pq.write_table(pa.table({"id": ["a", "b", "a"], "x": [1.0, 2.0, 3.0]}), p)
    expect_error(r"bad\.parquet: row 2: id 'a' repeats row 0", open_reader, p, id_column="id")
    expect_error(r"bad\.parquet: id column 'nope' is not a column", open_reader, p, id_column="nope")
    p.write_bytes(b"PAR1 not really")
    expect_error(r"bad\.parquet: not a readable Parquet file", open_reader, p)


# --- fvecs / bvecs / ivecs -----------------------------------------------------------------


def _write_vecs(path, X, vt):
    d = X.shape[1]
    rec = np.dtype([("d", "<i4"), ("v", vt, (d,))])
    a = np.empty(X.shape[0], rec)
    a["d"] = d
    a["v"] = X
    a.tofile(path)


@pytest.mark.parametrize("fmt,vt", [("fvecs", "<f4"), ("bvecs", "u1"), ("ivecs", "<i4")])
def test_vecs_formats(tmp_path, fmt, vt):
    rng = np.random.default_rng(2)
    X = (rng.random((123, 17)) * 200).astype(vt)
    p = tmp_path / f"x.{fmt}"
    _write_vecs(p, X, vt)
    r = open_reader(p, chunk_rows=50)
    assert (r.dim, r.rows) == (17, 123)
    _, got, _, _ = read_all(r)
    assert np.array_equal(got, X.astype(np.float64))


def test_fvecs_errors_name_the_row(tmp_path):
    X = np.ones((10, 4), np.float32)
    p = tmp_path / "x.fvecs"
    _write_vecs(p, X, "<f4")
    raw = bytearray(p.read_bytes())
    raw[7 * 20: 7 * 20 + 4] = np.array([5], "<i4").tobytes()  # row 7 claims dimension 5
    p.write_bytes(bytes(raw))
    expect_error(r"x\.fvecs: row 7: dimension field is 5, expected 4", open_reader, p)
    p.write_bytes(bytes(raw[:-3]))
    expect_error(r"x\.fvecs: size .* is not a multiple of the row size", open_reader, p)


# --- ids, several files -----------------------------------------------------------------------


def test_ids_file_and_errors(tmp_path):
    X = np.arange(1, 13, dtype=np.float64).reshape(4, 3)
    np.save(tmp_path / "x.npy", X)
    ids = tmp_path / "ids.txt"
    ids.write_text("a\nb\nc\nd\n")
    _, _, got, _ = read_all(open_reader(tmp_path / "x.npy", ids_file=ids, chunk_rows=3))
    assert got == ["a", "b", "c", "d"]
    ids.write_text("a\nb\nc\n")
    expect_error(r"ids\.txt: has 3 ids but the input has more rows", open_reader(tmp_path / "x.npy", ids_file=ids))
    ids.write_text("a\nb\nc\nd\ne\n")
    expect_error(r"ids\.txt: has 5 ids but the input has 4 rows", open_reader(tmp_path / "x.npy", ids_file=ids))
    ids.write_text("a\n\nc\nd\n")
    expect_error(r"ids\.txt:2: empty id", open_reader(tmp_path / "x.npy", ids_file=ids))
    ids.write_text("a\nb\na\nd\n")
    expect_error(r"ids\.txt:3: id 'a' repeats line 1", open_reader(tmp_path / "x.npy", ids_file=ids))


def test_several_inputs_are_one_stream(tmp_path):
    A = np.ones((5, 3))
    B = np.full((4, 3), 2.0)
    np.save(tmp_path / "a.npy", A)
    write_csv(tmp_path / "b.csv", B, fmt="%d")
    r = open_reader([tmp_path / "a.npy", tmp_path / "b.csv"], chunk_rows=3)
    chunks, X, ids, _ = read_all(r)
    assert ids == [str(i) for i in range(9)]
    assert np.array_equal(X, np.vstack([A, B]))
    assert chunks[-1].source.endswith("b.csv") and chunks[-1].start_row == 8 and chunks[-1].file_row == 3
    np.save(tmp_path / "c.npy", np.ones((2, 4)))
    expect_error("inputs have different dimensions", open_reader, [tmp_path / "a.npy", tmp_path / "c.npy"])


# --- the same data in three formats -----------------------------------------------------------


def test_fmnist_npy_csv_svmlight_give_identical_chunks(tmp_path, sub):
    X, y = sub
    np.save(tmp_path / "f.npy", X)
    write_csv(tmp_path / "f.csv", X, fmt="%d")
    write_svm(tmp_path / "f.svm", X, y, fmt=lambda v: str(int(v)))
    readers = [open_reader(tmp_path / "f.npy", chunk_rows=1000), open_reader(tmp_path / "f.csv", chunk_rows=1000),
               open_reader(tmp_path / "f.svm", dim=784, chunk_rows=1000)]
    outs = [read_all(r) for r in readers]
    for _, got, ids, _ in outs:
        assert np.array_equal(got, X.astype(np.float64))
        assert ids == [str(i) for i in range(3000)]
    assert outs[2][3][:5] == [{"label": int(v)} for v in y[:5]]
    # and float data written at full precision reads back bit for bit
    Xf = X[:500].astype(np.float64) / 255.0
    np.save(tmp_path / "g.npy", Xf)
    write_csv(tmp_path / "g.csv", Xf, fmt="%.17g")
    write_svm(tmp_path / "g.svm", Xf, y[:500])
    got = [read_all(open_reader(tmp_path / n, dim=784))[1] for n in ("g.npy", "g.csv", "g.svm")]
    for g in got:
        assert np.array_equal(g, Xf)
