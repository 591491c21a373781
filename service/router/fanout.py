"""The router's scatter and gather: which nodes, which replica, how many neighbours, the merge.

**Layout.** Search nodes announce themselves in Redis (:class:`gmmlsh.service.node.Heartbeat`):
URL, group ``g`` of ``G``, ready or not. A *layout* is one ``G``; the router answers through
the largest layout every group of which has a ready node (or the one ``route_groups`` names),
so a layout grown from 2 to 4 groups takes over once its last group is ready, and the old
one keeps answering until then.

**Replica and hedge.** Per group, the live replica with the fewest calls in flight is asked
(a replica that failed is left alone for :data:`DOWN_SECONDS`); if it has not answered after
the group's 95th percentile latency (``hedge_after`` fixes it), a second replica is asked too
and the first answer wins. A replica that fails is replaced by another at once; a group none
of whose replicas answers is *missing*.

**Batches.** Queries arriving within ``route_window`` travel to each group in one binary call
(:mod:`gmmlsh.service.wire`), after one read of the index's epoch made after the last of them
arrived (strong consistency: see :mod:`gmmlsh.service.router`). A request with a session token
travels on its own (a token ahead of the store fails that request, not its neighbours').

**Hashed once.** With more than one group, the router hashes each dense query that may be
answered by the sketch search (``auto``, ``sketch``) once and sends its codes along, so no
group's node hashes it again (a sparse query's hashing costs ~1 ms and its search is usually
the postings one, which needs none: a node hashes those itself, if it must).

**k and budgets per group.** Every group reports exact GMM similarities, so the merge (by
similarity, ties in group order) loses nothing a group found. An exact search asks each group
for ``k``: the merge then equals one node's answer. Other searches ask each group for
:func:`shard_k`: the fewest that hold the global top ``k`` with probability ≥ 0.999 when ids
are spread at random over ``G`` groups (union bound over the groups) — 10 of 10 at G = 2, 8 at
G = 4. Each group searches with its own tuning (made on its own rows for the index's recall
target); ``candidates`` and ``probes`` given with a query apply to every group as given.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache

import numpy as np
import orjson
from redis.exceptions import RedisError

from gmmlsh.core.validate import VectorError
from gmmlsh.index.records import SparseRow
from gmmlsh.index.store.base import StoreUnavailable
from gmmlsh.service.node import node_key, nodes_key
from gmmlsh.service.router.http import Pool
from gmmlsh.service.wire import MEDIA, NodeAnswer, NodeQuery, decode_answers, encode_queries

log = logging.getLogger("gmmlsh.router")

#: Seconds between reads of the node announcements.
REFRESH_SECONDS = 0.25
#: Seconds a replica that failed is not asked.
DOWN_SECONDS = 1.0
#: Latencies kept per group for its hedge threshold; the threshold before enough are known.
LATENCIES = 256
HEDGE_FLOOR = 0.002
#: Query modes the sketch search may answer: their dense queries are hashed once by the router.
_SKETCHED = ("auto", "sketch")
#: Probability that a group's top ``shard_k`` holds its share of the global top ``k``.
SHARD_K_CONFIDENCE = 0.999


@lru_cache(maxsize=4096)
def shard_k(k: int, groups: int, confidence: float = SHARD_K_CONFIDENCE) -> int:
    """The fewest neighbours per group such that, with ids spread uniformly over ``groups``,
    no group holds more of the global top ``k`` than that with probability ≥ ``confidence``
    (union bound: ``groups · P[Binomial(k, 1/groups) > k_s] ≤ 1 − confidence``)."""
    if groups <= 1:
        return k
    from scipy.stats import binom

    for ks in range(1, k + 1):
        if groups * binom.sf(ks, k, 1.0 / groups) <= 1.0 - confidence:
            return ks
    return k


class GroupMissing(Exception):
    """Groups of the layout with no live replica (or none that answered)."""

    def __init__(self, groups: list[int], layout: int, why: str = ""):
        self.groups, self.layout, self.why = groups, layout, why
        names = ", ".join(str(g) for g in groups)
        super().__init__(f"group{'s' if len(groups) > 1 else ''} {names} of {layout} "
                         f"{'have' if len(groups) > 1 else 'has'} no live search node{': ' + why if why else ''}")


class NodeRefused(Exception):
    """A node answered with an error of the caller's making (4xx): passed on, not retried."""

    def __init__(self, status: int, body: bytes):
        super().__init__(body.decode("utf-8", "replace"))
        self.status, self.body = status, body


@dataclass
class Replica:
    url: str
    group: int
    groups: int
    ready: bool
    inflight: int = 0
    down_until: float = 0.0

    def usable(self, now: float) -> bool:
        return self.ready and self.down_until <= now


@dataclass
class GroupLatency:
    seconds: deque = field(default_factory=lambda: deque(maxlen=LATENCIES))

    def hedge_after(self) -> float:
        if len(self.seconds) < 20:
            return max(HEDGE_FLOOR, max(self.seconds, default=0.0) * 2)
        return max(HEDGE_FLOOR / 4, float(np.percentile(np.fromiter(self.seconds, float), 95)))


@dataclass
class _Pending:
    queries: list[NodeQuery]
    epoch: int | None  # a session's epoch, or None
    strong: bool
    done: asyncio.Future


class Fanout:
    """Node discovery, replica choice with hedging, micro-batches and the merge (module docstring)."""

    def __init__(self, redis, prefix: str, *, route_groups: int | None = None, hedge_after: float | None = None,
                 timeout: float = 10.0, window: float = 0.0005, api_key: str | None = None,
                 hasher: Callable[[np.ndarray], np.ndarray] | None = None):
        self.redis, self.prefix = redis, prefix
        #: Dense query rows (n, dim) float32 → their codes (n, samples): see "Hashed once".
        self.hasher = hasher
        self.route_groups, self.fixed_hedge, self.timeout, self.window = route_groups, hedge_after, timeout, window
        self.replicas: dict[str, Replica] = {}
        self.latency: dict[tuple[int, int], GroupLatency] = {}
        headers = {"Content-Type": MEDIA, **({"X-API-Key": api_key} if api_key else {})}
        self.http = Pool(headers, timeout)
        self._pending: list[_Pending] = []
        self._flush: asyncio.TimerHandle | None = None
        self._task: asyncio.Task | None = None
        self.calls = 0
        self.hedged = 0
        self.hashed = 0  # queries the router hashed for its groups

    # --- discovery ------------------------------------------------------------------------
    async def start(self) -> None:
        try:
            await self.refresh()
        except Exception as exc:  # noqa: BLE001 - the loop tries again
            log.warning("reading the search nodes failed: %s", exc)
        self._task = asyncio.create_task(self._refresh_loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        await self.http.close()

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(REFRESH_SECONDS)
            try:
                await self.refresh()
            except Exception as exc:  # noqa: BLE001 - keep the last view; try again
                log.warning("reading the search nodes failed: %s", exc)

    async def refresh(self) -> None:
        """Read the announcements: nodes whose key expired are gone."""
        urls = sorted(u.decode() for u in await self.redis.smembers(nodes_key(self.prefix)))
        raws = await self.redis.mget([node_key(self.prefix, u) for u in urls]) if urls else []
        seen = {}
        for url, raw in zip(urls, raws, strict=True):
            if raw is None:
                continue
            facts = orjson.loads(raw)
            group, groups, ready = int(facts["group"]), int(facts["groups"]), bool(facts["ready"])
            rep = self.replicas.get(url)
            if rep is None or (rep.group, rep.groups) != (group, groups):
                rep = Replica(url, group, groups, ready)
            rep.ready = ready  # the same object: calls in flight count down on it
            seen[url] = rep
        self.replicas = seen

    def layouts(self) -> dict[int, dict[int, list[Replica]]]:
        """Ready replicas by layout and group."""
        out: dict[int, dict[int, list[Replica]]] = {}
        for r in self.replicas.values():
            if r.ready:
                out.setdefault(r.groups, {}).setdefault(r.group, []).append(r)
        return out

    def layout(self) -> tuple[int, dict[int, list[Replica]]]:
        """The layout answering now: ``(G, replicas by group)``; groups of it may be empty."""
        layouts = self.layouts()
        if self.route_groups is not None:
            return self.route_groups, layouts.get(self.route_groups, {})
        complete = [G for G, groups in layouts.items() if len(groups) == G]
        if complete:
            G = max(complete)
        elif layouts:  # none complete: the one closest to it, to name what is missing
            G = max(layouts, key=lambda G: (len(layouts[G]) / G, G))
        else:
            G = max((r.groups for r in self.replicas.values()), default=1)
        return G, layouts.get(G, {})

    # --- a query batch ----------------------------------------------------------------------
    async def search(self, queries: list[NodeQuery], *, session: int | None = None, strong: bool = True,
                     ) -> tuple[list[list[tuple[int, NodeAnswer]]], list[int], int]:
        """Each query's answers by group, the groups that are missing, the layout's G. Waits for
        the micro-batch it joins (and its epoch read)."""
        fut = asyncio.get_running_loop().create_future()
        pending = _Pending(queries, session, strong, fut)
        if session is not None:  # its own call: a token ahead of the store fails this request only
            asyncio.ensure_future(self._send([pending]))
            return await fut
        self._pending.append(pending)
        if self._flush is None:
            self._flush = asyncio.get_running_loop().call_later(self.window, self._start_flush)
        return await fut

    def _start_flush(self) -> None:
        self._flush = None
        batch, self._pending = self._pending, []
        if batch:
            asyncio.ensure_future(self._send(batch))

    async def _send(self, batch: list[_Pending]) -> None:
        try:
            epoch = max((p.epoch for p in batch if p.epoch is not None), default=None)
            if any(p.strong for p in batch):  # read after every query of the batch arrived
                try:
                    now = int(await self.redis.get(f"{{{self.prefix}}}:epoch") or 0)
                except RedisError as exc:
                    raise StoreUnavailable(f"Redis did not answer the epoch read: {type(exc).__name__}") from None
                epoch = now if epoch is None else max(epoch, now)
            queries = [q for p in batch for q in p.queries]
            per_query, missing, G = await self._scatter(queries, epoch)
        except Exception as exc:  # noqa: BLE001 - every waiter gets the failure
            for p in batch:
                if not p.done.done():
                    p.done.set_exception(exc)
            return
        at = 0
        for p in batch:
            if not p.done.done():
                p.done.set_result((per_query[at:at + len(p.queries)], missing, G))
            at += len(p.queries)

    async def _scatter(self, queries: list[NodeQuery], epoch: int | None
                       ) -> tuple[list[list[tuple[int, NodeAnswer]]], list[int], int]:
        G, groups = self.layout()
        sent = [_for_groups(q, G) for q in queries]
        if G > 1 and self.hasher is not None:
            sent = await self._hashed(sent)
        body = encode_queries(sent, epoch)
        missing = [g for g in range(G) if not groups.get(g)]
        live = [g for g in range(G) if groups.get(g)]
        results = await asyncio.gather(*(self._call_group(G, g, groups[g], body) for g in live),
                                       return_exceptions=True)
        per_query: list[list[tuple[int, NodeAnswer]]] = [[] for _ in queries]
        for g, res in zip(live, results, strict=True):
            if isinstance(res, NodeRefused):
                raise res
            if isinstance(res, BaseException):
                log.warning("group %d of %d failed: %s", g, G, res)
                missing.append(g)
                continue
            for i, a in enumerate(res):
                per_query[i].append((g, a))
        return per_query, sorted(missing), G

    async def _hashed(self, queries: list[NodeQuery]) -> list[NodeQuery]:
        """The queries with the codes of those the sketch search may answer (dense, ``auto`` or
        ``sketch``), hashed together off the event loop. A row that cannot be hashed (it equals
        a centred index's centre) leaves every query to its nodes, which answer each for itself."""
        todo = [i for i, q in enumerate(queries)
                if q.codes is None and q.mode in _SKETCHED and not isinstance(q.vector, SparseRow)]
        if not todo:
            return queries
        try:
            codes = await asyncio.to_thread(self.hasher, np.stack([queries[i].vector for i in todo]))
        except VectorError:
            return queries
        self.hashed += len(todo)
        out = list(queries)
        for j, i in enumerate(todo):
            out[i] = replace(queries[i], codes=codes[j])
        return out

    async def _call_group(self, G: int, g: int, replicas: list[Replica], body: bytes) -> list[NodeAnswer]:
        """One group's answer: the least busy replica, a hedge after the group's p95, another
        replica at once when one fails."""
        stats = self.latency.setdefault((G, g), GroupLatency())
        hedge = self.fixed_hedge if self.fixed_hedge is not None else stats.hedge_after()
        tried: set[str] = set()
        running: dict[asyncio.Task, Replica] = {}
        errors: list[str] = []
        t0 = time.perf_counter()

        def launch() -> bool:
            now = time.monotonic()
            choices = [r for r in replicas if r.url not in tried and r.usable(now)]
            if not choices:
                choices = [r for r in replicas if r.url not in tried]  # all marked down: try them anyway
            if not choices:
                return False
            rep = min(choices, key=lambda r: r.inflight)
            tried.add(rep.url)
            rep.inflight += 1
            self.calls += 1
            running[asyncio.ensure_future(self._post(rep, body))] = rep
            return True

        launch()
        try:
            while running:
                timeout = hedge if len(tried) == 1 and len(replicas) > 1 else None
                done, _ = await asyncio.wait(running, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                if not done:  # the first is slow: ask a second replica too
                    if launch():
                        self.hedged += 1
                    continue
                for task in done:
                    rep = running.pop(task)
                    rep.inflight -= 1
                    exc = task.exception()
                    if exc is None:
                        stats.seconds.append(time.perf_counter() - t0)
                        return task.result()
                    if isinstance(exc, NodeRefused):
                        raise exc
                    rep.down_until = time.monotonic() + DOWN_SECONDS
                    errors.append(f"{rep.url}: {exc}")
                if not running:
                    launch()
            raise GroupMissing([g], G, "; ".join(errors))
        finally:
            for task, rep in running.items():
                task.cancel()
                rep.inflight -= 1

    async def _post(self, rep: Replica, body: bytes) -> list[NodeAnswer]:
        status, content = await self.http.post(rep.url, "/internal/search", body)
        if status == 200:
            return decode_answers(content)[0]
        if 400 <= status < 500 and status not in (408, 429):
            raise NodeRefused(status, content)
        raise ConnectionError(f"HTTP {status}: {content[:200].decode('utf-8', 'replace')}")


def _for_groups(q: NodeQuery, G: int) -> NodeQuery:
    """The query as each group gets it: ``k`` cut to :func:`shard_k` unless exact."""
    if q.mode == "exact" or G == 1:
        return q
    return replace(q, k=shard_k(q.k, G))


def merge(answers: Sequence[tuple[int, NodeAnswer]], k: int) -> tuple[str, int, list[tuple[float, str, bytes]]]:
    """The groups' answers to one query as one: the best ``k`` by exact similarity (ties in
    group order, then each group's own order), the candidates added up, the search named."""
    hits = [(float(s), n, m) for _, a in answers for s, n, m in zip(a.similarities, a.names, a.metadata, strict=True)]
    hits.sort(key=lambda h: -h[0])  # stable: ties keep group order
    modes = sorted({a.mode for _, a in answers})
    return ("+".join(modes) if modes else "exact"), sum(a.candidates for _, a in answers), hits[:k]
