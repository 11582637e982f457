"""Appends of many generations share pipelines, and each keeps its own atomic checks."""

from __future__ import annotations

import asyncio
import uuid

import redis

from broker.events import EventType, encode_data
from broker.redis.connection import connect
from broker.redis.server import RedisServer
from broker.request.generation import GenerationRequest
from broker.streams.job_store import JobStore
from broker.streams.records import Claim
from broker.streams.stream_store import StreamStore
from generator.appends import AppendBatcher

REQ = GenerationRequest(None, "hello", None, 32, 0.8, 0.95, None, (), False)


async def test_batched_appends_land_in_order_and_zombies_are_still_refused(redis_server: RedisServer, redis_client: redis.Redis) -> None:
    redis = connect(redis_server.url)
    store = StreamStore(redis)
    jobs = JobStore(redis)
    batcher = AppendBatcher(jobs, max_batch=16)
    claims: list[Claim] = []
    for _ in range(40):
        sid = uuid.uuid4()
        await store.create(sid, REQ, model="m", max_queue=0, retention_s=60)
        claim = await jobs.claim(sid, "w")
        assert isinstance(claim, Claim)
        claims.append(claim)
    zombie = claims[0]
    owner = await jobs.claim(zombie.stream_id, "w2")  # takes stream 0 over: `zombie` is fenced out
    assert isinstance(owner, Claim)

    async def writer(claim: Claim) -> list[bool]:
        oks = []
        for n in range(5):
            res = await batcher.append(claim, n, n + 1, [(EventType.DELTA, encode_data({"text": f"{n}"}))])
            oks.append(res.ok)
        return oks

    results = await asyncio.gather(*(writer(c) for c in claims))
    assert results[0] == [False] * 5  # the zombie's appends are refused, batched or not
    assert all(r == [True] * 5 for r in results[1:])
    for claim in claims[1:]:
        texts = [e.json()["text"] for e in await store.read(claim.stream_id, None) if e.type == "delta"]
        assert texts == ["0", "1", "2", "3", "4"]
    assert [e.type for e in await store.read(zombie.stream_id, None)] == ["queued"]
    await redis.aclose()
