"""JobStore (the generator's side of a stream) against a real redis-server: appends (one stream's, many streams'
in one call), finishes, fences, and the races each of their scripts closes. How a claim picks its job:
tests/broker/test_job_queue.py."""

from __future__ import annotations

import dataclasses
import uuid
from typing import cast

import pytest
import redis

from broker.events import EventType, encode_data
from broker.redis.connection import connect
from broker.redis.server import RedisServer
from broker.request.generation import GenerationRequest
from broker.streams.job_store import JobStore
from broker.streams.keys import tenant_of, usage_log_key
from broker.streams.records import Claim, Quota
from broker.streams.stream_store import StreamStore

REQ = GenerationRequest(None, "hello", None, 32, 0.8, 0.95, None, (), False)


def _delta(text: str) -> tuple[str, bytes]:
    return EventType.DELTA, encode_data({"text": text})


async def _claimed(jobs: JobStore, sid: uuid.UUID, worker: str = "w1") -> Claim:
    claim = await jobs.claim(sid, worker)
    assert isinstance(claim, Claim)
    return claim


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
                       quota=Quota(tenant=tenant_of("", "10.0.0.7")))
    assert (await _claimed(jobs, keyed)).tenant == "alice"
    assert (await _claimed(jobs, anonymous)).tenant == tenant_of("", "10.0.0.7")
