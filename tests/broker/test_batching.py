"""Commands of concurrent callers share pipelines, and each caller still gets its own reply or error."""

from __future__ import annotations

import asyncio

import pytest
import redis

from broker.errors import StoreError, StoreTransient
from broker.redis.batching import CommandBatcher
from broker.redis.connection import connect, register_script
from broker.redis.server import RedisServer

pytestmark = pytest.mark.slow  # a real redis-server


async def test_a_burst_of_commands_goes_out_in_few_pipelines_each_with_its_own_answer(
        redis_server: RedisServer, redis_client: redis.Redis) -> None:
    opened = redis_client.info("stats")["total_connections_received"]
    r = connect(redis_server.url, max_connections=7)
    batcher = CommandBatcher(r)
    for i in range(500):
        redis_client.hset(f"h{i}", "v", str(i))
    redis_client.set("a-string", "x")
    before = redis_client.info("commandstats").get("cmdstat_hget", {}).get("calls", 0)
    replies = await asyncio.gather(*(batcher.execute("HGET", f"h{i}", "v") for i in range(500)),
                                   batcher.execute("HGET", "a-string", "v"), return_exceptions=True)
    assert replies[:500] == [str(i).encode() for i in range(500)]  # in order, each its own
    # WRONGTYPE: that caller's error, nobody else's, and rsb's (a bug: neither away nor full), not redis-py's
    assert isinstance(replies[500], StoreError) and not isinstance(replies[500], StoreTransient), replies[500]
    assert "WRONGTYPE" in str(replies[500])
    assert redis_client.info("commandstats")["cmdstat_hget"]["calls"] - before == 501
    # The first command went alone, the other 500 in pipelines behind it: two connections, of the pool's 7.
    assert redis_client.info("stats")["total_connections_received"] - opened == 2
    await r.aclose()


async def test_a_caller_that_leaves_takes_nothing_down_with_it(redis_server: RedisServer,
                                                               redis_client: redis.Redis) -> None:
    r = connect(redis_server.url)
    batcher = CommandBatcher(r)
    redis_client.set("k", "v")
    leaving = asyncio.ensure_future(batcher.execute("GET", "k"))
    staying = asyncio.ensure_future(batcher.execute("GET", "k"))
    await asyncio.sleep(0)  # one turn of the loop: both calls queued in the batcher
    leaving.cancel()
    assert await staying == b"v"
    with pytest.raises(asyncio.CancelledError):
        await leaving
    assert await batcher.execute("GET", "k") == b"v"
    await r.aclose()


async def test_a_batched_script_is_loaded_again_when_redis_lost_it(redis_server: RedisServer,
                                                                   redis_client: redis.Redis) -> None:
    r = connect(redis_server.url)
    batcher = CommandBatcher(r)
    script = register_script(r, "return tonumber(ARGV[1]) + 1")
    assert await batcher.script(script, [], [1]) == 2
    redis_client.script_flush()  # a restarted or flushed Redis
    assert await asyncio.gather(*(batcher.script(script, [], [i]) for i in range(10))) == list(range(1, 11))
    redis_client.script_flush()
    assert await batcher.script(script, [], [41]) == 42  # alone in its batch
    await r.aclose()
