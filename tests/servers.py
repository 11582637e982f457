"""The real servers tests start, as classes a fixture or a test can use: rsb processes (`Stack`), a primary and its
replica (`PrimaryReplica`), a Redis Cluster (`RedisClusterServers`), nginx in front of consumers (`Nginx`), and
where Debian's chromium is. Each is a separate process on a free port, stopped by whoever started it; the
fixtures in conftest.py start them for a test, a module or the session."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import redis
from helpers import eventually

from bench.procs import Nginx, Proc, wait_serving
from broker.redis.keyspace import tagged
from broker.redis.server import RedisServer, free_port
from broker.streams.keys import queue_stats_key

ROOT = Path(__file__).resolve().parent.parent


# -- Redis: a primary and its replica, a cluster ------------------------------------------------------


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


class RedisClusterServers:
    """A real Redis Cluster of ``masters`` redis-server processes (and ``replicas`` per master) on free ports,
    created with ``redis-cli --cluster create`` like an operator would."""

    def __init__(self, masters: int = 3, replicas: int = 0, node_timeout_ms: int = 2000,
                 extra_args: tuple[str, ...] = (), appendonly: bool = False) -> None:
        # Each node needs a client port and a cluster-bus port (by default port + 10000, which may be taken or
        # past 65535): pick both explicitly, holding the sockets until all are chosen so none repeats.
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
        self.nodes = [RedisServer(ports[2 * i], appendonly=appendonly, extra_args=(
            "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout",
            str(node_timeout_ms), "--cluster-port", str(ports[2 * i + 1]), *extra_args)) for i in range(count)]

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    @property
    def ports(self) -> list[int]:
        return [n.port for n in self.nodes]

    def start(self) -> RedisClusterServers:
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


# -- rsb's own processes -------------------------------------------------------------------------------


#: Model names the tests' requests give: aliases of whatever model a test generator runs (--model-alias).
TEST_MODEL_NAMES = ("m", "x", "demo", "llama3", "gpt-4o-mini", "test", "story-model")


class Stack:
    """Start real rsb processes against a real Redis; everything is stopped at teardown."""

    def __init__(self, redis_url: str, model: Path, tmp: Path) -> None:
        self.redis_url, self.model, self.tmp = redis_url, model, tmp
        self.procs: list[Proc] = []
        self.base_url = ""

    def _run(self, name: str, args: list[str], env: dict[str, str] | None = None) -> Proc:
        p = Proc([sys.executable, "-m", "rsb", *args], name, env=env,
                 log_path=self.tmp / f"{name}-{len(self.procs)}.log")
        self.procs.append(p)
        return p

    def generator(self, *extra: str, ignore_eos: bool = True, wait: bool = True, model: Path | None = None,
                  env: dict[str, str] | None = None) -> Proc:
        """``env``: added to this process's environment (a skewed clock: tests/consumer/test_clock_skew.py)."""
        args = ["generator", "--redis-url", self.redis_url, "--model", str(model or self.model), "--n-threads", "1",
                "--log-level", "info", *extra]
        if not any(a.startswith(("--model-name", "--model-alias")) for a in extra):
            # The names the tests' requests give (each generator answers to them: one model per stack).
            args += ["--model-alias", ",".join(TEST_MODEL_NAMES)]
        if ignore_eos:
            args.append("--ignore-eos")
        if not any(a.startswith("--parallel") for a in extra):
            # One generation at a time, as these tests' expectations of a worker's queue are written (the
            # batching tests, tests/generator/test_batch.py, and rsb up's test run the default).
            args += ["--parallel", "1"]
        p = self._run("generator", args, env)
        if wait:
            deadline = time.monotonic() + 30
            while "generator ready" not in p.output():
                assert p.alive(), f"generator died:\n{p.output()}"
                assert time.monotonic() < deadline, f"generator not ready:\n{p.output()}"
                time.sleep(0.05)
        return p

    def consumer(self, *extra: str, port: int | None = None, test_default: bool = True,
                 env: dict[str, str] | None = None) -> tuple[Proc, str]:
        """A consumer; ``test_default``: with ``--default-model`` the first of TEST_MODEL_NAMES (an alias every
        test generator answers to), so creates that name no model queue while no generator runs yet. ``env``: added
        to its environment."""
        port = port or free_port()
        if test_default and not any(a.startswith("--default-model") for a in extra) and \
                "RSB_DEFAULT_MODEL" not in os.environ:
            extra = (*extra, "--default-model", TEST_MODEL_NAMES[0])
        p = self._run("consumer", ["consumer", "--redis-url", self.redis_url, "--port", str(port), *extra], env)
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


class SharedStack(Stack):
    """The stack of ``shared_stack``: a Stack, and a client of the redis-server it runs on."""

    def __init__(self, server: RedisServer, model: Path, tmp: Path) -> None:
        super().__init__(server.url, model, tmp)
        self.server = server
        self.redis = redis.Redis(port=server.port)

    def wait_idle(self, timeout_s: float = 60.0) -> None:
        """Until no job is queued or running: whatever a test left generating ends before the next test."""
        def idle() -> bool:
            waiting = int(self.redis.hget(queue_stats_key(0, 1), "waiting") or 0)
            busy = sum(self.redis.zcard(k) for k in self.redis.keys(f"{tagged(0, 1)}:q:*:leases"))
            assert waiting == 0 and busy == 0, f"a shared stack still has {waiting} queued, {busy} running"
            return True

        eventually(idle, timeout_s)


# A fixture that starts stacks: call it with a Redis URL.
StackFactory = Callable[[str], Stack]


# -- nginx in front of consumers ----------------------------------------------------------------------

# bench.procs.Nginx: deploy/nginx.conf run for real (the benchmarks' balancer too).

# A fixture that starts nginx: call it with the consumer ports to balance over.
NginxFactory = Callable[[list[int]], Nginx]


# -- a real browser: Debian's chromium, driven by Playwright (which never downloads one here) -------------

CHROMIUM = os.environ.get("RSB_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")

needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="chromium is not installed (apt-get install chromium, or set RSB_CHROMIUM)")
