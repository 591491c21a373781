"""Limits and hostile input: nothing a client sends gets a 5xx, a traceback, a server path, a
hang, or more than the configured resources; Redis credentials never reach a log or an answer;
the API key is compared in constant time.

One LMDB server with small limits takes a table of hostile requests (raw sockets where an
HTTP client would refuse to send them); every answer must be a 4xx in the service's error
shape, small, without internals, and change nothing. Slow clients are bounded by
``body_timeout`` (408) and do not hold up other clients. A Redis server with a password is
killed and restarted under a gmmlsh server and a CLI, whose logs and answers must never
contain the password.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import re
import select
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from pydantic import SecretStr
from redis_fixtures import RedisServer
from test_crash import ServerProc, record

from gmmlsh.service import deps
from gmmlsh.service.cli import main

DIM = 8
MAX_BODY = 64 * 1024
KEY = "hostile-key"
H = {"X-API-Key": KEY}
LEAKS = re.compile(r"Traceback|File \"|site-packages|\.py\b|/tmp/|/work/|/home/|/root/")
GOOD = [0.5, -1.0, 0.0, 2.0, 1.0, 0.0, 0.25, 3.0]


@pytest.fixture(scope="module")
def srv(tmp_path_factory) -> Iterator[ServerProc]:
    tmp = tmp_path_factory.mktemp("hostile")
    env = {"GMMLSH_INDEX": str(tmp / "index"), "GMMLSH_DIM": str(DIM), "GMMLSH_SAMPLES": "16",
           "GMMLSH_MAX_BODY_BYTES": str(MAX_BODY), "GMMLSH_MAX_BATCH": "20", "GMMLSH_MAX_K": "50",
           "GMMLSH_MAX_METADATA_BYTES": "4096", "GMMLSH_BODY_TIMEOUT": "2", "GMMLSH_API_KEY": KEY}
    server = ServerProc(tmp, env).start()
    with server.client(headers=H) as c:
        assert c.post("/vectors", json={"id": "base", "values": GOOD}).status_code == 200
    yield server
    server.kill()


def raw(srv: ServerProc, data: bytes, timeout: float = 10.0, send_gap: float = 0.0) -> bytes:
    """Send raw bytes on a fresh connection; return everything the server answers."""
    with socket.create_connection(("127.0.0.1", srv.port), timeout=timeout) as s:
        try:
            if send_gap:  # trickle 64 bytes at a time, until the server answers
                for i in range(0, len(data), 64):
                    s.sendall(data[i:i + 64])
                    if select.select([s], [], [], send_gap)[0]:
                        break
            else:
                s.sendall(data)
        except OSError:  # the server may answer and close before reading everything
            pass
        out = b""
        with contextlib.suppress(OSError):
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                out += chunk
                if b"\r\n\r\n" in out:
                    head, _, body = out.partition(b"\r\n\r\n")
                    m = re.search(rb"content-length: (\d+)", head, re.I)
                    if m and len(body) >= int(m.group(1)):
                        break
        return out


def status_of(answer: bytes) -> int:
    m = re.match(rb"HTTP/1\.1 (\d{3})", answer)
    assert m, f"no HTTP answer: {answer[:200]!r}"
    return int(m.group(1))


def request(method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None) -> bytes:
    hdrs = {"Host": "127.0.0.1", "X-API-Key": KEY, "Content-Type": "application/json",
            "Content-Length": str(len(body)), "Connection": "close", **(headers or {})}
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in hdrs.items() if v is not None)
    return head.encode("latin-1") + b"\r\n" + body


def _nested(depth: int) -> dict:
    d: dict = {"leaf": 1}
    for _ in range(depth):
        d = {"a": d}
    return d


def _vec(**kw) -> bytes:
    return json.dumps({"id": "new", "values": GOOD, **kw}).encode()


#: (name, raw request bytes, allowed statuses)
HOSTILE: list[tuple[str, bytes, set[int]]] = [
    ("declared 10 GB body", request("POST", "/vectors", headers={"Content-Length": str(10 ** 10)}), {413}),
    ("negative Content-Length", request("POST", "/vectors", headers={"Content-Length": "-5"}), {400}),
    ("garbage Content-Length", request("POST", "/vectors", headers={"Content-Length": "12abc"}), {400}),
    ("chunked body over the cap", b"POST /vectors HTTP/1.1\r\nHost: x\r\nX-API-Key: " + KEY.encode()
     + b"\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
     + b"".join(b"%x\r\n" % 8192 + b"1" * 8192 + b"\r\n" for _ in range(12)) + b"0\r\n\r\n", {413}),
    ("200k values (dimension 8)", request("POST", "/vectors", b'{"id": "x", "values": [' + b"1," * 20000 + b"1]}"),
     {422}),
    ("sparse index 2^63-1", request("POST", "/vectors", b'{"id": "x", "indices": [9223372036854775807], '
                                    b'"values": [1]}'), {422}),
    ("sparse index 2^64", request("POST", "/vectors", b'{"id": "x", "indices": [18446744073709551616], '
                                  b'"values": [1]}'), {422}),
    ("sparse index -2^70", request("POST", "/vectors", b'{"id": "x", "indices": [-1180591620717411303424], '
                                   b'"values": [1]}'), {422}),
    ("too many vectors", request("POST", "/vectors", json.dumps({"vectors": [
        {"id": f"m{i}", "values": GOOD} for i in range(21)]}).encode()), {413}),
    ("too many queries", request("POST", "/neighbors/search", json.dumps({"queries": [
        {"id": "base"}] * 21}).encode()), {413}),
    ("k = 10^30", request("GET", "/neighbors?id=base&k=1000000000000000000000000000000"), {422}),
    ("k over max_k", request("POST", "/neighbors/search", b'{"id": "base", "k": 51}'), {422}),
    ("candidates = 10^30", request("GET", "/neighbors?id=base&candidates=1000000000000000000000000000000"), {422}),
    ("k as true", request("POST", "/neighbors/search", b'{"id": "base", "k": true}'), {422}),
    ("k as a string", request("POST", "/neighbors/search", b'{"id": "base", "k": "5"}'), {422}),
    ("min_similarity false", request("POST", "/neighbors/search", b'{"id": "base", "min_similarity": false}'),
     {422}),
    ("metadata nested 300 deep", request("POST", "/vectors", _vec(metadata=_nested(300))), {422}),
    ("metadata list nested 300 deep", request("POST", "/vectors", b'{"id": "x", "values": [1,1,1,1,1,1,1,1], '
                                              b'"metadata": {"a": ' + b"[" * 300 + b"]" * 300 + b"}}"), {422}),
    ("metadata over max_metadata_bytes", request("POST", "/vectors", _vec(metadata={"s": "x" * 5000})), {422}),
    ("metadata with NaN", request("POST", "/vectors", b'{"id": "x", "values": [1,1,1,1,1,1,1,1], '
                                  b'"metadata": {"n": NaN}}'), {422}),
    ("metadata with a 100-digit integer", request("POST", "/vectors", b'{"id": "x", "values": [1,1,1,1,1,1,1,1], '
                                                  b'"metadata": {"n": ' + b"9" * 100 + b"}}"), {422}),
    ("metadata not an object", request("POST", "/vectors", _vec(metadata=[1, 2])), {422}),
    ("id of 512 bytes", request("POST", "/vectors", _vec(id="x" * 512)), {422}),
    ("id of 300 two-byte characters", request("POST", "/vectors", _vec(id="é" * 300)), {422}),
    ("neighbours of a 600-byte id", request("GET", "/neighbors?id=" + "%C3%A9" * 300), {422}),
    ("GET of a 20,000-character id", request("GET", "/vectors/" + "z" * 20000), {404, 414, 422, 400}),
    ("request line of 70 KB", request("GET", "/neighbors?vector=" + "1," * 35000 + "1"), {400, 414, 422}),
    ("lone surrogate in an id", request("POST", "/vectors", b'{"id": "\\ud800", "values": [1,1,1,1,1,1,1,1]}'),
     {422}),
    ("invalid UTF-8 body", request("POST", "/vectors", b'{"id": "\xff\xfe", "values": [1,1,1,1,1,1,1,1]}'),
     {422}),
    ("body is JSON null", request("POST", "/vectors", b"null"), {422}),
    ("body is a bare number", request("POST", "/neighbors/search", b"1e999999"), {422}),
    ("NaN in a query vector", request("POST", "/neighbors/search", b'{"values": [NaN,1,1,1,1,1,1,1]}'), {422}),
    ("1e39 overflows float32", request("POST", "/vectors", b'{"id": "x", "values": [1e39,1,1,1,1,1,1,1]}'), {422}),
    ("1e-46 underflows to zero", request("POST", "/vectors", b'{"id": "x", "values": [1e-46,0,0,0,0,0,0,0]}'),
     {422}),
    ("no API key", request("POST", "/vectors", _vec(), headers={"X-API-Key": None}), {401}),
    ("API key with a NUL", request("GET", "/stats", headers={"X-API-Key": KEY + "\x00"}), {401, 400}),
    ("API key of 8 KB", request("GET", "/stats", headers={"X-API-Key": "k" * 8000}), {401}),
    ("unknown method", request("BREW", "/vectors"), {405, 400}),
    ("path traversal", request("GET", "/../../etc/passwd"), {404, 400}),
    ("header injection attempt", request("GET", "/vectors/a%0d%0aSet-Cookie:%20x=1"), {404}),
]


@pytest.mark.parametrize("name,data,allowed", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_request_is_refused_cleanly(srv, name, data, allowed):
    with srv.client(headers=H) as c:
        before = c.get("/stats").json()["count"]
    t0 = time.monotonic()
    answer = raw(srv, data)
    assert time.monotonic() - t0 < 8, f"{name}: took too long"
    status = status_of(answer)
    assert status in allowed, f"{name}: {status} {answer[:400]!r}"
    head, _, body = answer.partition(b"\r\n\r\n")
    assert len(body) < 4096, f"{name}: a {len(body)}-byte error answer (input echoed?)"
    assert not LEAKS.search(body.decode("utf-8", "replace")), f"{name}: internals in {body[:300]!r}"
    assert not re.search(rb"\r\nset-cookie", head, re.I)
    if body.startswith(b"{"):
        err = json.loads(body)["error"]
        assert err["status"] == status and err["message"]
    with srv.client(headers=H) as c:  # nothing was written, and the server is still fine
        assert c.get("/stats").json()["count"] == before
        assert c.get("/health").status_code == 200


ODD_IDS = ["a/b", "a%2Fb", "../x", "?q=1&k=2", "#frag", "sp ace", "tab\there", "new\nline", "nul\x00byte", "é",
           "日本語", "😀", "\u202eRTL", "\\back", "'quote\"", "<script>", "x" * 511, "é" * 255, "-", ".", "..",
           "%", "%2E", "a:b;c=d", "\r\n"]


def _url(ext: str) -> str:
    """/vectors/<id>, percent-encoded; dots too, or clients drop "." and ".." path segments."""
    from urllib.parse import quote

    return "/vectors/" + quote(ext, safe="").replace(".", "%2E")


def test_ids_with_odd_characters_round_trip(srv):
    """Every id the schema accepts can be written, read, queried and deleted through its URL."""
    with srv.client(headers=H) as c:
        for lo in range(0, len(ODD_IDS), 20):  # max_batch is 20 here
            r = c.post("/vectors", json={"vectors": [{"id": i, "values": GOOD, "metadata": {"id": i}}
                                                     for i in ODD_IDS[lo:lo + 20]]})
            assert r.status_code == 200, r.text
        for i in ODD_IDS:
            r = c.get(_url(i))
            assert r.status_code == 200 and r.json()["id"] == i and r.json()["metadata"] == {"id": i}, (i, r.text)
            r = c.get("/neighbors", params={"id": i, "k": 3})
            assert r.status_code == 200 and i not in [n["id"] for n in r.json()["neighbors"]], (i, r.text)
        for i in ODD_IDS:
            assert c.delete(_url(i)).status_code == 200, i
            assert c.get(_url(i)).status_code == 404, i


def test_deep_but_legal_metadata_round_trips(srv):
    meta = _nested(120)
    with srv.client(headers=H) as c:
        assert c.post("/vectors", json={"id": "deep", "values": GOOD, "metadata": meta}).status_code == 200
        assert c.get("/vectors/deep").json()["metadata"] == meta
        assert c.delete("/vectors/deep").status_code == 200


def test_slow_clients_get_408_and_hold_up_nobody(srv):
    """A body trickling in slower than body_timeout (2 s here) is cut off with 408; meanwhile
    20 stalled connections (half-sent headers, half-sent bodies) do not delay other clients."""
    body = _vec(id="slow", metadata={"pad": "p" * 600})
    t0 = time.monotonic()
    answer = raw(srv, request("POST", "/vectors", body), send_gap=0.5, timeout=15)
    took = time.monotonic() - t0
    assert status_of(answer) == 408, answer[:300]
    assert took < 6, f"the slow body was cut off only after {took:.1f} s"

    stalled = []
    try:
        for n in range(20):
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
            if n % 2:
                s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # headers never finish
            else:
                s.sendall(request("POST", "/vectors", body)[:-10])  # body never finishes
            stalled.append(s)
        served = 0
        t0 = time.monotonic()
        with srv.client(headers=H) as c:
            for _ in range(20):
                r = c.get("/neighbors", params={"id": "base", "k": 3})
                assert r.status_code == 200
                served += 1
        assert time.monotonic() - t0 < 5, "stalled connections slowed other clients down"
    finally:
        for s in stalled:
            s.close()
    with srv.client(headers=H) as c:
        assert c.get("/vectors/slow").status_code == 404
    record("hostile-slow-clients", body_timeout_s=2, cut_off_after_s=round(took, 1), stalled_connections=20,
           requests_served_meanwhile=served)


def test_many_concurrent_oversized_requests_are_cheap(srv):
    """Forty clients each declaring a 60 GB body at once: all refused, the server unharmed."""
    answers: list[int] = []
    lock = threading.Lock()

    def one() -> None:
        a = raw(srv, request("POST", "/vectors", headers={"Content-Length": str(60 * 2**30)}))
        with lock:
            answers.append(status_of(a))

    threads = [threading.Thread(target=one) for _ in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert answers == [413] * 40
    with srv.client(headers=H) as c:
        assert c.get("/health").status_code == 200


# --- credentials and internals ---------------------------------------------------------------


def test_store_errors_show_no_paths(tmp_path):
    """An LMDB index that vanishes: 503 without its path (the path goes to the log only)."""
    idx = tmp_path / "idx"
    s = ServerProc(tmp_path, {"GMMLSH_INDEX": str(idx), "GMMLSH_DIM": str(DIM)}).start()
    try:
        import shutil

        shutil.rmtree(idx)
        with s.client() as c:
            r = c.get("/health")
            assert r.status_code == 503 and str(tmp_path) not in r.text and not LEAKS.search(r.text), r.text
            st = c.get("/stats")
            assert str(tmp_path) not in st.text and not LEAKS.search(st.text), st.text
    finally:
        s.kill()


def test_redis_password_never_logged_or_answered(tmp_path, capsys):
    password = f"pw-{uuid.uuid4().hex}"
    redis = RedisServer(tmp_path / "redis", extra=["--requirepass", password]).start()
    url = f"redis://:{password}@127.0.0.1:{redis.port}/0"
    prefix = f"h{uuid.uuid4().hex[:8]}"
    cache = str(tmp_path / "cache")  # this machine's search mirror of the Redis index
    env = {"GMMLSH_REDIS_URL": url, "GMMLSH_PREFIX": prefix, "GMMLSH_DIM": str(DIM), "GMMLSH_LOG_LEVEL": "debug",
           "GMMLSH_ACCESS_LOG": "true", "GMMLSH_CACHE_DIR": cache}
    s = ServerProc(tmp_path, env)
    answers: list[str] = []
    try:
        s.start()
        with s.client() as c:
            answers.append(c.post("/vectors", json={"id": "a", "values": GOOD}).text)
            answers.append(c.get("/stats").text)
            redis.kill()
            for path in ("/health", "/vectors/a", "/stats"):
                r = c.get(path)
                assert r.status_code == 503
                answers.append(r.text)
            answers.append(c.post("/vectors", json={"id": "b", "values": GOOD}).text)
            redis.start()
            deadline = time.monotonic() + 15
            while c.get("/health").status_code != 200:
                assert time.monotonic() < deadline, "no reconnect after Redis came back"
                time.sleep(0.1)
            answers.append(c.get("/vectors/a").text)
        # a wrong password at start-up: the failure is logged, without the password either
        bad = ServerProc(tmp_path, {**env, "GMMLSH_REDIS_URL": f"redis://:{password}x@127.0.0.1:{redis.port}/0"})
        with pytest.raises(AssertionError):
            bad.start(timeout=30)
        bad_log = bad.log_path.read_text(errors="replace")
        assert "cannot open the index" in bad_log
    finally:
        s.stop()
        redis.stop()
    log = s.log_path.read_text(errors="replace")
    assert "index open" in log and "***" in log
    for where, text in [("server log", log), ("bad start-up log", bad_log), *[("answer", a) for a in answers]]:
        assert password not in text, f"the Redis password appears in the {where}"
    # the command line: info, check on a down server, a usage error
    capsys.readouterr()
    redis.start()
    try:
        assert main(["info", "--redis", url, "--prefix", prefix, "--cache-dir", cache]) == 0
        assert main(["check", "--redis", url, "--prefix", prefix, "--cache-dir", cache]) == 0
    finally:
        redis.stop()
    assert main(["info", "--redis", url, "--prefix", prefix, "--cache-dir", cache]) == 1  # Redis is down now
    out = capsys.readouterr()
    assert password not in out.out + out.err and "***" in out.out + out.err
    assert [p.name.startswith(f"redis-{prefix}-") for p in Path(cache).iterdir()] == [True]  # one mirror, shared


def test_api_key_is_compared_in_constant_time(monkeypatch):
    """Every check is one compare_digest of two SHA-256 digests: the time depends neither on
    where a wrong key differs nor on its length."""
    import asyncio

    calls: list[tuple[int, int]] = []
    real = deps.hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(deps.hmac, "compare_digest", spy)
    request = SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(
        settings=SimpleNamespace(api_key=SecretStr("the-right-key")))), headers={})
    for key in ("", "t", "the-right-kez", "the-right-key-and-more" * 50, "\u00e9\u00e9"):
        with pytest.raises(deps.ApiError):
            asyncio.run(deps.require_api_key(request, key))
    asyncio.run(deps.require_api_key(request, "the-right-key"))
    assert calls == [(32, 32)] * 6
    source = inspect.getsource(deps.check_api_key)  # the one check; require_api_key and the hot path call it
    assert "get_secret_value()" in source and "== expected" not in source and "key ==" not in source
    assert hashlib.sha256(b"x").digest_size == 32


def test_served_document_of_a_keyless_server_asks_for_no_key(tmp_path):
    s = ServerProc(tmp_path, {"GMMLSH_INDEX": str(tmp_path / "i"), "GMMLSH_DIM": str(DIM)}).start()
    try:
        with s.client() as c:
            doc = c.get("/openapi.json").json()
    finally:
        s.kill()
    assert "securitySchemes" not in doc.get("components", {})
    assert all("security" not in op for ops in doc["paths"].values() for op in ops.values())
