"""Late joiners: the answer as it stands, for a read "from the latest" (``?from=latest``).

A second device or a refreshed tab that only wants where the answer is now gets one snapshot of it (its text,
reasoning and tool calls so far: broker.answer) and then the live tail after the last event the snapshot
holds. The snapshot is read once per pod: the pod keeps the answers of the streams its late joiners read
(``SNAPSHOT_STREAMS`` of them, the least recently read dropped first), and a joiner reads only what was
appended since the last one did. A hundred joiners of a 4,000-token answer cost one read of it and a hundred
reads of its newest events, never a hundred reads of every delta; joiners of one stream take turns (the first
reads, the others extend what it read).

What a pod kept is checked against the stream on every read (the reset rule, consumer.streaming.reader): when a
failover lost events the pod had read, it reads the answer again from the start.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from broker.answer import AnswerRuns
from broker.errors import InvalidRequest
from broker.events import RESET_FROM_START, Event, EventType, encode_data
from broker.streams.stream_store import StreamStore

#: Streams whose answers a pod keeps for late joiners (each at most one answer's text: max_tokens bounds it).
SNAPSHOT_STREAMS = 256
#: Events read per round trip while catching up.
SNAPSHOT_PAGE = 2048


def from_latest(query: Mapping[str, str]) -> bool:
    """``?from=latest`` on a read (the native events route, the AI SDK's resume): it starts with a snapshot of the
    answer as it stands. Any other value is a 400: a typo would silently replay every event."""
    raw = query.get("from")
    if raw is None:
        return False
    if raw != "latest":
        raise InvalidRequest("'from' must be 'latest' (a snapshot of the answer so far, then the live tail); leave "
                             "it out to read from the start or from Last-Event-ID")
    return True


@dataclass(frozen=True, slots=True)
class AnswerSnapshot:
    """The answer as it stood after the event ``last_id`` (None: the stream had no event yet): its snapshot
    event's data, and the same answer as the fewest events that make it (``AnswerRuns.events``), for views
    that frame events in their own protocol."""

    last_id: str | None
    data: dict[str, Any]
    events: tuple[Event, ...]

    def event(self) -> Event:
        """The native ``snapshot`` event: its id is the last event it holds, so a reconnect with it resumes
        exactly after the snapshot."""
        return Event(self.last_id or RESET_FROM_START, EventType.SNAPSHOT, encode_data(self.data))


class _Kept:
    __slots__ = ("answer", "lock")

    def __init__(self) -> None:
        self.answer = AnswerRuns()
        self.lock = asyncio.Lock()


class Snapshots:
    """The answers this pod's late joiners read, kept to be extended (see the module doc)."""

    def __init__(self, store: StreamStore, max_streams: int = SNAPSHOT_STREAMS) -> None:
        self.store = store
        self.max_streams = max_streams
        self._kept: OrderedDict[uuid.UUID, _Kept] = OrderedDict()

    async def latest(self, stream_id: uuid.UUID) -> AnswerSnapshot:
        """The stream's answer as it stands now: every event before the terminal one (which a reader then gets
        from the tail, so that a snapshot and its tail are the whole stream)."""
        kept = self._kept.get(stream_id)
        if kept is None:
            kept = self._kept[stream_id] = _Kept()
            while len(self._kept) > self.max_streams:
                self._kept.popitem(last=False)
        else:
            self._kept.move_to_end(stream_id)
        async with kept.lock:
            await self._catch_up(stream_id, kept)
            answer = kept.answer
            return AnswerSnapshot(answer.last_id, answer.snapshot_data(), tuple(answer.events()))

    async def _catch_up(self, stream_id: uuid.UUID, kept: _Kept) -> None:
        check = kept.answer.last_id is not None
        while True:
            page = await self.store.replay(stream_id, kept.answer.last_id, SNAPSHOT_PAGE, check=check)
            if page.reset:  # a failover lost events this pod had read: the answer is read again, as it now is
                kept.answer = AnswerRuns()
                check = False
                continue
            check = False
            for ev in page.events:
                if ev.is_terminal:
                    return
                kept.answer.add(ev)
            if len(page.events) < SNAPSHOT_PAGE:
                return
