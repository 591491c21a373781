"""The router of a sharded deployment: ``gmmlsh route``.

A stateless FastAPI app with the REST API of ``gmmlsh serve`` (clients do not change): it
checks a query before anything leaves (the error shape and fields of a single server),
sends it to one search node of every group (:mod:`gmmlsh.service.router.fanout`) and merges
their answers by exact similarity; writes, reads by id and deletes go straight to Redis, the
truth.

**Consistency.** Every write bumps the index's epoch before it is acknowledged
(:mod:`gmmlsh.index.store.redis`). Per query the router reads the epoch once (one key,
whatever the number of id-shards; queries that arrive together share the read, made after
the last of them arrived) and passes it on; a node whose mirror was synced at that epoch or
later answers at once, one that is behind syncs first. So an answer never misses a write
acknowledged before the query, as on one server. ``X-Gmmlsh-Consistency: session`` with
``X-Gmmlsh-Session: E`` (the value a write answered in that header) skips the read and asks
only for what that session wrote (read-your-writes across nodes); ``eventual`` asks for
nothing. A session token ahead of the store (its writes were lost in a Redis failover) is
answered 409.

**Missing groups.** A group with no live node makes a query answer 503 naming it, unless the
request says ``X-Gmmlsh-Partial: true``: then the answer is merged from the other groups and
says which are missing (``missing_groups`` and the ``X-Gmmlsh-Missing-Groups`` header).
"""
