"""A randomized schedule of network and process faults over many streams, and the check of every reader's history
(tests/history.py) against the streams as they ended: what tests/test_fault_schedule.py runs for a minute in the
suite and ``python3 -m bench faults`` runs longer.

The deployment: a redis-server with AOF, two consumers and two generators, each process reaching Redis through a
fault proxy of its own (tests/faultproxy.py), the generators driving a paced scripted upstream (100 words a second,
`` w0 w1 ...``: each attempt's answer numbered from w0, so a duplicate or a lost piece shows in the text). Streams
are created as the schedule runs, through either consumer (a create refused while its pod cannot reach Redis is sent
again, same id, to the other: creates are idempotent), each read by two readers that reconnect to either pod.

The faults, one at a time, each lasting a random 1 to 6 s, then healed: 200 ms more on a link; a link half-open
(only the open connections, or every one: a partition); a link's connections reset; a generator SIGKILLed (and
started again), SIGSTOPped (a zombie: its lease lapses, it wakes fenced out), or SIGTERMed (it hands its jobs over);
a consumer drained (SIGTERM) and started again on its port; Redis stopped and started (AOF: nothing lost).

Checked at the end: every stream ended ``done`` with exactly its budget of words, each attempt's run ascending by one
from w0 (nothing twice, nothing lost at a seam); every reader's history is its stream's (no gap, duplicate or
reorder; each resume exact). The seed is printed; ``RSB_FAULT_SEED`` replays a run.
"""

from __future__ import annotations

import os
import random
import re
import signal
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis
from faultproxy import FaultProxy
from helpers import eventually, stored_events
from history import HistoryReader, check_history
from scripted_upstream import ScriptedUpstream
from servers import Stack

from bench.procs import Proc
from broker.events import Event
from broker.redis.server import RedisServer, free_port


@dataclass
class Outcome:
    seed: int
    faults: list[str] = field(default_factory=list)
    streams: int = 0
    readers: int = 0
    reconnects: int = 0
    attempts: dict[str, int] = field(default_factory=dict)


class Deployment:
    """The processes and links of the module doc, and the faults the schedule can apply to them."""

    def __init__(self, server: RedisServer, stack_factory: Callable[[str], Stack], upstream: ScriptedUpstream,
                 tmp: Path) -> None:
        self.server = server
        self.upstream = upstream
        self.stack_factory = stack_factory
        self.tmp = tmp
        self.proxies: dict[str, FaultProxy] = {}
        self.generators: dict[str, Proc] = {}
        self.consumers: dict[str, tuple[Proc, int]] = {}
        for name in ("generator-a", "generator-b"):
            self.proxies[name] = FaultProxy(server.port)
            self.generators[name] = self._generator(name)
        for name in ("consumer-a", "consumer-b"):
            self.proxies[name] = FaultProxy(server.port)
            port = free_port()
            self.consumers[name] = (self._consumer(name, port), port)

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{port}" for _, port in self.consumers.values()]

    def _generator(self, name: str) -> Proc:
        return self.stack_factory(self.proxies[name].url).generator(
            "--upstream", self.upstream.url, "--concurrency", "8", "--lease-s", "2", "--max-attempts", "20",
            "--generator-grace-s", "1", ignore_eos=False)

    def _consumer(self, name: str, port: int) -> Proc:
        return self.stack_factory(self.proxies[name].url).consumer("--heartbeat-s", "1", "--shutdown-grace-s", "2",
                                                                   port=port)[0]

    def close(self) -> None:
        for proc in self.generators.values():
            if proc.proc.poll() is None:
                os.kill(proc.proc.pid, signal.SIGCONT)
        for p in self.proxies.values():
            p.close()

    # -- the faults: each applies itself and returns how to heal -------------------------------------------

    def latency(self, rng: random.Random) -> tuple[str, Callable[[], None]]:
        name = rng.choice(list(self.proxies))
        self.proxies[name].latency(0.1)
        return f"200 ms more on {name}'s link", lambda: self.proxies[name].latency(0.0)

    def half_open(self, rng: random.Random) -> tuple[str, Callable[[], None]]:
        name = rng.choice(list(self.proxies))
        partition = rng.random() < 0.5
        self.proxies[name].dark(new_too=partition)
        return f"{name}'s link {'partitioned' if partition else 'half-open'}", self.proxies[name].heal

    def reset(self, rng: random.Random) -> tuple[str, Callable[[], None]]:
        name = rng.choice(list(self.proxies))
        self.proxies[name].reset()
        return f"{name}'s connections reset", lambda: None

    def kill_generator(self, rng: random.Random) -> tuple[str, Callable[[], None]]:
        name = rng.choice(list(self.generators))
        how = rng.choice(["SIGKILL", "SIGSTOP", "SIGTERM"])
        proc = self.generators[name]
        if how == "SIGSTOP":
            os.kill(proc.proc.pid, signal.SIGSTOP)
            return f"{name} stopped (a zombie)", lambda: os.kill(proc.proc.pid, signal.SIGCONT)
        if how == "SIGKILL":
            proc.kill()
        else:
            proc.signal(signal.SIGTERM)

        def restart() -> None:
            proc.wait(15)
            self.generators[name] = self._generator(name)

        return f"{name} {how}", restart

    def drain_consumer(self, rng: random.Random) -> tuple[str, Callable[[], None]]:
        name = rng.choice(list(self.consumers))
        proc, port = self.consumers[name]
        proc.signal(signal.SIGTERM)

        def restart() -> None:
            proc.wait(15)
            self.consumers[name] = (self._consumer(name, port), port)

        return f"{name} drained", restart

    def restart_redis(self, rng: random.Random) -> tuple[str, Callable[[], None]]:
        self.server.stop()

        def start() -> None:
            self.server.start()

        return "redis stopped", start


def _create(urls: list[str], sid: str, tokens: int, rng: random.Random, deadline: float) -> None:
    """Create the stream through either pod, again (same id and body: idempotent) until one answers."""
    body = {"id": sid, "prompt": "Count", "max_tokens": tokens}
    while True:
        assert time.monotonic() < deadline, f"no pod took the create of {sid}"
        url = rng.choice(urls)
        try:
            r = httpx.post(f"{url}/v1/streams", json=body, timeout=15)
            if r.status_code in (200, 201):
                return
            assert r.status_code in (503, 507), (r.status_code, r.text)  # never a 500
        except httpx.HTTPError:
            pass  # a pod that is down: the other
        time.sleep(0.2)  # a client's pause before it tries again


def _words_ok(final: list[Event], tokens: int) -> int:
    """Each attempt's run of words ascends by one from w0; all runs make exactly ``tokens`` words. Returns the runs
    (the attempts that appended words)."""
    text = "".join(e.json()["text"] for e in final if e.type == "delta")
    words = text.split()
    assert len(words) == tokens, f"{len(words)} words for a budget of {tokens}"
    expected = 0
    for w in words:
        m = re.fullmatch(r"w(\d+)", w)
        assert m, w
        n = int(m.group(1))
        assert n in (expected, 0), f"w{expected} expected, got {w}: a piece twice or lost"
        expected = n + 1
    return words.count("w0")


def run_schedule(deployment: Deployment, redis_client: redis.Redis, *, seconds: float, seed: int | None = None,
                 streams: int = 16) -> Outcome:
    seed = int(os.environ.get("RSB_FAULT_SEED", seed if seed is not None else random.randrange(1 << 30)))
    print(f"\nfault schedule seed {seed} (RSB_FAULT_SEED={seed} replays it)", flush=True)
    rng = random.Random(seed)
    out = Outcome(seed)
    faults = [deployment.latency, deployment.half_open, deployment.reset, deployment.kill_generator,
              deployment.drain_consumer, deployment.restart_redis]
    budgets: dict[str, int] = {}
    readers: list[HistoryReader] = []
    t_end = time.monotonic() + seconds
    next_stream = time.monotonic()
    every_s = seconds / streams
    try:
        while time.monotonic() < t_end:
            if time.monotonic() >= next_stream and len(budgets) < streams:
                sid = str(uuid.uuid4())
                budgets[sid] = rng.randint(150, 600)
                _create(deployment.urls, sid, budgets[sid], rng, time.monotonic() + 60)
                readers += [HistoryReader(rng.sample(deployment.urls, 2), sid, timeout_s=seconds + 240).start()
                            for _ in range(2)]
                next_stream += every_s
            fault = rng.choice(faults)
            what, heal = fault(rng)
            out.faults.append(what)
            print(f"  {time.monotonic() - t_end + seconds:5.1f}s {what}", flush=True)
            time.sleep(rng.uniform(1.0, 6.0))  # the fault lasts a random while
            heal()
            time.sleep(rng.uniform(0.5, 2.0))  # and the calm before the next one
    finally:
        for p in deployment.proxies.values():
            p.heal()
            p.latency(0.0)
    # Whatever the schedule left: streams still to create, then everything ends.
    for _ in range(streams - len(budgets)):
        sid = str(uuid.uuid4())
        budgets[sid] = rng.randint(150, 600)
        _create(deployment.urls, sid, budgets[sid], rng, time.monotonic() + 60)
        readers += [HistoryReader(deployment.urls, sid, timeout_s=240).start() for _ in range(2)]
    finals: dict[str, list[Event]] = {}
    for sid, tokens in budgets.items():
        def ended(sid: str = sid) -> list[Event] | None:
            events = stored_events(redis_client, sid)
            return events if events and events[-1].is_terminal else None

        final: list[Event] = eventually(ended, 180, f"stream {sid} to end (seed {seed})")
        assert final[-1].type == "done", f"{sid} ended {final[-1].type}: {final[-1].json()} (seed {seed})"
        assert final[-1].json()["usage"]["completion_tokens"] == tokens
        out.attempts[sid] = _words_ok(final, tokens)
        finals[sid] = final
    for reader in readers:
        reader.join()
        check_history(reader, finals[reader.sid])
        out.reconnects += len(reader.segments) - 1
    out.streams, out.readers = len(finals), len(readers)
    return out
