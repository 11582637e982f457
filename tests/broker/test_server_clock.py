"""The Redis server's time as a pod carries it (broker.redis.server_clock): read once, then the monotonic clock's;
read again in the background, a failed read keeping the last; the same whatever the pod's wall clock says, and a
budget period named by it (a pod a day ahead still counts today's budget)."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
import redis

from broker.redis.connection import connect
from broker.redis.server import RedisServer
from broker.redis.server_clock import ServerClock, server_now_s
from broker.request.generation import GenerationRequest
from broker.streams.budget import Budget
from broker.streams.keys import budget_key
from broker.streams.stream_store import StreamStore

SERVER_T = 1_800_000_000.0


class FakeServer:
    """A TIME that counts its reads, and a monotonic clock the test moves."""

    def __init__(self) -> None:
        self.mono = 1000.0
        self.reads = 0
        self.fail = False
        self.gate: asyncio.Event | None = None

    def monotonic(self) -> float:
        return self.mono

    async def read(self) -> float:
        self.reads += 1
        if self.gate is not None:
            await self.gate.wait()
        if self.fail:
            raise ConnectionError("redis away")
        return SERVER_T + (self.mono - 1000.0)

    def clock(self, refresh_s: float = 30.0) -> ServerClock:
        return ServerClock(self.read, refresh_s, monotonic=self.monotonic)


async def test_the_clock_reads_time_once_then_carries_it_on_the_monotonic_clock() -> None:
    s = FakeServer()
    clock = s.clock()
    assert await clock.now() == SERVER_T and s.reads == 1
    s.mono += 12.5
    assert await clock.now() == SERVER_T + 12.5 and s.reads == 1  # no round trip per call


async def test_concurrent_first_calls_share_one_read() -> None:
    s = FakeServer()
    s.gate = asyncio.Event()
    clock = s.clock()
    waiting = [asyncio.ensure_future(clock.now()) for _ in range(20)]
    await asyncio.sleep(0)
    s.gate.set()
    assert await asyncio.gather(*waiting) == [SERVER_T] * 20 and s.reads == 1


async def test_a_stale_offset_is_read_again_in_the_background_and_a_failed_read_keeps_it() -> None:
    s = FakeServer()
    clock = s.clock(refresh_s=30)
    await clock.now()
    s.mono += 31
    s.fail = True
    assert await clock.now() == SERVER_T + 31  # answered at once, from the offset it has
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert s.reads == 2
    s.mono += 1
    assert await clock.now() == SERVER_T + 32 and s.reads == 2  # not read again before refresh_s
    s.fail = False
    s.mono += 30
    await clock.now()
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert s.reads == 3


async def test_a_failed_first_read_raises_and_the_next_call_reads_again() -> None:
    s = FakeServer()
    s.fail = True
    clock = s.clock()
    with pytest.raises(ConnectionError):
        await clock.now()
    s.fail = False
    assert await clock.now() == SERVER_T and s.reads == 2


@pytest.mark.parametrize("skew", [60, -60, 86_400 * 40])
async def test_the_clock_is_the_servers_whatever_the_pods_wall_clock_says(
        redis_server: RedisServer, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch, skew: int) -> None:
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + skew)
    r = connect(redis_server.url)
    try:
        clock = ServerClock.of(r, 1)
        ours, direct = await clock.now(), await server_now_s(r, 1)
        secs, micros = redis_client.time()
        assert abs(ours - (secs + micros / 1e6)) < 1 and abs(direct - ours) < 1
    finally:
        await r.aclose()


@pytest.mark.parametrize("skew", [86_400 * 2, -86_400 * 2], ids=["pod-ahead", "pod-behind"])
async def test_a_budget_period_is_named_by_the_servers_day_not_the_pods(
        store: StreamStore, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch, skew: int) -> None:
    """A pod's clock days off (a minute off only moves creates near a period's end): the create counts in the
    period the server is in, where every other pod counts it."""
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + skew)
    budget = Budget(10_000, "day")
    request = GenerationRequest(None, "hello", None, 100, 0.8, 0.95, None, (), False)
    await store.create(uuid.uuid4(), request, model="m", max_queue=0, retention_s=60, key_id="alice", budget=budget)
    server_day = budget.window(real())[0]
    assert redis_client.exists(budget_key(0, 1, "alice", server_day))
    assert not redis_client.exists(budget_key(0, 1, "alice", budget.window(real() + skew)[0]))
