"""Budgets against a real redis-server: concurrent creates at the edge of a budget (in tokens, in USD, a team's)
reserve no more than it holds, a refusal queues nothing and says whose budget and when the period ends, and the end
of each generation settles its reservation to what it used in every budget it held (a cancel while queued, to
nothing)."""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import UTC, datetime

import orjson
import pytest
import redis

from broker.errors import BudgetExceeded
from broker.events import EventType
from broker.request.generation import GenerationRequest
from broker.streams.budget import NANO_PER_USD, Budget, Teams, reservation, team_holder, usd_reservation
from broker.streams.job_store import JobStore
from broker.streams.keys import budget_key
from broker.streams.records import Claim, Created
from broker.streams.stream_store import StreamStore
from broker.streams.usage import Price

REQ = GenerationRequest(None, "hello", None, 100, 0.8, 0.95, None, (), False)
WORST = reservation(REQ.canonical_json(), REQ.max_tokens)


def _counts(r: redis.Redis, budget: Budget, partitions: int = 1, partition: int = 0) -> tuple[int, int]:
    raw = r.hmget(budget_key(partition, partitions, "alice", budget.window(time.time())[0]), "reserved", "used")
    return int(raw[0] or 0), int(raw[1] or 0)


async def test_twenty_concurrent_creates_at_the_edge_reserve_no_more_than_the_budget(
        store: StreamStore, redis_client: redis.Redis) -> None:
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


async def test_each_end_settles_its_reservation_to_what_it_used(store: StreamStore, jobs: JobStore, redis_client: redis.Redis) -> None:
    budget = Budget(2 * WORST, "month")
    a, b = uuid.uuid4(), uuid.uuid4()
    for sid in (a, b):
        await store.create(sid, REQ, model="m", max_queue=0, retention_s=60, key_id="alice", budget=budget)
    with pytest.raises(BudgetExceeded):
        await store.create(uuid.uuid4(), REQ, model="m", max_queue=0, retention_s=60, key_id="alice",
                           budget=budget)
    claim = await jobs.claim(a, "w")
    assert isinstance(claim, Claim)
    u = {"prompt_tokens": 7, "completion_tokens": 30}
    for _ in range(2):  # a retried finish settles once
        assert await jobs.finish(claim, EventType.DONE, {}, status="done", usage=u, reason="stop") is not None
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


PRICE = Price(2.0, 0.5, 8.0)  # USD per million tokens: input, cached input, output
WORST_USD = usd_reservation(PRICE, REQ.canonical_json(), REQ.max_tokens)


def _usd(r: redis.Redis, holder: str, budget: Budget) -> tuple[int, int]:
    raw = r.hmget(budget_key(0, 1, holder, budget.window(time.time())[0]), "ureserved", "uused")
    return int(raw[0] or 0), int(raw[1] or 0)


async def test_twenty_concurrent_creates_at_the_edge_of_a_usd_budget(store: StreamStore, redis_client: redis.Redis) -> None:
    assert WORST_USD == -(-(len(REQ.canonical_json()) * 2.0 + 100 * 8.0) * NANO_PER_USD // 1_000_000)
    budget = Budget(0, "month", (4 * WORST_USD + WORST_USD // 3) / NANO_PER_USD, "alice")
    results = await asyncio.gather(*(store.create(uuid.uuid4(), REQ, model="m", max_queue=0, retention_s=60,
                                                  key_id="alice", budget=budget, price=PRICE) for _ in range(20)),
                                   return_exceptions=True)
    refused = [r for r in results if isinstance(r, BudgetExceeded)]
    assert sum(isinstance(r, Created) for r in results) == 4 and len(refused) == 16, results
    assert _usd(redis_client, "alice", budget) == (4 * WORST_USD, 0)
    assert await store.waiting() == 4
    assert "this API key's budget ($" in refused[0].message and f"${WORST_USD / NANO_PER_USD:.6f}" in refused[0].message


async def test_a_team_budget_holds_across_its_keys_and_settles_in_both(store: StreamStore, redis_client: redis.Redis) -> None:
    team = Teams.parse(orjson.dumps({"blue": {"token_budget": 6 * WORST + 10, "budget_period": "day"}})).budgets["blue"]
    own = Budget(0, "month", 1.0, "bob")  # bob's own budget, in money, is far from its end
    results = await asyncio.gather(*(store.create(uuid.uuid4(), REQ, model="m", max_queue=0, retention_s=60,
                                                  key_id=("bob", "carol")[i % 2], price=PRICE, team_budget=team,
                                                  budget=own if i % 2 == 0 else Budget(holder="carol"))
                                     for i in range(20)), return_exceptions=True)
    created = [r for r in results if isinstance(r, Created)]
    refused = [r for r in results if isinstance(r, BudgetExceeded)]
    assert len(created) == 6 and len(refused) == 14, results
    assert all("team blue's token budget" in r.message for r in refused)
    teams_hash = budget_key(0, 1, team_holder("blue"), team.window(time.time())[0])
    assert int(redis_client.hget(teams_hash, "reserved") or 0) == 6 * WORST
    assert await store.waiting() == 6


async def test_the_end_settles_every_budget_held_at_the_price_reserved_at(store: StreamStore, jobs: JobStore,
                                                                          redis_client: redis.Redis) -> None:
    team = Budget(10**9, "day", 0.0, team_holder("green"), "team green's")
    own = Budget(0, "month", 1.0, "dave")
    sid = uuid.uuid4()
    request = GenerationRequest(None, "hi", None, 10_000, 0.8, 0.95, None, (), False)
    await store.create(sid, request, model="m", max_queue=0, retention_s=60, key_id="dave", budget=own,
                       team_budget=team, price=PRICE)
    held = usd_reservation(PRICE, request.canonical_json(), 10_000)
    assert _usd(redis_client, "dave", own) == (held, 0)
    claim = await jobs.claim(sid, "w")
    assert isinstance(claim, Claim)
    u = {"prompt_tokens": 50, "cached_tokens": 20, "completion_tokens": 30}
    for _ in range(2):  # a retried finish settles once
        assert await jobs.finish(claim, EventType.DONE, {}, status="done", usage=u, reason="stop") is not None
    cost = (30 * 2.0 + 20 * 0.5 + 30 * 8.0) * NANO_PER_USD / 1e6  # cached prompt tokens at the cached price
    assert _usd(redis_client, "dave", own) == (0, round(cost))
    green = budget_key(0, 1, team_holder("green"), team.window(time.time())[0])
    assert (int(redis_client.hget(green, "reserved") or 0), int(redis_client.hget(green, "used") or 0)) == (0, 80)
    assert _usd(redis_client, team_holder("green"), team) == (0, round(cost))


def test_budgets_files_refuse_what_they_do_not_know() -> None:
    for raw in (b"[]", b'{"a:b": {"token_budget": 1}}', b'{"blue": {"token_budget": -1}}',
                b'{"blue": {"usd_budget": "1"}}', b'{"blue": {"budget_period": "week"}}', b'{"blue": {"x": 1}}'):
        with pytest.raises(ValueError):
            Teams.parse(raw)
