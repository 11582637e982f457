"""Where a ``reset`` cuts a read (broker.events: a failover took back the events after an id). The native view passes
it on; a view whose protocol cannot take text back ends its response before it (``until_reset``,
``events_until_reset``: its client re-syncs, as after any dropped connection); a read from the latest starts again
there from a snapshot of the stream as it now is (``from_latest``: a snapshot replaces what its reader had)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from contextlib import aclosing
from typing import cast

from broker.events import Event, EventType
from consumer.streaming.snapshots import AnswerSnapshot, Snapshots

Batches = Callable[..., AsyncIterator[Sequence[Event] | None]]


def reset_at(batch: Sequence[Event]) -> int | None:
    """The index of the batch's ``reset`` event (None: it has none)."""
    return next((i for i, ev in enumerate(batch) if ev.type == EventType.RESET), None)


async def until_reset(batches: AsyncIterator[Sequence[Event] | None]
                      ) -> AsyncGenerator[Sequence[Event] | None, None]:
    """The batches up to (not including) a ``reset``."""
    try:
        async for batch in batches:
            if batch is not None:
                cut = reset_at(batch)
                if cut is not None:
                    if cut:
                        yield batch[:cut]
                    return
            yield batch
    finally:
        await cast(AsyncGenerator[Sequence[Event] | None, None], batches).aclose()


async def events_until_reset(events: AsyncIterator[Event | None]) -> AsyncGenerator[Event | None, None]:
    """The events up to (not including) a ``reset``."""
    try:
        async for ev in events:
            if ev is not None and ev.type == EventType.RESET:
                return
            yield ev
    finally:
        await cast(AsyncGenerator[Event | None, None], events).aclose()


async def from_latest(snapshots: Snapshots, batches: Batches, stream_id: uuid.UUID, after_id: str | None, *,
                      watched: bool, snapshot: bool) -> AsyncGenerator[Sequence[Event] | AnswerSnapshot | None, None]:
    """The answer as it stands (``snapshot``), then ``batches`` after it; where a ``reset`` would come, a new
    snapshot instead (StreamService.latest)."""
    while True:
        if snapshot:
            snap = await snapshots.latest(stream_id)
            yield snap
            after_id = snap.last_id
        snapshot = True
        source = cast(AsyncGenerator[Sequence[Event] | None, None], batches(stream_id, after_id, watched=watched))
        async with aclosing(source):
            async for batch in source:
                if batch is None:
                    yield None
                    continue
                cut = reset_at(batch)
                if cut is None:
                    yield batch
                    continue
                if cut:
                    yield batch[:cut]
                break  # a reset: the next round starts with a snapshot of the stream as it now is
            else:
                return
