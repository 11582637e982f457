"""The eviction check at start: real redis-server processes with each kind of ``maxmemory-policy`` and the real
command line. ``allkeys-*`` is refused (exit 2, one line naming the policy and the fix); ``volatile-*`` starts with a
warning saying what it may cost; CONFIG renamed away starts with a line saying the policy could not be read."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from servers import ROOT, StackFactory

from broker.redis.eviction import judge
from broker.redis.server import RedisServer, free_port
from rsb.up import UpSettings, private_redis_memory

pytestmark = pytest.mark.slow


@pytest.fixture
def servers() -> Iterator[list[RedisServer]]:
    started: list[RedisServer] = []
    yield started
    for s in started:
        s.cleanup()


def _redis(started: list[RedisServer], *args: str) -> RedisServer:
    server = RedisServer(extra_args=args).start()
    started.append(server)
    return server


def _rsb(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rsb", *args], capture_output=True, text=True, timeout=60, cwd=ROOT)


@pytest.mark.parametrize("policy", ["allkeys-lru", "allkeys-random"])
def test_allkeys_is_refused_by_consumer_and_generator(servers: list[RedisServer], policy: str,
                                                     tmp_path: Path) -> None:
    url = _redis(servers, "--maxmemory-policy", policy).url
    for cmd in (["consumer", "--redis-url", url, "--port", str(free_port())],
                ["generator", "--redis-url", url, "--model", str(tmp_path / "never-loaded.gguf")]):
        done = _rsb(*cmd)
        assert done.returncode == 2, (cmd, done.stdout, done.stderr)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1, done.stderr
        assert lines[0].startswith(f"rsb {cmd[0]}: Redis has maxmemory-policy {policy}")
        assert "noeviction" in lines[0] and "volatile-" in lines[0]


def test_rsb_up_refuses_an_allkeys_redis(servers: list[RedisServer], demo_model: Path) -> None:
    url = _redis(servers, "--maxmemory-policy", "allkeys-lfu").url
    done = _rsb("up", "--redis-url", url, "--model", str(demo_model), "--port", str(free_port()))
    assert done.returncode == 1, (done.stdout, done.stderr)
    refusal = [line for line in done.stderr.splitlines() if line.startswith("rsb up: ")]
    assert len(refusal) == 1 and "maxmemory-policy allkeys-lfu" in refusal[0] and "noeviction" in refusal[0]


def test_volatile_warns_and_starts(servers: list[RedisServer], stack_factory: StackFactory) -> None:
    stack = stack_factory(_redis(servers, "--maxmemory-policy", "volatile-lru").url)
    gen = stack.generator()
    consumer, _ = stack.consumer()
    for proc in (gen, consumer):
        warned = [line for line in proc.output().splitlines() if '"eviction_check":"warn"' in line]
        assert len(warned) == 1, proc.output()
        assert "volatile-lru" in warned[0] and "finished streams before their retention" in warned[0]
    assert stack.client().get("/readyz").status_code == 200


def test_config_renamed_is_said_and_starts(servers: list[RedisServer], stack_factory: StackFactory) -> None:
    stack = stack_factory(_redis(servers, "--rename-command", "CONFIG", "").url)
    consumer, _ = stack.consumer()
    unread = [line for line in consumer.output().splitlines() if '"eviction_check":"unread"' in line]
    assert len(unread) == 1 and "maxmemory-policy" in unread[0], consumer.output()
    assert stack.client().get("/readyz").status_code == 200


def test_noeviction_says_nothing(servers: list[RedisServer], stack_factory: StackFactory) -> None:
    stack = stack_factory(_redis(servers).url)
    consumer, _ = stack.consumer()
    assert "eviction_check" not in consumer.output()


def test_judge_and_the_private_redis() -> None:
    assert judge("noeviction") == (True, "")
    assert judge("allkeys-lfu")[0] is False and judge("volatile-ttl")[0] is True
    assert private_redis_memory(UpSettings()) == ("--maxmemory", "1024mb", "--maxmemory-policy", "noeviction")
