"""Which server worker holds each client's TCP connections (Linux ``/proc``, loopback).

A multi-worker ``gmmlsh serve`` shares one listening socket among its workers, and a
connection stays with the worker that accepted it. A benchmark client keeps one connection
open, so where the query client's and the writer's connections landed decides whether
the two loads share a worker (its GIL and event loop) or each has one: the operation
benchmark over HTTP reports it with its figures.
"""

from __future__ import annotations

import os
from pathlib import Path

from bench.common import children


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    try:
        fds = list(fd_dir.iterdir())
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def _tcp_ends() -> dict[int, tuple[int, int]]:
    """Socket inode → (local port, remote port) of every established TCP connection."""
    ends = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] != "01":  # ESTABLISHED
                continue
            ends[int(f[9])] = (int(f[1].rsplit(":", 1)[1], 16), int(f[2].rsplit(":", 1)[1], 16))
    return ends


def workers_of(server_pid: int, clients: dict[str, int], port: int) -> dict[str, list[int]]:
    """For each named client process, the pids of the server's workers holding its
    connections to ``port``."""
    ends = _tcp_ends()
    held: dict[int, int] = {}  # a client's local port → the worker holding the other end
    for worker in children(server_pid):
        for inode in _socket_inodes(worker):
            local, remote = ends.get(inode, (None, None))
            if local == port:
                held[remote] = worker
    out = {}
    for name, pid in clients.items():
        ports = [ends[i][0] for i in _socket_inodes(pid) if i in ends and ends[i][1] == port]
        out[name] = sorted({held[p] for p in ports if p in held})
    return out
