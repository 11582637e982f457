"""The webhook outbox against a real redis-server (broker.streams.outbox): taking is fair across destinations (at most
``per_dest`` of each, this pod's own in-flight deliveries counted), a destination failing in a row is held and then
probed with one event, a delivery clears its hold, pending events count in their creator's storage quota (and past
``max_pending_hooks`` a create with a webhook is refused), and events written before destinations were kept apart
are moved into theirs."""

from __future__ import annotations

import time
import uuid
from typing import cast

import orjson
import pytest

from broker.errors import WebhookBacklog
from broker.redis.connection import reply_text
from broker.redis.quota import storage_key
from broker.request.generation import GenerationRequest
from broker.streams.keys import outbox_dests_key, outbox_due_key, outbox_holds_key, outbox_key
from broker.streams.outbox import BREAKER_FAILURES, HOOK_BYTES, HookEvent, Outbox, hold_s
from broker.streams.stream_store import StreamStore

REQ = GenerationRequest(None, "hello", None, 8, 0.8, 0.95, None, (), False)
A, B = "http://a.example:8080/hooks", "https://b.example/hooks"


async def _ended(store: StreamStore, url: str, key_id: str = "alice", *, max_pending: int = 0) -> str:
    """A stream created with a webhook to ``url`` and cancelled while queued: one event in the outbox."""
    sid = uuid.uuid4()
    await store.create(sid, REQ, model="m", max_queue=0, retention_s=60, key_id=key_id, webhook=(url, str(sid)),
                       max_pending_hooks=max_pending)
    assert await store.cancel(sid, "client") == "cancelled"
    return "evt_" + sid.hex


def _now() -> int:
    return int(time.time() * 1000)


async def _later(store: StreamStore, ms: int) -> None:
    """As if ``ms`` passed on the Redis server (whose clock the outbox's scripts read): every due time and hold of
    partition 0's outbox moved ``ms`` earlier."""
    r, outbox = store.redis, outbox_key(0, 1)
    for key in [outbox_dests_key(0, 1)] + [k async for k in r.scan_iter(match=outbox + ":d:*")]:
        for member in cast("list[bytes]", await r.zrange(key, 0, -1)):
            await r.zincrby(key, -ms, member)
    for dest, hold in (await r.hgetall(outbox_holds_key(0, 1))).items():
        until, failures = reply_text(hold).split()
        await r.hset(outbox_holds_key(0, 1), dest, f"{int(until) - ms} {failures}")


async def test_taking_is_fair_across_destinations(store: StreamStore) -> None:
    outbox = Outbox(store.redis, 1)
    for _ in range(50):
        await _ended(store, A)
    b = await _ended(store, B)
    taken = await outbox.take(0, 10, 4, {})
    assert sorted(e.url for e in taken) == [A] * 4 + [B]
    a_dest = taken[0].dest if taken[0].url == A else taken[1].dest
    # This pod already has 4 in flight to A: none more of A; B's was taken and is leased.
    assert await outbox.take(0, 10, 4, {a_dest: 4}) == []
    await _later(store, 31_000)
    assert [e.id for e in await outbox.take(0, 10, 4, {a_dest: 4})] == [b]


async def test_a_failing_destination_is_held_then_probed_and_a_delivery_clears_it(store: StreamStore) -> None:
    outbox = Outbox(store.redis, 1)
    for _ in range(6):
        await _ended(store, A)
    failed = await outbox.take(0, 10, 4, {})
    assert len(failed) == 4
    for e in failed[:BREAKER_FAILURES]:
        assert await outbox.retry(e)
    # Held: nothing of A is taken until the hold is over, though two of its events are due.
    held_ms = int(hold_s(BREAKER_FAILURES) * 1000)
    await _later(store, held_ms - 1000)  # a second before the hold's end (its slack: this test's own time)
    assert await outbox.take(0, 10, 4, {}) == []
    await _later(store, 2 * 60_000)
    probe = await outbox.take(0, 10, 4, {})
    assert len(probe) == 1  # then one event: a probe
    await outbox.done(probe[0], delivered=True)
    assert len(await outbox.take(0, 10, 4, {})) == 4  # the hold cleared: as many as may go
    assert await store.redis.hlen(outbox_key(0, 1)) == 5


async def test_pending_events_count_in_their_creators_quota_and_are_bounded(store: StreamStore) -> None:
    outbox = Outbox(store.redis, 1)
    for _ in range(3):
        await _ended(store, A, max_pending=3)
    quota = storage_key(0, 1, "alice")
    assert await store.redis.hmget(quota, "hooks", "bytes") == [b"3", str(3 * HOOK_BYTES).encode()]
    with pytest.raises(WebhookBacklog) as e:
        await _ended(store, A, max_pending=3)
    assert e.value.retry_after_s > 0 and "--webhook-max-pending" in e.value.message
    await store.create(uuid.uuid4(), REQ, model="m", max_queue=0, retention_s=60, key_id="alice",
                       max_pending_hooks=3)  # no webhook: not held up
    await store.create(uuid.uuid4(), REQ, model="m", max_queue=0, retention_s=60, key_id="bob",
                       webhook=(A, "x"), max_pending_hooks=3)  # another caller
    for event in await outbox.take(0, 10, 8, {}):
        await outbox.done(event, delivered=True)
    assert await store.redis.hget(quota, "hooks") in (None, b"0")
    await _ended(store, A, max_pending=3)


async def test_events_from_before_destinations_are_moved_into_theirs(store: StreamStore) -> None:
    outbox = Outbox(store.redis, 1)
    record = {"sid": str(uuid.uuid4()), "hid": "x", "url": B, "type": "response.completed", "created_at": 1,
              "first_ms": _now(), "attempts": 0}
    await store.redis.hset(outbox_key(0, 1), "evt_old", orjson.dumps(record))
    await store.redis.zadd(outbox_due_key(0, 1), {"evt_old": _now()})
    [event] = await outbox.take(0, 10, 4, {})
    assert event.id == "evt_old" and event.url == B and event.dest
    assert await store.redis.zcard(outbox_due_key(0, 1)) == 0
    await outbox.done(event, delivered=True)
    assert await outbox.pending() == 0


async def test_an_event_a_day_old_by_the_servers_clock_is_given_up(store: StreamStore) -> None:
    outbox = Outbox(store.redis, 1)
    await _ended(store, A)
    [event] = await outbox.take(0, 10, 4, {})
    assert await outbox.retry(event)  # a failed try: due again
    day_old = HookEvent(0, event.id, {**event.record, "first_ms": int(event.record["first_ms"]) - 86_400_000})
    assert not await outbox.retry(day_old)  # its age is the server's: past a day, it leaves the outbox
    assert await outbox.pending() == 0
