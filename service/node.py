"""A search node: ``gmmlsh serve --group g/G`` behind ``gmmlsh route``.

A search node serves the id-shards ``s ≡ g (mod G)`` of an index in Redis (its mirror follows
only their feeds, :class:`~gmmlsh.index.store.redis.RedisStore` ``group``) with the whole REST
API, plus the router's binary batch call ``POST /internal/search`` (:mod:`gmmlsh.service.wire`).
It announces itself in Redis every :data:`BEAT_SECONDS` (:class:`Heartbeat`): a key per node
that expires after :data:`NODE_TTL_MS` unless renewed, so a killed node drops out of the
router's view within that time, and a node that is not warmed up yet says so.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import defaultdict

import numpy as np
import orjson
from fastapi import Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from gmmlsh.core import parallel
from gmmlsh.index.index import Index
from gmmlsh.index.records import SparseRow
from gmmlsh.index.store.redis_tokens import SessionAhead  # imports no redis: an LMDB server loads none
from gmmlsh.results import QueryResult
from gmmlsh.service.errors import ApiError
from gmmlsh.service.wire import MEDIA, NodeAnswer, NodeQuery, WireError, decode_queries, encode_answers

log = logging.getLogger("gmmlsh.node")

#: Seconds between a node's announcements; milliseconds an announcement lives.
BEAT_SECONDS = 0.5
NODE_TTL_MS = 2000


def nodes_key(prefix: str) -> str:
    """The set of announced node URLs (one hash tag with the index's config: one Cluster slot)."""
    return f"{{{prefix}}}:nodes"


def node_key(prefix: str, url: str) -> str:
    """A node's announcement (JSON), expiring after :data:`NODE_TTL_MS`."""
    return f"{{{prefix}}}:node:{url}"


class Publisher:
    """The builder duty of a node's group: while it holds the group's lease, publish its mirror
    as a snapshot whenever it has something new (every ``every`` seconds at most; one process
    of the machine at a time)."""

    def __init__(self, index: Index, where: str, holder: str, group: tuple[int, int], every: float) -> None:
        from gmmlsh.index.snapshots import Lease, open_snapshots

        self.index, self.group, self.every = index, group, every
        self.snaps = open_snapshots(where, index.store.prefix, index.config.uid)
        self.lease = Lease(index.store, group, holder)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gmmlsh-snapshots", daemon=True)

    def start(self) -> Publisher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def round(self):
        """One look: the snapshot published, or None."""
        from gmmlsh.index.snapshots import publish

        if not self.lease.hold():
            return None
        with self.index.mirror.locked("snapshot", blocking=False) as mine:
            if not mine:
                return None
            made = publish(self.index.mirror, self.snaps, self.group)
        if made is not None:
            log.info("snapshot %s published (%d rows)", made.name, made.rows)
        return made

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            try:
                self.round()
            except Exception as exc:  # noqa: BLE001 - the next round tries again
                log.warning("snapshot round failed: %s", exc)


class Heartbeat:
    """Announces a search node in Redis while it runs: its URL, group, readiness and what its
    mirror holds (a thread; the store's client, so a Redis outage is only a missed beat)."""

    def __init__(self, index: Index, url: str, group: tuple[int, int], state) -> None:
        self.index, self.url, self.group, self.state = index, url, group, state
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gmmlsh-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        try:  # leave at once rather than when the key expires
            prefix = self.index.store.prefix
            self.index.store.guarded(lambda r: r.delete(node_key(prefix, self.url)))
        except Exception:  # noqa: BLE001 - Redis down: the key expires on its own
            pass

    def beat(self) -> None:
        store = self.index.store
        view = self.index.mirror.view
        facts = {"url": self.url, "group": self.group[0], "groups": self.group[1],
                 "ready": bool(getattr(self.state, "ready", False)), "rows": view.rows, "live": view.live,
                 "pid": os.getpid(), "at": time.time()}
        body = orjson.dumps(facts)

        def announce(r) -> None:
            r.sadd(nodes_key(store.prefix), self.url)
            r.set(node_key(store.prefix, self.url), body, px=NODE_TTL_MS)

        store.guarded(announce)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.beat()
            except Exception as exc:  # noqa: BLE001 - the next beat tries again
                log.warning("heartbeat to Redis failed: %s", exc)
            self._stop.wait(BEAT_SECONDS)


async def internal_search(request: Request) -> Response:
    """``POST /internal/search``: a router's batch of queries (:mod:`gmmlsh.service.wire`)."""
    index: Index | None = request.app.state.index
    if index is None:
        raise ApiError(503, "the index is not open yet")
    body = await request.body()
    threads = request.app.state.settings.batch_threads
    try:
        out = await run_in_threadpool(answer_batch, index, body, threads)
    except SessionAhead as exc:
        raise ApiError(409, str(exc), field="session", code="session_ahead") from None
    return Response(out, media_type=MEDIA)


def answer_batch(index: Index, body: bytes, threads: int = 1) -> bytes:
    """Answer a batch: dense queries with the same knobs in one ``query_batch``, the others one
    by one; a query by id (``exclude``) asks for one more neighbour and leaves that id out."""
    try:
        queries, epoch = decode_queries(body, index.config.dim)
    except (WireError, KeyError, TypeError, ValueError) as exc:
        raise ApiError(400, f"not a batch of the router's protocol: {exc}", field="body") from None
    parallel.set_threads(threads)
    store = index.store
    store.assume_epoch(epoch)
    try:
        answers: list[NodeAnswer | None] = [None] * len(queries)
        together: dict[tuple, list[int]] = defaultdict(list)
        for i, q in enumerate(queries):
            if isinstance(q.vector, SparseRow) or q.exclude is not None or q.filter is not None:
                vector = (q.vector.indices, q.vector.values) if isinstance(q.vector, SparseRow) else q.vector
                answers[i] = _answer(q, index.query(vector, **_kwargs(q), codes=_codes([q])))
            else:
                together[q.knobs()].append(i)
        for members in together.values():
            q0 = queries[members[0]]
            if len(members) == 1:
                results = [index.query(q0.vector, **_kwargs(q0), codes=_codes([q0]))]
            else:
                results = index.query_batch(np.stack([queries[i].vector for i in members]), **_kwargs(q0),
                                            codes=_codes([queries[i] for i in members]))
            for i, r in zip(members, results, strict=True):
                answers[i] = _answer(queries[i], r)
    finally:
        store.assume_epoch(None)
    return encode_answers(answers, epoch)  # type: ignore[arg-type]


def _codes(queries: list[NodeQuery]) -> np.ndarray | None:
    """The queries' codes as the index takes them, if the router sent every one's."""
    if any(q.codes is None for q in queries):
        return None
    return np.stack([q.codes for q in queries])


def _kwargs(q: NodeQuery) -> dict:
    return {"k": q.k + (q.exclude is not None), "mode": q.mode, "min_similarity": q.min_similarity,
            "candidates": q.candidates, "probes": q.probes, "filter": q.filter}


def _answer(q: NodeQuery, r: QueryResult) -> NodeAnswer:
    hits = [n for n in r.neighbors if n.id != q.exclude][:q.k]
    return NodeAnswer(r.mode, r.candidates, np.array([n.similarity for n in hits], dtype=np.float64),
                      [n.id for n in hits],
                      [orjson.dumps(n.metadata) if n.metadata is not None else b"" for n in hits])
