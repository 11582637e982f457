"""broker.redis.connection against real servers: a redis+sentinel:// URL follows a primary failover that Redis
Sentinel (``redis-server --sentinel``) carries out."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from servers import PrimaryReplica

from broker.redis.connection import connect, is_sentinel_url
from broker.redis.server import find_server_binary, free_port

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
        deadline = time.monotonic() + 20
        s = redis.Redis(port=self.port, decode_responses=True)
        try:
            while True:  # the sentinel knows the primary and has found its replica
                try:
                    if s.execute_command("SENTINEL", "REPLICAS", SERVICE):
                        break
                except redis.RedisError:
                    pass
                assert time.monotonic() < deadline, "the sentinel did not start"
                time.sleep(0.1)
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
        deadline = time.monotonic() + 30
        while True:
            try:
                await r.set("k2", "after")
                break
            except redis.RedisError:
                assert time.monotonic() < deadline, "the client never reached the promoted replica"
                await asyncio.sleep(0.2)
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

    from broker.redis.connection import sentinel_auth

    password = "p@ss:w/rd%"
    parts = urlsplit(f"redis+sentinel://us%40er:{quote(password, safe='')}@h1:26379,h2:26379/mymaster/0")
    assert sentinel_auth(parts) == {"username": "us@er", "password": password}
    assert sentinel_auth(urlsplit("redis+sentinel://:secret@h1:26379/mymaster")) == {"username": None,
                                                                                      "password": "secret"}
    assert sentinel_auth(urlsplit("redis+sentinel://h1:26379/mymaster")) == {}
