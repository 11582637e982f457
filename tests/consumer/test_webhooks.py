"""Webhooks with real receivers (HTTP servers on this machine) and real rsb processes: every event is checked by
openai's ``client.webhooks.unwrap`` and by ``standardwebhooks``' verifier, as a receiver would check it. A receiver
down for 20 s and then back, one answering 500, one that sleeps 30 s on its first request; the delivering consumer
SIGKILLed with deliveries in flight, 50 generations giving exactly 50 distinct events; private destinations
refused at start."""

from __future__ import annotations

import base64
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
import redis
import standardwebhooks
from helpers import create, eventually, metric, read_sse, wait_status
from servers import Stack, StackFactory

from broker.redis.server import RedisServer, free_port
from broker.streams.outbox import LEASE_MS, retry_delay_s
from consumer.edge.auth import new_key
from consumer.streaming.webhooks import MAX_IN_FLIGHT

pytestmark = pytest.mark.slow

SECRET = "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()
ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Hit:
    at: float
    headers: dict[str, str]
    body: bytes


@dataclass
class Receiver:
    """A webhook receiver: ``answer(hit number)`` is (status, seconds to sleep first)."""

    port: int
    answer: Callable[[int], tuple[int, float]] = lambda n: (200, 0.0)
    hits: list[Hit] = field(default_factory=list)
    server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hooks"

    def start(self) -> Receiver:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.hits.append(Hit(time.monotonic(), {k.lower(): v for k, v in self.headers.items()}, body))
                status, sleep_s = receiver.answer(len(receiver.hits))
                time.sleep(sleep_s)
                try:
                    self.send_response(status)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                except OSError:
                    pass  # rsb gave up waiting

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()

    def verified(self) -> list[Any]:
        """Every hit, checked by both verifiers (each raises on a bad signature or a stale timestamp)."""
        sdk = openai.OpenAI(api_key="unused", webhook_secret=SECRET)
        events: list[Any] = []
        for hit in self.hits:
            standardwebhooks.Webhook(SECRET).verify(hit.body, hit.headers)
            events.append(sdk.webhooks.unwrap(hit.body, hit.headers))
            assert hit.headers["content-type"] == "application/json"
        return events


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver(free_port())
    yield r
    r.stop()


def _stack(stack_factory: StackFactory, redis_url: str, url: str, *extra: str) -> Stack:
    s = stack_factory(redis_url)
    s.consumer("--webhook-url", url, "--webhook-allow-private", *extra)
    return s


def _env() -> dict[str, str]:
    return {**os.environ, "RSB_WEBHOOK_SECRET": SECRET}


@pytest.fixture(autouse=True)
def _secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RSB_WEBHOOK_SECRET", SECRET)  # the processes the stack starts inherit it (it is a secret)


def test_each_end_is_one_signed_event_in_openais_shape(stack_factory: StackFactory, redis_server: RedisServer,
                                                       redis_client: redis.Redis, receiver: Receiver) -> None:
    receiver.start()
    s = _stack(stack_factory, redis_server.url, receiver.url)
    with s.client() as c:
        queued = create(c, max_tokens=8).json()["id"]  # no generator yet: cancelled while queued
        assert c.post(f"/v1/streams/{queued}/cancel").json()["status"] == "cancelled"
        s.generator()
        done = create(c, max_tokens=8).json()["id"]  # ignore_eos: it stops at max_tokens
        wait_status(c, done, {"done"})
        resp = c.post("/v1/responses", json={"model": "m", "input": "hi", "max_output_tokens": 8,
                                             "background": True})
        assert resp.status_code == 200, resp.text
        eventually(lambda: len(receiver.hits) == 3, 30, "three events")
        events = {e.data.id: e for e in receiver.verified()}
        assert events[queued].type == "response.cancelled" and events[done].type == "response.incomplete"
        assert events[resp.json()["id"]].type == "response.incomplete"
        assert all(e.object == "event" and e.id.startswith("evt_") for e in events.values())
        assert abs(events[done].created_at - time.time()) < 60
        time.sleep(1.5)  # nothing more comes: one event per end
        assert len(receiver.hits) == 3
        text = c.get("/metrics").text
        assert metric(text, "rsb_webhooks_delivered_total") == 3 and metric(text, "rsb_webhooks_pending") == 0


def test_a_receiver_down_for_20_s_gets_its_events_once_back(stack_factory: StackFactory, redis_server: RedisServer,
                                                             redis_client: redis.Redis, receiver: Receiver) -> None:
    s = _stack(stack_factory, redis_server.url, receiver.url)  # nothing listens on the port yet
    s.generator()
    with s.client() as c:
        sids = [create(c, max_tokens=4).json()["id"] for _ in range(3)]
        for sid in sids:
            wait_status(c, sid, {"done"})
        down_at = time.monotonic()
        time.sleep(20)
        retried = metric(c.get("/metrics").text, "rsb_webhooks_retried_total")
        assert retried >= 3 * 5, "tries while it was down: no gap over 60 s, the first within 5 s"
        receiver.start()
        eventually(lambda: {e.data.id for e in receiver.verified()} == set(sids), 90, "every event, once back")
        # Back at 20 s: the gaps by then are at most 16 s, so every event arrives within ~20 s of its return.
        assert max(h.at for h in receiver.hits) - down_at < 45
        assert metric(c.get("/metrics").text, "rsb_webhooks_delivered_total") == 3


def test_a_receiver_answering_500_gets_the_same_webhook_id_on_every_retry(
        stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis, receiver: Receiver) -> None:
    receiver.answer = lambda n: (500 if n <= 3 else 204, 0.0)
    receiver.start()
    s = _stack(stack_factory, redis_server.url, receiver.url)
    s.generator()
    with s.client() as c:
        sid = create(c, max_tokens=4).json()["id"]
        wait_status(c, sid, {"done"})
        eventually(lambda: len(receiver.hits) == 4, 60, "three 500s, then a 204")
        time.sleep(2)
        assert len(receiver.hits) == 4  # delivered: no more tries
    assert len({h.headers["webhook-id"] for h in receiver.hits}) == 1
    assert len({h.body for h in receiver.hits}) == 1  # the same event, signed again at each try
    gaps = [b.at - a.at for a, b in zip(receiver.hits, receiver.hits[1:], strict=False)]
    assert gaps[0] < 5 and all(g < 60 for g in gaps), gaps
    assert {e.data.id for e in receiver.verified()} == {sid}


def test_a_receiver_sleeping_30_s_delays_no_stream(stack_factory: StackFactory, redis_server: RedisServer,
                                                   redis_client: redis.Redis, receiver: Receiver) -> None:
    receiver.answer = lambda n: (200, 30.0 if n == 1 else 0.0)
    receiver.start()
    s = _stack(stack_factory, redis_server.url, receiver.url)
    s.generator()
    with s.client() as c:
        first = create(c, max_tokens=4).json()["id"]
        wait_status(c, first, {"done"})
        eventually(lambda: len(receiver.hits) == 1, 20, "the first delivery, which the receiver sits on")
        # While it sleeps, streams run as ever: each of these ends well within the receiver's 30 s.
        started = time.monotonic()
        for _ in range(5):
            sid = create(c, max_tokens=16).json()["id"]
            assert read_sse(c, f"/v1/streams/{sid}/events").events[-1].event == "done"
        assert time.monotonic() - started < 15
        # Its try timed out (10 s) and is retried, with the same webhook-id; the retry is answered at once.
        def named(sid: str) -> list[Hit]:
            return [h for h in receiver.hits if orjson.loads(h.body)["data"]["id"] == sid]

        eventually(lambda: len(named(first)) == 2, 60, "the first event tried again")
        eventually(lambda: metric(c.get("/metrics").text, "rsb_webhooks_pending") == 0, 30, "every event delivered")
        assert len({h.headers["webhook-id"] for h in named(first)}) == 1
        assert len({e.data.id for e in receiver.verified()}) == 6
        assert metric(c.get("/metrics").text, "rsb_webhooks_retried_total") == 1


def test_the_delivering_consumer_sigkilled_50_generations_50_events(
        stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis, receiver: Receiver) -> None:
    receiver.answer = lambda n: (200, 2.0)  # slow: deliveries are in flight when the consumer dies
    receiver.start()
    s = stack_factory(redis_server.url)
    victim, victim_url = s.consumer("--webhook-url", receiver.url, "--webhook-allow-private")
    s.generator()
    with s.client(victim_url) as c:
        sids = [create(c, max_tokens=2).json()["id"] for _ in range(50)]
        for sid in sids:
            wait_status(c, sid, {"done"})
        eventually(lambda: len(receiver.hits) >= 5, 30, "deliveries under way")
    victim.signal(signal.SIGKILL)
    victim.wait(5)
    killed_at = time.monotonic()
    _, url = s.consumer("--webhook-url", receiver.url, "--webhook-allow-private")
    eventually(lambda: {e.data.id for e in receiver.verified()} == set(sids), 120, "50 distinct events")
    every = time.monotonic() - killed_at
    with httpx.Client(base_url=url) as c:
        # The events the dead pod had in flight are its until their lease ends; then the survivor sends them again.
        eventually(lambda: metric(c.get("/metrics").text, "rsb_webhooks_pending") == 0, LEASE_MS / 1000 + 60,
                   "the dead pod's leases taken over")
    ids = [h.headers["webhook-id"] for h in receiver.hits]
    assert len(set(ids)) == 50 and {e.data.id for e in receiver.verified()} == set(sids)
    assert len(ids) <= 50 + MAX_IN_FLIGHT  # at least once: only what the dead pod had in flight came twice
    print(f"50 events in {len(ids)} deliveries; all 50 {every:.1f} s after the SIGKILL, the last "
          f"{max(h.at for h in receiver.hits) - killed_at:.1f} s after it")


def test_private_destinations_are_refused_at_start(redis_server: RedisServer, redis_client: redis.Redis,
                                                   tmp_path: Path) -> None:
    def consumer(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "rsb", "consumer", "--redis-url", redis_server.url,
                               "--port", str(free_port()), *args], capture_output=True, text=True, timeout=60,
                              cwd=ROOT, env=_env())

    for url in ("http://127.0.0.1:9/x", "http://10.1.2.3/x", "http://[::1]/x", "http://169.254.169.254/latest"):
        r = consumer("--webhook-url", url)
        assert r.returncode == 2 and "--webhook-allow-private" in r.stderr, (url, r.stderr)
    _, entry = new_key("alice")
    keys = tmp_path / "keys.json"
    keys.write_bytes(orjson.dumps({"keys": [{**entry, "webhook_url": "http://localhost:9/x"}]}))
    r = consumer("--api-keys", str(keys))
    assert r.returncode == 2 and "--webhook-allow-private" in r.stderr and "localhost" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "rsb", "consumer", "--redis-url", redis_server.url,
                        "--webhook-url", "http://127.0.0.1:9/x", "--webhook-allow-private"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT,
                       env={k: v for k, v in os.environ.items() if k != "RSB_WEBHOOK_SECRET"})
    assert r.returncode == 2 and "--webhook-secret" in r.stderr, r.stderr


def test_the_backoff_schedule() -> None:
    assert retry_delay_s(1, 0) <= 1.0 and retry_delay_s(2, 1) <= 2.0
    assert all(retry_delay_s(n, 600) <= 60 for n in range(1, 100))
    assert sum(retry_delay_s(n, 0) for n in range(1, 4)) < 7
    assert 240 <= retry_delay_s(50, 4000) <= 300
