"""Prometheus metrics: requests, latency, candidates per query, index size, served recall.

Each app owns its metric objects and registry (several apps in one process, as in
tests, must not collide in prometheus-client's global registry).

With several uvicorn workers each process counts only its own requests, so a
scrape answered by one worker would show a fraction of the traffic. When
``PROMETHEUS_MULTIPROC_DIR`` is set (``gmmlsh serve --workers N`` sets it to a
fresh temporary directory when it is not set already), prometheus-client keeps
the values in shared files and ``/metrics`` aggregates every worker's. The
index size is read live from the store at scrape time: every worker sees the
same LMDB environment or Redis, so any worker's answer is the whole index's. So is the
recall monitor's estimate of each collection (:mod:`gmmlsh.index.monitor`), read at scrape
time from the machine's mirror directories.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gmmlsh.index.store.registry import DEFAULT_COLLECTION, NAME_RE

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
CANDIDATE_BUCKETS = (0, 10, 30, 100, 300, 1000, 3000, 10_000, 30_000, 100_000, 300_000, 1_000_000)


def multiprocess_dir() -> str | None:
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


class _IndexCollector(Collector):
    """``gmmlsh_index_vectors`` / ``gmmlsh_store_up`` and the recall gauges, computed at scrape time."""

    def __init__(self, count: Callable[[], int], recall: Callable[[], dict[str, dict]] | None = None):
        self._count = count
        self._recall = recall

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield from self._index()
        if self._recall is not None:
            yield from recall_gauges(self._recall())

    def _index(self) -> Iterator[GaugeMetricFamily]:
        up = GaugeMetricFamily("gmmlsh_store_up", "1 if the index store answered this scrape")
        try:
            n = self._count()
        except Exception:  # a scrape must still succeed while the store is down
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield GaugeMetricFamily("gmmlsh_index_vectors", "vectors stored in the index", value=n)


#: The recall monitor's gauges: (name, help, the report's field).
RECALL_GAUGES = (
    ("gmmlsh_recall_estimate", "recall@10 of the served answers, estimated by the recall monitor "
     "(the current tuning's sample)", "estimate"),
    ("gmmlsh_recall_lower", "lower end of the estimate's 90 % interval (one-sided 95 % bound)", "lower"),
    ("gmmlsh_recall_upper", "upper end of the estimate's 90 % interval", "upper"),
    ("gmmlsh_recall_checked", "served queries the recall monitor checked by exact search (current tuning)", "checked"),
    ("gmmlsh_recall_target", "the recall@10 target the index tunes for", "target"),
)


def recall_gauges(reports: dict[str, dict]) -> Iterator[GaugeMetricFamily]:
    """One gauge family per :data:`RECALL_GAUGES`, a sample per collection (those with a value)."""
    for name, text, field in RECALL_GAUGES:
        family = GaugeMetricFamily(name, text, labels=["collection"])
        for collection, report in sorted(reports.items()):
            if report.get(field) is not None:
                family.add_metric([collection], float(report[field]))
        yield family


class Metrics:
    def __init__(self) -> None:
        self.multiprocess = multiprocess_dir() is not None
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "gmmlsh_http_requests", "HTTP requests answered",
            ["method", "route", "status", "collection"], registry=self.registry,
        )
        self.latency = Histogram(
            "gmmlsh_http_request_duration_seconds", "time to answer an HTTP request",
            ["method", "route", "collection"], buckets=LATENCY_BUCKETS, registry=self.registry,
        )
        self.candidates = Histogram(
            "gmmlsh_query_candidates", "vectors scored exactly per query",
            ["mode"], buckets=CANDIDATE_BUCKETS, registry=self.registry,
        )
        self.upserted = Counter(
            "gmmlsh_vectors_upserted", "vectors written through the API", registry=self.registry,
        )
        self.deleted = Counter(
            "gmmlsh_vectors_deleted", "vectors deleted through the API", registry=self.registry,
        )
        self._children: dict[tuple[str, str, int], tuple] = {}
        self._count: Callable[[], int] | None = None
        self._recall: Callable[[], dict[str, dict]] | None = None
        if not self.multiprocess:
            self.registry.register(_IndexCollector(self._live_count, self._recall_reports))

    def observe_request(self, method: str, route: str, status: int, collection: str, seconds: float) -> None:
        """Count one answered request and its time, by route template and collection (the
        labelled children are made once per key: ``labels()`` costs more than the update). A 401
        or 404 counts under collection ``-``: it may name one that does not exist (any name could
        be sent), and only collections that exist may become labels."""
        key = (method, route, status, collection)
        children = self._children.get(key)
        if children is None:
            label = "-" if status in (401, 404) or not NAME_RE.match(collection) else collection
            children = self._children[key] = (self.requests.labels(method, route, str(status), label),
                                              self.latency.labels(method, route, label))
        children[0].inc()
        children[1].observe(seconds)

    def bind_index(self, count: Callable[[], int] | None, recall: Callable[[], dict[str, dict]] | None = None) -> None:
        """What the scrape-time gauges read: the index's size, and each collection's recall report."""
        self._count = count
        self._recall = recall

    def _recall_reports(self) -> dict[str, dict]:
        try:
            return self._recall() if self._recall is not None else {}
        except Exception:  # noqa: BLE001 - a scrape must succeed while a collection is being deleted
            return {}

    def _live_count(self) -> int:
        if self._count is None:
            raise RuntimeError("no index open")
        return self._count()

    def render(self) -> tuple[bytes, str]:
        """The exposition text (blocking: reads the store and, if shared, the files)."""
        if self.multiprocess:
            from prometheus_client import multiprocess

            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
            registry.register(_IndexCollector(self._live_count, self._recall_reports))
        else:
            registry = self.registry
        return generate_latest(registry), CONTENT_TYPE_LATEST


class MetricsMiddleware:
    """Counts and times every request by route *template* (``/vectors/{id}``, not the id:
    label values must stay few; a route under ``/collections/{collection}`` shows as the route
    it mounts, ``/vectors``) and collection: the ``{collection}`` of the path, else the
    server's own (``GMMLSH_COLLECTION``, by default ``default``)."""

    def __init__(self, app: ASGIApp, metrics: Metrics, collection: str = DEFAULT_COLLECTION):
        self.app = app
        self.metrics = metrics
        self.collection = collection

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            path = getattr(route, "path_format", None) or getattr(route, "path", None) or "<unmatched>"
            collection = (scope.get("path_params") or {}).get("collection") or self.collection
            self.metrics.observe_request(scope.get("method", ""), path, status, collection,
                                         time.perf_counter() - start)
