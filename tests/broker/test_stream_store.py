"""StreamStore (the consumer's side of a stream) against a real redis-server: creates and the limits they meet,
readers' marks, cancels, and the races each of their scripts closes."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
import redis
from helpers import create_outcome, eventually_async

from broker.errors import Conflict, RateLimited, TooManyGenerations
from broker.redis.connection import connect
from broker.redis.server import RedisServer
from broker.request.generation import GenerationRequest
from broker.streams.job_store import JobStore
from broker.streams.records import Claim, Quota, Unclaimable
from broker.streams.stream_store import StreamStore

REQ = GenerationRequest(None, "hello", None, 32, 0.8, 0.95, None, (), False)


async def test_concurrent_creates_enqueue_exactly_one_job(store: StreamStore) -> None:
    sid = uuid.uuid4()
    results = await asyncio.gather(*(store.create(sid, REQ, model="m", max_queue=0, retention_s=60)
                                     for _ in range(50)))
    assert sorted(create_outcome(r) for r in results) == ["created"] + ["exists"] * 49
    assert await store.redis.xlen(store.keys(sid).queue("m").backlog) == 1
    other = GenerationRequest(None, "other", None, 32, 0.8, 0.95, None, (), False)
    with pytest.raises(Conflict):
        await store.create(sid, other, model="m", max_queue=0, retention_s=60)


async def test_queue_bound_is_enforced_atomically(store: StreamStore) -> None:
    results = await asyncio.gather(*(store.create(uuid.uuid4(), REQ, model="m", max_queue=5, retention_s=60)
                                     for _ in range(20)), return_exceptions=True)
    assert sum(create_outcome(r) == "created" for r in results) == 5
    assert sum(create_outcome(r) == "queue_full" for r in results) == 15
    assert await store.waiting() == 5


async def test_a_callers_create_rate_allows_its_burst_at_once_then_refills(store: StreamStore) -> None:
    quota = Quota("a:test", burst=10, rate_per_s=2.0)  # 500 ms per create once the burst is used
    results = await asyncio.gather(*(store.create(uuid.uuid4(), REQ, model="m", max_queue=0, retention_s=60,
                                                  quota=quota) for _ in range(30)), return_exceptions=True)
    assert sorted(create_outcome(r) for r in results).count("created") == 10
    refused = [r for r in results if isinstance(r, RateLimited)]
    assert len(refused) == 20 and all(r.retry_after_s == 1 for r in refused)
    await asyncio.sleep(1.2)  # deliberate: two intervals and a bit of time passing refill two more
    more = await asyncio.gather(*(store.create(uuid.uuid4(), REQ, model="m", max_queue=0, retention_s=60,
                                               quota=quota) for _ in range(5)), return_exceptions=True)
    assert [create_outcome(r) for r in more].count("created") == 2
    # A retry of an accepted create is answered whatever the rate: it costs nothing.
    sid = uuid.uuid4()
    other = Quota("a:other", burst=1, rate_per_s=0.001)
    assert (await store.create(sid, REQ, model="m", max_queue=0, retention_s=60, quota=other)).created
    again = await store.create(sid, REQ, model="m", max_queue=0, retention_s=60, quota=other)
    assert not again.created


async def test_a_callers_counters_leave_redis_once_it_has_nothing_unfinished(store: StreamStore) -> None:
    quota = Quota("a:gone", max_active=2, burst=5, rate_per_s=1000.0)
    sids = [uuid.uuid4() for _ in range(3)]
    results = [await store.create(s, REQ, model="m", max_queue=0, retention_s=60, quota=quota)
               for s in sids[:2]]
    assert all(r.created for r in results)
    with pytest.raises(TooManyGenerations):
        await store.create(sids[2], REQ, model="m", max_queue=0, retention_s=60, quota=quota)
    tenant = store.keys(sids[0]).tenant_counters("a:gone")
    assert await store.redis.ttl(tenant) == -1  # unfinished generations: kept
    for sid in sids[:2]:
        await store.cancel(sid, "client")

    async def forgotten() -> bool:
        return not await store.redis.exists(tenant)

    await eventually_async(forgotten, 5, "the counters leaving")  # the rate limiter forgets within ms at 1,000/s


@pytest.mark.parametrize("partitions", [1, 4])
async def test_a_callers_limits_are_divided_over_partitions(redis_server: RedisServer, redis_client: redis.Redis,
                                                            partitions: int) -> None:
    r = connect(redis_server.url)
    store = StreamStore(r, partitions)
    quota = Quota("a:p", max_active=8)
    results = await asyncio.gather(*(store.create(uuid.uuid4(), REQ, model="m", max_queue=0, retention_s=60,
                                                  quota=quota) for _ in range(64)), return_exceptions=True)
    created = [create_outcome(x) for x in results].count("created")
    # Each partition holds ceil(8 / P) of them: exactly 8 with one partition; with 4, 2 per partition.
    assert created == 8
    assert {create_outcome(x) for x in results} == {"created", "too_many_generations"}
    await r.aclose()


async def test_touch_marks_every_read_stream_in_one_call_per_partition_and_resurrects_none(
        redis_server: RedisServer, redis_client: redis.Redis) -> None:
    """TOUCH: what abandonment and cancel_on_disconnect count from. A stream gone (expired) stays gone."""
    r = connect(redis_server.url)
    store = StreamStore(r, 4)
    read = [uuid.uuid4() for _ in range(8)]
    for sid in read:
        await store.create(sid, REQ, model="m", max_queue=0, retention_s=60)
    assert len({store.keys(sid).partition for sid in read}) > 1
    gone = uuid.uuid4()  # never created, or expired: same keys, no meta
    await store.touch([*read, gone])
    for sid in read:
        seen, was_read = redis_client.hmget(store.keys(sid).meta, ["seen", "read"])
        assert was_read == b"1" and seen is not None and abs(float(seen) - time.time()) < 60
    assert not redis_client.exists(store.keys(gone).meta)
    await r.aclose()


async def test_cancel_racing_claim_has_exactly_one_winner(store: StreamStore, jobs: JobStore) -> None:
    for _ in range(20):
        sid = uuid.uuid4()
        await store.create(sid, REQ, model="m", max_queue=0, retention_s=60)
        claim, status = await asyncio.gather(jobs.claim(sid, "w"), store.cancel(sid, "client"))
        events = [e.type for e in await store.read(sid, None)]
        if isinstance(claim, Claim):  # the worker won: the cancel is pending for it to honour
            assert status == "running" and events == ["queued"] and claim.cancel_reason in ("", "client")
        else:  # the cancel won: the stream ended and the worker has nothing to do
            assert claim is Unclaimable.FINISHED and status == "cancelled" and events == ["queued", "cancelled"]
