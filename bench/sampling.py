"""CPU and memory of processes (psutil), and Redis's own counters."""

from __future__ import annotations

import threading
import time
from typing import Any

import psutil
import redis


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds used so far by these processes (all threads; children not included)."""
    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


def rss_bytes(pid: int) -> int:
    return int(psutil.Process(pid).memory_info().rss)


class CpuWindow:
    """CPU seconds of ``pids`` between ``start()`` and ``stop()``, and the wall time in between."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self._c0 = self._t0 = 0.0
        self.cpu_s = self.wall_s = 0.0

    def start(self) -> CpuWindow:
        self._c0, self._t0 = cpu_seconds(self.pids), time.monotonic()
        return self

    def stop(self) -> CpuWindow:
        self.cpu_s = cpu_seconds(self.pids) - self._c0
        self.wall_s = time.monotonic() - self._t0
        return self

    @property
    def cores(self) -> float:
        """Average cores used over the window."""
        return self.cpu_s / self.wall_s if self.wall_s > 0 else 0.0


class Sampler:
    """Samples, every ``interval_s`` in a thread: RSS of ``pid`` and Redis ``used_memory``."""

    def __init__(self, pid: int, redis_url: str, interval_s: float = 1.0) -> None:
        self.pid, self.interval_s = pid, interval_s
        self._redis = redis.Redis.from_url(redis_url)
        self.samples: list[dict[str, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._t0 = time.monotonic()

    def start(self) -> Sampler:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def sample(self) -> dict[str, float]:
        s = {"t": time.monotonic() - self._t0, "rss": float(rss_bytes(self.pid)),
             "redis_used_memory": float(redis_used_memory(self._redis))}
        self.samples.append(s)
        return s

    def stop(self) -> list[dict[str, float]]:
        self._stop.set()
        self._thread.join()
        self._redis.close()
        return self.samples


def redis_used_memory(client: redis.Redis) -> int:
    info: dict[str, Any] = client.info("memory")
    return int(info["used_memory"])


def redis_clients_of(client: redis.Redis, pid: int) -> int:
    """Connections to Redis held by process ``pid``: CLIENT LIST entries whose address is one of its sockets."""
    ports = set()
    for c in psutil.Process(pid).net_connections(kind="tcp"):
        if c.laddr and c.raddr:
            ports.add(c.laddr.port)
    count = 0
    for entry in client.client_list():
        addr = str(entry.get("addr", ""))
        try:
            port = int(addr.rsplit(":", 1)[1])
        except (IndexError, ValueError):
            continue
        if port in ports:
            count += 1
    return count
