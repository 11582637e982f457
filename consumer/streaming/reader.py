"""One reader's view of a stream: replay after the resume point, then tail live, until the terminal event.

The reset rule. Redis replicates asynchronously: with durability ``local``, a primary that dies may take the
last events of a stream with it after a reader received them, and the worker that continues the stream
appends other events, under new ids, after the last one that survived. So whenever this reader reads the
range (the replay after a resume point, and every re-read after a missed live message or a failover) it
checks that its resume point is still in the stream; when it is not (it is newer than the stream's last
event, or gone while later ones exist), the reader first sends a ``reset`` event whose id (and
``last_event_id``) is the newest event the stream still has at or before the reader's point (``0-0``/null:
none), then every event after that one. A client drops what it received after that id (the text of the
deltas after it) and applies what follows: never a silent skip, never a silent duplicate. With durability
``replicated`` no event a reader can see is lost by a failover, and no reset happens.

On Redis Cluster an idle reader also re-reads its range at each heartbeat: a live message published while
its shard failed over may have been lost without its connection noticing.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Sequence

from broker.errors import StoreUnavailable
from broker.events import RESET_FROM_START, Event, parse_event_id, reset_event
from broker.streams.records import ReplayPage
from broker.streams.stream_store import StreamStore
from consumer.streaming.hub import LiveHub, Subscription

REPLAY_PAGE = 512
# A replay's pages double up to this: the first comes fast, and a long catch-up takes few round trips (each a
# loopback write that wakes Redis: the largest single cost of a resume). A page is sent as one write, and
# flow control holds the next until the client took it, so a reader holds at most one page.
REPLAY_PAGE_MAX = 2048
RETRY_READ_S = 1.0


async def read_stream(
    store: StreamStore, hub: LiveHub, stream_id: uuid.UUID, after_id: str | None, idle_s: float, *, watched: bool = True
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


class _Place:
    """Where a reader is in its stream: the id of the last event it was sent (None: none yet) and that id as a
    comparable key. The one place the reader parses an id: a live event at or before it was sent already (by the
    replay of the range), and is skipped."""

    __slots__ = ("id", "key")

    def __init__(self, event_id: str | None) -> None:
        self.id: str | None = None
        self.key: tuple[int, int] | None = (0, 0)
        self.move(event_id)

    def move(self, event_id: str | None) -> None:
        self.id = event_id
        self.key = parse_event_id(event_id) if event_id else (0, 0)

    def past(self, events: Sequence[Event]) -> list[Event]:
        """The events after this place, up to a terminal one; the place moves to the last of them."""
        fresh: list[Event] = []
        for ev in events:
            key = parse_event_id(ev.id)
            if self.key is not None and key is not None and key <= self.key:
                continue  # already replayed from the range
            fresh.append(ev)
            self.id, self.key = ev.id, key
            if ev.is_terminal:
                break
        return fresh


async def read_batches(
    store: StreamStore, hub: LiveHub, stream_id: uuid.UUID, after_id: str | None, idle_s: float, *, watched: bool = True
) -> AsyncIterator[Sequence[Event] | None]:
    """``read_stream`` by the batch: a replay page, or all the live events that arrived together, so the
    response can write them in one send (one syscall, one loop iteration) instead of one per event.

    One pass: the range after the reader's place is read from the stream (``StreamStore.replay``: one read, which also
    says when the place is gone), page by page; then the reader waits on its subscription and sends what is past
    its place; a resync (or, on a cluster, a heartbeat) reads the range again."""
    keys = store.keys(stream_id)
    sub: Subscription | None = None
    prefetch: asyncio.Future[ReplayPage] | None = None
    try:
        # Inside the try: a reader that leaves at any await from here on (a page reload) unsubscribes, or the
        # pod would keep the channel and go on touching the stream as if it had a reader.
        sub = await hub.subscribe(keys.channel, stream_id, watched=watched)
        if watched:
            with contextlib.suppress(StoreUnavailable):
                await store.touch([stream_id])  # a reader is here now (cancel_on_disconnect counts from here)
        # A client resuming after a reset to the start resumes from the start.
        place = _Place(None if after_id == RESET_FROM_START else after_id)
        need_range = True
        # Heartbeats are due idle_s after whatever was yielded last, event or heartbeat.
        next_beat = time.monotonic() + idle_s
        while True:
            if need_range:
                # Replay (or catch up after a resync) from the stream itself, page by page; the first read checks
                # that the place is still in the stream (the reset rule, see the module doc).
                check = place.id is not None
                count = REPLAY_PAGE
                while True:
                    try:
                        if prefetch is not None:
                            task, prefetch = prefetch, None
                            page = await task
                        else:
                            page = await store.replay(stream_id, place.id, count, check=check)
                    except StoreUnavailable:
                        # Redis is away: keep the reader with heartbeats; the hub's reconnect resyncs us.
                        await sub.wait(min(RETRY_READ_S, max(0.0, next_beat - time.monotonic())))
                        if time.monotonic() >= next_beat:
                            yield None
                            next_beat = time.monotonic() + idle_s
                        sub.take()
                        continue
                    check = False
                    if page.reset:
                        yield [reset_event(page.common)]
                        next_beat = time.monotonic() + idle_s
                        place.move(page.common)
                        continue
                    events = page.events
                    # Nothing is appended after a terminal event (FINISH closes the stream), so only a page's
                    # last event can be one.
                    if events and events[-1].is_terminal:
                        yield events
                        return
                    full = len(events) >= count
                    if full:
                        # The next page is read while this one is sent: Redis's side of it overlaps ours.
                        count = min(2 * count, REPLAY_PAGE_MAX)
                        prefetch = asyncio.ensure_future(store.replay(stream_id, events[-1].id, count, check=False))
                    if events:
                        yield events
                        next_beat = time.monotonic() + idle_s
                        place.move(events[-1].id)
                    if not full:
                        break
                need_range = False
            if not await sub.wait(max(0.0, next_beat - time.monotonic())):
                yield None
                next_beat = time.monotonic() + idle_s
                need_range = store.cluster  # see the module doc
                continue
            live, resync = sub.take()
            if resync:
                need_range = True
                continue
            fresh = place.past(live)
            if fresh:
                yield fresh
                next_beat = time.monotonic() + idle_s
                if fresh[-1].is_terminal:
                    return
    finally:
        if prefetch is not None:
            prefetch.cancel()
        if sub is not None:
            hub.unsubscribe(sub)
