"""consumer.streaming.reader's reset rule, on a real redis-server: a reader whose resume point is no longer in the stream
(a failover lost the events after it; simulated by deleting them with XDEL, which leaves the stream's
last-id behind as a lost tail does) gets a ``reset`` naming the last event it shares with the stream, then the
stream's events from there: never a silent skip, never a silent duplicate."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
import redis

from broker.events import RESET_FROM_START, Event, EventType, encode_data
from broker.redis.connection import connect, connect_blocking
from broker.redis.server import RedisServer
from broker.request.generation import GenerationRequest
from broker.streams.job_store import JobStore
from broker.streams.records import Claim
from broker.streams.stream_store import StreamStore
from consumer.streaming.hub import LiveHub
from consumer.streaming.reader import read_stream

REQ = GenerationRequest(None, "hello", None, 32, 0.8, 0.95, None, (), False)
IDLE_S = 0.2


@pytest.fixture
async def parts(redis_server: RedisServer, redis_client: redis.Redis) -> AsyncIterator[tuple[StreamStore, LiveHub]]:
    r = connect(redis_server.url)
    blocking = connect_blocking(redis_server.url)
    hub = LiveHub(blocking)
    await hub.start()
    yield StreamStore(r), hub
    await hub.stop()
    await r.aclose()
    await blocking.aclose()


@pytest.fixture
def jobs(parts: tuple[StreamStore, LiveHub]) -> JobStore:
    """The generator's side, on the store's Redis."""
    return JobStore(parts[0].redis)


async def _stream(store: StreamStore, jobs: JobStore, texts: list[str]) -> tuple[uuid.UUID, Claim, list[str]]:
    """A running stream with a delta per text; returns its event ids (queued, then the deltas)."""
    sid = uuid.uuid4()
    await store.create(sid, REQ, model="m", max_queue=0, retention_s=60)
    claim = await jobs.claim(sid, "w")
    assert isinstance(claim, Claim)
    for i, t in enumerate(texts):
        assert (await jobs.append(claim, i, i + 1, [(EventType.DELTA, encode_data({"text": t}))])).ok
    return sid, claim, [e.id for e in await store.read(sid, None)]


async def _lose_tail(store: StreamStore, sid: uuid.UUID, ids: list[str]) -> None:
    """What an asynchronous failover does to a stream: its last events are gone, the seq goes back."""
    await store.redis.xdel(store.keys(sid).events, *ids)
    await store.redis.hincrby(store.keys(sid).meta, "seq", -len(ids))


async def _take(store: StreamStore, hub: LiveHub, sid: uuid.UUID, after: str | None, n: int) -> list[Event]:
    out: list[Event] = []
    reader = read_stream(store, hub, sid, after, IDLE_S)
    try:
        async with asyncio.timeout(10):
            async for ev in reader:
                if ev is not None:
                    out.append(ev)
                    if len(out) == n:
                        break
    finally:
        await reader.aclose()  # type: ignore[attr-defined]
    return out


def _text(events: list[Event]) -> str:
    return "".join(e.json()["text"] for e in events if e.type == EventType.DELTA)


async def test_a_resume_point_in_the_stream_needs_no_reset(jobs: JobStore, parts: tuple[StreamStore, LiveHub]) -> None:
    store, hub = parts
    sid, _, ids = await _stream(store, jobs, ["a", "b", "c"])
    got = await _take(store, hub, sid, ids[1], 2)
    assert [e.id for e in got] == ids[2:] and _text(got) == "bc"
    assert [e.id for e in await _take(store, hub, sid, RESET_FROM_START, 4)] == ids  # 0-0: from the start


async def test_a_resume_point_a_failover_lost_gets_a_reset_to_the_last_common_event(jobs: JobStore,
        parts: tuple[StreamStore, LiveHub]) -> None:
    store, hub = parts
    sid, claim, ids = await _stream(store, jobs, ["a", "b", "c", "d"])
    await _lose_tail(store, sid, ids[3:])  # "c" and "d" lost; a reader had read up to "d"
    for i, t in enumerate(["C", "D"]):  # the continuation, from what the stream still has
        assert (await jobs.append(claim, 2 + i, 3 + i, [(EventType.DELTA, encode_data({"text": t}))])).ok
    got = await _take(store, hub, sid, ids[-1], 3)
    assert got[0].type == EventType.RESET and got[0].id == ids[2]
    assert got[0].json() == {"last_event_id": ids[2]}
    assert _text(got[1:]) == "CD"  # the reader's "ab" + "CD": the stream's text, nothing skipped or repeated
    assert [e.id for e in got[1:]] == [e.id for e in await store.read(sid, ids[2])]
    # Newer than anything the stream has, with nothing after it: reset too (the common event is the last).
    sid2, _, ids2 = await _stream(store, jobs, ["x", "y"])
    await _lose_tail(store, sid2, ids2[2:])
    got = await _take(store, hub, sid2, ids2[2], 1)
    assert got[0].type == EventType.RESET and got[0].id == ids2[1]


async def test_a_reset_to_the_start_when_nothing_is_shared(jobs: JobStore, parts: tuple[StreamStore, LiveHub]) -> None:
    store, hub = parts
    sid, claim, ids = await _stream(store, jobs, ["a"])
    await store.redis.xdel(store.keys(sid).events, *ids)  # all of it, "queued" included
    await store.redis.hset(store.keys(sid).meta, "seq", 0)
    assert (await jobs.append(claim, 0, 1, [(EventType.DELTA, encode_data({"text": "A"}))])).ok
    got = await _take(store, hub, sid, ids[-1], 2)
    assert got[0].type == EventType.RESET and got[0].id == RESET_FROM_START
    assert got[0].json() == {"last_event_id": None}
    assert _text(got[1:]) == "A"


async def test_a_live_reader_whose_tail_was_lost_is_reset_on_resync(jobs: JobStore, parts: tuple[StreamStore, LiveHub]) -> None:
    store, hub = parts
    sid, claim, ids = await _stream(store, jobs, ["a", "b"])
    reader = read_stream(store, hub, sid, None, IDLE_S)
    got: list[Event] = []
    try:
        async with asyncio.timeout(10):
            while len(got) < 3:
                ev = await reader.__anext__()
                if ev is not None:
                    got.append(ev)
            await _lose_tail(store, sid, ids[2:])  # "b" lost after the reader got it
            hub._on_reset([store.keys(sid).channel.encode()])  # what the hub reports after a failover
            assert (await jobs.append(claim, 1, 2, [(EventType.DELTA, encode_data({"text": "B"}))])).ok
            while len(got) < 5:
                ev = await reader.__anext__()
                if ev is not None:
                    got.append(ev)
    finally:
        await reader.aclose()  # type: ignore[attr-defined]
    assert [e.type for e in got] == ["queued", "delta", "delta", "reset", "delta"]
    assert got[3].id == ids[1] and _text(got[4:]) == "B"
