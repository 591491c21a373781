"""Writes acknowledged only once Redis replicas hold them: ``WAIT`` on the connection that ran them.

Redis replicates asynchronously: a master that dies may take the writes it acknowledged last
with it, and the replica promoted in its place never had them. ``WAIT n timeout`` blocks until
``n`` replicas hold every write *its own connection* sent before it, so it must follow the
scripts on the connection that carried them:

* on one server a pipeline is one connection: ``WAIT`` closes it;
* on a Cluster each script goes to its slot's master, so the commands are grouped by node,
  each node's sent in a pipeline of their own on one of its connections and closed by
  ``WAIT``; the nodes' pipelines run at once (a thread each). A command redirected (its slot
  moved: ``MOVED``; moving: ``ASK``; ``TRYAGAIN`` while a slot's keys are split) did not run:
  it goes again, to the node now serving its slot, in the next round, so the ``WAIT`` that
  answers for a command is always one on the connection that ran it.

A ``WAIT`` that comes back with fewer replicas than asked for makes the write fail with
:class:`NotReplicated` (the service answers 503): it is on the master, but not acknowledged,
and sending it again is safe (a write by id replaces what is there). ``WAIT`` does not make
Redis strongly consistent (a replica that acknowledged may still lose a race in a failover
with a second failure), but a failover alone loses nothing acknowledged.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from redis.exceptions import AskError, MovedError, NoScriptError, TryAgainError

from gmmlsh.index.store.base import StoreUnavailable
from gmmlsh.index.store.location import WAIT_TIMEOUT

#: Rounds of redirections a command may take before the write gives up (a reshard hands a slot
#: over milliseconds after moving its keys; ``TRYAGAIN`` rounds wait 20 ms: ~2 s in all).
ROUNDS = 100


class NotReplicated(StoreUnavailable):
    """Written to a Redis master, but fewer of its replicas acknowledged it than were asked for
    within the timeout: not acknowledged (a failover now could lose it); send it again.
    ``replies``: the commands' replies (every command ran)."""

    def __init__(self, message: str, replies: list[Any]) -> None:
        super().__init__(message)
        self.replies = replies


class ReplicatedWrites:
    """Runs write commands so that each is acknowledged by ``replicas`` replicas of the master that
    ran it (Redis' ``WAIT``), or fails; ``timeout`` in seconds."""

    def __init__(self, replicas: int, timeout: float = WAIT_TIMEOUT) -> None:
        if not (isinstance(replicas, int) and replicas >= 1):
            raise ValueError(f"wait: replicas to wait for must be a whole number ≥ 1, got {replicas!r}")
        if not timeout > 0:
            raise ValueError(f"wait_timeout: must be > 0 seconds, got {timeout!r}")
        self.replicas, self.timeout = replicas, timeout
        self._pool: ThreadPoolExecutor | None = None

    def _wait(self) -> tuple:
        return ("WAIT", self.replicas, max(1, round(self.timeout * 1000)))

    def run(self, client: Any, cluster: bool, commands: Sequence[tuple], scripts: Sequence[Any], where: str
            ) -> list[Any]:
        """The commands' replies in order (a command's error in its place). Raises
        :class:`NotReplicated` (after every command ran) if a master's replicas fell short.
        ``scripts``: the store's registered scripts, loaded again where a node forgot them;
        ``where``: the Redis named in messages (its password masked)."""
        if not commands:
            return []
        if not cluster:
            return self._on_one_server(client, commands, scripts, where)
        return self._on_cluster(client, commands, scripts, where)

    def _on_one_server(self, client: Any, commands: Sequence[tuple], scripts: Sequence[Any], where: str
                       ) -> list[Any]:
        replies: list[Any] = [None] * len(commands)
        pending = list(range(len(commands)))
        for _ in range(3):
            pipe = client.pipeline(transaction=False)
            for i in pending:
                pipe.execute_command(*commands[i])
            pipe.execute_command(*self._wait())
            *got, acked = pipe.execute(raise_on_error=False)
            forgot = [i for i, r in zip(pending, got, strict=True) if isinstance(r, NoScriptError)]
            for i, r in zip(pending, got, strict=True):
                replies[i] = r
            if isinstance(acked, Exception):
                raise acked
            if int(acked) < self.replicas:
                raise NotReplicated(self._short_message(str(int(acked)), where), replies)
            if not forgot:
                return replies
            for script in scripts:
                client.script_load(script.script)
            pending = forgot
        raise StoreUnavailable(f"Redis at {where} keeps forgetting this store's scripts")

    def _on_cluster(self, client: Any, commands: Sequence[tuple], scripts: Sequence[Any], where: str) -> list[Any]:
        replies: list[Any] = [None] * len(commands)
        pending: dict[int, Any] = {i: None for i in range(len(commands))}  # command → node it was sent to by ASK
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="gmmlsh-redis-wait")
        short: list[str] = []
        for _ in range(ROUNDS):
            by_node: dict[str, tuple[Any, list[int]]] = {}
            for i, asked in pending.items():
                node = asked or client.nodes_manager.get_node_from_slot(client.determine_slot(*commands[i]))
                by_node.setdefault(node.name, (node, []))[1].append(i)
            sent = [(node, idx, self._pool.submit(self._node_round, client, node, idx, commands, pending))
                    for node, idx in by_node.values()]
            pending = {}
            retry_after = 0.0
            for node, idx, future in sent:
                got, acked = future.result()
                if acked is not None and not isinstance(acked, Exception) and int(acked) < self.replicas:
                    short.append(f"{node.name}: {int(acked)}")
                for i, r in zip(idx, got, strict=True):
                    if isinstance(r, AskError):  # to the importing master; one it does not know: by slot, relearned
                        pending[i] = client.get_node(host=r.host, port=r.port)
                        if pending[i] is None:
                            client.nodes_manager.initialize()
                    elif isinstance(r, MovedError):
                        client.nodes_manager.move_slot(r)
                        pending[i] = None
                    elif isinstance(r, TryAgainError):
                        pending[i], retry_after = None, 0.02
                    elif isinstance(r, NoScriptError):
                        for script in scripts:
                            client.get_redis_connection(node).script_load(script.script)
                        pending[i] = None
                    else:
                        replies[i] = r
                if isinstance(acked, Exception):
                    raise acked
            if not pending:
                break
            time.sleep(retry_after)
        else:
            raise StoreUnavailable(f"Redis Cluster at {where}: slots still moving after {ROUNDS} rounds of "
                                   "redirections; nothing more was written, send the write again")
        if short:
            raise NotReplicated(self._short_message(", ".join(short), where), replies)
        return replies

    def _node_round(self, client: Any, node: Any, idx: list[int], commands: Sequence[tuple],
                    asked: dict[int, Any]) -> tuple[list[Any], Any]:
        """One node's commands and its ``WAIT``, in one pipeline (one connection). The ``WAIT``'s
        reply, or None when no command ran (all redirected)."""
        pipe = client.get_redis_connection(node).pipeline(transaction=False)
        own = []  # where each command's reply is (an ASKING's comes before it)
        for i in idx:
            if asked.get(i) is not None:
                pipe.execute_command("ASKING")
            pipe.execute_command(*commands[i])
            own.append(len(pipe) - 1)
        pipe.execute_command(*self._wait())
        *replies, acked = pipe.execute(raise_on_error=False)
        got = [replies[j] for j in own]
        ran = any(not isinstance(r, AskError | MovedError | TryAgainError | NoScriptError) for r in got)
        return got, acked if ran else None

    def _short_message(self, acked: str, where: str) -> str:
        return (f"Redis at {where}: the write reached the master but only {acked} of the {self.replicas} "
                f"replica(s) asked for (GMMLSH_REDIS_WAIT) acknowledged it within {self.timeout:g} s; it is not "
                "acknowledged and a failover could lose it: send it again (a write by id replaces what is there)")

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

