"""The SSE response: the event stream, the heartbeat, the client's disconnect and the pod's shutdown,
raced in one task group so whichever comes first ends the response cleanly.

Memory per reader stays bounded whatever the client does: events are pulled from the reader one at a
time and each ``send`` waits while uvicorn's transport buffer is full (flow control), so nothing piles
up here; a reader that accepts nothing for ``send_timeout_s`` is dropped (consumer.server aborts the
connection; the timeout below is the same rule seen from the app) and resumes from its last event id.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.types import Message, Receive, Scope, Send

from broker.events import Event

HEARTBEAT = b": keep-alive\n\n"
# Sent before closing on shutdown: reconnect soon (to another pod), resuming from the last id.
RECONNECT_HINT = b"retry: 1000\n\n"
# The last writes of a response (the hint, the end of the body) wait at most this long: a client that
# does not read must not hold up a draining pod.
CLOSING_SEND_TIMEOUT_S = 1.0

HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
    (b"connection", b"keep-alive"),
]


async def _cancel_all(*tasks: asyncio.Task[Any]) -> None:
    """Cancel the tasks and wait for them, cancelling again any that shrugged a cancellation off (a
    library's wait_for may swallow one that lands as its inner future completes): the response must not
    outlive its end."""
    pending = {t for t in tasks if not t.done()}
    while pending:
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=0.1)


class SSEResponse:
    def __init__(
        self,
        events: AsyncIterator[Event | list[Event] | None],
        *,
        shutdown: asyncio.Event,
        send_timeout_s: float = 30.0,
        on_sent: Callable[[int], None] | None = None,
    ) -> None:
        self.events = events
        self.shutdown = shutdown
        self.send_timeout_s = send_timeout_s
        self.on_sent = on_sent  # counts events as they go out (metrics)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
        stream = asyncio.create_task(self._stream(send))
        disconnect = asyncio.create_task(self._wait_disconnect(receive))
        shutdown = asyncio.create_task(self.shutdown.wait())
        try:
            done, _ = await asyncio.wait({stream, disconnect, shutdown}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            await _cancel_all(stream, disconnect, shutdown)
            with contextlib.suppress(Exception):
                await self.events.aclose()  # type: ignore[attr-defined]
        if disconnect in done:
            return  # nobody to send the end of the body to
        if stream in done and not stream.cancelled() and isinstance(stream.exception(), TimeoutError):
            return  # the client stopped reading: nothing more can reach it; uvicorn closes the connection
        if shutdown in done and stream not in done:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._send(send, RECONNECT_HINT), CLOSING_SEND_TIMEOUT_S)
        # Otherwise the stream ended (terminal event sent) or failed between events: either way the
        # body ends at an event boundary and the client can resume from its last id.
        with contextlib.suppress(Exception):
            await asyncio.wait_for(send({"type": "http.response.body", "body": b"", "more_body": False}),
                                   CLOSING_SEND_TIMEOUT_S)

    async def _send(self, send: Send, chunk: bytes) -> None:
        await send({"type": "http.response.body", "body": chunk, "more_body": True})

    async def _stream(self, send: Send) -> None:
        async for item in self.events:
            # A batch (replay page, events that arrived together) goes out in one send: per-send costs
            # (a loop iteration, a syscall) dominate per-event costs.
            if item is None:
                chunk, n = HEARTBEAT, 0
            elif isinstance(item, list):
                chunk, n = b"".join(ev.to_sse() for ev in item), len(item)
            else:
                chunk, n = item.to_sse(), 1
            # A reader that stops reading is dropped after send_timeout_s instead of pinning memory;
            # it can resume from its last event id. (asyncio.timeout, not wait_for: before Python 3.12
            # wait_for can swallow a cancellation that races with the send completing, and the stream
            # would go on after the response ended.)
            async with asyncio.timeout(self.send_timeout_s):
                await self._send(send, chunk)
            if n and self.on_sent is not None:
                self.on_sent(n)

    @staticmethod
    async def _wait_disconnect(receive: Receive) -> None:
        while True:
            message: Message = await receive()
            if message["type"] == "http.disconnect":
                return
