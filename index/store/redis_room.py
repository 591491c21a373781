"""Whether a Redis has room for an index's writes: a memory policy that may evict keys, and a
maxmemory reached.

A Redis that may *evict* keys (``maxmemory-policy allkeys-*``) would drop acknowledged
vectors, or the index's configuration, in silence: such a server is refused for writes.
A full Redis (``OOM`` replies under ``noeviction``) refuses a write (the store raises
:class:`~gmmlsh.index.store.base.DiskFull`), and :meth:`RoomWatch.write_problem` reports it
full until it has gained room.

:class:`~gmmlsh.index.store.redis.RedisStore` keeps the connection and hands in its
``INFO memory`` reads: ``memory`` returns the reply (on a Cluster, one per node) and ``cluster``
says whether the server is a Cluster, asked after ``memory`` (which connects).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from redis.exceptions import RedisError, ResponseError

from gmmlsh.index.store.base import StoreError, StoreUnavailable
from gmmlsh.index.store.redis_errors import UNAVAILABLE, out_of_memory

#: Room (bytes) a full Redis must gain beyond what it had when a write was refused to count as writable.
NO_ROOM = 1 << 20


def _room_of(mem: dict) -> tuple[int, int] | None:
    """(bytes below maxmemory — negative: above it —, maxmemory) of an ``INFO memory`` reply, or
    None when the Redis has no limit."""
    limit = int(mem.get("maxmemory", 0) or 0)
    return (limit - int(mem.get("used_memory", 0)), limit) if limit else None


def _room(memory: Callable[[], Any], cluster: Callable[[], bool]) -> int | None:
    """Bytes below maxmemory, or None: no limit, a Cluster, ``INFO`` refused or failing."""
    if cluster():
        return None
    try:
        room = _room_of(memory())
    except (*UNAVAILABLE, RedisError, StoreError):
        return None
    return room[0] if room else None


class RoomWatch:
    """What a store has learnt of its Redis' memory: that its policy does not evict keys (checked
    on each write until it is found so), and the room left when a write was last refused for want
    of it.

    ``where``: the Redis' URL, masked, for the messages."""

    def __init__(self, where: str) -> None:
        self._where = where
        self._policy_ok = False
        self._refused_at: int | None = None  # room below maxmemory when a write was last refused for want of it

    def check_policy(self, memory: Callable[[], Any], cluster: Callable[[], bool]) -> None:
        """Refuse to write to a Redis that may evict keys (raise :class:`StoreUnavailable`): it
        would lose acknowledged vectors. A Redis that refuses ``INFO`` is taken at its word."""
        if self._policy_ok:
            return
        try:
            info = memory()
        except ResponseError:  # INFO disabled: the operator's word is all there is
            self._policy_ok = True
            return
        if cluster():  # one reply per node
            policies = {v.get("maxmemory_policy") for v in info.values()} if isinstance(info, dict) and all(
                isinstance(v, dict) for v in info.values()) else {info.get("maxmemory_policy")}
        else:
            policies = {info.get("maxmemory_policy")}
        bad = sorted(str(p) for p in policies if p and str(p).startswith("allkeys"))
        if bad:
            raise StoreUnavailable(
                f"Redis at {self._where} may evict keys (maxmemory-policy {bad[0]}): it would lose "
                "acknowledged vectors in silence; set maxmemory-policy noeviction (or a volatile-* policy)")
        self._policy_ok = True

    def eviction_problem(self, memory: Callable[[], Any], cluster: Callable[[], bool]) -> str | None:
        """Why this Redis cannot take writes safely (an evicting memory policy), or None."""
        try:
            self.check_policy(memory, cluster)
        except StoreUnavailable as e:
            return str(e)
        return None

    def write_problem(self, memory: Callable[[], Any], cluster: Callable[[], bool]) -> str | None:
        """An evicting Redis, or a full one: within 1 % of maxmemory, or with no more room than
        when this process's last write was refused for want of it (a batch is refused whole,
        so memory can stay below the limit; cleared by the next write that succeeds). On a
        Cluster, only the policy is looked at."""
        problem = self.eviction_problem(memory, cluster)
        got = _room_of(memory()) if problem is None and not cluster() else None
        if got is not None:
            room, limit = got
            refused = self._refused_at is not None and room < self._refused_at + NO_ROOM
            if room <= 0.01 * limit or refused:
                problem = out_of_memory(self._where, "writes are refused until memory is freed or maxmemory "
                                        "raised")
        return problem

    def refused(self, memory: Callable[[], Any], cluster: Callable[[], bool]) -> None:
        """A write was refused for want of memory: note the room left below maxmemory now."""
        self._refused_at = _room(memory, cluster)

    def written(self) -> None:
        """A write succeeded: the Redis has room again."""
        self._refused_at = None

