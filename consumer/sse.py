"""The SSE response: the event stream, the heartbeat, the client's disconnect and the pod's shutdown,
raced in one task group so whichever comes first ends the response cleanly."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from starlette.types import Message, Receive, Scope, Send

from broker.events import Event

HEARTBEAT = b": keep-alive\n\n"
# Sent before closing on shutdown: reconnect soon (to another pod), resuming from the last id.
RECONNECT_HINT = b"retry: 1000\n\n"

HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
    (b"connection", b"keep-alive"),
]


class SSEResponse:
    def __init__(
        self,
        events: AsyncIterator[Event | None],
        *,
        shutdown: asyncio.Event,
        send_timeout_s: float = 30.0,
    ) -> None:
        self.events = events
        self.shutdown = shutdown
        self.send_timeout_s = send_timeout_s
        self.sent_events = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
        stream = asyncio.create_task(self._stream(send))
        disconnect = asyncio.create_task(self._wait_disconnect(receive))
        shutdown = asyncio.create_task(self.shutdown.wait())
        try:
            done, _ = await asyncio.wait({stream, disconnect, shutdown}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (stream, disconnect, shutdown):
                t.cancel()
            await asyncio.gather(stream, disconnect, shutdown, return_exceptions=True)
            with contextlib.suppress(Exception):
                await self.events.aclose()  # type: ignore[attr-defined]
        if disconnect in done:
            return  # nobody to send the end of the body to
        if shutdown in done and stream not in done:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._send(send, RECONNECT_HINT), 1.0)
        # Otherwise the stream ended (terminal event sent) or failed between events: either way the
        # body ends at an event boundary and the client can resume from its last id.
        with contextlib.suppress(Exception):
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _send(self, send: Send, chunk: bytes) -> None:
        await send({"type": "http.response.body", "body": chunk, "more_body": True})

    async def _stream(self, send: Send) -> None:
        async for ev in self.events:
            chunk = HEARTBEAT if ev is None else ev.to_sse()
            # A reader that stops reading is dropped after send_timeout_s instead of pinning memory;
            # it can resume from its last event id.
            await asyncio.wait_for(self._send(send, chunk), self.send_timeout_s)
            if ev is not None:
                self.sent_events += 1

    @staticmethod
    async def _wait_disconnect(receive: Receive) -> None:
        while True:
            message: Message = await receive()
            if message["type"] == "http.disconnect":
                return
