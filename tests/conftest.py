"""Fixtures that start and stop real servers: redis-server, `rsb generator` (llama.cpp on the demo
model) and `rsb consumer` (uvicorn), each a separate process on a free port."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from broker.redis_server import RedisServer, free_port

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from generator.demo_model import build_demo_model

    return build_demo_model(tmp_path_factory.mktemp("model") / "demo.gguf")


@pytest.fixture(scope="session")
def slow_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A larger demo model (~700 tokens/s on one thread): slow enough to kill a worker mid-answer."""
    from generator.demo_model import build_demo_model

    return build_demo_model(tmp_path_factory.mktemp("slow-model") / "slow.gguf", embd=256, layers=4)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One real redis-server for the session; tests that kill or restart Redis use `own_redis`."""
    server = RedisServer().start()
    yield server
    server.cleanup()


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    server = RedisServer(appendonly=True).start()
    yield server
    server.cleanup()


@pytest.fixture
def redis_client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis(port=redis_server.port)
    client.flushall()
    yield client
    client.close()


class Proc:
    def __init__(self, argv: list[str], name: str, log_path: Path) -> None:
        self.argv, self.name, self.log_path = argv, name, log_path
        self.log = open(log_path, "ab")  # closed in stop()
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            self.proc.send_signal(sig)

    def wait(self, timeout_s: float) -> int:
        return self.proc.wait(timeout_s)

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")


class Stack:
    """Start real rsb processes against a real Redis; everything is stopped at teardown."""

    def __init__(self, redis_url: str, model: Path, tmp: Path) -> None:
        self.redis_url, self.model, self.tmp = redis_url, model, tmp
        self.procs: list[Proc] = []
        self.base_url = ""

    def _run(self, name: str, args: list[str]) -> Proc:
        p = Proc([sys.executable, "-m", "broker.cli", *args], name, self.tmp / f"{name}-{len(self.procs)}.log")
        self.procs.append(p)
        return p

    def generator(self, *extra: str, ignore_eos: bool = True, wait: bool = True, model: Path | None = None) -> Proc:
        args = ["generator", "--redis-url", self.redis_url, "--model", str(model or self.model), "--n-threads", "1",
                "--log-level", "info", *extra]
        if ignore_eos:
            args.append("--ignore-eos")
        p = self._run("generator", args)
        if wait:
            deadline = time.monotonic() + 30
            while "generator ready" not in p.output():
                assert p.alive(), f"generator died:\n{p.output()}"
                assert time.monotonic() < deadline, f"generator not ready:\n{p.output()}"
                time.sleep(0.05)
        return p

    def consumer(self, *extra: str, port: int | None = None) -> tuple[Proc, str]:
        port = port or free_port()
        p = self._run("consumer", ["consumer", "--redis-url", self.redis_url, "--port", str(port), *extra])
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert p.alive(), f"consumer died:\n{p.output()}"
            assert time.monotonic() < deadline, "consumer did not come up"
            time.sleep(0.05)
        if not self.base_url:
            self.base_url = url
        return p, url

    def client(self, url: str | None = None) -> httpx.Client:
        return httpx.Client(base_url=url or self.base_url, timeout=30)

    def close(self) -> None:
        for p in reversed(self.procs):
            p.stop()


@pytest.fixture
def stack_factory(demo_model: Path, tmp_path: Path) -> Iterator[type[Stack] | object]:
    stacks: list[Stack] = []

    def make(redis_url: str) -> Stack:
        s = Stack(redis_url, demo_model, tmp_path)
        stacks.append(s)
        return s

    yield make
    for s in stacks:
        s.close()


@pytest.fixture
def stack(stack_factory, redis_server: RedisServer, redis_client: redis.Redis) -> Stack:  # type: ignore[no-untyped-def]
    """A consumer (heartbeat 1 s) and one generator on the session Redis (flushed)."""
    s: Stack = stack_factory(redis_server.url)
    s.generator()
    s.consumer("--heartbeat-s", "1")
    return s
