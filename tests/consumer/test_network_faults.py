"""A consumer pod whose network to Redis fails while its process lives, through the tests' fault proxy
(tests/faultproxy.py) between the pod and a real redis-server; its generator reaches Redis directly.

- Cut off for 20 s (a partition: nothing delivered either way, no FIN, no RST) with readers attached: the readers
  keep their connections (heartbeats) or reconnect, and every one ends with the stream exactly (tests/history.py);
  creates meanwhile answer 503 with Retry-After within a bound, never a 500, never a hang; /readyz says 503.
- A half-open pub/sub link (it alone goes dark: a new one works): found dead within the bound
  (broker.redis.pubsub), /readyz 503 until it resubscribed, its readers resynced from the stream.
- A connection reset: the next create is Redis away (503) or succeeds on a new connection, never a 500.
- 200 ms more on every link of every process: streams read, resumed and ended exactly.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import httpx
import pytest
import redis
from faultproxy import FaultProxy
from helpers import create, eventually, stored_events, stored_text
from history import HistoryReader, check_history
from scripted_upstream import ScriptedUpstream, paced
from servers import Stack, StackFactory

from broker.events import Event
from broker.redis.connection import COMMAND_TIMEOUT_S
from broker.redis.pubsub.liveness import DEAD_AFTER_S, WATCH_TICK_S
from broker.redis.server import RedisServer

pytestmark = pytest.mark.slow

CUT_S = 20.0
# A create on a dark link: one command's timeout, a pool connection's wait, the retries' backoff; and a busy machine.
CREATE_BOUND_S = 3 * COMMAND_TIMEOUT_S
# A dead pub/sub link is found within DEAD_AFTER_S + WATCH_TICK_S; a loaded machine adds to it.
PUBSUB_BOUND_S = DEAD_AFTER_S + WATCH_TICK_S + 6


@pytest.fixture
def proxy(redis_server: RedisServer) -> Iterator[FaultProxy]:
    p = FaultProxy(redis_server.port)
    yield p
    p.close()


@pytest.fixture(scope="module")
def upstream() -> Iterator[ScriptedUpstream]:
    """The generators' engine: 100 words a second whatever the machine's load, at no CPU cost."""
    with ScriptedUpstream() as up:
        up.respond = paced(100)
        yield up


def _generator(stack: Stack, upstream: ScriptedUpstream) -> None:
    stack.generator("--upstream", upstream.url, "--concurrency", "8", ignore_eos=False)


def _final(redis_client: redis.Redis, sid: str, timeout_s: float = 120) -> list[Event]:
    def ended() -> list[Event] | None:
        events = stored_events(redis_client, sid)
        return events if events and events[-1].is_terminal else None

    final: list[Event] = eventually(ended, timeout_s, f"stream {sid} to end")
    return final


def test_a_pod_cut_off_for_20s_keeps_its_readers_and_answers_creates_503(
        stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis, proxy: FaultProxy,
        upstream: ScriptedUpstream) -> None:
    _generator(stack_factory(redis_server.url), upstream)
    _, url = stack_factory(proxy.url).consumer("--heartbeat-s", "1")
    with httpx.Client(base_url=url, timeout=60) as c:
        sid = create(c, max_tokens=2800).json()["id"]  # 28 s: it runs on through the cut
        readers = [HistoryReader([url], sid, timeout_s=180).start() for _ in range(3)]
        eventually(lambda: len(stored_text(redis_client, sid)) > 200, 30, "the answer to be under way")
        assert c.get("/readyz").status_code == 200

        proxy.dark()
        t_cut = time.monotonic()
        refused: list[tuple[int, float]] = []
        while time.monotonic() - t_cut < CUT_S:
            t0 = time.monotonic()
            r = create(c, max_tokens=4)
            took = time.monotonic() - t0
            refused.append((r.status_code, took))
            assert r.status_code == 503, (r.status_code, r.text)  # never a 500, never a 201 it cannot have stored
            assert r.json()["error"]["code"] == "unavailable" and int(r.headers["retry-after"]) >= 1
            assert took < CREATE_BOUND_S, f"a create took {took:.1f}s to fail"
            assert c.get("/readyz").status_code == 503
        proxy.heal()
        t_heal = time.monotonic()

        eventually(lambda: c.get("/readyz").status_code == 200, 30, "ready again")
        print(f"\ncut {CUT_S:.0f}s: {len(refused)} creates answered 503 in {max(t for _, t in refused):.1f}s at most; "
              f"ready {time.monotonic() - t_heal:.1f}s after the link healed")
        assert eventually(lambda: create(c, max_tokens=4).status_code == 201, 30)
    final = _final(redis_client, sid, 240)
    for reader in readers:
        reader.join()
        check_history(reader, final)
    # Connected readers were kept with heartbeats (or came back): none saw an error.
    assert all(s.end in ("clean", "cut", "http 503") for r in readers for s in r.segments)
    assert any(s.heartbeats for r in readers for s in r.segments)


def test_a_half_open_pubsub_link_is_found_the_pod_unready_until_it_resubscribed(
        stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis, proxy: FaultProxy,
        upstream: ScriptedUpstream) -> None:
    _generator(stack_factory(redis_server.url), upstream)
    _, url = stack_factory(proxy.url).consumer("--heartbeat-s", "1")
    with httpx.Client(base_url=url, timeout=60) as c:
        sid = create(c, max_tokens=1500).json()["id"]
        reader = HistoryReader([url], sid, timeout_s=180).start()
        eventually(lambda: len(stored_text(redis_client, sid)) > 200, 30, "the answer to be under way")
        # Only the pub/sub link goes dark (a lost NAT entry, a dead balancer flow): the pod's commands still work, so
        # what makes it unready is the hub alone.
        proxy.dark(sent=b"SUBSCRIBE")
        t0 = time.monotonic()
        eventually(lambda: c.get("/readyz").status_code == 503, PUBSUB_BOUND_S, "the dead pub/sub link to be found")
        found = time.monotonic() - t0
        eventually(lambda: c.get("/readyz").status_code == 200, 30, "resubscribed on a new link")
        print(f"\nhalf-open pub/sub: not ready after {found:.1f}s, ready again after {time.monotonic() - t0:.1f}s")
        assert found >= 2.0, "unready before the link could have been found dead: something else failed"
        # Live events flow again on the new link: the reader gets the rest, exactly.
        before = len(stored_text(redis_client, sid))
        eventually(lambda: sum(len(e.data.get("text", "")) for e in reader.events if e.event == "delta") > before,
                   30, "live events to reach the reader again")
    final = _final(redis_client, sid, 240)
    reader.join()
    check_history(reader, final)
    proxy.heal()


def test_a_reset_connection_is_never_a_500(stack_factory: StackFactory, redis_server: RedisServer,
                                           redis_client: redis.Redis, proxy: FaultProxy,
                                           upstream: ScriptedUpstream) -> None:
    _generator(stack_factory(redis_server.url), upstream)
    _, url = stack_factory(proxy.url).consumer()
    with httpx.Client(base_url=url, timeout=30) as c:
        assert create(c, max_tokens=2).status_code == 201
        for _ in range(3):
            proxy.reset()  # every pooled connection of the pod is reset by the network
            time.sleep(0.2)  # the resets reach the pod's sockets before the next requests (nothing shows it)
            codes = [create(c, max_tokens=2).status_code for _ in range(4)] + [c.get("/readyz").status_code]
            assert set(codes) <= {201, 200, 503}, codes
            assert 201 in codes or 503 in codes


def test_200ms_more_on_every_link_of_every_process(stack_factory: StackFactory, redis_server: RedisServer,
                                                   redis_client: redis.Redis, upstream: ScriptedUpstream) -> None:
    proxies = [FaultProxy(redis_server.port) for _ in range(3)]  # a generator and two consumers, each its own link
    try:
        for p in proxies:
            p.latency(0.1)  # each way: 200 ms more per round trip
        _generator(stack_factory(proxies[0].url), upstream)
        urls = [stack_factory(p.url).consumer("--heartbeat-s", "1")[1] for p in proxies[1:]]
        with httpx.Client(base_url=urls[0], timeout=60) as c:
            sids = [create(c, id=str(uuid.uuid4()), max_tokens=400).json()["id"] for _ in range(3)]
        readers = [HistoryReader(urls[i % 2:] + urls[:i % 2], sid, timeout_s=180, read_timeout_s=5).start()
                   for i, sid in enumerate(sids) for _ in range(2)]
        for reader in readers:
            reader.join()
            check_history(reader, _final(redis_client, reader.sid))
    finally:
        for p in proxies:
            p.close()
