"""A lean SSE reader for load processes (httpx asyncio). It parses only the framing, so one load
process can keep up with thousands of connections; ``data`` stays raw bytes for the caller."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from broker.sse import ByteDecoder, parse_block


@dataclass(slots=True)
class Frame:
    id: bytes | None
    event: bytes | None  # None for a comment (heartbeat)
    data: bytes
    t: float  # unix time the chunk holding the frame's end was received


def client(max_connections: int | None = None, *, timeout_s: float = 600.0,
           keepalive: bool = True) -> httpx.AsyncClient:
    """An AsyncClient without a connection cap and with a long read timeout, for SSE load."""
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=None if keepalive else 0)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s, connect=30.0))


def parse_frame(block: bytes, t: float) -> Frame:
    parsed = parse_block(block)
    if not parsed.is_event:
        return Frame(None, None, b"", t)  # a comment (heartbeat) or a bare retry hint
    return Frame(parsed.id.encode() if parsed.id is not None else None,
                 parsed.event.encode() if parsed.event is not None else None, parsed.data.encode(), t)


async def frames(response: httpx.Response) -> AsyncIterator[Frame]:
    """The frames of an open SSE response, as they arrive (split by broker.sse, the one parser)."""
    decoder = ByteDecoder()
    async for chunk in response.aiter_raw():
        t = time.time()
        for block in decoder.feed(chunk):
            if block:
                yield parse_frame(block, t)


async def create_stream(http: httpx.AsyncClient, base: str, **body: Any) -> str:
    """POST /v1/streams with a fresh id; returns the id."""
    sid = str(uuid.uuid4())
    payload = {"id": sid, "prompt": "bench", **body}
    r = await http.post(f"{base}/v1/streams", content=orjson.dumps(payload),
                        headers={"content-type": "application/json"})
    if r.status_code not in (200, 201):
        raise RuntimeError(f"create failed: {r.status_code} {r.text}")
    return sid


class RawConnection:
    """A bare HTTP/1.1 keep-alive connection for request-rate load (httpx costs ~1.5 ms CPU per request,
    which on 2 cores would make the load generator, not the server, the bottleneck at 500/s)."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self._reader: Any = None
        self._writer: Any = None

    async def connect(self) -> None:
        import asyncio

        self._reader, self._writer = await asyncio.open_connection(self.host, self.port)

    async def request(self, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
        if self._writer is None:
            await self.connect()
        head = (f"{method} {path} HTTP/1.1\r\nhost: {self.host}:{self.port}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\n\r\n").encode()
        self._writer.write(head + body)
        raw = await self._reader.readuntil(b"\r\n\r\n")
        lines = raw.split(b"\r\n")
        status = int(lines[0].split(b" ", 2)[1])
        length = 0
        for line in lines[1:]:
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
        data = await self._reader.readexactly(length) if length else b""
        return status, data

    async def get_counting(self, path: str, marker: bytes, on_count: Callable[[int], bool]) -> None:
        """GET a chunked (SSE) response, reporting how many ``marker``s each read brought to ``on_count``;
        returns at the response's end, or when ``on_count`` says stop (the connection is then closed). No
        HTTP parsing beyond the head: the load process must cost far less than the server it loads."""
        if self._writer is None:
            await self.connect()
        self._writer.write(f"GET {path} HTTP/1.1\r\nhost: {self.host}:{self.port}\r\n\r\n".encode())
        await self._reader.readuntil(b"\r\n\r\n")
        tail, end = b"", b"\r\n0\r\n\r\n"  # the last chunk of a chunked body
        keep = max(len(marker), len(end)) - 1
        while True:
            data = await self._reader.read(1 << 16)
            if not data:
                raise ConnectionError("the server closed the connection mid-response")
            window = tail + data  # a marker or the end may straddle two reads (counted once: tail is short)
            if not on_count(window.count(marker)):
                await self.close()
                return
            if window.endswith(end):
                return
            tail = window[-keep:]

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._reader = self._writer = None
