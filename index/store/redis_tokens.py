"""Reading where a Redis index's feed stands: the token of a grouped store through the epoch,
and the token's ``MGET`` sent before its reply is needed.

:class:`~gmmlsh.index.store.redis.RedisStore` keeps the connections and reads the counters;
this module decides when to read them and what a read is worth (nothing here imports redis).

Groups and the epoch
--------------------
A search node of a sharded deployment follows one *group* of id-shards: ``group=(g, G)``
restricts the store's ``token``, ``changes``, ``count``, ``scan`` and ``scan_ids`` to the
shards ``s ≡ g (mod G)`` (writes, lookups and reads by iid still reach every shard). Every
write and delete bumps ``{P}:epoch`` after its scripts' writes and before it returns (so
before the write is acknowledged): on one server each script does it as its last step (a full
Redis lets a script that has written finish, but would refuse an ``INCR`` sent on its own), on
a Cluster one ``INCR`` follows the scripts (a script's keys share one slot). A grouped store
reads that one key instead of its shards' counters when asked for the token, and reads the
counters only when the epoch has moved since it last did (and every
:data:`EPOCH_REREAD_SECONDS` anyway): an acknowledged write bumped the epoch before a query
that follows it read it, so the query still sees the write (see :meth:`GroupTokens.token`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from gmmlsh.index.store.base import StoreError, Token

#: Seconds a grouped store trusts counters read at an unchanged epoch: a failover that lost the
#: epoch's last increments could bring it back to a value it had, over other writes.
EPOCH_REREAD_SECONDS = 1.0


class SessionAhead(StoreError):
    """A session token names an epoch the store has not reached: writes acknowledged to that
    session were lost (a failover of Redis), and waiting would not bring them back."""


def token_of(values: list) -> Token:
    """A token from the shards' counters as ``MGET`` returns them (absent: 0)."""
    return tuple(int(v) if v is not None else 0 for v in values)


def ready(token: Token) -> Callable[[], Token]:
    """A token already read, in the shape of :meth:`~gmmlsh.index.store.base.Store.token_later`'s
    answer (for the stores that cannot defer the read)."""
    return lambda: token


def mget_later(pool: Any, keys: list[str], again: Callable[[], Token]) -> Callable[[], Token]:
    """The ``MGET`` of ``keys`` (a token's counters) sent now on a connection of its own from
    redis-py's ``pool``, its reply read when the returned function is called: a query searches
    its mirror while the round trip travels (docs/tuning.md). Any failure reads the token with
    ``again`` instead (the store's ``token``, which says what is wrong, with the retry policy)."""
    try:
        conn = pool.get_connection()
    except Exception:  # noqa: BLE001 - again() says what is wrong, with the retry policy
        return ready(again())
    try:
        conn.send_command("MGET", *keys)
    except Exception:  # noqa: BLE001
        conn.disconnect()
        pool.release(conn)
        return ready(again())

    def reply() -> Token:
        try:
            values = conn.read_response()
        except Exception:  # noqa: BLE001 - the connection is dropped, the token read again
            conn.disconnect()
            return again()
        finally:
            pool.release(conn)
        return token_of(values)

    return reply


class GroupTokens:
    """The token of a grouped store, read through the epoch: the counters last read, the epoch
    they were read after, and each thread's epoch assumed by its caller. Thread-safe.

    The reads themselves are the store's, passed in as ``read_epoch`` (``{P}:epoch``) and
    ``read_counters`` (the group's shards' ``seq`` and ``ndead``, read now)."""

    def __init__(self) -> None:
        self._cached: tuple[int, Token, float] | None = None  # (epoch, token read after it, when)
        self._lock = threading.Lock()
        self._reads = self._cached_ticket = 0
        self._local = threading.local()

    def assume(self, epoch: int | None) -> None:
        """Tell this thread's next :meth:`token` reads that the epoch was ``epoch`` when the
        caller's query arrived (a router read it): no read of it is needed when the token cached
        is at least that recent. None: read it."""
        self._local.assumed = epoch

    def token(self, read_epoch: Callable[[], int], read_counters: Callable[[], Token]) -> Token:
        """Where the feed of the group stands: the epoch read first and the counters only if it
        moved since they were last read (a token read after epoch ``e`` holds every write that
        bumped the epoch to ``e`` or less). Such a token may be older than one another process
        read since (a mirror it synced): :meth:`read_after` reads the counters now.

        Raises :class:`SessionAhead` when the epoch assumed is ahead of the one read."""
        cached = self._cached
        fresh = cached is not None and time.monotonic() - cached[2] < EPOCH_REREAD_SECONDS
        assumed = getattr(self._local, "assumed", None)
        if fresh and assumed is not None and assumed <= cached[0]:
            return cached[1]
        epoch = read_epoch()
        if assumed is not None and epoch < assumed:
            raise SessionAhead(f"the session token (epoch {assumed}) is ahead of the store (epoch {epoch}): "
                               "writes acknowledged to this session were lost (a Redis failover?)")
        if fresh and epoch == cached[0]:
            return cached[1]
        return self.read_after(epoch, read_counters)

    def read_after(self, epoch: int, read_counters: Callable[[], Token]) -> Token:
        """The counters, read after ``epoch`` was; cached unless a read that started later got
        there first (threads race: the cache only ever moves to a later read)."""
        with self._lock:
            self._reads += 1
            ticket = self._reads
        now = read_counters()
        with self._lock:
            if ticket > self._cached_ticket:
                self._cached, self._cached_ticket = (epoch, now, time.monotonic()), ticket
        return now
