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
import socket
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
from consumer.streaming.webhooks import DELIVERY_TIMEOUT_S, PER_DESTINATION, WebhookRefused, check_destination

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
                time.sleep(sleep_s)  # a receiver as slow as the test scripts it
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
        time.sleep(20)  # deliberate: the receiver is down for 20 s
        retried = metric(c.get("/metrics").text, "rsb_webhooks_retried_total")
        # Each event tried within 5 s; then the destination, failing, is held (2 s, doubling) and probed once per
        # hold: tried all along, never more than BREAKER_MAX_S (30 s) apart.
        assert retried >= 3 + 3, "tries while it was down"
        receiver.start()
        eventually(lambda: {e.data.id for e in receiver.verified()} == set(sids), 90, "every event, once back")
        # Back at 20 s: the hold by then is at most 16 s, and the probe's success releases every event.
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
        time.sleep(2)  # deliberate: two seconds in which no more tries may come
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
    assert len(ids) <= 50 + PER_DESTINATION  # at least once: only what the dead pod had in flight came twice
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


@dataclass
class Tarpit:
    """A webhook receiver that accepts every connection and never answers (nor reads): each delivery to it lasts
    until rsb's timeout. Counts the connections open at once."""

    port: int
    sock: socket.socket | None = None
    held: list[socket.socket] = field(default_factory=list)
    accepted: int = 0
    most_at_once: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hooks"

    def start(self) -> Tarpit:
        self.sock = socket.create_server(("127.0.0.1", self.port), backlog=512)

        def serve() -> None:
            assert self.sock is not None
            while True:
                try:
                    conn, _ = self.sock.accept()
                except OSError:
                    return
                self.accepted += 1
                self.held = [c for c in self.held if _open(c)] + [conn]
                self.most_at_once = max(self.most_at_once, len(self.held))

        threading.Thread(target=serve, daemon=True).start()
        return self

    def stop(self) -> None:
        if self.sock is not None:
            self.sock.close()
        for c in self.held:
            c.close()


def _open(conn: socket.socket) -> bool:
    """Whether the peer still holds the connection (rsb closes it at its timeout)."""
    try:
        conn.setblocking(False)
        return conn.recv(65536, socket.MSG_PEEK) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


def test_a_tarpit_receiver_delays_no_other_tenants_events(stack_factory: StackFactory, redis_server: RedisServer,
                                                         redis_client: redis.Redis, receiver: Receiver,
                                                         tmp_path: Path) -> None:
    """Issue 42: 100 events of one key aimed at a receiver that never answers took a pod's 32 shared delivery slots;
    another key's event came 30.5 s late, and later still as the first key kept going. Now: at most PER_DESTINATION
    deliveries in flight per destination, a circuit breaker, and the other key's event is delivered without waiting
    for any of the tarpit's (each of which lasts DELIVERY_TIMEOUT_S). Each key's events are signed with its own
    webhook_secret (else --webhook-secret's), and one key's pending events are bounded (--webhook-max-pending) and
    counted in its storage quota."""
    tarpit = Tarpit(free_port()).start()
    receiver.start()
    bob_secret = "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()
    mallory, mallory_entry = new_key("mallory")
    bob, bob_entry = new_key("bob")
    carol, carol_entry = new_key("carol")
    keys = tmp_path / "keys.json"
    keys.write_bytes(orjson.dumps({"keys": [{**mallory_entry, "webhook_url": tarpit.url},
                                            {**bob_entry, "webhook_url": receiver.url, "webhook_secret": bob_secret},
                                            {**carol_entry, "webhook_url": receiver.url}]}))
    s = stack_factory(redis_server.url)
    s.consumer("--api-keys", str(keys), "--webhook-allow-private", "--webhook-max-pending", "100")
    m, b, c_ = ({"Authorization": f"Bearer {t}"} for t in (mallory, bob, carol))
    try:
        with s.client() as c:
            for _ in range(100):  # free events: created and cancelled while queued (no generator runs)
                sid = c.post("/v1/streams", json={"prompt": "x", "max_tokens": 4}, headers=m).json()["id"]
                assert c.post(f"/v1/streams/{sid}/cancel", headers=m).json()["status"] == "cancelled"
            eventually(lambda: tarpit.accepted >= PER_DESTINATION, 10, "the tarpit's deliveries under way")
            # Mallory's pending events are bounded, and counted in its quota.
            r = c.post("/v1/streams", json={"prompt": "x", "max_tokens": 4}, headers=m)
            assert r.status_code == 429 and r.json()["error"]["code"] == "webhook_backlog", r.text
            held = redis_client.hmget("rsb:{p0}:storage:mallory", "hooks", "bytes")
            assert int(held[0] or 0) == 100 and int(held[1] or 0) >= 100 * 512
            for who, headers in (("bob", b), ("carol", c_)):
                sid = c.post("/v1/streams", json={"prompt": "x", "max_tokens": 4}, headers=headers).json()["id"]
                ended = time.monotonic()
                assert c.post(f"/v1/streams/{sid}/cancel", headers=headers).json()["status"] == "cancelled"
                def arrived(sid: str = sid) -> Hit | None:
                    return next((h for h in receiver.hits if orjson.loads(h.body)["data"]["id"] == sid), None)

                hit = eventually(arrived, 30, who)
                # Never behind one of the tarpit's deliveries, each of which waits DELIVERY_TIMEOUT_S.
                assert hit.at - ended < DELIVERY_TIMEOUT_S / 2, f"{who}'s event came {hit.at - ended:.1f} s late"
        assert tarpit.most_at_once <= PER_DESTINATION
        bob_hit, carol_hit = receiver.hits
        standardwebhooks.Webhook(bob_secret).verify(bob_hit.body, bob_hit.headers)
        with pytest.raises(standardwebhooks.WebhookVerificationError):
            standardwebhooks.Webhook(SECRET).verify(bob_hit.body, bob_hit.headers)  # the flag's secret is not bob's
        standardwebhooks.Webhook(SECRET).verify(carol_hit.body, carol_hit.headers)
    finally:
        tarpit.stop()


def test_ipv6_literals_that_embed_a_private_ipv4_are_private() -> None:
    """Issue 42: ``[::127.0.0.1]``, NAT64 ``64:ff9b::/96`` and 6to4 ``2002::/16`` addresses passed the guard."""
    private = ["::127.0.0.1", "::ffff:10.0.0.1", "::ffff:0:a00:1", "64:ff9b::7f00:1", "64:ff9b::a9fe:a9fe",
               "64:ff9b::c0a8:101", "2002:7f00:1::1", "2002:a00:1::5", "2002:a9fe:a9fe::1", "64:ff9b:1::808:808",
               "2001:0:4136:e378:8000:63bf:3fff:fdd2",  # Teredo, its client 192.0.2.45 (documentation)
               "2001:0:a00:1::1",  # Teredo through a server at 10.0.0.1
               "2600::5efe:a00:1", "2600::200:5efe:7f00:1",  # ISATAP of 10.0.0.1, 127.0.0.1
               "::", "::1", "fe80::1", "fc00::1"]
    for literal in private:
        with pytest.raises(WebhookRefused, match="webhook-allow-private"):
            check_destination(f"http://[{literal}]:8080/hook", allow_private=False)
    for literal in ("2606:4700:4700::1111", "64:ff9b::808:808", "2002:808:808::1"):  # public, or reaching 8.8.8.8
        check_destination(f"http://[{literal}]/hook", allow_private=False)
    check_destination("http://[::127.0.0.1]/hook", allow_private=True)
