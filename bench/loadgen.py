"""A keep-alive HTTP/1.1 load generator, cheap enough to share two cores with the server.

    python -m bench.loadgen HOST PORT REQUESTS_FILE --connections 8 --seconds 10 [--out FILE]

``REQUESTS_FILE`` holds complete requests (bytes, as :func:`write_requests` writes them);
each of ``connections`` connections sends one, reads the whole answer, sends the next (the
requests taken in turn from a shared cursor), for ``seconds``. It prints (or writes to ``--out``) one JSON object:
answers, seconds, non-2xx answers, and the latencies (seconds, sorted).

Why not httpx in threads (what measured the service before): its client spends as much CPU
on a request as the server's own work, on the same two cores (docs/tuning.md); this one
speaks raw HTTP/1.1 over asyncio protocols (uvloop when installed).
Answers are framed by ``Content-Length`` (what the server always sends).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pickle
import time
from pathlib import Path


def request_bytes(method: str, path: str, body: bytes = b"", content_type: str | None = None,
                  headers: dict[str, str] | None = None) -> bytes:
    """One HTTP/1.1 keep-alive request, complete."""
    lines = [f"{method} {path} HTTP/1.1", "Host: bench", "Connection: keep-alive"]
    if body or method == "POST":
        lines.append(f"Content-Length: {len(body)}")
    if content_type:
        lines.append(f"Content-Type: {content_type}")
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def write_requests(path: Path, requests: list[bytes]) -> Path:
    path.write_bytes(pickle.dumps(requests, protocol=pickle.HIGHEST_PROTOCOL))
    return path


class _Conn(asyncio.Protocol):
    """One connection: send, read one answer (headers, then Content-Length bytes), repeat."""

    def __init__(self, run: _Run):
        self.run = run
        self.buf = bytearray()
        self.need = -1  # bytes of the whole answer, once its headers are in
        self.status = 0
        self.t0 = 0.0
        self.transport: asyncio.Transport | None = None
        self.closed = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self._send()

    def _send(self) -> None:
        if time.perf_counter() >= self.run.end:
            self.transport.close()
            return
        self.t0 = time.perf_counter()
        self.transport.write(self.run.next())

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            if self.need < 0:
                head_end = self.buf.find(b"\r\n\r\n")
                if head_end < 0:
                    return
                head = bytes(self.buf[:head_end]).lower()
                self.status = int(head[9:12])
                at = head.find(b"content-length:")
                if at < 0:
                    raise RuntimeError("an answer without Content-Length")
                length = int(head[at + 15:head.index(b"\r\n", at) if b"\r\n" in head[at:] else None])
                self.need = head_end + 4 + length
            if len(self.buf) < self.need:
                return
            del self.buf[:self.need]
            self.need = -1
            self.run.done(time.perf_counter() - self.t0, self.status)
            self._send()
            if self.buf:  # never: one request in flight per connection
                continue
            return

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(exc)


class _Run:
    def __init__(self, requests: list[bytes], seconds: float):
        self.requests = requests
        self.i = 0
        self.end = time.perf_counter() + seconds
        self.lat: list[float] = []
        self.errors = 0

    def next(self) -> bytes:
        r = self.requests[self.i % len(self.requests)]
        self.i += 1
        return r

    def done(self, seconds: float, status: int) -> None:
        self.lat.append(seconds)
        if not 200 <= status < 300:
            self.errors += 1


async def _main(host: str, port: int, requests: list[bytes], connections: int, seconds: float) -> dict:
    loop = asyncio.get_running_loop()
    run = _Run(requests, seconds)
    t0 = time.perf_counter()
    conns = [(await loop.create_connection(lambda: _Conn(run), host, port))[1] for _ in range(connections)]
    for c in conns:
        await c.closed
    return {"n": len(run.lat), "seconds": time.perf_counter() - t0, "errors": run.errors, "lat": sorted(run.lat)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("host")
    ap.add_argument("port", type=int)
    ap.add_argument("requests", type=Path)
    ap.add_argument("--connections", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--out", type=Path, help="write the JSON there (default: standard output)")
    a = ap.parse_args(argv)
    requests = pickle.loads(a.requests.read_bytes())
    coro = _main(a.host, a.port, requests, a.connections, a.seconds)
    try:
        import uvloop
    except ImportError:
        result = asyncio.run(coro)
    else:
        result = uvloop.run(coro)
    text = json.dumps(result)
    if a.out:
        a.out.write_text(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
