"""Named collections: several indexes, each with its own dimension and parameters, kept
beside the default index in one LMDB directory or one Redis.

:class:`Collections` creates, lists, opens and deletes them; where each lives and why a
kill leaves one whole or absent is :mod:`gmmlsh.index.store.registry`'s. The default
collection (:data:`DEFAULT_COLLECTION`) is the index at the location itself, so an index
made before collections existed is the default collection of its location.
"""

from __future__ import annotations

import os
import shutil

from gmmlsh.index.config import IndexConfig
from gmmlsh.index.index import Index
from gmmlsh.index.mirror import mirror_dir
from gmmlsh.index.store.location import DEFAULT_PREFIX
from gmmlsh.index.store.registry import (
    DEFAULT_COLLECTION,
    CollectionExists,
    UnknownCollection,
    check_name,
    open_registry,
)

__all__ = ["DEFAULT_COLLECTION", "CollectionExists", "Collections", "UnknownCollection", "check_indexed",
           "described"]

#: Most metadata fields a collection may declare indexed.
MAX_INDEXED_FIELDS = 32


def check_indexed(fields, where: str = "indexed_fields") -> list[str]:
    """Declared indexed metadata fields: distinct non-empty strings (ValueError naming ``where``)."""
    if fields is None:
        return []
    if not isinstance(fields, list | tuple) or len(fields) > MAX_INDEXED_FIELDS:
        raise ValueError(f"{where}: must be a list of at most {MAX_INDEXED_FIELDS} metadata field names")
    for i, f in enumerate(fields):
        if not isinstance(f, str) or not f or len(f) > 256:
            got = f"{len(f)} characters" if isinstance(f, str) else type(f).__name__
            raise ValueError(f"{where}[{i}]: must be a field name (1-256 characters), got {got}")
    if len(set(fields)) != len(fields):
        raise ValueError(f"{where}: names a field twice")
    return list(fields)


def described(entry: dict) -> dict:
    """A registry entry as the API and the command line show it."""
    return {"name": entry["name"], "dim": entry.get("dim"), "indexed_fields": entry.get("indexed", []),
            "created": entry.get("created")}


class Collections:
    """The named collections beside the index at ``location`` (a directory or a Redis URL).

    ``prefix``: the default index's Redis prefix (collections take prefixes derived from it);
    ``cache_dir``: where Redis collections' search mirrors live on this machine; other
    options go to each store (e.g. LMDB's ``max_readers``).
    """

    def __init__(self, location: str | os.PathLike, *, prefix: str = DEFAULT_PREFIX,
                 cache_dir: str | os.PathLike | None = None, **store_options):
        self.location, self.prefix, self.cache_dir = str(location), prefix, cache_dir
        self.store_options = store_options
        self.registry = open_registry(self.location, prefix=prefix, **store_options)

    def list(self) -> list[dict]:
        """Every named collection's entry (name, uid, indexed fields, creation time), by name."""
        return self.registry.list()

    def listing(self, default: Index | None) -> list[dict]:
        """What ``GET /collections`` and ``gmmlsh collections`` show: ``default`` first (given the
        location's own index, open; None: there is none), then the named collections by name,
        each as ``{"name", "dim", "indexed_fields", "created"}``."""
        head = [] if default is None else [described({"name": DEFAULT_COLLECTION, "dim": default.config.dim,
                                                       "indexed": list(default.indexed)})]
        return head + [described(e) for e in self.list()]

    def get(self, name: str) -> dict:
        """The entry of collection ``name`` (UnknownCollection if there is none)."""
        check_name(name)
        entry = self.registry.get(name)
        if entry is None:
            raise UnknownCollection(name)
        return entry

    def uid(self, name: str) -> str | None:
        """The uid of collection ``name`` (one cheap read), or None: an open collection whose uid
        differs was deleted (and maybe made again) by another process."""
        return self.registry.uid(check_name(name))

    def create(self, name: str, config: IndexConfig, indexed=()) -> dict:
        """Create collection ``name`` (CollectionExists if it exists, the default's name included)."""
        check_name(name)
        indexed = check_indexed(list(indexed))
        if name == DEFAULT_COLLECTION:
            raise CollectionExists(name)
        return self.registry.create(name, config.to_dict(), indexed)

    def delete(self, name: str) -> None:
        """Delete collection ``name`` and everything in it (UnknownCollection if there is none)."""
        check_name(name)
        if name == DEFAULT_COLLECTION:
            raise ValueError("collection: the default collection is the index itself; it cannot be deleted")
        entry = self.registry.get(name)
        if entry is None or not self.registry.delete(name):
            raise UnknownCollection(name)
        if "prefix" in entry:  # a Redis collection: its mirror on this machine (an LMDB one's went with it)
            shutil.rmtree(mirror_dir(self.location, entry["prefix"], entry["uid"], self.cache_dir), ignore_errors=True)

    def open(self, name: str, *, search: dict | None = None, maintain: bool = True, **options) -> Index:
        """The index of collection ``name``, opened (close it when done); ``options``: the
        index's own (:meth:`Index.open`'s ``monitor_budget``, ``monitor_share``)."""
        entry = self.get(name)
        index = Index.open(self.registry.location(entry), None, create=False, prefix=entry.get("prefix", self.prefix),
                           cache_dir=self.cache_dir, search=search, maintain=maintain, **options,
                           **self.store_options)
        if index.config.uid != entry["uid"]:  # deleted and made again between the two reads
            index.close()
            raise UnknownCollection(name)
        index.declare_indexed(entry.get("indexed", ()))
        index.collection = name
        return index

    def sweep(self) -> int:
        """Remove leftovers of killed creations and deletions; returns how many."""
        return self.registry.sweep()

    def close(self) -> None:
        self.registry.close()

    def __enter__(self) -> Collections:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
