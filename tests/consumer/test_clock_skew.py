"""Pods whose clocks disagree agree on every time rsb stores or compares: a consumer and a generator run under
libfaketime with their clocks moved a minute apart (+60 s / -60 s each way), and no lease, abandonment, usage or
webhook figure changes. Every such time is the Redis server's, read inside the script that uses it
(docs/ARCHITECTURE.md, "One clock"); before, a consumer behind cancelled a read stream as ``abandoned``, a generator
ahead cancelled it as ``disconnect`` (one behind went on generating past the grace), the ledger's ``queue_s`` read 0
for a real wait, and two webhook pods delivered events twice. Real processes on a real redis-server."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import cast

import orjson
import pytest
import redis
from helpers import SSERead, create, eventually, read_sse, wait_status
from servers import StackFactory

from broker.errors import Unauthorized
from broker.redis.connection import reply_text
from broker.redis.server import RedisServer, free_port
from broker.redis.server_clock import ServerClock
from broker.streams.keys import outbox_key, usage_log_prefix
from consumer.edge.auth import ApiKey, ApiKeys, new_key

SKEW_S = 60
#: Where Debian's libfaketime (the ``faketime`` package, scripts/test.sh's SYSTEM_PACKAGES) puts its library.
_LIBFAKETIME = [*sorted(glob.glob("/usr/lib/*/faketime/libfaketime.so.1")), "/usr/lib/faketime/libfaketime.so.1",
                "/usr/local/lib/faketime/libfaketime.so.1"]


def _library() -> str | None:
    return next((p for p in _LIBFAKETIME if os.path.exists(p)), None)


def skewed(offset_s: int) -> dict[str, str]:
    """The environment of a process whose wall clock is ``offset_s`` off (its monotonic clock is left alone)."""
    lib = _library()
    if lib is None:
        pytest.skip("libfaketime is not installed (Debian: apt-get install faketime): no clock to skew")
    env = {"LD_PRELOAD": lib, "FAKETIME": f"{offset_s:+d}s", "DONT_FAKE_MONOTONIC": "1"}
    # The library must move what Python's time.time() reads in a child process, or this test proves nothing.
    out = subprocess.run([sys.executable, "-c", "import time; print(time.time())"], env={**os.environ, **env},
                         capture_output=True, text=True, timeout=30, check=True).stdout
    if abs(float(out) - time.time() - offset_s) > 10:
        pytest.skip(f"libfaketime at {lib} does not move time.time() in a child process")
    return env


@pytest.mark.slow
@pytest.mark.parametrize("skew", [SKEW_S, -SKEW_S], ids=["consumer-ahead", "consumer-behind"])
def test_skewed_pods_agree_on_abandonment_disconnect_and_the_wait(
        stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis, slow_model: Path,
        skew: int) -> None:
    """The consumer's clock ``skew`` off and the generator's as far the other way (two minutes apart)."""
    s = stack_factory(redis_server.url)
    # A reader's pod marks it every 2 s (consumer.app.TOUCH_INTERVAL_S): the grace and the abandonment bound are over
    # that, with room for a busy machine's late marks. A skewed minute is far past either.
    abandon_s, grace_s = 20, 5
    s.consumer("--abandon-after-s", str(abandon_s), env=skewed(skew))
    s.generator("--lease-s", "1", "--disconnect-grace-s", str(grace_s), model=slow_model, env=skewed(-skew))
    with s.client() as c:
        # Streams read to their end: not abandoned, not disconnected, whoever's clock is ahead. B waits behind A (one
        # generation at a time), its reader connected while it waits.
        a = create(c, max_tokens=300, cancel_on_disconnect=True).json()["id"]
        b = create(c, max_tokens=16).json()["id"]
        b_created = time.monotonic()
        reads: dict[str, SSERead] = {}

        def read_b() -> None:
            with s.client() as cb:
                reads["b"] = read_sse(cb, f"/v1/streams/{b}/events")

        reader_b = threading.Thread(target=read_b)
        reader_b.start()
        read_a = read_sse(c, f"/v1/streams/{a}/events")
        a_ended = time.monotonic()
        assert read_a.events[-1].event == "done", read_a.events[-1]
        reader_b.join(60)
        assert reads["b"].events[-1].event == "done", reads["b"].events[-1]  # not cancelled at its claim
        # Its ledger's wait is the server's, from its create to its claim: what this test saw it wait, not 0 and
        # not a minute more.
        log = cast("list[tuple[bytes, dict[bytes, bytes]]]", redis_client.xrange(usage_log_prefix(0, 1) + "-"))
        records = {reply_text(f[b"sid"]): f for _, f in log}
        queue_s = float(records[b][b"queue_s"])
        # (Less the 2 s this test may see A's end after B's claim on a busy machine: A takes 3 s and more.)
        assert a_ended - b_created - 2.0 <= queue_s <= time.monotonic() - b_created, queue_s
        assert abs(float(records[b][b"ts"]) - time.time()) < 30  # the server's time, not a pod's

        # C's reader leaves: it is cancelled as ``disconnect`` within the grace, not generated to its end.
        c_id = create(c, max_tokens=4000, cancel_on_disconnect=True).json()["id"]
        head = read_sse(c, f"/v1/streams/{c_id}/events", stop_after=10)
        left = time.monotonic()
        st = wait_status(c, c_id, {"cancelled", "done"}, timeout_s=30)
        cancelled_after = time.monotonic() - left
        assert st["status"] == "cancelled", st
        end = read_sse(c, f"/v1/streams/{c_id}/events", headers={"Last-Event-ID": head.ids[-1]}).events[-1]
        assert end.data["reason"] == "disconnect" and end.data["usage"]["completion_tokens"] < 4000
        # The grace, a renewal (a third of the 1 s lease) and a busy machine's latency; far from the skew's minute.
        assert cancelled_after < grace_s + 15, cancelled_after


class _Receiver:
    """A webhook receiver that holds each delivery ``hold_s`` before its 200: deliveries stay in flight while the
    other pod polls the outbox."""

    def __init__(self, hold_s: float) -> None:
        self.hold_s = hold_s
        self.ids: list[str] = []
        self.bodies: list[dict[str, object]] = []
        self.in_flight = 0
        self._lock = threading.Lock()
        self.port = free_port()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with receiver._lock:
                    receiver.ids.append(self.headers["webhook-id"])
                    receiver.bodies.append(orjson.loads(body))
                    receiver.in_flight += 1
                try:
                    time.sleep(receiver.hold_s)  # a receiver as slow as the test scripts it
                    self.send_response(200)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                except OSError:
                    pass
                finally:
                    with receiver._lock:
                        receiver.in_flight -= 1

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hooks"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[_Receiver]:
    r = _Receiver(hold_s=1.0)
    yield r
    r.stop()


@pytest.mark.slow
@pytest.mark.parametrize("skew", [SKEW_S, -SKEW_S], ids=["ahead", "behind"])
def test_two_webhook_pods_whose_clocks_disagree_deliver_each_event_once(
        stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis, receiver: _Receiver,
        monkeypatch: pytest.MonkeyPatch, skew: int) -> None:
    monkeypatch.setenv("RSB_WEBHOOK_SECRET", "whsec_" + "A" * 44)  # the pods inherit it
    s = stack_factory(redis_server.url)
    hooks = ("--webhook-url", receiver.url, "--webhook-allow-private")
    _, right = s.consumer(*hooks)
    _, off = s.consumer(*hooks, env=skewed(skew))
    n = 8
    for i in range(n):  # no generator: each is cancelled while queued, and its end is one webhook event
        with s.client(right if i % 2 else off) as c:
            sid = create(c, max_tokens=8).json()["id"]
            assert c.post(f"/v1/streams/{sid}/cancel").json()["status"] == "cancelled"
    # Delivered and out of the outbox, and no delivery in flight: then every POST the pods made has arrived.
    eventually(lambda: len(receiver.ids) >= n and redis_client.hlen(outbox_key(0, 1)) == 0
               and receiver.in_flight == 0, 60, "every event delivered")
    assert len(receiver.ids) == n and len(set(receiver.ids)) == n, sorted(receiver.ids)
    # Each event's created_at is the server's time of its end, whichever pod's request ended it.
    assert all(abs(int(str(b["created_at"])) - time.time()) < 30 for b in receiver.bodies), receiver.bodies


# -- what a pod states itself: read tokens, conversation times, Durable Streams cursors (broker.redis.server_clock)

class _Server:
    """The Redis server's clock as the test moves it, read by every pod's ServerClock."""

    def __init__(self) -> None:
        self.t = 1_800_000_000.0
        self.mono = 0.0

    async def read(self) -> float:
        return self.t

    def pod_clock(self) -> ServerClock:
        return ServerClock(self.read, monotonic=lambda: self.mono)

    def advance(self, s: float) -> None:
        self.t += s
        self.mono += s


@pytest.mark.parametrize("skew", [SKEW_S, -SKEW_S], ids=["minted-behind", "minted-ahead"])
async def test_a_read_token_minted_on_one_pod_holds_on_another_until_the_servers_clock_says(
        monkeypatch: pytest.MonkeyPatch, skew: int) -> None:
    """Pods two minutes apart (the minting one ``-skew``, the checking one ``+skew``) and a 30 s token: it reads on
    either pod for its 30 s of the server's time, then on neither. Before, a pod behind minted tokens a pod ahead
    refused at once, and a pod behind honoured a pod ahead's for two minutes more."""
    server = _Server()
    secret = b"s" * 32
    key = ApiKey("alice", b"\0" * 32)
    minting, checking = ApiKeys([key], secret), ApiKeys([key], secret)
    minting.set_clock(server.pod_clock().now)
    checking.set_clock(server.pod_clock().now)
    sid = uuid.uuid4()
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() - skew)
    token = await minting.issue_read_token(sid, "alice", 30)
    assert int(token.split(".")[0]) == int(server.t) + 30
    for wall_s in (skew, -skew):
        monkeypatch.setattr(time, "time", lambda w=wall_s: real() + w)
        assert await checking.check_read_token(token, sid) == "alice"
        assert await minting.check_read_token(token, sid) == "alice"
    server.advance(31)
    for pod in (checking, minting):
        with pytest.raises(Unauthorized, match="expired"):
            await pod.check_read_token(token, sid)


@pytest.mark.slow
def test_pods_a_minute_either_way_agree_on_read_tokens_conversation_times_and_cursors(
        stack_factory: StackFactory, redis_server: RedisServer, tmp_path: Path) -> None:
    """Real consumers under libfaketime, one a minute behind and one a minute ahead: a 5 s read token minted behind
    reads ahead and ends after 5 s of the server's time on both; conversation items added on either show the
    server's time; a Durable Streams cursor is the same 20 s interval from either pod."""
    behind_env, ahead_env = skewed(-SKEW_S), skewed(SKEW_S)
    secret, entry = new_key("alice")
    keys = tmp_path / "keys.json"
    keys.write_bytes(orjson.dumps({"keys": [entry]}))
    auth = {"Authorization": f"Bearer {secret}"}
    s = stack_factory(redis_server.url)
    flags = ("--api-keys", str(keys), "--read-token-ttl-s", "5")
    _, behind = s.consumer(*flags, env=behind_env)
    _, ahead = s.consumer(*flags, env=ahead_env)
    with s.client(behind) as b, s.client(ahead) as a:
        created = b.post("/v1/streams", json={"id": str(uuid.uuid4()), "prompt": "x", "max_tokens": 4}, headers=auth)
        sid, token = created.json()["id"], created.json()["read_token"]
        minted = time.time()
        assert abs(int(token.split(".")[0]) - (minted + 5)) <= 2  # the server's time, not the minting pod's
        for c in (a, b):
            assert c.get(f"/v1/streams/{sid}", params={"token": token}).status_code == 200
        time.sleep(max(0.0, minted + 7 - time.time()))
        for c in (a, b):
            assert c.get(f"/v1/streams/{sid}", params={"token": token}).status_code == 401

        item = {"type": "message", "role": "user", "content": "hello"}
        conv = b.post("/v1/conversations", json={"items": [item]}, headers=auth).json()
        assert a.post(f"/v1/conversations/{conv['id']}/items", json={"items": [item]}, headers=auth).status_code == 200
        assert abs(conv["created_at"] - time.time()) < 10
        turns = a.get(f"/v1/conversations/{conv['id']}/turns", headers=auth).json()["turns"]
        assert len(turns) == 2
        for turn in turns:
            shown = datetime.fromisoformat(turn["created_at"].replace("Z", "+00:00")).timestamp()
            assert abs(shown - time.time()) < 10, turns

        path = f"/v1/stream/t-{uuid.uuid4().hex}"
        assert b.put(path, content=b"x", headers={**auth, "Content-Type": "text/plain"}).status_code == 201
        # A long-poll from the start answers at once (there is data), with its cursor.
        cursors = [int(c.get(path, params={"offset": "-1", "live": "long-poll"}, headers=auth)
                       .headers["stream-cursor"]) for c in (b, a, b)]
        assert max(cursors) - min(cursors) <= 1, cursors  # a minute apart was three 20 s intervals each way
