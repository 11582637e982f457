"""rsb's own generations as read-only Durable Streams: ``/v1/stream/rsb/<stream id>``.

No copy: a read goes through the stream service (its ownership checks, its reader and the live hub), like
every other view. The stream is in JSON mode, one message per rsb event, ``{"id", "type", "data"}`` built
from the stored fields without parsing them (so every type reads as stored: typed output's ``reasoning``,
``tool_call`` and ``tool_args`` too); its offsets are the event ids (``1795948061229-0`` is
``0001795948061229_0000000000000000``), so a client can switch between this and ``/v1/streams/{id}/events``
without losing its place. The terminal event (``done``, ``cancelled``, ``error``) closes the stream. PUT,
POST and DELETE answer 405: a generation is written by its worker only.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import cast

from starlette.requests import Request
from starlette.responses import Response

from broker.ascii import parse_uuid
from broker.durable.format import JSON_TYPE, ZERO_ID, id_key, offset_of
from broker.durable.store import Page
from broker.errors import InvalidRequest, NotFound
from broker.events import Event
from broker.streams.records import TERMINAL_STATUSES, StreamStatus
from consumer.state import State, caller_of, state_of
from consumer.streaming.reader import REPLAY_PAGE
from consumer.streaming.sse import Draining, Gone, SSEResponse, race
from consumer.views.durable.protocol import CLOSED, NEXT_OFFSET, cursor, offset_param, respond
from consumer.views.durable.responses import control_event, no_content, page_events, page_response, sse_headers

PREFIX = "rsb/"
# Generation ids never come back once expired (a create with an expired id is refused): a constant does.
_GEN = "rsb"


def generation_id(path: str) -> uuid.UUID:
    raw = path[len(PREFIX):] if path.startswith(PREFIX) else ""
    parsed = parse_uuid(raw)
    if parsed is None:
        raise NotFound("no generation at this path: use /v1/stream/rsb/<stream id>")
    return parsed


def item(ev: Event) -> bytes:
    """One message: the event's id, type and data (already one line of JSON)."""
    return b'{"id":"%s","type":"%s","data":%s}' % (ev.id.encode(), ev.type.encode(), ev.data)


def page_of(events: Sequence[Event], after: str, *, more: bool, ended: bool) -> Page:
    """``ended``: the generation is over and nothing is left after ``after``."""
    if events:
        tail, closed = events[-1].id, events[-1].is_terminal
    else:
        tail, closed = after, ended
    return Page(tail, closed, JSON_TYPE, True, _GEN, after, more and not closed,
                [(ev.id, item(ev)) for ev in events])


async def handle(request: Request, path: str) -> Response:
    state = state_of(request)
    if request.method not in ("GET", "HEAD"):
        return respond(405, {"Allow": "GET, HEAD, OPTIONS"})
    sid = generation_id(path)
    st = await state.service.status(caller_of(request), sid)  # 404 / 410, and the caller's own only
    if request.method == "HEAD":
        tail = await state.service.last_event_id(sid) or ZERO_ID
        headers = {"content-type": JSON_TYPE, NEXT_OFFSET: offset_of(tail), "Cache-Control": "no-store"}
        if st.status in TERMINAL_STATUSES:
            headers[CLOSED] = "true"
        return respond(200, headers)
    offset = offset_param(request)
    mode = request.query_params.get("live")
    if mode in ("long-poll", "sse") and offset is None:
        raise InvalidRequest(f"live={mode} needs an offset (-1 for the start, now for the tail)")
    page = await _read(state, sid, st, offset)
    if mode == "sse":
        return _sse(request, state, sid, st, page)
    if mode != "long-poll":
        return page_response(request, page, offset)
    if page.entries or page.closed:
        return page_response(request, page, offset, cursor=await cursor(request)) if page.entries else \
            no_content(page.tail, closed=True, cursor=await cursor(request))
    with state.service.connection(caller_of(request)) as slot:
        try:
            batch = await race(_next_batch(state, sid, st, page.tail), request.receive, state.draining)
        except Gone:
            return respond(204)
        except Draining:
            batch = None
        finally:
            slot.release()
    if not batch:
        return no_content(page.tail, closed=False, cursor=await cursor(request))
    return page_response(request, page_of(batch, page.tail, more=len(batch) >= REPLAY_PAGE, ended=False), offset,
                         cursor=await cursor(request))


async def _read(state: State, sid: uuid.UUID, st: StreamStatus, offset: str | None) -> Page:
    if offset == "now":
        after = await state.service.last_event_id(sid) or ZERO_ID
    else:
        after = ZERO_ID if offset in (None, "-1") else offset
    events = await state.service.page(sid, None if after == ZERO_ID else after)
    # The status was read first: a generation that had ended then has nothing after the last event read.
    return page_of(events, after, more=len(events) >= REPLAY_PAGE, ended=st.status in TERMINAL_STATUSES)


def _batches(state: State, sid: uuid.UUID, st: StreamStatus, after: str
             ) -> AsyncGenerator[Sequence[Event] | None, None]:
    return cast(AsyncGenerator[Sequence[Event] | None, None],
                state.service.batches(sid, None if after == ZERO_ID else after, watched=st.watched,
                                                         resets=False))


async def _next_batch(state: State, sid: uuid.UUID, st: StreamStatus, after: str) -> Sequence[Event] | None:
    """The next events after ``after``, waiting up to --ds-long-poll-timeout-s, through the one reader."""
    batches = _batches(state, sid, st, after)
    try:
        async with asyncio.timeout(state.settings.ds_long_poll_timeout_s):
            async for batch in batches:
                if batch:
                    return batch
    except TimeoutError:
        pass
    finally:
        await batches.aclose()
    return None


def _sse(request: Request, state: State, sid: uuid.UUID, st: StreamStatus, page: Page) -> Response:
    with state.service.connection(caller_of(request)) as slot:
        return SSEResponse(_sse_frames(request, state, sid, st, page), shutdown=state.draining,
                           send_timeout_s=state.settings.send_timeout_s, headers=sse_headers(JSON_TYPE),
                           shutdown_frame=b"", on_close=slot.release)


async def _sse_frames(request: Request, state: State, sid: uuid.UUID, st: StreamStatus,
                      page: Page) -> AsyncIterator[bytes | None]:
    """The catch-up pages, then live batches from the stream service's reader, each as a data event and its
    control event; a keep-alive control at each heartbeat; ends after the terminal event or --ds-sse-max-s."""
    loop = asyncio.get_running_loop()
    ends_at = loop.time() + state.settings.ds_sse_max_s
    yield page_events(page, text=True, cursor=await cursor(request))
    while page.more:
        page = await _read(state, sid, st, page.next_id)
        yield page_events(page, text=True, cursor=await cursor(request))
    if page.closed_here:
        return
    pos = page.next_id
    batches = _batches(state, sid, st, pos)
    try:
        async for batch in batches:
            if batch is None:
                yield control_event(pos, cursor=await cursor(request), up_to_date=True, closed=False)
            else:
                fresh = [ev for ev in batch if id_key(ev.id) > id_key(pos)]
                if fresh:
                    live = page_of(fresh, pos, more=False, ended=False)
                    pos = live.next_id
                    yield page_events(live, text=True, cursor=await cursor(request))
                    if live.closed_here:
                        return
            if loop.time() >= ends_at:
                return
    finally:
        await batches.aclose()
