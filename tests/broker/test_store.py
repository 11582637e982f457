"""The atomic operations against a real redis-server: the races each Lua script closes."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from typing import cast

import pytest
import redis
from helpers import create_outcome, eventually_async

from broker.errors import Conflict, RateLimited, TooManyGenerations
from broker.events import EventType, encode_data
from broker.redis.connection import connect
from broker.redis.server import RedisServer
from broker.request import GenerationRequest
from broker.streams.job_store import JobStore
from broker.streams.keys import principal, usage_log_key
from broker.streams.records import Claim, Quota, Unclaimable
from broker.streams.stream_store import StreamStore

REQ = GenerationRequest(None, "hello", None, 32, 0.8, 0.95, None, (), False)


@pytest.fixture
async def store(redis_server: RedisServer, redis_client: redis.Redis) -> AsyncIterator[StreamStore]:
    r = connect(redis_server.url)
    yield StreamStore(r)
    await r.aclose()


@pytest.fixture
def jobs(store: StreamStore) -> JobStore:
    """The generator's side, on the store's Redis."""
    return JobStore(store.redis, store.partitions)


def _delta(text: str) -> tuple[str, bytes]:
    return EventType.DELTA, encode_data({"text": text})


async def _claimed(jobs: JobStore, sid: uuid.UUID, worker: str = "w1") -> Claim:
    claim = await jobs.claim(sid, worker)
    assert isinstance(claim, Claim)
    return claim


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
    tenant = store.keys(sids[0]).tenant("a:gone")
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


async def test_a_zombie_cannot_append_or_finish_after_a_new_claim(store: StreamStore, jobs: JobStore) -> None:
    sid = uuid.uuid4()
    await store.create(sid, REQ, model="m", max_queue=0, retention_s=60)
    zombie = await _claimed(jobs, sid, "w1")
    assert (await jobs.append(zombie, 0, 1, [_delta("a")])).ok
    owner = await _claimed(jobs, sid, "w2")  # takeover: w1 lost its lease
    assert owner.fence == zombie.fence + 1 and owner.seq == 1
    refused = await jobs.append(zombie, 1, 2, [_delta("zombie")])
    assert not refused.ok and refused.seq is None
    assert await jobs.finish(zombie, EventType.DONE, {"finish_reason": "stop", "usage": {}}, status="done",
                              usage={}) is None
    assert (await jobs.append(owner, 1, 2, [_delta("b")])).ok
    texts = [e.json()["text"] for e in await store.read(sid, None) if e.type == "delta"]
    assert texts == ["a", "b"]


async def test_a_retried_append_whose_reply_was_lost_is_not_duplicated(store: StreamStore, jobs: JobStore) -> None:
    sid = uuid.uuid4()
    await store.create(sid, REQ, model="m", max_queue=0, retention_s=60)
    claim = await _claimed(jobs, sid)
    assert (await jobs.append(claim, 0, 3, [_delta("abc")])).ok
    retry = await jobs.append(claim, 0, 3, [_delta("abc")])
    assert not retry.ok and retry.seq == 3  # the caller learns its first try landed
    assert [e.type for e in await store.read(sid, None)] == ["queued", "delta"]


@pytest.mark.slow
async def test_many_streams_appends_in_one_call_per_partition_keep_each_streams_checks(
        redis_server: RedisServer, redis_client: redis.Redis) -> None:
    r = connect(redis_server.url)
    store = StreamStore(r, 4)
    jobs = JobStore(r, 4)
    claims = []
    for _ in range(12):
        sid = uuid.uuid4()
        await store.create(sid, REQ, model="m", max_queue=0, retention_s=60)
        claims.append(await _claimed(jobs, sid))
    assert len({c.keys.partition for c in claims}) > 1
    zombie, landed = claims[0], claims[1]
    owner = await _claimed(jobs, zombie.stream_id, "w2")  # zombie is fenced out
    assert (await jobs.append(landed, 0, 2, [_delta("ab")])).ok  # its retry below finds it landed
    pubsub = redis_client.pubsub()
    pubsub.subscribe(claims[2].keys.channel)
    assert pubsub.get_message(timeout=5)["type"] == "subscribe"
    calls = [(zombie, 0, 1, [_delta("z")]), (landed, 0, 2, [_delta("ab")])]
    calls += [(c, 0, 2, [_delta(f"{i}a"), _delta(f"{i}b")]) for i, c in enumerate(claims[2:], 2)]
    calls.append((owner, 0, 1, [_delta("o")]))
    results = await jobs.append_many(calls)
    assert not isinstance(results[0], BaseException) and not results[0].ok and results[0].seq is None
    assert not isinstance(results[1], BaseException) and not results[1].ok and results[1].seq == 2
    for res in results[2:]:
        assert not isinstance(res, BaseException) and res.ok
    for i, c in enumerate(claims[2:], 2):
        texts = [e.json()["text"] for e in await store.read(c.stream_id, None) if e.type == "delta"]
        assert texts == [f"{i}a", f"{i}b"]
        assert int(redis_client.hget(c.keys.meta, "seq")) == 2  # type: ignore[arg-type]
    assert [e.json()["text"] for e in await store.read(owner.stream_id, None) if e.type == "delta"] == ["o"]
    assert [e.json()["text"] for e in await store.read(landed.stream_id, None) if e.type == "delta"] == ["ab"]
    published = [pubsub.get_message(timeout=5) for _ in range(2)]
    assert [m["data"].split(b"\n", 2)[2] for m in published if m] == [
        encode_data({"text": "2a"}), encode_data({"text": "2b"})]
    pubsub.close()
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


async def test_finish_sets_status_usage_expiry_and_records_aborts(store: StreamStore, jobs: JobStore) -> None:
    sid = uuid.uuid4()
    await store.create(sid, REQ, model="m", max_queue=0, retention_s=60)
    claim = await _claimed(jobs, sid)
    usage = {"prompt_tokens": 3, "completion_tokens": 5, "ttft_ms": 1.0, "tpot_ms": 0.5}
    eid = await jobs.finish(claim, EventType.CANCELLED, {"reason": "client", "usage": usage}, status="cancelled",
                             usage=usage, model="demo", reason="client", compute_s=0.25)
    assert eid is not None
    st = await store.status(sid)
    assert st is not None and st.status == "cancelled" and st.usage == usage and st.last_id == eid
    assert st.model == "demo"
    assert 0 < await store.redis.ttl(store.keys(sid).events) <= 60
    # redis-py types each entry's fields as optional (XCLAIM of a deleted entry); XRANGE always has them.
    records = cast("list[tuple[bytes, dict[bytes, bytes]]]",
                   await store.redis.xrange(usage_log_key(0, 1, "")))
    assert len(records) == 1 and records[0][1][b"reason"] == b"client" and records[0][1][b"status"] == b"cancelled"
    assert records[0][1][b"completion_tokens"] == b"5" and records[0][1][b"max_tokens"] == b"32"
    # A second finish adds nothing: a retry of this claim's (its reply lost) gets the same id, a zombie's None.
    assert await jobs.finish(claim, EventType.DONE, {}, status="done", usage={}) == eid
    zombie = dataclasses.replace(claim, fence=claim.fence - 1)
    assert await jobs.finish(zombie, EventType.DONE, {}, status="done", usage={}) is None
    assert len(await store.read(sid, None)) == 2


@pytest.mark.slow
async def test_a_script_flush_is_not_an_error_every_script_is_loaded_again(store: StreamStore, jobs: JobStore, redis_client: redis.Redis) -> None:
    """NOSCRIPT after SCRIPT FLUSH (or a restarted Redis) is answered by loading the script again, on single calls
    and on the batched appends' pipeline alike: the stream goes on, whole and once."""
    sid = uuid.uuid4()
    await store.create(sid, REQ, model="m", max_queue=0, retention_s=60)
    redis_client.script_flush()
    claim = await _claimed(jobs, sid)
    redis_client.script_flush()
    assert (await jobs.append(claim, 0, 1, [_delta("a")])).ok
    redis_client.script_flush()
    [res] = await jobs.append_many([(claim, 1, 2, [_delta("b")])])
    assert not isinstance(res, BaseException) and res.ok
    redis_client.script_flush()
    assert (await jobs.renew(claim, 5.0, 30.0)).ok
    redis_client.script_flush()
    assert await jobs.finish(claim, EventType.DONE, {"finish_reason": "stop"}, status="done", usage={}) is not None
    events = await store.read(sid, None)
    assert [e.type for e in events] == ["queued", "delta", "delta", "done"]
    assert [e.json()["text"] for e in events if e.type == "delta"] == ["a", "b"]


async def test_a_claim_names_the_tenant_its_stream_is_charged_to(store: StreamStore, jobs: JobStore) -> None:
    keyed, anonymous = uuid.uuid4(), uuid.uuid4()
    await store.create(keyed, REQ, model="m", max_queue=0, retention_s=60, key_id="alice")
    await store.create(anonymous, REQ, model="m", max_queue=0, retention_s=60,
                       quota=Quota(principal=principal("", "10.0.0.7")))
    assert (await _claimed(jobs, keyed)).tenant == "alice"
    assert (await _claimed(jobs, anonymous)).tenant == principal("", "10.0.0.7")
