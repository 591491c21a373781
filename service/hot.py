"""The hot routes, served straight from the ASGI entry point.

A request's way through FastAPI — its middleware stack, the router's matching over every
route, the dependency solver, the query-parameter models — cost more of the event loop's
time per request than a query of a small index (docs/tuning.md). The few routes a service
answers most — neighbour queries and ``/ping`` — are matched here by method and path (a dict
look-up) and answered by their handlers with the checks the full stack would apply, each
from its one source: the API key (:func:`check_api_key`), the body limits
(:mod:`gmmlsh.service.limits`), the request metrics, and every error through the app's own
exception handlers. Everything else, and any request carrying an ``Origin`` header while
CORS is configured, goes through the full stack, where the same handlers are registered as
documented FastAPI routes.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gmmlsh.service import node
from gmmlsh.service.deps import check_api_key
from gmmlsh.service.limits import declared_refusal, limited_receive
from gmmlsh.service.routes import neighbors, ops

Handler = Callable[[Request], Awaitable[Response]]


@dataclass(frozen=True)
class HotRoute:
    handler: Handler
    template: str  #: the route's path template: the metrics' label, as the full stack names it
    public: bool = False  #: answered without the API key
    internal: bool = False  #: not inside a collection


_ROUTES = {
    ("GET", "/ping"): HotRoute(ops.ping, "/ping", public=True),
    ("GET", "/neighbors"): HotRoute(neighbors.get_neighbors, "/neighbors"),
    ("POST", "/neighbors/search"): HotRoute(neighbors.post_search, "/neighbors/search"),
    # The router's binary batch call (a search node behind `gmmlsh route`; see service/node.py).
    ("POST", "/internal/search"): HotRoute(node.internal_search, "/internal/search", internal=True),
}
_IN_COLLECTION = {key: r for key, r in _ROUTES.items() if not r.public and not r.internal}  # collection: a label
_PREFIX = "/collections/"


class HotPath:
    """Matches and serves the hot routes of one app (see the module)."""

    def __init__(self, app) -> None:
        self.app = app
        self.settings = app.state.settings
        self.metrics = app.state.metrics
        self.cors = bool(self.settings.cors_origins)

    def match(self, scope: Scope) -> tuple[HotRoute, str | None] | None:
        """The hot route of a request and its collection (None: the server's), or None."""
        path: str = scope["path"]
        method: str = scope["method"]
        route = _ROUTES.get((method, path))
        collection = None
        if route is None:
            if not path.startswith(_PREFIX):
                return None
            collection, slash, rest = path[len(_PREFIX):].partition("/")
            route = _IN_COLLECTION.get((method, slash + rest)) if collection else None
            if route is None:
                return None
        if self.cors and any(name == b"origin" for name, _ in scope["headers"]):
            return None  # CORS headers are the full stack's to add
        return route, collection

    async def serve(self, route: HotRoute, collection: str | None, scope: Scope, receive: Receive,
                    send: Send) -> None:
        start = time.perf_counter()
        settings = self.settings
        if collection is not None:
            scope["path_params"] = {"collection": collection}
        response = declared_refusal(scope, settings.max_body_bytes)
        if response is None:
            request = Request(scope, limited_receive(receive, settings.max_body_bytes, settings.body_timeout))
            try:
                if not route.public:
                    check_api_key(settings, request.headers)
                response = await route.handler(request)
            except Exception as exc:  # noqa: BLE001 - answered by the app's handler for it, as the full stack would
                response = await self._handler(exc)(request, exc)
        await response(scope, receive, send)
        self.metrics.observe_request(scope["method"], route.template, response.status_code,
                                     collection or settings.collection, time.perf_counter() - start)

    def _handler(self, exc: Exception) -> Callable:
        handlers = self.app.exception_handlers
        for cls in type(exc).__mro__:
            if cls in handlers:
                return handlers[cls]
        raise exc
