"""Token budgets against a real redis-server: concurrent creates at the edge of a budget reserve no more than it
holds, a refusal queues nothing and says when the period ends, and the end of each generation settles its
reservation to what it used (a cancel while queued, to nothing)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import pytest
import redis

from broker.errors import BudgetExceeded
from broker.events import EventType
from broker.redis.connection import connect
from broker.redis.server import RedisServer
from broker.request import GenerationRequest
from broker.streams.budget import Budget, reservation
from broker.streams.keys import budget_key
from broker.streams.records import Claim, Created
from broker.streams.store import Store

REQ = GenerationRequest(None, "hello", None, 100, 0.8, 0.95, None, (), False)
WORST = reservation(REQ.canonical_json(), REQ.max_tokens)


@pytest.fixture
async def store(redis_server: RedisServer, redis_client: redis.Redis) -> AsyncIterator[Store]:
    redis_client.flushall()
    r = connect(redis_server.url)
    yield Store(r)
    await r.aclose()


def _counts(r: redis.Redis, budget: Budget, partitions: int = 1, partition: int = 0) -> tuple[int, int]:
    raw = r.hmget(budget_key(partition, partitions, "alice", budget.window(time.time())[0]), "reserved", "used")
    return int(raw[0] or 0), int(raw[1] or 0)


async def test_twenty_concurrent_creates_at_the_edge_reserve_no_more_than_the_budget(
        store: Store, redis_client: redis.Redis) -> None:
    budget = Budget(5 * WORST + WORST // 2, "day")
    results = await asyncio.gather(*(store.create(uuid.uuid4(), REQ, model="m", max_queue=0, retention_s=60,
                                                  key_id="alice", budget=budget) for _ in range(20)),
                                   return_exceptions=True)
    created = [r for r in results if isinstance(r, Created)]
    refused = [r for r in results if isinstance(r, BudgetExceeded)]
    assert len(created) == 5 and len(refused) == 15, results
    assert _counts(redis_client, budget) == (5 * WORST, 0)
    assert await store.waiting() == 5  # nothing of the refused ones was queued
    end = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0).timestamp() + 86_400
    for err in refused:
        assert err.code == "budget_exceeded" and abs(err.retry_after_s - (end - time.time())) < 5
        assert str(budget.tokens) in err.message and str(WORST) in err.message


async def test_each_end_settles_its_reservation_to_what_it_used(store: Store, redis_client: redis.Redis) -> None:
    budget = Budget(2 * WORST, "month")
    a, b = uuid.uuid4(), uuid.uuid4()
    for sid in (a, b):
        await store.create(sid, REQ, model="m", max_queue=0, retention_s=60, key_id="alice", budget=budget)
    with pytest.raises(BudgetExceeded):
        await store.create(uuid.uuid4(), REQ, model="m", max_queue=0, retention_s=60, key_id="alice",
                           budget=budget)
    claim = await store.claim(a, "w")
    assert isinstance(claim, Claim)
    u = {"prompt_tokens": 7, "completion_tokens": 30}
    for _ in range(2):  # a retried finish settles once
        assert await store.finish(claim, EventType.DONE, {}, status="done", usage=u, reason="stop") is not None
    assert _counts(redis_client, budget) == (WORST, 37)
    assert await store.cancel(b, "client") == "cancelled"  # never ran: its reservation comes back whole
    assert _counts(redis_client, budget) == (0, 37)
    # What is left (2 * WORST - 37) holds one more worst case, not two.
    results = await asyncio.gather(*(store.create(uuid.uuid4(), REQ, model="m", max_queue=0, retention_s=60,
                                                  key_id="alice", budget=budget) for _ in range(4)),
                                   return_exceptions=True)
    assert sum(isinstance(r, Created) for r in results) == 1
    # The period's hash outlives the period by the settling grace, then leaves Redis.
    key = budget_key(0, 1, "alice", budget.window(time.time())[0])
    assert budget.window(time.time())[1] - time.time() < redis_client.ttl(key) <= (
        budget.window(time.time())[1] - time.time() + 2 * 86_400 + 5)


def test_periods_are_utc_days_and_months() -> None:
    t = datetime(2026, 2, 14, 23, 59, 30, tzinfo=UTC).timestamp()
    assert Budget(1, "day").window(t) == ("2026-02-14", datetime(2026, 2, 15, tzinfo=UTC).timestamp())
    assert Budget(1, "month").window(t) == ("2026-02", datetime(2026, 3, 1, tzinfo=UTC).timestamp())
    assert Budget(1, "day").retry_after_s(t) == 30
    assert Budget(10, "day").share(4) == 3 and Budget(0, "day").share(4) == 0
