"""A lean SSE reader for load processes (httpx asyncio). It parses only the framing, so one load
process can keep up with thousands of connections; ``data`` stays raw bytes for the caller."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
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


def split_event(block: bytes) -> tuple[bytes | None, bytes | None, bytes] | None:
    """(id, event, data) of a block as rsb's framer writes it (``broker.sse.event_frame``: ``id: ``, ``event: ``,
    ``data: `` lines, in that order, or fewer of them); None for a comment or a retry hint. Anything shaped
    otherwise goes through ``broker.sse.parse_block``, the one parser: this is only its fast path for rsb's
    own frames, so that a load process parses ten thousand events a second on a fraction of a core."""
    if block[:1] == b":" or block[:6] == b"retry:":
        return None
    lines = block.split(b"\n")
    if len(lines) == 3 and lines[0][:4] == b"id: " and lines[1][:7] == b"event: " and lines[2][:6] == b"data: ":
        return lines[0][4:], lines[1][7:], lines[2][6:]
    parsed = parse_block(block)
    if not parsed.is_event:
        return None
    return (parsed.id.encode() if parsed.id is not None else None,
            parsed.event.encode() if parsed.event is not None else None, parsed.data.encode())


OnFrames = Callable[["SSEStream", list[tuple[bytes | None, bytes | None, bytes]], float], None]


class SSEStream(asyncio.Protocol):
    """One ``GET`` of an SSE route over a connection of its own, parsed as it arrives (HTTP/1.1 head, chunked
    body, SSE blocks) inside ``data_received``: no task, no stream reader, no per-event await. Every read's
    complete events go to ``on_frames(stream, [(id, event, data), ...], t)`` with ``t`` the unix time of the
    read. httpx holds thousands of open responses in one pool whose every new request scans all of them, and
    costs ~30 µs per event: at a thousand readers it, not the server, was the limit (docs/benchmarks.md).

    ``status`` resolves with the response's status code once its head is in; ``ended`` resolves when the body
    ends: True for a complete body (the last chunk came), False for a connection that closed before."""

    def __init__(self, on_frames: OnFrames) -> None:
        loop = asyncio.get_running_loop()
        self.on_frames = on_frames
        self.status: asyncio.Future[int] = loop.create_future()
        self.ended: asyncio.Future[bool] = loop.create_future()
        self.transport: asyncio.Transport | None = None
        self._buf = b""
        self._head = True
        self._chunk_left = 0  # bytes left in the current chunk (then its CRLF)
        self._body_left = -1  # a body with Content-Length (an error answer): bytes still to come
        self._decoder = ByteDecoder()
        self.body = b""  # the body of a non-SSE answer (an error's JSON)
        self.retry_ms: int | None = None  # the server's last reconnect hint (``retry:``)
        self.received = 0.0  # unix time of the first event (0: none yet)

    @classmethod
    async def open(cls, host: str, port: int, path: str, on_frames: OnFrames,
                   headers: Sequence[tuple[str, str]] = (), local_address: str | None = None) -> SSEStream:
        """Connect (from ``local_address``, a loopback address, when given) and send the GET."""
        loop = asyncio.get_running_loop()
        _, proto = await loop.create_connection(lambda: cls(on_frames), host, port,
                                                local_addr=(local_address, 0) if local_address else None)
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers)
        assert proto.transport is not None
        proto.transport.write(f"GET {path} HTTP/1.1\r\nhost: {host}:{port}\r\naccept: text/event-stream\r\n"
                              f"{extra}\r\n".encode())
        return proto

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.status.done():
            self.status.set_exception(ConnectionError("closed before the response head"))
            self.status.exception()
        if not self.ended.done():
            self.ended.set_result(False)

    def data_received(self, data: bytes) -> None:
        buf = self._buf + data if self._buf else data
        if self._head:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                self._buf = buf
                return
            lines = buf[:end].split(b"\r\n")
            code = int(lines[0].split(b" ", 2)[1])
            chunked = False
            for line in lines[1:]:
                name, _, value = line.partition(b":")
                name = name.strip().lower()
                if name == b"transfer-encoding" and b"chunked" in value.lower():
                    chunked = True
                elif name == b"content-length":
                    self._body_left = int(value)
            self._head = False
            buf = buf[end + 4:]
            if not chunked and self._body_left < 0:
                self._body_left = 0
            self.status.set_result(code)
        if self._body_left >= 0:  # not an event stream: keep the body, end when it is complete
            part = buf[:self._body_left]
            self.body += part
            self._body_left -= len(part)
            self._buf = b""
            if self._body_left == 0:
                self._finish(True)
            return
        payload: list[bytes] = []
        pos, n = 0, len(buf)
        while pos < n:
            if self._chunk_left > 0:
                take = min(self._chunk_left, n - pos)
                payload.append(buf[pos:pos + take])
                pos += take
                self._chunk_left -= take
                if self._chunk_left > 0:
                    break
                self._chunk_left = -2  # its CRLF
                continue
            if self._chunk_left == -2:
                if n - pos < 2:
                    break
                pos += 2
                self._chunk_left = 0
                continue
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                break
            size = int(buf[pos:eol].split(b";", 1)[0], 16)
            pos = eol + 2
            if size == 0:
                self._buf = b""
                self._deliver(payload)
                self._finish(True)
                return
            self._chunk_left = size
        self._buf = buf[pos:]
        self._deliver(payload)

    def _deliver(self, payload: list[bytes]) -> None:
        if not payload:
            return
        frames = []
        for block in self._decoder.feed(b"".join(payload)):
            if block:
                fields = split_event(block)
                if fields is not None:
                    frames.append(fields)
                elif block[:6] == b"retry:":
                    hint = parse_block(block).retry
                    self.retry_ms = hint if hint is not None else self.retry_ms
        if frames:
            t = time.time()
            self.received = self.received or t
            self.on_frames(self, frames, t)

    def _finish(self, complete: bool) -> None:
        if not self.ended.done():
            self.ended.set_result(complete)
        self.close()


class Creator:
    """POST /v1/streams over a few raw keep-alive connections, in turn (httpx's ~1.5 ms per request would
    make thousands of creates the load process's main cost)."""

    def __init__(self, host: str, port: int, connections: int = 8) -> None:
        self._free: asyncio.Queue[RawConnection] = asyncio.Queue()
        for _ in range(connections):
            self._free.put_nowait(RawConnection(host, port))

    async def create(self, **body: Any) -> str:
        sid = str(uuid.uuid4())
        payload = orjson.dumps({"id": sid, "prompt": "bench", **body})
        conn = await self._free.get()
        try:
            status, raw = await conn.request("POST", "/v1/streams", payload)
        except BaseException:
            await conn.close()  # a fresh connection next time
            raise
        finally:
            self._free.put_nowait(conn)
        if status not in (200, 201):
            raise RuntimeError(f"create failed: {status} {raw[:200]!r}")
        return sid

    async def post(self, path: str, body: bytes = b"") -> int:
        conn = await self._free.get()
        try:
            status, _ = await conn.request("POST", path, body)
            return status
        except BaseException:
            await conn.close()
            raise
        finally:
            self._free.put_nowait(conn)

    async def aclose(self) -> None:
        while not self._free.empty():
            await self._free.get_nowait().close()
