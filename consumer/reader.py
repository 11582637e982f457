"""One reader's view of a stream: replay after the resume point, then tail live, until the terminal event."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator

from redis.exceptions import RedisError

from broker.events import Event, parse_event_id
from broker.store import Store
from consumer.hub import LiveHub

REPLAY_PAGE = 512
RETRY_READ_S = 1.0


async def read_stream(
    store: Store, hub: LiveHub, stream_id: uuid.UUID, after_id: str | None, idle_s: float, *, watched: bool = True
) -> AsyncIterator[Event | None]:
    """Every event after ``after_id``, in order, exactly once; ``None`` after each ``idle_s`` of silence
    (the caller sends a heartbeat). Ends after the terminal event. ``watched``: record that the stream
    has a reader (for cancel_on_disconnect and abandonment)."""
    batches = read_batches(store, hub, stream_id, after_id, idle_s, watched=watched)
    try:
        async for batch in batches:
            if batch is None:
                yield None
                continue
            for ev in batch:
                yield ev
    finally:
        await batches.aclose()  # type: ignore[attr-defined]


async def read_batches(
    store: Store, hub: LiveHub, stream_id: uuid.UUID, after_id: str | None, idle_s: float, *, watched: bool = True
) -> AsyncIterator[list[Event] | None]:
    """``read_stream`` by the batch: a replay page, or all the live events that arrived together, so the
    response can write them in one send (one syscall, one loop iteration) instead of one per event."""
    sub = await hub.subscribe(store.keys(stream_id).channel, stream_id, watched=watched)
    if watched:
        with contextlib.suppress(RedisError, OSError):
            await store.touch([stream_id])  # a reader is here now (cancel_on_disconnect counts from here)
    try:
        last = after_id
        last_key = parse_event_id(after_id) if after_id else (0, 0)
        need_range = True
        # Heartbeats are due idle_s after whatever was yielded last, event or heartbeat.
        next_beat = time.monotonic() + idle_s
        while True:
            if need_range:
                # Replay (or catch up after a resync) from the stream itself, page by page.
                while True:
                    try:
                        page = await store.read(stream_id, last, count=REPLAY_PAGE)
                    except (RedisError, OSError):
                        # Redis is away: keep the reader with heartbeats; the hub's reconnect resyncs us.
                        await sub.wait(min(RETRY_READ_S, max(0.0, next_beat - time.monotonic())))
                        if time.monotonic() >= next_beat:
                            yield None
                            next_beat = time.monotonic() + idle_s
                        sub.take()
                        continue
                    # Nothing is appended after a terminal event (FINISH closes the stream), so only a page's
                    # last event can be one.
                    if page and page[-1].is_terminal:
                        yield page
                        return
                    if page:
                        yield page
                        next_beat = time.monotonic() + idle_s
                        last = page[-1].id
                        last_key = parse_event_id(last)
                    if len(page) < REPLAY_PAGE:
                        break
                need_range = False
            if not await sub.wait(max(0.0, next_beat - time.monotonic())):
                yield None
                next_beat = time.monotonic() + idle_s
                continue
            events, resync = sub.take()
            if resync:
                need_range = True
                continue
            fresh: list[Event] = []
            for ev in events:
                key = parse_event_id(ev.id)
                if last_key is not None and key is not None and key <= last_key:
                    continue  # already replayed from the range
                fresh.append(ev)
                last, last_key = ev.id, key
                if ev.is_terminal:
                    break
            if fresh:
                yield fresh
                next_beat = time.monotonic() + idle_s
                if fresh[-1].is_terminal:
                    return
    finally:
        hub.unsubscribe(sub)
