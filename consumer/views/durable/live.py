"""Live reads of a Durable Stream: long-poll and SSE. Neither holds a Redis connection while it waits: one
that has to wait subscribes the stream's channel on the pod's LiveHub (one pub/sub connection for every
reader), reads the stream once the subscription is confirmed (so nothing appended in between is missed), and
reads again when an append, a close or a delete wakes it. Both count against the per-address and per-key
connection limits, like the native view's SSE readers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from broker.durable.format import id_key
from broker.durable.keys import DurableKeys
from broker.durable.store import Page
from consumer.state import State, caller_of
from consumer.streaming.hub import Subscription
from consumer.streaming.sse import Draining, Gone, SSEResponse, race
from consumer.views.durable.protocol import cursor, respond
from consumer.views.durable.responses import is_text, no_content, page_events, page_response, sse_headers

#: Messages one read returns at most (it also stops at --ds-read-max-bytes).
READ_COUNT = 1024


async def read(state: State, keys: DurableKeys, after: str, *, refresh: bool = True) -> Page:
    return await state.durable.read(keys, after, count=READ_COUNT, max_bytes=state.settings.ds_read_max_bytes,
                                    refresh=refresh)


async def long_poll(request: Request, state: State, keys: DurableKeys, offset: str) -> Response:
    with state.service.connection(caller_of(request)) as slot:
        try:
            return await race(_long_poll(request, state, keys, offset), request.receive, state.draining)
        except Gone:
            return respond(204)  # nobody is listening any more
        except Draining:
            # The pod stops: answer now with whatever there is; the client polls again (elsewhere).
            page = await read(state, keys, offset)
            if page.entries:
                return page_response(request, page, offset, cursor=await cursor(request))
            return no_content(page.tail, closed=page.closed, cursor=await cursor(request))
        finally:
            slot.release()


async def _long_poll(request: Request, state: State, keys: DurableKeys, offset: str) -> Response:
    # A reader that is behind gets its data without touching the hub: only one that waits subscribes.
    page = await read(state, keys, offset)
    if page.entries:
        return page_response(request, page, offset, cursor=await cursor(request))
    if page.closed:
        return no_content(page.tail, closed=True, cursor=await cursor(request))  # at the end: never wait
    if id_key(page.after) != id_key(page.tail):
        # An offset past the tail (no offset we minted): say where the tail is rather than wait there.
        return page_response(request, page, offset, cursor=await cursor(request))
    sub = await state.hub.subscribe(keys.channel)
    try:
        # Read again once the subscription is confirmed: whatever came after that wakes us, and whatever
        # came between the first read and the subscription is found here.
        page = await read(state, keys, page.tail, refresh=False)
        timed_out = not (page.entries or page.closed)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + state.settings.ds_long_poll_timeout_s
        while timed_out and (left := deadline - loop.time()) > 0:
            if not await sub.wait(left):
                break
            sub.take()  # a wake-up only: the stream says what happened
            page = await read(state, keys, page.tail)
            timed_out = not (page.entries or page.closed)
        if timed_out:
            # One last read restarts a sliding TTL and catches an append the hub could not report (a pub/sub
            # reconnect).
            page = await read(state, keys, page.tail)
        if page.entries:
            return page_response(request, page, offset, cursor=await cursor(request))
        return no_content(page.tail, closed=page.closed, cursor=await cursor(request))
    finally:
        state.hub.unsubscribe(sub)


async def sse(request: Request, state: State, keys: DurableKeys, offset: str) -> Response:
    with state.service.connection(caller_of(request)) as slot:
        sub = await state.hub.subscribe(keys.channel)
        try:
            page = await read(state, keys, offset)  # 404 / 410 before the 200 starts
        except BaseException:
            state.hub.unsubscribe(sub)
            raise
        def close() -> None:
            # Here, not in the frames' own finally: a response that ends before its first frame (the pod
            # drains, the client left) never starts them, and would leave the channel subscribed for nobody.
            state.hub.unsubscribe(sub)
            slot.release()

        frames = _sse_frames(request, state, keys, sub, page)
        return SSEResponse(frames, shutdown=state.draining, send_timeout_s=state.settings.send_timeout_s,
                           headers=sse_headers(page.content_type), shutdown_frame=b"", on_close=close)


async def _sse_frames(request: Request, state: State, keys: DurableKeys, sub: Subscription,
                      page: Page) -> AsyncIterator[bytes | None]:
    """The first page, then every page the stream grows by, each as a data event and its control event; a
    keep-alive control (which also restarts a sliding TTL) after each --heartbeat-s of silence (half the TTL,
    if that is shorter). Ends after the
    final control of a closed stream, or after --ds-sse-max-s (the client reconnects from its last offset). The
    response's ``on_close`` ends ``sub``."""
    settings = state.settings
    text = is_text(page.content_type)
    loop = asyncio.get_running_loop()
    ends_at = loop.time() + settings.ds_sse_max_s
    yield page_events(page, text=text, cursor=await cursor(request))
    while not page.closed_here:
        if page.more:
            page = await read(state, keys, page.next_id)
            yield page_events(page, text=text, cursor=await cursor(request))
            continue
        left = ends_at - loop.time()
        if left <= 0:
            return
        # The keep-alive's read restarts a sliding TTL: an open reader keeps a short-lived stream alive.
        idle_s = min(settings.heartbeat_s, page.ttl_s / 2) if page.ttl_s else settings.heartbeat_s
        woke = await sub.wait(min(idle_s, left))
        sub.take()
        if not woke and ends_at - loop.time() <= 0:
            return
        page = await read(state, keys, page.next_id)
        if page.entries or page.closed_here or not woke:
            yield page_events(page, text=text, cursor=await cursor(request))
