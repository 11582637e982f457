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
    store: Store, hub: LiveHub, stream_id: uuid.UUID, after_id: str | None, idle_s: float
) -> AsyncIterator[Event | None]:
    """Every event after ``after_id``, in order, exactly once; ``None`` after each ``idle_s`` of silence
    (the caller sends a heartbeat). Ends after the terminal event."""
    sub = await hub.subscribe(store.keys(stream_id).channel, stream_id)
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
                    for ev in page:
                        yield ev
                        next_beat = time.monotonic() + idle_s
                        if ev.is_terminal:
                            return
                    if page:
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
            for ev in events:
                key = parse_event_id(ev.id)
                if last_key is not None and key is not None and key <= last_key:
                    continue  # already replayed from the range
                yield ev
                next_beat = time.monotonic() + idle_s
                last, last_key = ev.id, key
                if ev.is_terminal:
                    return
    finally:
        hub.unsubscribe(sub)
