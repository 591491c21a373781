"""The router's HTTP/1.1 client for its calls to the search nodes: keep-alive connections over
asyncio streams, one request in flight on each, answers framed by ``Content-Length`` (what
the nodes always send).

Why not httpx: in this router it spent 2–3 ms of CPU a call (measured by
``bench/bench_shards.py``), more than the node's search; a call here is a write and two reads
on a pooled connection (the approach of ``bench/loadgen.py``).
"""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit


class HttpError(ConnectionError):
    """The call did not complete (connection refused or dropped, a malformed answer, a timeout)."""


class Pool:
    """Idle keep-alive connections per node."""

    def __init__(self, headers: dict[str, str], timeout: float):
        self.extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items()).encode()
        self.timeout = timeout
        self.idle: dict[tuple[str, int], list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]] = {}

    async def post(self, url: str, path: str, body: bytes) -> tuple[int, bytes]:
        """``POST url+path`` with ``body``: (status, answer body)."""
        parts = urlsplit(url)
        key = (parts.hostname or "127.0.0.1", parts.port or 80)
        try:
            return await asyncio.wait_for(self._post(key, path, body), self.timeout)
        except TimeoutError:
            raise HttpError(f"no answer from {url} within {self.timeout:g} s") from None

    async def _post(self, key: tuple[str, int], path: str, body: bytes) -> tuple[int, bytes]:
        idle = self.idle.setdefault(key, [])
        fresh = not idle
        reader, writer = idle.pop() if idle else await self._open(key)
        head = (f"POST {path} HTTP/1.1\r\nHost: {key[0]}:{key[1]}\r\nContent-Length: {len(body)}\r\n").encode()
        try:
            writer.write(head + self.extra + b"\r\n" + body)
            status, answer, keep = await self._read(reader)
        except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
            writer.close()
            if not fresh:  # a pooled connection the node closed meanwhile: once more, on a new one
                return await self._post(key, path, body)
            raise HttpError(f"{key[0]}:{key[1]}: {type(exc).__name__}: {exc}") from None
        except BaseException:  # cancelled (a hedge lost): the answer is not read, the connection goes
            writer.close()
            raise
        if keep:
            idle.append((reader, writer))
        else:
            writer.close()
        return status, answer

    async def _open(self, key: tuple[str, int]) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        try:
            return await asyncio.open_connection(*key)
        except OSError as exc:
            raise HttpError(f"{key[0]}:{key[1]}: {exc}") from None

    @staticmethod
    async def _read(reader: asyncio.StreamReader) -> tuple[int, bytes, bool]:
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        length, keep = None, True
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"connection" and value.strip().lower() == b"close":
                keep = False
        if length is None:
            raise ValueError("an answer without Content-Length")
        return status, await reader.readexactly(length), keep

    async def close(self) -> None:
        for conns in self.idle.values():
            for _, writer in conns:
                writer.close()
        self.idle.clear()
