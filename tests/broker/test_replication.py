"""Durability ``replicated`` on a real primary and its replica (two redis-server processes): an event becomes
visible (readable, published) only once the replica has it; with the replica stopped (SIGSTOP) the
generation pauses and readers get heartbeats, never an event the replica lacks; SIGCONT and it goes on."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
import uuid
from typing import Any

import httpx
import pytest
import redis
from helpers import SSE, create, eventually, sse_blocks
from servers import PrimaryReplica, StackFactory

from broker.events import EventType, encode_data
from broker.redis.connection import connect
from broker.request.generation import GenerationRequest
from broker.streams.job_store import JobStore
from broker.streams.keys import StreamKeys
from broker.streams.records import Claim
from broker.streams.stream_store import StreamStore

pytestmark = pytest.mark.slow

REQ = GenerationRequest(None, "hello", None, 32, 0.8, 0.95, None, (), False)


def _delta(text: str) -> tuple[str, bytes]:
    return EventType.DELTA, encode_data({"text": text})


def _replica_ids(pair: PrimaryReplica, key: str) -> list[str]:
    client = redis.Redis(port=pair.replica.port, decode_responses=True)
    try:
        entries: Any = client.xrange(key)
        return [eid for eid, _ in entries]
    finally:
        client.close()


async def test_an_event_is_visible_only_once_the_replica_has_it(primary_replica: PrimaryReplica) -> None:
    pair = primary_replica
    r = connect(pair.primary.url)
    store = StreamStore(r, durability_level="replicated", replica_wait_ms=100)
    jobs = JobStore(r, durability_level="replicated", replica_wait_ms=100)
    assert pair.replica.proc is not None
    try:
        sid = uuid.uuid4()
        k = store.keys(sid)
        await store.create(sid, REQ, model="m", max_queue=0, retention_s=60)
        claim = await jobs.claim(sid, "w")
        assert isinstance(claim, Claim)
        pubsub = r.pubsub()
        await pubsub.subscribe(k.channel)
        assert (await jobs.append(claim, 0, 1, [_delta("a")])).ok
        seen = [e.id for e in await store.read(sid, None)]
        assert len(seen) == 2 and seen == _replica_ids(pair, k.events)  # queued + "a", both on the replica

        os.kill(pair.replica.proc.pid, signal.SIGSTOP)
        try:
            pending = asyncio.ensure_future(jobs.append(claim, 1, 2, [_delta("b")]))
            await asyncio.sleep(1.0)  # deliberate: a second in which the append must not complete
            assert not pending.done()  # paused: no replica acknowledged it
            everything = await store.read(sid, None, visible_only=False)
            assert [e.type for e in everything] == ["queued", "delta", "delta"]  # on the primary...
            assert [e.id for e in await store.read(sid, None)] == seen  # ...but no reader may see it
            assert await store.last_event_id(sid) == seen[-1]
        finally:
            os.kill(pair.replica.proc.pid, signal.SIGCONT)
        res = await asyncio.wait_for(pending, 15)
        assert res.ok
        visible = await store.read(sid, None)
        assert [e.id for e in visible] == [e.id for e in everything]
        assert [e.id for e in visible] == _replica_ids(pair, k.events)
        published: list[str] = []
        deadline = time.monotonic() + 5
        while len(published) < 2 and time.monotonic() < deadline:
            msg: dict[str, Any] | None = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.5)
            if msg is not None:
                published.append(msg["data"].split(b"\n", 1)[0].decode())
        assert published == [e.id for e in visible[1:]]  # "a", then "b" only once the replica had it
        await pubsub.aclose()
    finally:
        await r.aclose()


def _follow(base_url: str, sid: str, out: list[tuple[float, SSE | bytes]]) -> None:
    with httpx.Client(base_url=base_url, timeout=httpx.Timeout(60.0)) as c, \
            c.stream("GET", f"/v1/streams/{sid}/events") as resp:
        for parsed in sse_blocks(resp):
            out.append((time.monotonic(), parsed if isinstance(parsed, SSE) else parsed[1]))


@pytest.mark.timeout(120)
def test_a_generation_pauses_while_no_replica_answers(primary_replica: PrimaryReplica,
                                                      stack_factory: StackFactory) -> None:
    pair = primary_replica
    assert pair.replica.proc is not None
    stack = stack_factory(pair.primary.url)
    flags = ("--durability", "replicated", "--replica-wait-ms", "100")
    stack.generator(*flags)
    stack.consumer(*flags, "--heartbeat-s", "0.3")
    with stack.client() as c:
        r = create(c, max_tokens=3000)
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        got: list[tuple[float, SSE | bytes]] = []
        reader = threading.Thread(target=_follow, args=(stack.base_url, sid, got), daemon=True)
        reader.start()
        eventually(lambda: sum(isinstance(x, SSE) and x.event == "delta" for _, x in got) >= 20, 30, "20 deltas",
                   interval_s=0.02)
        os.kill(pair.replica.proc.pid, signal.SIGSTOP)
        try:
            time.sleep(0.5)  # an append whose WAIT was answered before the stop may still arrive
            before = sum(isinstance(x, SSE) for _, x in got)
            stopped_at = time.monotonic()
            time.sleep(2.0)  # deliberate: two seconds with no replica, in which no event may be delivered
            during = [x for t, x in got if t >= stopped_at]
            assert not any(isinstance(x, SSE) for x in during), "an event was delivered while no replica had it"
            assert sum(isinstance(x, bytes) for x in during) >= 3  # heartbeats kept the reader
            assert sum(isinstance(x, SSE) for _, x in got) == before
        finally:
            os.kill(pair.replica.proc.pid, signal.SIGCONT)
        reader.join(60)
        assert not reader.is_alive(), "the stream did not end after the replica came back"
    events = [x for _, x in got if isinstance(x, SSE)]
    assert events[-1].event == "done"
    ids = [e.id for e in events]
    assert len(ids) == len(set(ids))
    client = redis.Redis(port=pair.primary.port, decode_responses=True)
    try:
        stored: Any = client.xrange(StreamKeys.of(uuid.UUID(sid), 1).events)
    finally:
        client.close()
    assert ids == [eid for eid, _ in stored]  # every event once, in order: the reader's text is the stream's
    assert events[-1].data["usage"]["completion_tokens"] == 3000


@pytest.mark.timeout(120)
def test_paused_generations_give_their_slot_back_up_to_max_parked(primary_replica: PrimaryReplica,
                                                                  stack_factory: StackFactory) -> None:
    """One worker, one slot, --max-parked 2: with the replica stopped, the running generation parks and the worker
    starts the next stream, which parks too; the third keeps the slot (the bound), the last two stay queued. With
    the replica back, every stream ends with its whole answer, once, on its first attempt (the lease kept)."""
    pair = primary_replica
    assert pair.replica.proc is not None
    stack = stack_factory(pair.primary.url)
    flags = ("--durability", "replicated", "--replica-wait-ms", "100")
    stack.generator(*flags, "--concurrency", "1", "--max-parked", "2", "--park-after-s", "0.5", "--lease-s", "2")
    stack.consumer(*flags, "--heartbeat-s", "0.3")
    max_tokens = 1500
    with stack.client() as c:
        sids = []
        for _ in range(5):
            r = create(c, max_tokens=max_tokens)
            assert r.status_code == 201, r.text
            sids.append(r.json()["id"])
        os.kill(pair.replica.proc.pid, signal.SIGSTOP)
        try:
            def statuses() -> list[str]:
                return [c.get(f"/v1/streams/{sid}").json()["status"] for sid in sids]

            eventually(lambda: statuses() == ["running"] * 3 + ["queued"] * 2, 20,
                       "two parked, one paused in the slot, two queued", interval_s=0.1)
            time.sleep(3.0)  # deliberate: longer than the lease, with no replica: nothing may move or be taken over
            assert statuses() == ["running"] * 3 + ["queued"] * 2
        finally:
            os.kill(pair.replica.proc.pid, signal.SIGCONT)
        reads: list[list[tuple[float, SSE | bytes]]] = [[] for _ in sids]
        readers = [threading.Thread(target=_follow, args=(stack.base_url, sid, got), daemon=True)
                   for sid, got in zip(sids, reads, strict=True)]
        for t in readers:
            t.start()
        for t in readers:
            t.join(60)
    client = redis.Redis(port=pair.primary.port, decode_responses=True)
    try:
        for sid, got in zip(sids, reads, strict=True):
            events = [x for _, x in got if isinstance(x, SSE)]
            assert events and events[-1].event == "done", sid
            assert events[-1].data["usage"]["completion_tokens"] == max_tokens
            k = StreamKeys.of(uuid.UUID(sid), 1)
            stored: Any = client.xrange(k.events)
            assert [e.id for e in events] == [eid for eid, _ in stored]  # every event once, in order
            assert [e.event for e in events].count("started") == 1
            assert client.hget(k.meta, "attempts") == "1"  # never taken over: its lease was kept while parked
    finally:
        client.close()


@pytest.mark.timeout(120)
def test_a_parked_generation_cancelled_meanwhile_ends_cancelled_once_the_replica_is_back(
        primary_replica: PrimaryReplica, stack_factory: StackFactory) -> None:
    pair = primary_replica
    assert pair.replica.proc is not None
    stack = stack_factory(pair.primary.url)
    flags = ("--durability", "replicated", "--replica-wait-ms", "100")
    gen = stack.generator(*flags, "--park-after-s", "0.5")
    stack.consumer(*flags, "--heartbeat-s", "0.3")
    with stack.client() as c:
        r = create(c, max_tokens=3000)
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        got: list[tuple[float, SSE | bytes]] = []
        reader = threading.Thread(target=_follow, args=(stack.base_url, sid, got), daemon=True)
        reader.start()
        eventually(lambda: any(isinstance(x, SSE) and x.event == "delta" for _, x in got), 30, "a delta")
        os.kill(pair.replica.proc.pid, signal.SIGSTOP)
        try:
            gen.wait_for_line('"msg":"parked', 20)
            # The cancel's own write waits for a replica too: 503 after the consumer's patience, or 202; either
            # way the flag is on the primary, and the worker hears of it.
            assert c.post(f"/v1/streams/{sid}/cancel").status_code in (202, 503)
        finally:
            os.kill(pair.replica.proc.pid, signal.SIGCONT)
        reader.join(60)
        assert not reader.is_alive(), "the stream did not end after the replica came back"
    events = [x for _, x in got if isinstance(x, SSE)]
    assert events[-1].event == "cancelled" and events[-1].data["reason"] == "client", events[-1]
    assert events[-1].data["usage"]["completion_tokens"] < 3000
    client = redis.Redis(port=pair.primary.port, decode_responses=True)
    try:
        stored: Any = client.xrange(StreamKeys.of(uuid.UUID(sid), 1).events)
    finally:
        client.close()
    assert [e.id for e in events] == [eid for eid, _ in stored]  # every event once, in order, nothing after the end
    assert "resuming after a parked write" not in gen.output()  # cancelled while parked: its engine never restarted
