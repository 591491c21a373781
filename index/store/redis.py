"""The Redis backend: one index under one key prefix, shared by many stateless API replicas.

Key layout and how a batch becomes scripts: :mod:`gmmlsh.index.store.redis_layout`. Groups,
the epoch every write bumps and a grouped store's token read through it:
:mod:`gmmlsh.index.store.redis_tokens`. An evicting or a full Redis:
:mod:`gmmlsh.index.store.redis_room`. Redis' failures as the store's exceptions:
:mod:`gmmlsh.index.store.redis_errors`.

Reads
-----
``token()`` reads every shard's ``seq`` and ``ndead`` (one ``MGET`` on a single server;
a pipeline of per-shard ``MGET`` on a Cluster; a grouped store only when the epoch moved);
``changes()`` turns two tokens into the iids added (sequence ranges) and retired (``LRANGE``
of the feeds); ``read()`` is a pipeline of ``HMGET`` grouped by hash.

Durability and replays: with ``appendfsync always`` an acknowledged write survives a
Redis crash; with ``everysec`` (Redis' default) the last second may be lost, whole
scripts at a time. A failover may lose what the master had not replicated yet, unless writes
wait for replicas (``wait``: :mod:`gmmlsh.index.store.redis_wait`). redis-py resends a command
once after a dropped connection: a replayed write script writes the same records again under
fresh iids (idempotent by id); a replayed delete may under-count what it removed.
"""

from __future__ import annotations

import json
import re
import threading
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import redis
from redis.backoff import ExponentialBackoff
from redis.exceptions import NoScriptError, RedisError, ResponseError
from redis.retry import Retry

from gmmlsh.index.store import redis_layout as layout
from gmmlsh.index.store import redis_tokens as tokens
from gmmlsh.index.store.base import (
    IID_LIMIT,
    Changes,
    DiskFull,
    RecordBatch,
    StoreError,
    StoreUnavailable,
    Token,
    Written,
)
from gmmlsh.index.store.location import DEFAULT_PREFIX, REDIS_SCHEMES, WAIT_TIMEOUT, is_redis, mask_url
from gmmlsh.index.store.redis_errors import guarded as _guarded  # RedisStore has a method "guarded"
from gmmlsh.index.store.redis_errors import out_of_memory, translate
from gmmlsh.index.store.redis_room import RoomWatch
from gmmlsh.index.store.redis_wait import NotReplicated, ReplicatedWrites

_PREFIX_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")
#: Fields every stored record has (NRFF features and metadata may be absent).
_ALWAYS = ("name", "vector", "sketch")


class RedisStore:
    """Redis implementation of :class:`gmmlsh.index.store.base.Store` (single server or Cluster).

    ``url``: ``redis://[user:password@]host:port[/db]``, ``rediss://`` (TLS) or ``unix://``.
    ``prefix`` names the index (letters, digits, ``_ . -``): several indexes share one
    Redis. ``shards`` only matters when the index is created. ``wait``: replicas of the
    master that must hold a write before it is acknowledged (Redis' ``WAIT``, at most
    ``wait_timeout`` seconds; :mod:`gmmlsh.index.store.redis_wait`); 0: Redis' asynchronous
    replication, whose failover may lose the last acknowledged writes. Nothing connects in the
    constructor: while Redis is down every call raises :class:`StoreUnavailable`, and
    the first call after it is back reconnects.
    """

    kind = "redis"
    local = False

    def __init__(self, url: str, *, prefix: str = DEFAULT_PREFIX, shards: int = 16, cluster: bool | None = None,
                 socket_timeout: float = 5.0, group: tuple[int, int] | None = None, wait: int = 0,
                 wait_timeout: float = WAIT_TIMEOUT, **client_kwargs: Any) -> None:
        if not is_redis(url):
            raise ValueError(f"url: expected {', '.join(REDIS_SCHEMES)}, got {mask_url(url)!r}")
        if not _PREFIX_RE.match(prefix):
            raise ValueError(f"prefix: must be 1-128 of [A-Za-z0-9_.-], got {prefix!r}")
        if not 1 <= shards <= 1024:
            raise ValueError(f"shards: must be between 1 and 1024, got {shards}")
        if group is not None:
            g, G = group
            if not (isinstance(G, int) and isinstance(g, int) and 1 <= G <= 1024 and 0 <= g < G):
                raise ValueError(f"group: expected g/G with 0 ≤ g < G ≤ 1024, got {g}/{G}")
            group = (g, G)
        #: Runs the writes when they wait for replicas (``wait`` > 0), else None.
        self._replicated = ReplicatedWrites(wait, wait_timeout) if wait else None
        client_kwargs.pop("decode_responses", None)
        self.url, self.prefix = url, prefix
        #: The group of id-shards this store follows ((g, G)), or None: all of them.
        self.group = group
        self._epoch_key = f"{{{prefix}}}:epoch"
        self._local = threading.local()
        self._tokens = tokens.GroupTokens()
        self._new_shards = shards
        self._want_cluster = cluster
        self._socket_timeout = socket_timeout
        self._client_kwargs = client_kwargs
        self._lock = threading.Lock()
        self._client: Any = None
        self._cluster = False
        self._closed = False
        self._shards: int | None = None
        self._token_keys: list[str] | None = None  # what token() reads, made once
        self._room_watch = RoomWatch(mask_url(url))
        self._scripts: dict[str, Any] = {}
        self._config_key = f"{{{prefix}}}:config"

    # --- plumbing ------------------------------------------------------------------------
    def _relearn_slots(self) -> None:
        """After a node of a Cluster failed to answer: learn which node serves each slot again,
        so the next call reaches the replica promoted in its place (redis-py's pipelines keep
        sending a failed master's slots to it; its single commands relearn on their own)."""
        client = self._client
        if not self._cluster or client is None:
            return
        try:
            client.nodes_manager.initialize()
        except Exception:  # noqa: BLE001 - no node answers yet: the next failure tries again
            pass

    def _r(self) -> Any:
        """The redis-py client, made on first use."""
        if self._client is not None:
            return self._client
        with self._lock:
            if self._closed:
                raise StoreUnavailable(f"Redis store {self.prefix!r} at {mask_url(self.url)} is closed")
            if self._client is None:
                kw = dict(self._client_kwargs)
                kw.setdefault("socket_timeout", self._socket_timeout)
                kw.setdefault("socket_connect_timeout", min(self._socket_timeout, 2.0))
                retry = Retry(ExponentialBackoff(cap=0.05, base=0.01), 1)  # a pooled connection may predate a restart
                cluster = self._want_cluster
                if cluster is None:
                    probe = redis.Redis.from_url(self.url, retry=retry, **kw)
                    try:
                        cluster = bool(probe.info("cluster").get("cluster_enabled"))
                    except ResponseError:  # INFO refused (some managed services): not a cluster
                        cluster = False
                    finally:
                        probe.close()
                make = redis.RedisCluster if cluster else redis.Redis
                client = make.from_url(self.url, retry=retry, **kw)
                self._scripts = {name: client.register_script(layout.script(name)) for name in ("write", "delete")}
                self._cluster, self._client = bool(cluster), client
            return self._client

    def _pipeline(self, commands: list[tuple], errors: bool = False) -> list[Any]:
        """Commands in one pipelined round trip (one per node on a Cluster); results in order.

        A script the server does not know yet (a restart, a failover) is loaded and its
        commands, which did not run, are sent again. A command's error is raised (the first),
        or with ``errors`` left in its place among the results.
        """
        if not commands:
            return []
        r = self._r()
        pending, results = list(range(len(commands))), [None] * len(commands)
        for _ in range(3):
            pipe = r.pipeline(transaction=False)
            for i in pending:
                pipe.execute_command(*commands[i])
            missing = []
            for i, res in zip(pending, pipe.execute(raise_on_error=False), strict=True):
                if isinstance(res, NoScriptError):
                    missing.append(i)
                elif isinstance(res, Exception) and not errors:
                    raise res
                else:
                    results[i] = res
            if not missing:
                return results
            for script in self._scripts.values():
                r.script_load(script.script)  # on a Cluster: every primary
            pending = missing
        raise StoreError(f"Redis at {mask_url(self.url)} keeps forgetting this store's scripts")

    def _evalsha(self, name: str, keys: Sequence, args: Sequence) -> tuple:
        self._r()
        return ("EVALSHA", self._scripts[name].sha, len(keys), *keys, *args)

    @property
    def shards(self) -> int:
        """The index's shard count (from its stored configuration, or this store's for a new one)."""
        if self._shards is None:
            cfg = self.read_config()
            if cfg is not None:
                self._shards = int(cfg.get("redis_shards", self._new_shards))
        return self._shards or self._new_shards

    def mine(self) -> list[int]:
        """The id-shards this store follows, ascending (all of them unless grouped); the token
        holds ``seq`` and ``ndead`` of each, in this order."""
        S = self.shards
        if self.group is None:
            return list(range(S))
        g, G = self.group
        if G > S:
            raise StoreError(f"group: {g}/{G} has more groups than the index has id-shards ({S})")
        return list(range(g, S, G))

    def _tag(self, s: int) -> str:
        return layout.tag(self.prefix, s)

    def _shard_keys(self, s: int) -> list[str]:
        return layout.shard_keys(self.prefix, s)

    def _loc(self, iid: int, fam: str, S: int) -> tuple[str, str]:
        return layout.loc(self.prefix, iid, fam, S)

    def _shard_of(self, ext_id: str, S: int) -> int:
        return layout.shard_of(ext_id, S)

    def _memory(self) -> Any:
        """``INFO memory`` (on a Cluster, one reply per node): what :class:`RoomWatch` reads."""
        return self._r().info("memory")

    def _on_cluster(self) -> bool:
        return self._cluster

    def eviction_problem(self) -> str | None:
        """Why this Redis cannot take writes safely (an evicting memory policy), or None."""
        return self._room_watch.eviction_problem(self._memory, self._on_cluster)

    @_guarded
    def write_problem(self) -> str | None:
        """An evicting Redis, or a full one (:meth:`RoomWatch.write_problem`), or None."""
        return self._room_watch.write_problem(self._memory, self._on_cluster)

    # --- configuration -----------------------------------------------------------------
    @_guarded
    def read_config(self) -> dict | None:
        raw = self._r().get(self._config_key)
        return json.loads(raw) if raw is not None else None

    @_guarded
    def init_config(self, config: dict) -> dict:
        mine = json.dumps({**config, "redis_shards": self._new_shards}, sort_keys=True)
        raw = self._r().set(self._config_key, mine, nx=True, get=True) or mine.encode()
        stored = json.loads(raw)
        self._shards = int(stored.get("redis_shards", self._new_shards))
        return stored

    # --- writes ----------------------------------------------------------------------------
    @_guarded
    def write(self, batch: RecordBatch) -> Written:
        """The batch in scripts of at most ``layout.SCRIPT_BYTES`` of records each, one pipelined
        round trip: on a single server one script holds records of every shard, so a batch of
        up to that size is all or nothing, a full Redis included; on a Cluster a script's keys
        must share a slot, so each holds one id shard's. When a script of a batch that took
        several is refused (a full Redis or node), the others' records stay written, and the
        error says which ids were stored (``StoreError.stored``)."""
        rows = batch.last_rows()
        if rows.shape[0] == 0:
            return Written(0, 0)
        self._room_watch.check_policy(self._memory, self._on_cluster)  # an evicting Redis is refused
        S = self.shards
        records: dict[int, list] = {}
        by_shard: dict[int, list[int]] = defaultdict(list)
        for i in rows.tolist():
            rec = batch.stored(i)  # a field not stored goes as '' (the script stores none)
            records[i] = [rec["name"], rec["vector"], rec["sketch"], rec["nrff"] or b"", rec["meta"] or b""]
            by_shard[self._shard_of(batch.ids[i], S)].append(i)
        calls = layout.scripts_of(by_shard, {i: sum(map(len, rec)) for i, rec in records.items()}, self._cluster)
        commands = []
        for call in calls:
            keys = [k for s, _ in call for k in self._shard_keys(s)]
            args: list = [S, layout.CHUNK_BIG, layout.CHUNK_SMALL]
            for s, members in call:
                args += [s, self._tag(s), len(members), *(f for i in members for f in records[i])]
            commands.append(self._script_call("write", keys, args))
        results = self._bumped(commands, errors=True)
        failed = [r for r in results if isinstance(r, Exception)]
        if not failed:
            self._room_watch.written()
            iids = np.full(len(batch), -1, dtype=np.int64)
            for call, reply in zip(calls, results, strict=True):
                for (s, members), first in zip(call, reply[2:], strict=True):
                    iids[members] = (int(first) + np.arange(len(members))) * S + s
            return Written(int(rows.shape[0]), sum(int(r[0]) for r in results), iids)
        err = translate(failed[0], self.url)
        if isinstance(err, DiskFull):
            self._room_watch.refused(self._memory, self._on_cluster)
        err.stored = tuple(batch.ids[i] for call, r in zip(calls, results, strict=True) if not isinstance(r, Exception)
                           for _, members in call for i in members)
        if err.stored:
            what = (f"{len(err.stored)} of the batch's {rows.shape[0]} vectors were stored (it took {len(calls)} "
                    "scripts, run one by one), the others were not; the stored ids are in .stored")
            err.args = (out_of_memory(mask_url(self.url), f"{what}; free memory or raise maxmemory, then send "
                                      "the batch again") if isinstance(err, DiskFull) else f"{err} ({what})",)
        raise err

    @_guarded
    def delete(self, ids: Sequence[str], expect: np.ndarray | None = None) -> int:
        pairs = dict(zip(ids, expect.tolist() if expect is not None else [None] * len(ids), strict=True))
        if not pairs:
            return 0
        S = self.shards
        by_shard: dict[int, list] = defaultdict(list)
        for name, iid in pairs.items():
            by_shard[self._shard_of(name, S)] += [name] if expect is None else [name, iid]
        flag = "0" if expect is None else "1"
        args = [S, layout.CHUNK_BIG, layout.CHUNK_SMALL]
        commands = [self._script_call("delete", self._shard_keys(s), [*args, self._tag(s), flag, *members])
                    for s, members in by_shard.items()]
        return sum(int(r[0]) for r in self._bumped(commands))

    def _bumped(self, commands: list[tuple], errors: bool = False) -> list[Any]:
        """Run write scripts (made by :meth:`_script_call`), the epoch bumped after them (why:
        :mod:`gmmlsh.index.store.redis_tokens`); the scripts' replies (``{value, epoch, ...}``: see
        ``bumped`` in ``lua/shard.lua``; with ``errors``, a command's error in its place, as
        :meth:`_pipeline` leaves it). On one server each script bumps it as its last
        step (a full Redis lets a script that has written finish, but refuses an ``INCR`` sent on
        its own); on a Cluster a script's keys share one slot, so the ``INCR`` follows once the
        scripts' nodes have answered. When writes wait for replicas, the scripts and the
        ``INCR`` each do (a failover then takes back neither)."""
        short = None
        try:
            replies = self._writes(commands, errors)
        except NotReplicated as e:  # every script ran: the epoch still says so, then the error
            replies, short = e.replies, e
        done = [r for r in replies if not isinstance(r, Exception)]
        if self._cluster and done:
            try:
                self._local.epoch = int(self._writes([("INCR", self._epoch_key)])[0])
            except redis.exceptions.ResponseError:  # a full Redis: the scripts' error says it
                if len(done) == len(replies):
                    raise
        elif done:
            self._local.epoch = max(int(r[1]) for r in done)
        if short is not None:
            raise short
        return replies

    def _writes(self, commands: list[tuple], errors: bool = False) -> list[Any]:
        """Write commands in one round trip (:meth:`_pipeline`), or, when writes wait for
        replicas, acknowledged by them (:class:`ReplicatedWrites`)."""
        if self._replicated is None:
            return self._pipeline(commands, errors)
        replies = self._replicated.run(self._r(), self._cluster, commands, list(self._scripts.values()),
                                       mask_url(self.url))
        failed = [r for r in replies if isinstance(r, Exception)]
        if failed and not errors:
            raise failed[0]
        return replies

    def _script_call(self, name: str, keys: list, args: list) -> tuple:
        """The ``EVALSHA`` of a write script: on one server its keys end with the epoch key."""
        return self._evalsha(name, keys if self._cluster else [*keys, self._epoch_key], args)

    def last_epoch(self) -> int | None:
        """The epoch this thread's last write or delete bumped to: a session token (a query
        that passes it is answered by a mirror that holds that write)."""
        return getattr(self._local, "epoch", None)

    @_guarded
    def epoch(self) -> int:
        """The index's epoch (bumped by every write and delete before it returns)."""
        return int(self._r().get(self._epoch_key) or 0)

    def assume_epoch(self, epoch: int | None) -> None:
        """Tell this thread's next :meth:`token` reads of a grouped store that the epoch was
        ``epoch`` when the caller's query arrived (see :meth:`GroupTokens.assume`). None: read it."""
        self._tokens.assume(epoch)

    # --- reads -----------------------------------------------------------------------------
    @_guarded
    def lookup(self, ids: Sequence[str]) -> np.ndarray:
        out = np.full(len(ids), -1, dtype=np.int64)
        if not len(ids):
            return out
        S = self.shards
        by_shard: dict[int, list[int]] = defaultdict(list)
        for p, name in enumerate(ids):
            by_shard[self._shard_of(name, S)].append(p)
        shards = list(by_shard)
        replies = self._pipeline([("HMGET", self._tag(s) + "ids", *[ids[p] for p in by_shard[s]]) for s in shards])
        for s, reply in zip(shards, replies, strict=True):
            for p, v in zip(by_shard[s], reply, strict=True):
                if v is not None:
                    out[p] = int(v)
        return out

    @_guarded
    def read(self, iids: np.ndarray, fields: Sequence[str]) -> dict[str, list[bytes | None]]:
        a = np.asarray(iids, dtype=np.int64).ravel().tolist()
        S = self.shards
        groups: dict[str, list[tuple[str, int, str]]] = defaultdict(list)  # hash key -> (field, position, family)
        for field in fields:
            fam = layout.FAMILY[field]
            for p, iid in enumerate(a):
                if 0 <= iid < IID_LIMIT:
                    key, f = self._loc(iid, fam, S)
                    groups[key].append((f, p, field))
        out: dict[str, list[bytes | None]] = {field: [None] * len(a) for field in fields}
        keys = list(groups)
        replies = self._pipeline([("HMGET", k, *[f for f, _, _ in groups[k]]) for k in keys])
        for k, reply in zip(keys, replies, strict=True):
            for (_, p, field), v in zip(groups[k], reply, strict=True):
                out[field][p] = v
        # A pipeline is not a snapshot: a record retired between two of its hashes' reads shows
        # some fields only. A live record always has these: missing one, it is gone, wholly.
        whole = [f for f in fields if f in _ALWAYS]
        for p in range(len(a)):
            if any(out[f][p] is None for f in whole):
                for f in fields:
                    out[f][p] = None
        return out

    @_guarded
    def token(self) -> Token:
        """Where the feed of the shards this store follows stands. A grouped store reads the
        epoch first and the shards' counters only if it moved (:meth:`GroupTokens.token`); such
        a token may be older than one another process read since (a mirror it synced):
        :meth:`token_fresh` reads the counters now."""
        if self.group is None:
            return self._counters()
        return self._tokens.token(self.epoch, self._counters)

    def token_fresh(self) -> Token:
        """The counters read now (a grouped store's cache brought up to them)."""
        if self.group is None:
            return self._counters()
        return self._tokens.read_after(self.epoch(), self._counters)

    def _counters(self) -> Token:
        """``seq`` and ``ndead`` of each shard of :meth:`mine`, read now."""
        mine = self.mine()
        keys = self._token_keys
        if keys is None or len(keys) != 2 * len(mine):
            keys = self._token_keys = [k for s in mine for k in (self._tag(s) + "seq", self._tag(s) + "ndead")]
        r = self._r()
        if self._cluster:  # MGET may not cross slots: one per shard, pipelined
            values = [v for reply in self._pipeline([("MGET", keys[2 * i], keys[2 * i + 1])
                                                     for i in range(len(mine))]) for v in reply]
        else:
            values = r.mget(keys)
        return tokens.token_of(values)

    def token_later(self) -> Callable[[], Token]:
        """The token's ``MGET`` sent now on a connection of its own, its reply read when asked
        for (:func:`redis_tokens.mget_later`). A Cluster or a group, and any failure, fall back
        to :meth:`token`."""
        if self._cluster or self._token_keys is None or self.group is not None:
            return tokens.ready(self.token())
        return tokens.mget_later(self._r().connection_pool, self._token_keys, self.token)

    @_guarded
    def changes(self, since: Token | None) -> Changes:
        now = self.token()
        S, mine = self.shards, self.mine()
        if since is not None and len(since) != len(now):
            raise StoreError(f"token of {len(since) // 2} shards given to a store following {len(mine)}")
        old = since if since is not None else tuple(0 for _ in now)
        added = [np.arange(old[2 * i], now[2 * i], dtype=np.int64) * S + s for i, s in enumerate(mine)]
        retired: list[int] = []
        if since is not None:
            ranges = [(s, old[2 * i + 1], now[2 * i + 1]) for i, s in enumerate(mine)
                      if now[2 * i + 1] > old[2 * i + 1]]
            replies = self._pipeline([("LRANGE", self._tag(s) + "dead", a, b - 1) for s, a, b in ranges])
            retired = [int(v) for reply in replies for v in reply]
        return Changes(added=np.sort(np.concatenate(added)) if added else np.zeros(0, np.int64),
                       retired=np.array(retired, dtype=np.int64), token=now)

    @_guarded
    def scan(self, fields: Sequence[str], batch_size: int = 4096
             ) -> Iterator[tuple[np.ndarray, dict[str, list[bytes | None]]]]:
        """Every iid holding any of ``fields``, in iid order, a block of sequence numbers at a time."""
        S, mine = self.shards, self.mine()
        top = max(self.token()[0::2], default=0)
        for c in range(-(-top // layout.CHUNK_BIG)):
            found: dict[int, dict[str, bytes]] = defaultdict(dict)
            commands, meta = [], []
            for s in mine:
                for field in fields:
                    fam = layout.FAMILY[field]
                    step = layout.CHUNK_BIG // layout.chunk(fam)
                    for sub in range(step):
                        chunk = c * step + sub
                        commands.append(("HGETALL", f"{self._tag(s)}{fam}:{chunk}"))
                        meta.append((s, field, chunk, layout.chunk(fam)))
            for (s, field, chunk, size), reply in zip(meta, self._pipeline(commands), strict=True):
                items = reply.items() if isinstance(reply, dict) else zip(reply[::2], reply[1::2], strict=True)
                for f, v in items:
                    found[(chunk * size + int(f)) * S + s][field] = v
            iids = sorted(found)
            for lo in range(0, len(iids), batch_size):
                part = iids[lo:lo + batch_size]
                yield (np.array(part, dtype=np.int64),
                       {field: [found[i].get(field) for i in part] for field in fields})

    @_guarded
    def scan_ids(self, batch_size: int = 4096, shards: Sequence[int] | None = None
                 ) -> Iterator[tuple[list[str], np.ndarray]]:
        """The id map of the shards this store follows (or of ``shards``)."""
        r = self._r()
        for s in self.mine() if shards is None else shards:
            names, iids = [], []
            for k, v in r.hscan_iter(self._tag(s) + "ids", count=batch_size):
                names.append(k.decode("utf-8", errors="replace"))
                iids.append(int(v))
                if len(names) == batch_size:
                    yield names, np.array(iids, dtype=np.int64)
                    names, iids = [], []
            if names:
                yield names, np.array(iids, dtype=np.int64)

    @_guarded
    def count(self) -> int:
        keys = [self._tag(s) + "live" for s in self.mine()]
        values = self._pipeline([("GET", k) for k in keys])
        return sum(int(v) for v in values if v is not None)

    # --- housekeeping --------------------------------------------------------------------
    @_guarded
    def guarded(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(client)`` with Redis failures raised as the store's exceptions (for the collection
        registry, which keeps its few keys beside the index's)."""
        return fn(self._r())

    @_guarded
    def drop(self) -> None:
        """Delete every key of this index, its configuration last (a kill midway leaves a store
        that still has its configuration; dropping again finishes). The keys are known from the
        shards' sequences: no SCAN, and each command names one key (a Cluster takes it)."""
        S = self.shards
        seqs = self._pipeline([("GET", self._tag(s) + "seq") for s in range(S)])
        cmds = []
        for s, seq in enumerate(seqs):
            n = int(seq or 0)
            keys = self._shard_keys(s)
            for fam in layout.FAMILY.values():
                c = layout.chunk(fam)
                keys += [f"{self._tag(s)}{fam}:{i}" for i in range(n // c + 2)]
            cmds += [("UNLINK", k) for k in keys]
        for lo in range(0, len(cmds), 4096):
            self._pipeline(cmds[lo:lo + 4096])
        self._r().unlink(self._epoch_key)
        self._r().unlink(self._config_key)

    @_guarded
    def ping(self) -> None:
        self._r().ping()

    @_guarded
    def info(self) -> dict:
        mem = self._r().info("memory")
        if self._cluster and isinstance(mem, dict) and all(isinstance(v, dict) for v in mem.values()):
            used = sum(int(v.get("used_memory", 0)) for v in mem.values())
        else:
            used = int(mem.get("used_memory", 0))
        out = {"kind": "redis", "url": mask_url(self.url), "prefix": self.prefix, "cluster": self._cluster,
               "shards": self.shards, "vectors": self.count(), "redis_used_memory": used}
        if self.group is not None:
            out["group"] = f"{self.group[0]}/{self.group[1]}"
        return out

    def close(self) -> None:
        with self._lock:
            client, self._client, self._closed = self._client, None, True
        if self._replicated is not None:
            self._replicated.close()
        if client is not None:
            try:
                client.close()
            except RedisError:
                pass

    def __enter__(self) -> RedisStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RedisStore({mask_url(self.url)!r}, prefix={self.prefix!r})"
