"""Concurrency soak: writers and readers on a 2-worker server; the final state equals a replay.

For ``GMMLSH_SOAK_SECONDS`` (default 30) per backend, 4 writer threads upsert
(batches, sometimes naming an id twice: the last wins), re-upsert and delete
ids — each its own pool of ids, plus a small pool all writers fight over —
while 4 reader threads read vectors back, query neighbours by id and by
vector, and look at /stats. Connections are reopened often, so requests land
on both worker processes.

Checked while it runs: no error status (404 only for ids a delete may have
removed), and every vector read back is exactly one version some writer wrote
(values and metadata of the same write: no torn or mixed record). Checked at
the end: the stored state equals a replay of the writers' acknowledged
operations — exactly, for the ids one writer owns; for the contended ids, the
state is the effect of one writer's *last* operation on that id (what any
linearisation of the overlapping requests leaves) — the count is exact, and
:meth:`Index.check` passes.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field

import httpx
import numpy as np
import pytest
from redis_fixtures import redis_url  # noqa: F401  (session fixture)
from test_crash import ServerProc, index_env, random_vectors, record

from gmmlsh.index.index import Index, UnknownIdError

SOAK_SECONDS = float(os.environ.get("GMMLSH_SOAK_SECONDS", "30"))
WRITERS, READERS = 4, 4
OWN_IDS, SHARED_IDS = 20, 5


@dataclass
class Registry:
    """Every version ever sent, keyed (id, writer, seq, position): what a read may legitimately see."""

    versions: dict[tuple[str, int, int, int], bytes] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, key: tuple[str, int, int, int], values: np.ndarray) -> None:
        with self.lock:
            self.versions[key] = values.tobytes()

    def get(self, key: tuple[str, int, int, int]) -> bytes | None:
        with self.lock:
            return self.versions.get(key)


def _version_of(ext: str, meta: dict | None) -> tuple[str, int, int, int]:
    assert meta is not None, f"{ext}: stored without its metadata"
    return ext, int(meta["w"]), int(meta["seq"]), int(meta["pos"])


@pytest.mark.parametrize("backend", ["lmdb", "redis"])
def test_soak_two_workers_final_state_equals_replay(backend, tmp_path, request):
    redis = request.getfixturevalue("redis_url") if backend == "redis" else None
    env, loc, kw = index_env(backend, tmp_path, redis)
    srv = ServerProc(tmp_path, env, workers=2).start()
    registry = Registry()
    # per writer, in acknowledgement order: (id, version key or None for a delete)
    logs: list[list[tuple[str, tuple | None]]] = [[] for _ in range(WRITERS)]
    errors: list[str] = []
    counts: dict[str, int] = defaultdict(int)
    pids: set[int] = set()
    lock = threading.Lock()
    deadline = time.monotonic() + SOAK_SECONDS

    def fail(what: str, r: httpx.Response | None = None) -> None:
        with lock:
            errors.append(what + (f": {r.status_code} {r.text[:300]}" if r is not None else ""))

    def count(kind: str) -> None:
        with lock:
            counts[kind] += 1

    def writer(w: int) -> None:
        rng = np.random.default_rng(100 + w)
        prng = random.Random(100 + w)
        own = [f"w{w}-{i}" for i in range(OWN_IDS)]
        shared = [f"shared-{i}" for i in range(SHARED_IDS)]
        live: set[str] = set()
        c = srv.client()
        seq = 0
        try:
            while time.monotonic() < deadline and not errors:
                seq += 1
                pool = shared if prng.random() < 0.2 else own
                if prng.random() < 0.2 and (live & set(pool) or pool is shared):
                    ext = prng.choice(sorted(live & set(pool)) if pool is own else pool)
                    r = c.delete(f"/vectors/{ext}")
                    if r.status_code == 200 or (r.status_code == 404 and pool is shared):
                        logs[w].append((ext, None))
                        live.discard(ext)
                        count("deletes")
                    else:
                        fail(f"delete {ext}", r)
                else:
                    ids = prng.sample(pool, prng.randint(1, min(5, len(pool))))
                    if prng.random() < 0.15:
                        ids.append(ids[0])  # the same id twice in one batch: the last one wins
                    X = random_vectors(rng, len(ids))
                    items = []
                    for pos, (ext, x) in enumerate(zip(ids, X, strict=True)):
                        registry.add((ext, w, seq, pos), x)
                        items.append({"id": ext, "values": x.tolist(), "metadata": {"w": w, "seq": seq, "pos": pos}})
                    r = c.post("/vectors", json={"vectors": items})
                    if r.status_code != 200:
                        fail("upsert", r)
                        continue
                    last = {ext: pos for pos, ext in enumerate(ids)}
                    for ext, pos in sorted(last.items(), key=lambda t: t[1]):
                        logs[w].append((ext, (ext, w, seq, pos)))
                        live.add(ext)
                    count("upserts")
                if seq % 20 == 0:  # a new connection: maybe the other worker
                    c.close()
                    c = srv.client()
        except Exception as exc:  # noqa: BLE001 - reported by the main thread
            fail(f"writer {w}: {type(exc).__name__}: {exc}")
        finally:
            c.close()

    def check_read(ext: str, body: dict) -> None:
        key = _version_of(ext, body.get("metadata"))
        want = registry.get(key)
        got = np.asarray(body["values"], np.float32).tobytes()
        if want is None or got != want:
            fail(f"read of {ext} returned a version nobody wrote (or a mix): {key}")

    def reader(t: int) -> None:
        rng = np.random.default_rng(200 + t)
        prng = random.Random(200 + t)
        every = [f"w{w}-{i}" for w in range(WRITERS) for i in range(OWN_IDS)]
        every += [f"shared-{i}" for i in range(SHARED_IDS)]
        c = srv.client()
        n = 0
        try:
            while time.monotonic() < deadline and not errors:
                n += 1
                ext = prng.choice(every)
                op = prng.random()
                if op < 0.4:
                    r = c.get(f"/vectors/{ext}")
                    if r.status_code == 200:
                        check_read(ext, r.json())
                    elif r.status_code != 404:
                        fail(f"get {ext}", r)
                    count("reads")
                elif op < 0.6:
                    r = c.get("/neighbors", params={"id": ext, "k": 5})
                    if r.status_code == 200:
                        if ext in [x["id"] for x in r.json()["neighbors"]]:
                            fail(f"neighbours of {ext} include itself")
                    elif r.status_code != 404:
                        fail(f"neighbors of {ext}", r)
                    count("queries")
                elif op < 0.9:
                    q = random_vectors(rng, 1)[0]
                    mode = prng.choice(["auto", "exact"])
                    r = c.post("/neighbors/search", json={"values": q.tolist(), "k": 10, "mode": mode})
                    if r.status_code != 200:
                        fail("search", r)
                    else:
                        sims = [x["similarity"] for x in r.json()["neighbors"]]
                        if any(not 0.0 <= s <= 1.0 + 1e-9 for s in sims) or sims != sorted(sims, reverse=True):
                            fail(f"search returned similarities {sims}")
                    count("queries")
                else:
                    r = c.get("/stats")
                    if r.status_code == 200:
                        with lock:
                            pids.add(r.json()["pid"])
                    else:
                        fail("stats", r)
                    count("stats")
                if n % 10 == 0:
                    c.close()
                    c = srv.client()
        except Exception as exc:  # noqa: BLE001
            fail(f"reader {t}: {type(exc).__name__}: {exc}")
        finally:
            c.close()

    t0 = time.monotonic()
    try:
        threads = [threading.Thread(target=writer, args=(w,)) for w in range(WRITERS)]
        threads += [threading.Thread(target=reader, args=(t,)) for t in range(READERS)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(SOAK_SECONDS + 120)
        assert not any(th.is_alive() for th in threads), "a client thread hung"
        assert not errors, (errors[:5], srv.log())
    finally:
        code = srv.stop()
    assert code in (0, -15), srv.log()

    # --- replay ---------------------------------------------------------------------------
    expect: dict[str, tuple | None] = {}
    last_by_writer: dict[str, list[tuple | None]] = defaultdict(list)
    for log in logs:
        mine: dict[str, tuple | None] = {}
        for ext, version in log:
            mine[ext] = version
        for ext, version in mine.items():
            if ext.startswith("shared-"):
                last_by_writer[ext].append(version)
            else:
                expect[ext] = version
    with Index.open(loc, None, create=False, **kw) as ix:
        checked = 0
        for ext, version in expect.items():
            got = _read(ix, ext)
            want = None if version is None else (registry.get(version), version)
            assert got == want, f"{ext}: stored {got and got[1]}, the replay says {version}"
            checked += 1
        for ext, finals in last_by_writer.items():
            got = _read(ix, ext)
            options = [None if v is None else (registry.get(v), v) for v in finals]
            assert got in options, f"{ext}: stored {got and got[1]}, not any writer's last operation {finals}"
        live = sum(v is not None for v in expect.values())
        live += sum(_read(ix, e) is not None for e in last_by_writer)
        assert ix.count() == live
        rep = ix.check()
        assert rep.ok, rep.summary()
    assert len(pids) == 2, f"expected answers from both workers, saw pids {pids}"
    total = sum(counts.values())
    assert counts["upserts"] > 50 and counts["deletes"] > 5 and counts["reads"] > 50
    record(f"soak-{backend}", seconds=round(time.monotonic() - t0, 1), requests=total,
           requests_per_s=round(total / SOAK_SECONDS), **dict(counts), ids_replayed=checked + len(last_by_writer),
           live=live, workers_seen=len(pids))


def _read(ix: Index, ext: str) -> tuple[bytes, tuple] | None:
    try:
        sv = ix.get(ext)
    except UnknownIdError:
        return None
    return sv.values.astype(np.float32).tobytes(), _version_of(ext, sv.metadata)


def test_get_never_mixes_two_versions(tmp_path, monkeypatch):
    """The race the soak found, made deterministic: the id is replaced between get's lookup
    and its read, so the iid it looked up is retired: get reads again, never a mix."""
    from gmmlsh.index.config import IndexConfig

    with Index.open(str(tmp_path / "idx"), IndexConfig(dim=4, samples=16)) as ix:
        ix.upsert(["a"], np.array([[1.0, 2, 3, 4]]), metadata=[{"v": 1}])
        real = ix.store.read
        fired: list[int] = []

        def racing(iids, fields):
            if "vector" in fields and not fired:
                fired.append(1)
                ix.upsert(["a"], np.array([[5.0, 6, 7, 8]]), metadata=[{"v": 2}])
            return real(iids, fields)

        monkeypatch.setattr(ix.store, "read", racing)
        sv = ix.get("a")
        assert fired and (sv.values.tolist(), sv.metadata) == ([5, 6, 7, 8], {"v": 2})
