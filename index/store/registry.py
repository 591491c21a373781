"""The registry of named collections beside a default index: which exist and where each lives.

A *collection* is an index of its own (its own dimension, parameters, records, feed and
search mirror) kept in the same place as the default index:

* **LMDB**: the link ``<index dir>/collections/<name>`` names a hidden directory
  ``.c-<name>-<uid>-<pid>`` holding a whole LMDB index (its environment and search mirror)
  and a ``collection.json`` (name, uid, indexed fields, dimension, creation time). The links
  *are* the registry: a collection is built in its hidden directory — environment
  initialised, ``collection.json`` written and fsynced — and appears when its link is made
  (``symlink``: atomic, refused if the name exists); it is deleted by one ``rename`` of the
  link to a hidden ``.gone-…`` name, then its directory is removed. A kill at any moment
  leaves it whole or absent; hidden leftovers are swept. A process still holding a deleted
  collection open works in its own directory, never in a new one made under the same name.
* **Redis**: the hash ``{P}:collections`` maps a name to its entry, which names the
  collection's own key prefix ``P.<name>.<uid>`` (all its keys carry that hash tag, so a
  Cluster works as for the default index). Creation writes the collection's configuration
  under its fresh prefix, then registers it with one ``HSETNX`` (the commit point); deletion
  unregisters it with one ``HDEL`` first, then removes its keys. A kill leaves it whole
  or absent; keys of an unregistered prefix are invisible garbage, removed by :meth:`sweep`.

Each creation gets a fresh ``uid`` (the index configuration's), so a collection deleted
and created again under the same name never shares data, or a search mirror, with the old
one; a process holding the old one open notices by comparing uids (:meth:`uid`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
import uuid
from pathlib import Path

from gmmlsh.index.store.base import StoreError
from gmmlsh.index.store.location import DEFAULT_PREFIX, is_redis

#: Name of the collection the unprefixed routes and commands use: the index itself.
DEFAULT_COLLECTION = "default"
#: A collection name: letters, digits, ``_`` and ``-``, starting with a letter or digit.
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,47}$")
_ENTRY = "collection.json"


class CollectionExists(StoreError):
    """A collection of that name exists already (the service answers 409)."""

    def __init__(self, name: str):
        super().__init__(f"collection: {name!r} exists already")
        self.name = name


class UnknownCollection(LookupError):
    """No collection of that name (the service answers 404)."""

    def __init__(self, name: str):
        super().__init__(name)
        self.name = name

    def __str__(self) -> str:
        return f"collection: no collection named {self.name!r}"


def check_name(name: str, field: str = "collection") -> str:
    """``name`` if it is a valid collection name (and not the reserved default), else ValueError."""
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise ValueError(f"{field}: a collection name is 1-48 letters, digits, '_' or '-', starting with a letter "
                         f"or digit; got {name!r}")
    return name


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class LmdbRegistry:
    """Collections as directories under ``<root>/collections`` (see the module docstring)."""

    kind = "lmdb"

    def __init__(self, root: str | os.PathLike, **store_options):
        self.dir = Path(root) / "collections"
        self.store_options = store_options

    def list(self) -> list[dict]:
        """Entries of every collection, by name."""
        if not self.dir.is_dir():
            return []
        out = []
        for d in sorted(self.dir.iterdir()):
            entry = self.get(d.name) if NAME_RE.match(d.name) else None
            if entry is not None:
                out.append(entry)
        return out

    def get(self, name: str) -> dict | None:
        """The entry of collection ``name``, or None."""
        try:
            return json.loads((self.dir / name / _ENTRY).read_text())
        except (FileNotFoundError, NotADirectoryError, ValueError):
            return None

    def uid(self, name: str) -> str | None:
        entry = self.get(name)
        return entry["uid"] if entry else None

    def location(self, entry: dict) -> str:
        """The collection's own directory (where its link points now)."""
        return os.path.realpath(self.dir / entry["name"])

    def create(self, name: str, config: dict, indexed: list[str]) -> dict:
        """Create collection ``name`` with this index configuration; CollectionExists if taken."""
        from gmmlsh.index.store.lmdb import LmdbStore

        check_name(name)
        self.dir.mkdir(parents=True, exist_ok=True)
        if os.path.lexists(self.dir / name):
            raise CollectionExists(name)
        data = self.dir / f".c-{name}-{config['uid'][:12]}-{os.getpid()}"
        entry = {"name": name, "uid": config["uid"], "indexed": list(indexed), "dim": config["dim"],
                 "created": time.time()}
        linked = False
        try:
            store = LmdbStore(data, **self.store_options)
            try:
                store.init_config(config)
            finally:
                store.close()
            with open(data / _ENTRY, "w") as f:
                json.dump(entry, f)
                f.flush()
                os.fsync(f.fileno())
            _fsync_dir(data)
            try:
                os.symlink(data.name, self.dir / name)  # the commit point: atomic, and refused if the name exists
            except FileExistsError:
                raise CollectionExists(name) from None
            linked = True
            _fsync_dir(self.dir)
        except BaseException:
            if not linked:
                shutil.rmtree(data, ignore_errors=True)
            raise
        return entry

    def delete(self, name: str) -> bool:
        """Remove collection ``name``; False if there was none."""
        check_name(name)
        gone = self.dir / f".gone-{name}-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(self.dir / name, gone)  # the commit point (the link moves): from here on it does not exist
        except FileNotFoundError:
            return False
        _fsync_dir(self.dir)
        self._remove_gone(gone)
        return True

    def _remove_gone(self, gone: Path) -> None:
        with contextlib.suppress(OSError):
            shutil.rmtree(self.dir / os.readlink(gone), ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            gone.unlink()

    def sweep(self) -> int:
        """Remove what killed creations and deletions left behind; returns how many."""
        if not self.dir.is_dir():
            return 0
        n = 0
        for p in list(self.dir.iterdir()):
            if p.name.startswith(".gone-"):
                self._remove_gone(p)
                n += 1
        linked = {os.readlink(p) for p in self.dir.iterdir() if p.is_symlink() and NAME_RE.match(p.name)}
        for p in self.dir.iterdir():
            pid = p.name.rsplit("-", 1)[-1]
            if p.name.startswith(".c-") and p.name not in linked and pid.isdigit() and not _pid_alive(int(pid)):
                shutil.rmtree(p, ignore_errors=True)  # a creation killed before its link was made
                n += 1
        return n

    def close(self) -> None:
        pass


class RedisRegistry:
    """Collections in the hash ``{P}:collections`` (see the module docstring)."""

    kind = "redis"

    def __init__(self, url: str, prefix: str = DEFAULT_PREFIX, **store_options):
        from gmmlsh.index.store.redis import RedisStore

        self.url, self.prefix = url, prefix
        self.store_options = store_options
        self._store = RedisStore(url, prefix=prefix, **store_options)  # its client and error translation
        self._key = f"{{{prefix}}}:collections"
        self._pending = f"{{{prefix}}}:collections:pending"

    def _call(self, fn):
        return self._store.guarded(fn)

    def list(self) -> list[dict]:
        raw = self._call(lambda r: r.hgetall(self._key))
        return [json.loads(v) for _, v in sorted(raw.items())]

    def get(self, name: str) -> dict | None:
        raw = self._call(lambda r: r.hget(self._key, name))
        return json.loads(raw) if raw is not None else None

    def uid(self, name: str) -> str | None:
        entry = self.get(name)
        return entry["uid"] if entry else None

    def location(self, entry: dict) -> str:
        return self.url

    def create(self, name: str, config: dict, indexed: list[str]) -> dict:
        from gmmlsh.index.store.redis import RedisStore

        check_name(name)
        if self.get(name) is not None:
            raise CollectionExists(name)
        entry = {"name": name, "uid": config["uid"], "indexed": list(indexed), "dim": config["dim"],
                 "created": time.time(),
                 "prefix": f"{self.prefix}.{name}.{config['uid'][:12]}"}
        blob = json.dumps(entry)
        # Noted first, so that a kill before registration leaves keys :meth:`sweep` finds.
        self._call(lambda r: r.hset(self._pending, entry["prefix"], blob))
        store = RedisStore(self.url, prefix=entry["prefix"], **self.store_options)
        try:
            store.init_config(config)
            if not self._call(lambda r: r.hsetnx(self._key, name, blob)):  # the commit point
                store.drop()
                raise CollectionExists(name)
        finally:
            store.close()
        self._call(lambda r: r.hdel(self._pending, entry["prefix"]))
        return entry

    def delete(self, name: str) -> bool:
        check_name(name)
        entry = self.get(name)
        if entry is None:
            return False
        self._call(lambda r: r.hset(self._pending, entry["prefix"], json.dumps(entry)))
        if not self._call(lambda r: r.hdel(self._key, name)):  # the commit point
            return False
        self._drop(entry["prefix"])
        return True

    def _drop(self, prefix: str) -> None:
        from gmmlsh.index.store.redis import RedisStore

        store = RedisStore(self.url, prefix=prefix, **self.store_options)
        try:
            store.drop()
        finally:
            store.close()
        self._call(lambda r: r.hdel(self._pending, prefix))

    def sweep(self, older_than: float = 60.0) -> int:
        """Remove the keys of collections whose creation or deletion was killed (noted in the
        pending hash over ``older_than`` seconds ago and not registered); returns how many."""
        registered = {e["prefix"] for e in self.list()}
        n = 0
        for prefix, raw in self._call(lambda r: r.hgetall(self._pending)).items():
            prefix = prefix.decode() if isinstance(prefix, bytes) else prefix
            entry = json.loads(raw)
            if prefix in registered:
                self._call(lambda r, p=prefix: r.hdel(self._pending, p))
            elif time.time() - entry.get("created", 0) > older_than:
                self._drop(prefix)
                n += 1
        return n

    def close(self) -> None:
        self._store.close()


def open_registry(location: str, *, prefix: str = DEFAULT_PREFIX, **store_options) -> LmdbRegistry | RedisRegistry:
    """The registry of the collections kept beside the index at ``location`` (directory or Redis URL)."""
    store_options.pop("cache_dir", None)
    if is_redis(location):
        return RedisRegistry(str(location), prefix=prefix, **store_options)
    return LmdbRegistry(location, **store_options)
