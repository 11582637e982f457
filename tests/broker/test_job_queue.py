"""The job queue's scripts against a real redis-server (broker.streams.queue_scripts): each model's jobs go only to
its workers, tenants take turns, tiers keep their order and age, and a job is never lost or run twice (a lapsed
lease, a release, a job given back, one left for a chat's worker, a cancel while queued)."""

from __future__ import annotations

import asyncio
import time
import uuid

import orjson
import redis

from broker.redis.connection import connect_blocking
from broker.redis.server import RedisServer
from broker.request.generation import GenerationRequest
from broker.streams.job_store import JobStore
from broker.streams.records import Claim, Quota
from broker.streams.stream_store import StreamStore

REQ = GenerationRequest(None, "hello", None, 32, 0.8, 0.95, None, (), False)
LEASE_S = 30.0


async def _create(store: StreamStore, model: str = "alpha", tenant: str = "a", tier: str = "default",
                  request: GenerationRequest = REQ) -> uuid.UUID:
    sid = uuid.uuid4()
    await store.create(sid, request, model=model, tier=tier, max_queue=0, retention_s=60,
                       quota=Quota(tenant=tenant))
    return sid


async def _next(jobs: JobStore, model: str = "alpha", worker: str = "w1", **kw: float) -> Claim | None:
    got = await jobs.claim_next(model, 0, worker, lease_s=kw.get("lease_s", LEASE_S), aging_s=kw.get("aging_s", 0.0),
                                 affinity_wait_s=kw.get("affinity_wait_s", 0.0))
    return got if isinstance(got, Claim) else None


async def _next_by_token(jobs: JobStore, token: str, worker: str = "w1") -> Claim | None:
    got = await jobs.claim_next("alpha", 0, worker, lease_s=LEASE_S, token=token)
    return got if isinstance(got, Claim) else None


async def _drain(jobs: JobStore, model: str = "alpha", **kw: float) -> list[uuid.UUID]:
    out = []
    while (c := await _next(jobs, model, "w1", **kw)) is not None:
        out.append(c.stream_id)
    return out


async def _positions(store: StreamStore, sid: uuid.UUID) -> list[int]:
    return [orjson.loads(e.data)["position"] for e in await store.read(sid, None) if e.type == "queued"]


async def test_a_job_goes_only_to_a_worker_of_its_model(store: StreamStore, jobs: JobStore) -> None:
    a, b = await _create(store, "alpha"), await _create(store, "beta")
    assert await _next(jobs, "gamma") is None
    got = await _next(jobs, "beta")
    assert got is not None and got.stream_id == b and got.model == "beta"
    assert await _next(jobs, "beta") is None  # alpha's job is not beta's to take
    got = await _next(jobs, "alpha")
    assert got is not None and got.stream_id == a
    assert await store.backlog("alpha") == {"priority": 0, "default": 0, "flex": 0}
    assert await store.running("alpha") == 1 and await store.running("beta") == 1


async def test_tenants_take_turns_whatever_their_backlogs(store: StreamStore, jobs: JobStore) -> None:
    a_jobs = [await _create(store, tenant="a") for _ in range(6)]
    b_job = await _create(store, tenant="b")
    c_jobs = [await _create(store, tenant="c") for _ in range(2)]
    order = await _drain(jobs)
    # a, b, c in turn, then whoever still has work, each tenant's own jobs first come first served.
    assert order == [a_jobs[0], b_job, c_jobs[0], a_jobs[1], c_jobs[1], *a_jobs[2:]]
    # The queued events told each job its place in that order: b's job was second from its create on.
    assert (await _positions(store, b_job))[0] == 2
    assert (await _positions(store, c_jobs[1]))[0] == 5


async def test_queue_positions_count_down_in_service_order(store: StreamStore, jobs: JobStore) -> None:
    a_jobs = [await _create(store, tenant="a") for _ in range(4)]
    b_job = await _create(store, tenant="b")
    assert await _positions(store, a_jobs[3]) == [4]
    assert await _positions(store, b_job) == [2]  # created last, served second: a's backlog is a's
    await _next(jobs)  # a's first
    assert (await _positions(store, b_job))[-1] == 1
    assert (await _positions(store, a_jobs[3]))[-1] == 4


async def test_priority_before_default_before_flex(store: StreamStore, jobs: JobStore) -> None:
    flex = await _create(store, tier="flex")
    default = await _create(store, tier="default")
    priority = await _create(store, tier="priority")
    assert (await _positions(store, priority))[0] == 1
    assert await store.backlog("alpha") == {"priority": 1, "default": 1, "flex": 1}
    assert await _drain(jobs) == [priority, default, flex]


async def test_a_lower_tier_that_waited_past_the_aging_bound_is_served_next(store: StreamStore, jobs: JobStore,
                                                                          redis_client: redis.Redis) -> None:
    flex = await _create(store, tier="flex")
    defaults = [await _create(store, tier="default") for _ in range(3)]
    got = await _next(jobs, aging_s=3600)
    assert got is not None and got.stream_id == defaults[0]  # flex has not waited an hour
    # Flex last served (or started waiting) long ago: aged, it goes before the default work.
    stats = store.queue(0, "alpha").stats
    redis_client.hset(stats, "served:flex", 0)
    got = await _next(jobs, aging_s=1)
    assert got is not None and got.stream_id == flex and got.tier == "flex"
    assert await _drain(jobs, aging_s=3600) == defaults[1:]


async def test_a_lapsed_lease_is_taken_over_once_and_fences_the_first_owner(store: StreamStore, jobs: JobStore) -> None:
    sid = await _create(store)
    t0 = time.monotonic()
    first = await _next(jobs, worker="w1", lease_s=1.0)
    assert first is not None
    still = await _next(jobs, worker="w2")
    if time.monotonic() - t0 < 0.9:  # what a busy machine allows this test to check
        assert still is None  # leased: nothing to take
    await asyncio.sleep(max(0.0, t0 + 1.1 - time.monotonic()))  # deliberate: the lease lapses in real time
    claims = await asyncio.gather(*(_next(jobs, worker=f"w{i}") for i in range(2, 8)))
    taken = [c for c in claims if c is not None]
    assert len(taken) == 1 and taken[0].stream_id == sid and taken[0].attempts == 2
    assert not (await jobs.append(first, 0, 1, [("delta", b'{"text":"x"}')])).ok  # the zombie is fenced out
    assert (await jobs.renew(taken[0], 5.0, LEASE_S)).ok
    assert not (await jobs.renew(first, 5.0, LEASE_S)).ok


async def test_a_renewed_lease_is_not_taken_over(store: StreamStore, jobs: JobStore) -> None:
    await _create(store)
    renewed_at = time.monotonic()
    c = await _next(jobs, lease_s=1.0)
    assert c is not None
    for _ in range(4):
        await asyncio.sleep(0.3)  # deliberate: a worker renewing at its pace, within the 1 s lease
        assert (await jobs.renew(c, 5.0, 1.0)).ok
        gap, renewed_at = time.monotonic() - renewed_at, time.monotonic()
        other = await _next(jobs, worker="w2")
        if gap < 0.9:  # renewed within its lease (a stalled machine may not manage it)
            assert other is None


async def test_a_released_job_is_taken_over_at_once(store: StreamStore, jobs: JobStore) -> None:
    sid = await _create(store)
    c = await _next(jobs)
    assert c is not None
    assert await jobs.release(c)
    got = await _next(jobs, worker="w2")
    assert got is not None and got.stream_id == sid and got.attempts == 2
    assert not await jobs.release(c)  # fenced out: nothing to release


async def test_a_job_given_back_unstarted_is_next_again_and_counts_no_attempt(store: StreamStore, jobs: JobStore) -> None:
    first, second = await _create(store, tenant="a"), await _create(store, tenant="b")
    c = await _next(jobs)
    assert c is not None and c.stream_id == first
    await jobs.give_back(c)
    assert await store.backlog("alpha") == {"priority": 0, "default": 2, "flex": 0}
    assert await store.running("alpha") == 0
    again = await _next(jobs)
    assert again is not None and again.stream_id == first and again.attempts == 1
    assert await _drain(jobs) == [second]


async def test_a_job_given_back_after_it_started_is_handed_over_to_be_continued(store: StreamStore, jobs: JobStore) -> None:
    sid = await _create(store)
    c = await _next(jobs)
    assert c is not None
    assert (await jobs.append(c, 0, 1, [("delta", b'{"text":"a"}')])).ok
    await jobs.give_back(c)
    got = await _next(jobs, worker="w2")
    assert got is not None and got.stream_id == sid and got.seq == 1 and got.attempts == 2


async def test_cancel_while_queued_takes_the_job_out_of_line(store: StreamStore, jobs: JobStore) -> None:
    a1, a2 = await _create(store, tenant="a"), await _create(store, tenant="a")
    b = await _create(store, tenant="b")
    assert await store.cancel(a1, "client") == "cancelled"
    assert await store.waiting() == 2
    assert await _drain(jobs) == [a2, b]
    assert await store.redis.xlen(store.keys(a1).queue("alpha").backlog) == 2  # the two running: a1's entry gone


async def test_a_claim_racing_a_cancel_of_a_queued_job(store: StreamStore, jobs: JobStore) -> None:
    for _ in range(20):
        sid = await _create(store)
        claim, status = await asyncio.gather(_next(jobs), store.cancel(sid, "client"))
        if claim is None:
            assert status == "cancelled"
        else:
            assert status == "running"
            await jobs.finish(claim, "cancelled", {"reason": "client", "usage": {}}, status="cancelled", usage={},
                               reason="client")
    assert await store.waiting() == 0 and await store.running("alpha") == 0


async def test_a_finished_job_leaves_the_backlog_and_its_lease(store: StreamStore, jobs: JobStore) -> None:
    sid = await _create(store)
    q = store.keys(sid).queue("alpha")
    assert await store.redis.xlen(q.backlog) == 1
    c = await _next(jobs)
    assert c is not None
    assert await store.redis.xlen(q.backlog) == 1  # running: still a job KEDA counts
    await jobs.finish(c, "done", {"usage": {}}, status="done", usage={})
    assert await store.redis.xlen(q.backlog) == 0 and await store.redis.zcard(q.leases) == 0
    assert await store.running("alpha") == 0


async def test_a_chat_turn_waits_for_its_workers_then_any_worker_takes_it(store: StreamStore, jobs: JobStore) -> None:
    chat = GenerationRequest(None, "hello", None, 32, 0.8, 0.95, None, (), False, prompt_cache_key="chat-1")
    sid = await _create(store, request=chat)
    await jobs.affinity.note(chat.affinity("a"), "owner", 60)
    # Another tenant's chat of the same key is not routed by tenant a's: any worker takes it at once.
    theirs = await _create(store, tenant="b", request=chat)
    got_b = await _next(jobs, worker="other", affinity_wait_s=30)
    assert got_b is not None and got_b.stream_id == theirs and got_b.tenant == "b"
    assert chat.affinity("a") != chat.affinity("b")
    # Another worker meets tenant a's first: left for the owner (woken), not taken.
    assert await _next(jobs, worker="other", affinity_wait_s=30) is None
    assert await store.redis.llen(store.queue(0, "alpha").wake_for("owner")) == 1
    got = await _next(jobs, worker="owner", affinity_wait_s=30)
    assert got is not None and got.stream_id == sid
    # Past the wait (the owner never came), any worker takes the next one.
    sid2 = await _create(store, request=chat)
    created = time.monotonic()
    left = await _next(jobs, worker="other", affinity_wait_s=2.0)
    if time.monotonic() - created < 1.9:
        assert left is None
        due = await jobs.claim_next("alpha", 0, "other", lease_s=LEASE_S, affinity_wait_s=2.0)
        assert isinstance(due, float) and 0 < due <= 2.0
        await asyncio.sleep(due + 0.05)  # deliberate: the wait it named lapses in real time, and no more
        got = await _next(jobs, worker="other", affinity_wait_s=2.0)
    else:
        got = left
    assert got is not None and got.stream_id == sid2
    assert await _next(jobs, worker="owner", affinity_wait_s=2.0) is None  # its stale inbox entry is skipped


async def test_an_idle_worker_is_woken_by_a_create(store: StreamStore, jobs: JobStore, redis_server: RedisServer) -> None:
    blocking = connect_blocking(redis_server.url)
    keys = jobs.wake_keys("alpha", "w1")[0]
    try:
        waiter = asyncio.create_task(jobs.wait_for_jobs(blocking, keys, 5.0))
        await asyncio.sleep(0.1)  # deliberate: a moment in which no job may wake it
        assert not waiter.done()
        await _create(store)
        assert await asyncio.wait_for(waiter, 2.0) == keys[0]
        assert await jobs.wait_for_jobs(blocking, jobs.wake_keys("beta", "w1")[0], 0.1) is None
    finally:
        await blocking.aclose()


async def test_a_claim_asked_again_with_its_token_gets_the_same_job_never_a_second_one(store: StreamStore, jobs: JobStore) -> None:
    # The reply of a claim can be lost after its script ran (a link cut under it): redis-py's retry, or the worker's
    # next try, sends the same token. Claiming a second job instead left the first held by no one until its lease
    # lapsed (an attempt lost; the shard-down test met it under load).
    first, second = await _create(store), await _create(store)
    got = await _next_by_token(jobs, "t1")
    assert got is not None and got.stream_id == first and got.attempts == 1
    again = await _next_by_token(jobs, "t1")
    assert again is not None and (again.stream_id, again.fence, again.attempts) == (first, got.fence, 1)
    assert await store.backlog("alpha") == {"priority": 0, "default": 1, "flex": 0}
    other = await _next_by_token(jobs, "t2")
    assert other is not None and other.stream_id == second
    # Another worker's token, or one the worker no longer holds the job of, claims as usual: nothing left here.
    assert await _next_by_token(jobs, "t2", worker="w2") is None
    await jobs.give_back(other)
    back = await _next_by_token(jobs, "t2")  # given back: t2's receipt names a job no longer this worker's
    assert back is not None and back.stream_id == second and back.fence == other.fence + 1
