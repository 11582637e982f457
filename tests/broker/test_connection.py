"""broker.redis.connection against real servers: a redis+sentinel:// URL follows a primary failover that Redis
Sentinel (``redis-server --sentinel``) carries out; a fresh Redis Cluster client takes many concurrent first
commands (redis-py alone failed some of them)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from helpers import eventually, eventually_async
from servers import PrimaryReplica, RedisClusterServers

from broker.errors import StoreUnavailable
from broker.redis.connection import RedisClient, connect, register_script
from broker.redis.server import find_server_binary, free_port
from broker.redis.urls import is_sentinel_url

pytestmark = pytest.mark.slow

SERVICE = "rsbmaster"


class SentinelSetup:
    """A primary, its replica and one sentinel (quorum 1) that fails over after 1 s of silence."""

    def __init__(self, tmp: Path) -> None:
        self.pair = PrimaryReplica()
        self.primary, self.replica = self.pair.primary, self.pair.replica
        self.port = free_port()
        conf = tmp / "sentinel.conf"
        conf.write_text(f"port {self.port}\nbind 127.0.0.1\ndir {tmp}\n"
                        f"sentinel monitor {SERVICE} 127.0.0.1 {self.primary.port} 1\n"
                        f"sentinel down-after-milliseconds {SERVICE} 1000\n"
                        f"sentinel failover-timeout {SERVICE} 5000\n")
        import subprocess

        self.proc = subprocess.Popen([find_server_binary(), str(conf), "--sentinel"], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        s = redis.Redis(port=self.port, decode_responses=True)

        def knows_the_replica() -> bool:  # the sentinel knows the primary and has found its replica
            try:
                return bool(s.execute_command("SENTINEL", "REPLICAS", SERVICE))
            except redis.RedisError:
                return False

        try:
            eventually(knows_the_replica, 20, "the sentinel started", interval_s=0.1)
        finally:
            s.close()

    @property
    def url(self) -> str:
        return f"redis+sentinel://127.0.0.1:{self.port}/{SERVICE}"

    def cleanup(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.pair.cleanup()


@pytest.fixture
def sentinel(tmp_path: Path) -> Iterator[SentinelSetup]:
    setup = SentinelSetup(tmp_path)
    yield setup
    setup.cleanup()


@pytest.mark.timeout(60)
async def test_a_sentinel_url_follows_a_failover(sentinel: SentinelSetup) -> None:
    assert is_sentinel_url(sentinel.url)
    r = connect(sentinel.url)
    try:
        await r.set("k", "before")
        assert await r.execute_command("WAIT", 1, 5000) == 1  # on the replica: the failover cannot lose it
        assert (await r.execute_command("ROLE"))[0] in (b"master", "master")
        sentinel.primary.kill()  # SIGKILL: the sentinel promotes the replica

        async def written() -> bool:
            try:
                await r.set("k2", "after")
            except StoreUnavailable:  # rsb's error for Redis away, never redis-py's (broker.redis.errors)
                return False
            return True

        await eventually_async(written, 30, "the client reached the promoted replica", interval_s=0.2)
        promoted = redis.Redis(port=sentinel.replica.port)
        try:
            assert promoted.execute_command("ROLE")[0] == b"master"
            assert promoted.get("k2") == b"after" and promoted.get("k") == b"before"
        finally:
            promoted.close()
    finally:
        await r.aclose()


def test_a_sentinel_urls_credentials_are_percent_decoded() -> None:
    from urllib.parse import quote, urlsplit

    from broker.redis.urls import sentinel_auth

    password = "p@ss:w/rd%"
    parts = urlsplit(f"redis+sentinel://us%40er:{quote(password, safe='')}@h1:26379,h2:26379/mymaster/0")
    assert sentinel_auth(parts) == {"username": "us@er", "password": password}
    assert sentinel_auth(urlsplit("redis+sentinel://:secret@h1:26379/mymaster")) == {"username": None,
                                                                                      "password": "secret"}
    assert sentinel_auth(urlsplit("redis+sentinel://h1:26379/mymaster")) == {}


async def _incr_in_one_pipeline(r: RedisClient, keys: list[str]) -> None:
    async with r.pipeline(transaction=False) as pipe:
        for k in keys:
            pipe.incr(k)
        assert all(isinstance(n, int) for n in await pipe.execute())


async def test_many_concurrent_first_commands_of_a_cluster_client_all_succeed(
        redis_cluster: RedisClusterServers, cluster_client: redis.RedisCluster) -> None:
    """A pod or a worker starts and its first burst (readers attaching, creates, polls) meets a client that has no
    slot map and no connection yet. redis-py 8.1 routed those first commands without their slot (MOVED), closed
    every connection in use after five MOVEDs, and the commands caught mid-handshake died with
    ``AttributeError: 'NoneType' object has no attribute 'writelines'`` (in about a quarter of these commands
    here, every trial). Each trial is a fresh client: scripts, pipelines and plain commands over every master."""
    keys = [f"{{p{i}}}first-use" for i in range(12)]  # twelve hash tags: every master owns some
    for trial in range(15):
        r = connect(redis_cluster.url, max_connections=8)
        script = register_script(r, "return redis.call('INCR', KEYS[1])")
        try:
            calls: list[Awaitable[Any]] = [r.incr(keys[i % 12]) for i in range(20)]
            calls += [script(keys=[keys[i % 12]], args=[]) for i in range(10)]
            calls += [_incr_in_one_pipeline(r, [keys[(i + j) % 12] for j in range(3)]) for i in range(10)]
            results = await asyncio.gather(*calls, return_exceptions=True)
            failed = [repr(x) for x in results if isinstance(x, BaseException)]
            assert not failed, (trial, failed)
        finally:
            await r.aclose()
    assert sum(int(cluster_client.get(k) or 0) for k in keys) == 15 * (20 + 10 + 30)
