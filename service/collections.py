"""The collections a server serves: the default index and the named ones, opened on first use.

Each worker process keeps the collections it has served open (an LMDB environment or a
Redis connection pool each). Before a named collection answers, one cheap read of the
registry (a small file, or one ``HGET``) confirms it still exists *as the one opened* — its
uid — so a collection deleted, or deleted and made again, through another worker or replica
is never written to or read from stale: the request sees 404, or the new one.
"""

from __future__ import annotations

import logging
import threading

from gmmlsh.index import monitor
from gmmlsh.index.collections import DEFAULT_COLLECTION, Collections, UnknownCollection
from gmmlsh.index.config import IndexConfig
from gmmlsh.index.index import Index
from gmmlsh.index.mirror import mirror_dir
from gmmlsh.service.opening import INDEX_ONLY, index_options
from gmmlsh.service.settings import Settings

log = logging.getLogger("gmmlsh.service")


class CollectionManager:
    """Opens, caches and checks the indexes of one server's collections (thread-safe)."""

    def __init__(self, settings: Settings, default: Index):
        self.settings = settings
        self.default = default
        opts = index_options(settings)
        self._index_options = {k: opts.pop(k) for k in INDEX_ONLY}
        self.collections = Collections(settings.location, **opts)
        self._open: dict[str, Index] = {}  # name → index, oldest first
        self._users: dict[int, int] = {}  # id(index) → requests using it now
        self._dropped: dict[int, Index] = {}  # forgotten while in use: closed by the last user
        self._lock = threading.Lock()
        try:  # what killed creations and deletions left behind (invisible, but it takes space)
            swept = self.collections.sweep()
        except Exception as exc:  # noqa: BLE001 - the server starts anyway; the next start tries again
            log.warning("leftovers of collections not swept: %s", settings.scrub(str(exc)))
        else:
            if swept:
                log.info("swept the leftovers of %d collection creations or deletions", swept)

    def acquire(self, name: str) -> Index:
        """The open index of collection ``name`` (UnknownCollection: 404), held for one request
        until :meth:`release`: an index dropped meanwhile (deleted, made again elsewhere, or
        beyond ``open_collections``) is closed when its last request releases it."""
        if name == DEFAULT_COLLECTION:
            return self.default
        uid = self.collections.uid(name)
        with self._lock:
            index = self._open.get(name)
            if index is not None and index.config.uid != uid:
                self._drop(name)
                index = None
            if index is None:
                if uid is None:
                    raise UnknownCollection(name)
                while len(self._open) >= self.settings.open_collections:  # the one open longest
                    self._drop(next(iter(self._open)))
                index = self.collections.open(name, **self._index_options)
                self._open[name] = index
            self._users[id(index)] = self._users.get(id(index), 0) + 1
        return index

    def release(self, index: Index) -> None:
        """A request is done with an index from :meth:`acquire`."""
        if index is self.default:
            return
        with self._lock:
            left = self._users[id(index)] = self._users[id(index)] - 1
            if left == 0:
                del self._users[id(index)]
            close = left == 0 and id(index) in self._dropped
            if close:
                self._dropped.pop(id(index))
        if close:
            index.close()

    def _drop(self, name: str) -> None:
        """Forget an open index (under the lock); closed now, or by its last user."""
        index = self._open.pop(name)
        if self._users.get(id(index)):
            self._dropped[id(index)] = index
        else:
            index.close()

    def create(self, name: str, config: IndexConfig, indexed: list[str]) -> dict:
        return self.collections.create(name, config, indexed)

    def delete(self, name: str) -> None:
        self.collections.delete(name)
        with self._lock:
            if name in self._open:
                self._drop(name)

    def listing(self) -> list[dict]:
        """``default`` (the server's own index), then the named collections: see :meth:`Collections.listing`."""
        return self.collections.listing(self.default)

    def recall_reports(self) -> dict[str, dict]:
        """Each collection's recall monitor report (:func:`gmmlsh.index.monitor.report`), read from
        this machine's mirror directories without opening the collections."""
        out = {DEFAULT_COLLECTION: monitor.report(self.default.mirror.dir)}
        for entry in self.collections.list():
            where = mirror_dir(self.collections.registry.location(entry), entry.get("prefix", self.settings.prefix),
                               entry["uid"], self.settings.cache_dir)
            out[entry["name"]] = monitor.report(where)
        return out

    def close(self) -> None:
        with self._lock:
            opened, self._open = [*self._open.values(), *self._dropped.values()], {}
            self._dropped = {}
        for index in opened:
            index.close()
        self.collections.close()
