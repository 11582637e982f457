"""The one plain-HTTP ``/metrics`` server of a port of its own (a generator's ``--metrics-port``, a consumer's):
GET /metrics over HTTP/1.0, anything else a JSON 404. Enough for a Prometheus scraper, and nothing else is served
there, so the port can be opened to the monitoring network only, without the API's keys."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger("rsb")

CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"
# A scraper sends its request at once: a connection that does not is dropped.
READ_TIMEOUT_S = 5.0
_NOT_FOUND = b'{"error":{"code":"not_found","message":"try /metrics"}}'


async def serve_scrapes(render: Callable[[], Awaitable[bytes]], host: str, port: int) -> asyncio.Server:
    """Serves ``render()`` at GET /metrics on ``host:port``; the caller closes the returned server."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            request_line = await asyncio.wait_for(reader.readline(), READ_TIMEOUT_S)
            while (await asyncio.wait_for(reader.readline(), READ_TIMEOUT_S)) not in (b"\r\n", b"\n", b""):
                pass  # headers: not needed
            parts = request_line.split()
            if len(parts) >= 2 and parts[0] == b"GET" and parts[1].split(b"?")[0] == b"/metrics":
                try:
                    body, status, ctype = await render(), b"200 OK", CONTENT_TYPE
                except Exception as e:  # Redis away (a consumer's totals): the scrape fails, the port stays up
                    log.warning("a metrics scrape failed: %s", type(e).__name__)
                    body, status, ctype = (b'{"error":{"code":"unavailable","message":"retry"}}',
                                           b"503 Service Unavailable", b"application/json")
            else:
                body, status, ctype = _NOT_FOUND, b"404 Not Found", b"application/json"
            writer.write(b"HTTP/1.0 " + status + b"\r\nContent-Type: " + ctype + b"\r\nContent-Length: "
                         + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
            await writer.drain()
        writer.close()

    return await asyncio.start_server(handle, host, port)
