"""File readers (issue: batch build): every format from real files, exact values, and errors that name file + line."""

from __future__ import annotations

import gzip
import io
import re

import numpy as np
import pytest
import scipy.sparse as sp
from gmmlsh.index.ingest.readers import _P10, InputFormatError, _parse_float, detect_format, open_reader

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


# --- the exact decimal fast path ----------------------------------------------------------


def _fast(s: str):
    b = np.frombuffer(s.encode(), np.uint8)
    return _parse_float(b, 0, len(b), _P10)


@pytest.mark.parametrize("s", ["0", "-0", "1", "+3", "255", ".5", "5.", "0.1", "-2.5e-3", "1E+05", "1e22",
                               "9007199254740992", "123456789012345678", "0.000000000000000000001",
                               "3.14159", "1e-22", "00012.50", "0e0", "100e-2", "0.3", "1e23", "0.1234567890123456789"])
def test_fast_path_equals_python_float(s):
    v, ok = _fast(s)
    assert ok and v == float(s) and np.signbit(v) == np.signbit(float(s)), s


@pytest.mark.parametrize("s", ["", "-", ".", "e5", "1e", "abc", "1.2.3", "1,5", "nan", "inf", "1_000", " 1",
                               "1.00000000000000011102230246251565404236316680908203125"])
def test_fast_path_declines_what_it_cannot_do_exactly(s):
    v, ok = _fast(s)
    assert not ok, (s, v)


def test_fast_path_random_decimals_match_python():
    """Clinger and Eisel-Lemire paths against Python's correctly rounded float(), over the whole range."""
    rng = np.random.default_rng(7)
    bits = rng.integers(0, 0x7FF0000000000000, size=40000, dtype=np.int64).view(np.float64)  # every finite double
    vals = np.concatenate([bits, rng.standard_normal(20000) * 10.0 ** rng.integers(-12, 12, 20000),
                           rng.random(5000), rng.integers(0, 1 << 62, 5000).astype(np.float64),
                           np.array([5e-324, 2.2250738585072014e-308, 1.7976931348623157e308, 2**53, 2**53 + 2])])
    accepted = declined = 0
    for v in vals.tolist():
        for s in (repr(v), f"{v:.18e}", f"{v:.6g}", f"{v:.15g}", f"{v:.25e}", f"{v:.3f}", f"{v:.4e}"):
            got, ok = _fast(s)
            if ok:
                accepted += 1
                assert got == float(s), s
            else:
                declined += 1
    # digits beyond what 128 bits decide (e.g. exact binary midpoints) go to Python; the rest is fast
    assert declined < accepted / 100


@pytest.mark.parametrize("s, want", [("9007199254740993", 9007199254740992.0), ("2.4703282292062328e-324", 5e-324),
                                     ("2.4703282292062327e-324", 0.0), ("1.7976931348623159e308", float("inf")),
                                     ("1e-400", 0.0), ("-0.0", -0.0), ("3.921568627450980338e-03", 1 / 255)])
def test_fast_path_hard_cases(s, want):
    got, ok = _fast(s)
    assert ok and got == want and np.signbit(got) == np.signbit(want)


# --- format detection -------------------------------------------------------------------


def test_detect_format():
    assert detect_format("a.npy") == "npy"
    assert detect_format("a.CSV") == "csv"
    assert detect_format("a.tsv.gz") == "tsv"
    assert detect_format("a.libsvm") == "svmlight"
    assert detect_format("x.dat", "libsvm") == "svmlight"
    assert detect_format("x.fvecs") == "fvecs"
    expect_error(r"x\.dat: cannot tell the format", detect_format, "x.dat")
    expect_error("unknown format 'parquet'", detect_format, "x.dat", "parquet")


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


def test_csv_quoted_fields_fall_back_to_the_csv_module(tmp_path):
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


def test_csv_long_rows_many_blocks(tmp_path, monkeypatch):
    """Blocks end at line ends: rows are never split, line numbers run on across blocks."""
    import gmmlsh.index.ingest.readers as readers

    monkeypatch.setattr(readers, "BLOCK_BYTES", 1000)
    X = np.arange(1, 200 * 30 + 1, dtype=np.float64).reshape(200, 30)
    p = tmp_path / "x.csv"
    write_csv(p, X, fmt="%d")
    chunks, got, _, _ = read_all(open_reader(p))
    assert len(chunks) > 10 and np.array_equal(got, X)
    assert np.concatenate([c.lines for c in chunks]).tolist() == list(range(1, 201))


# --- svmlight -----------------------------------------------------------------------------


def test_svmlight_labels_qid_comments_and_base(tmp_path):
    p = tmp_path / "d.svm"
    p.write_text(
        "# header comment\n"
        "1 qid:4 1:0.5 3:2 # trailing comment\n"
        "\n"
        "-1 2:1e-3 4:7\n"
        "2.5 3:1 1:4\n"  # unsorted: sorted by the reader
        "1,3 1:1\n"  # multi-label
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
        ("1 x3:1\n", r"data\.svm:17: index 'x3' is not an integer"),
        ("1 3:abc\n", r"data\.svm:17: value 'abc' of index 3 is not a number"),
        ("1 3\n", r"data\.svm:17: expected index:value, got '3'"),
        ("1 2:1 2:3\n", r"data\.svm:17: index 2 appears twice"),
        ("1 -2:1\n", r"data\.svm:17: index -2 is negative"),
        ("1 qid:a 1:1\n", r"data\.svm:17: qid 'a' is not an integer"),
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
