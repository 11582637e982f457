"""The one SSE response of the consumer, for every protocol view: the event stream, the heartbeat, the
client's disconnect and the pod's shutdown, raced (``race``) so whichever comes first ends the response
cleanly; the stream runs in the response's own task, so an open reader costs one task more, not three.
Views only decide what bytes each event becomes (``frames``); everything about the connection is here.

Memory per reader stays bounded whatever the client does: frames are pulled from the view one batch at a
time and each ``send`` waits while uvicorn's transport buffer is full (flow control), so nothing piles up
here; a reader that accepts nothing for ``send_timeout_s`` is dropped (consumer.edge.guards.stall_guarded
aborts the connection; under a server without it, a timer of the response applies the same rule) and resumes
from its last event id.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, TypeVar

from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from broker.errors import RsbError, StoreUnavailable
from broker.sse import HEARTBEAT, retry_hint
from consumer.edge.guards import guards_stalls, watch_disconnect

log = logging.getLogger("rsb.consumer")

# Sent before closing on shutdown: reconnect soon (to another pod), resuming from the last id.
RECONNECT_HINT = retry_hint(1000)
# The last writes of a response (the hint, the end of the body) wait at most this long: a client that
# does not read must not hold up a draining pod.
CLOSING_SEND_TIMEOUT_S = 1.0

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "Connection": "keep-alive"}
#: The response header of the protocol views (OpenAI, AI SDK) that names the rsb stream behind a response, for
#: reading it again through the native API.
STREAM_ID_HEADER = "x-rsb-stream-id"

T = TypeVar("T")


async def cancel_all(*tasks: asyncio.Future[Any]) -> None:
    """Cancel the tasks and wait for them, cancelling again any that shrugged a cancellation off (on Python
    3.11 a library's wait_for may swallow one that lands as its inner future completes): a response must
    not outlive its end."""
    pending = {t for t in tasks if not t.done()}
    while pending:
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=0.1)
    for t in tasks:
        if not t.cancelled():
            t.exception()  # retrieved: an outcome nobody needs is not logged as lost


async def wait_disconnect(receive: Receive) -> None:
    while True:
        message: Message = await receive()
        if message["type"] == "http.disconnect":
            return


class Gone(Exception):
    """The client went away."""


class Draining(Exception):
    """The pod is shutting down."""


class Drain(asyncio.Event):
    """The pod's shutdown signal: an ``asyncio.Event`` whose ``set`` also runs the callbacks registered with
    ``on_set``, at once, so thousands of open responses each react to it without a task waiting on it."""

    def __init__(self) -> None:
        super().__init__()
        self._callbacks: set[Callable[[], None]] = set()

    def set(self) -> None:
        if self.is_set():
            return
        super().set()
        for callback in list(self._callbacks):
            callback()

    def on_set(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Register ``callback``; returns what unregisters it."""
        self._callbacks.add(callback)
        return lambda: self._callbacks.discard(callback)


class _Race:
    """The state of one ``race``: bound methods as callbacks, not closures (each open reader holds them)."""

    __slots__ = ("task", "winner")

    def __init__(self, task: asyncio.Task[Any]) -> None:
        self.task = task
        self.winner: type[Exception] | None = None

    def interrupt(self, reason: type[Exception]) -> None:
        if self.winner is None and self.task.cancelling() == 0:
            self.winner = reason
            self.task.cancel()

    def on_gone(self, fut: asyncio.Future[None]) -> None:
        if not fut.cancelled() and fut.exception() is None:
            self.interrupt(Gone)

    def on_lost(self) -> None:
        self.interrupt(Gone)

    def on_drain(self) -> None:
        self.interrupt(Draining)


async def race(work: Awaitable[T], receive: Receive, shutdown: Drain) -> T:
    """``work``'s result, unless the client disconnects (Gone) or the pod drains (Draining) first.

    ``work`` runs in the calling task, which is cancelled (and the cancellation turned into Gone or Draining)
    when the other side wins. The disconnect comes through a callback from the connection's protocol where it
    can (consumer.edge.guards.watch_disconnect: no task per reader), else from a task waiting in ``receive``
    (a middleware wrapped it); the drain comes through a callback (Drain.on_set)."""
    if shutdown.is_set():
        if inspect.iscoroutine(work):
            work.close()
        raise Draining
    task = asyncio.current_task()
    assert task is not None
    state = _Race(task)
    unwatch = watch_disconnect(receive, state.on_lost)
    gone = None
    if unwatch is None:
        gone = asyncio.ensure_future(wait_disconnect(receive))
        gone.add_done_callback(state.on_gone)
    off = shutdown.on_set(state.on_drain)
    try:
        return await work
    except asyncio.CancelledError:
        if state.winner is not None and task.uncancel() == 0:
            raise state.winner from None
        raise
    finally:
        off()
        if unwatch is not None:
            unwatch()
        if gone is not None:
            gone.remove_done_callback(state.on_gone)
            await cancel_all(gone)


def _default_raw_headers() -> list[tuple[bytes, bytes]]:
    prototype = Response(media_type="text/event-stream", headers=SSE_HEADERS)
    return [(k, v) for k, v in prototype.raw_headers if k != b"content-length"]


_DEFAULT_RAW_HEADERS = _default_raw_headers()


class SSEResponse(Response):
    """``frames`` yields bytes (one or more whole frames, written in one send: per-send costs, a loop
    iteration and a syscall, dominate per-event costs) or None when a heartbeat is due; or, with ``encode``,
    items that ``encode`` turns into those bytes (a view that frames each batch alone needs no generator of
    its own wrapping the reader's: a suspended generator per open reader less). On shutdown the
    client gets ``shutdown_frame`` (default: a reconnect hint) before the body ends at a frame boundary.
    ``on_close`` runs when the response is over, however it ended (connection accounting)."""

    media_type = "text/event-stream"

    def __init__(self, frames: AsyncIterator[Any], *, shutdown: Drain, send_timeout_s: float,
                 encode: Callable[[Any], bytes] | None = None,
                 headers: Mapping[str, str] | None = None, shutdown_frame: bytes = RECONNECT_HINT,
                 on_close: Callable[[], None] | None = None) -> None:
        # As StreamingResponse does: no body attribute, so no Content-Length (the body is chunked).
        self.status_code = 200
        if headers:
            self.init_headers({**SSE_HEADERS, **headers})
        else:
            # Most responses send exactly these: one list for all of them (about 1 kB per open reader
            # otherwise). Nothing mutates a response's headers once it is built.
            self.raw_headers = _DEFAULT_RAW_HEADERS
        self.frames = frames
        self.encode = encode
        self.shutdown = shutdown
        self.send_timeout_s = send_timeout_s
        self.shutdown_frame = shutdown_frame
        # Called directly, not as a BackgroundTask: Starlette runs a plain function in a worker thread.
        self.background = None
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            try:
                await race(self._stream(send, watchdog=not guards_stalls(receive, self.send_timeout_s)), receive,
                           self.shutdown)
            except Gone:
                return  # nobody to send the end of the body to
            except TimeoutError:
                return  # the client stopped reading: nothing more can reach it; uvicorn closes the connection
            except Draining:
                if self.shutdown_frame:
                    with contextlib.suppress(Exception):
                        async with asyncio.timeout(CLOSING_SEND_TIMEOUT_S):
                            await self._send(send, self.shutdown_frame)
            except Exception as e:
                if not isinstance(e, RsbError | StoreUnavailable):
                    # A bug (a failing script, WRONGTYPE, a view's own error): logged, and the body is cut
                    # rather than ended: a clean end says "resume from here", and the client would meet the same
                    # bug again without anyone being told. uvicorn closes the connection; the client sees an
                    # incomplete body.
                    log.error("a response's stream failed: %s", type(e).__name__, exc_info=e)
                    return
                # The stream ended in an error rsb expects (Redis away, the stream deleted or expired meanwhile):
                # end the body at a frame boundary, and the client resumes.
            # The stream ended (terminal event sent), failed between events or the pod drains: either way the
            # body ends at a frame boundary and the client can resume from its last id.
            with contextlib.suppress(Exception):
                async with asyncio.timeout(CLOSING_SEND_TIMEOUT_S):
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            with contextlib.suppress(Exception):
                await self.frames.aclose()  # type: ignore[attr-defined]
            if self.on_close is not None:
                self.on_close()

    @staticmethod
    async def _send(send: Send, chunk: bytes) -> None:
        await send({"type": "http.response.body", "body": chunk, "more_body": True})

    async def _stream(self, send: Send, *, watchdog: bool) -> None:
        encode = self.encode
        if not watchdog:
            # The connection's protocol drops a client that accepts nothing for send_timeout_s
            # (consumer.edge.guards.stall_guarded): the race sees it leave. No timer per reader here.
            async for item in self.frames:
                await self._send(send, HEARTBEAT if item is None else encode(item) if encode else item)
            return
        # A reader that stops reading is dropped after send_timeout_s instead of pinning memory; it can resume
        # from its last event id. One watchdog timer per response, re-armed when it fires, instead of a timer
        # set and cancelled around every send: the rule seen from the app, for a server whose transport does not
        # apply it (consumer.edge.guards.stall_guarded).
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        sending_since: float | None = None
        stalled = False
        handle: asyncio.TimerHandle

        def check() -> None:
            nonlocal handle, stalled
            stuck = sending_since is not None and loop.time() - sending_since >= self.send_timeout_s
            if stuck and not task.cancelling():  # not when the response is already being ended
                stalled = True
                task.cancel()
                return
            due = self.send_timeout_s if sending_since is None else sending_since + self.send_timeout_s - loop.time()
            handle = loop.call_later(due, check)

        handle = loop.call_later(self.send_timeout_s, check)
        try:
            async for item in self.frames:
                sending_since = loop.time()
                await self._send(send, HEARTBEAT if item is None else encode(item) if encode else item)
                sending_since = None
        except asyncio.CancelledError:
            if not stalled:
                raise
            task.uncancel()
            raise TimeoutError from None
        finally:
            handle.cancel()
