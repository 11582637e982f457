"""Through a real nginx running deploy/nginx.conf (least_conn over two real `rsb consumer` processes): each
event reaches the browser within milliseconds of its append, and a reader whose pod is drained (SIGTERM)
or killed (SIGKILL) mid-stream resumes on the other pod through nginx with nothing lost or repeated."""

from __future__ import annotations

import signal
import statistics
import threading
import time
from pathlib import Path
from typing import cast

import httpx
import pytest
import redis
from helpers import ResumingRead, create, eventually, read_resuming, read_sse
from servers import NginxFactory, Stack, StackFactory

from bench.procs import Nginx, Proc
from broker.redis.server import RedisServer

pytestmark = pytest.mark.slow


def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return next(float(line.split()[1]) for line in text.splitlines() if line.startswith(name + " "))


def _front(stack_factory: StackFactory, redis_server: RedisServer, nginx_factory: NginxFactory
           ) -> tuple[Stack, list[tuple[Proc, str]], Nginx]:
    s = stack_factory(redis_server.url)
    pods = [s.consumer("--heartbeat-s", "1", "--shutdown-grace-s", "3") for _ in range(2)]
    nginx = nginx_factory([int(url.rsplit(":", 1)[1]) for _, url in pods])
    return s, pods, nginx


def test_events_reach_the_reader_through_nginx_within_milliseconds(stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis,
                                                                    nginx_factory: NginxFactory, slow_model: Path) -> None:
    """A proxy that buffers holds events back until its buffer fills: nearly every event reaches its reader later
    than it reaches a reader of the pod itself. So the reader through nginx is compared with one reading the pod
    directly at the same time, event by event: what a busy machine delays, it delays for both."""
    s, pods, nginx = _front(stack_factory, redis_server, nginx_factory)
    with httpx.Client(base_url=nginx.url, timeout=10) as c:
        sid = create(c, max_tokens=1500).json()["id"]  # queued: no generator yet
    proxied, direct = ResumingRead(), ResumingRead()
    readers = [threading.Thread(target=read_resuming, args=(url, sid), kwargs={"into": into})
               for url, into in ((nginx.url, proxied), (pods[0][1], direct))]
    for reader in readers:
        reader.start()
    eventually(lambda: len(proxied.events) >= 1 and len(direct.events) >= 1, 10, "both readers getting `queued`",
               interval_s=0.02)
    s.generator(model=slow_model)  # every delta from now on is appended while the readers tail live
    for reader in readers:
        reader.join(60)
    assert proxied.done and proxied.ends == ["clean"] and direct.done
    direct_at = {e.id: t for e, t in zip(direct.events, direct.received_at, strict=True)}
    deltas = [(e, t) for e, t in zip(proxied.events, proxied.received_at, strict=True) if e.event == "delta"]
    assert len(deltas) >= 100
    lat = [t * 1000 - int(cast(str, e.id).split("-")[0]) for e, t in deltas]
    behind = [(t - direct_at[e.id]) * 1000 for e, t in deltas]
    q, b = statistics.quantiles(lat, n=100), statistics.quantiles(behind, n=100)
    print(f"\nnginx delivery latency over {len(lat)} deltas: p50 {q[49]:.1f} ms, p99 {q[98]:.1f} ms, "
          f"max {max(lat):.1f} ms; behind the pod's own reader: p50 {b[49]:.1f} ms, p90 {b[89]:.1f} ms")
    assert b[49] < 20 and b[89] < 100, f"behind the direct reader by p50 {b[49]:.1f} ms, p90 {b[89]:.1f} ms: " \
        "something buffers the stream"
    with httpx.Client(base_url=nginx.url, timeout=10) as c:
        full = read_sse(c, f"/v1/streams/{sid}/events", headers={"Accept-Encoding": "gzip"})
    # Headers survive the proxy, and nginx does not compress the stream even when asked to.
    assert full.headers["content-type"].startswith("text/event-stream")
    assert "content-encoding" not in full.headers
    assert [e.id for e in full.events] == proxied.ids


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_a_reader_survives_its_pod_going_away_mid_stream(stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis,
                                                         nginx_factory: NginxFactory, slow_model: Path, sig: signal.Signals) -> None:
    s, pods, nginx = _front(stack_factory, redis_server, nginx_factory)
    s.generator(model=slow_model)
    with httpx.Client(base_url=nginx.url, timeout=10) as c:
        sid = create(c, max_tokens=1200).json()["id"]
    result = ResumingRead()
    reader = threading.Thread(target=read_resuming, args=(nginx.url, sid), kwargs={"into": result})
    reader.start()
    eventually(lambda: sum(e.event == "delta" for e in result.events) >= 20, 20, "20 deltas", interval_s=0.02)
    serving = [(proc, url) for proc, url in pods if _metric(url, "rsb_connected_readers") == 1]
    assert len(serving) == 1, "exactly one pod serves the reader"
    proc, _ = serving[0]
    at_kill = len(result.events)
    t0 = time.monotonic()
    proc.signal(sig)
    if sig == signal.SIGTERM:
        assert proc.wait(10) == 0
        print(f"\ndrained pod exited after {time.monotonic() - t0:.2f}s")
        assert time.monotonic() - t0 < 4  # --shutdown-grace-s 3, and well before it: streams end at once
    reader.join(60)
    assert result.done, result.ends
    assert len(result.ends) >= 2 and at_kill < len(result.events)
    if sig == signal.SIGTERM:  # a clean end at an event boundary, with the reconnect hint
        assert result.ends[0] == "clean" and result.retry == [1000], (result.ends, result.errors)
    # The reader's events are the stream's: in order, none missing, none twice.
    survivor = next(u for p, u in pods if p is not proc)
    with httpx.Client(base_url=survivor, timeout=10) as c:
        whole = read_sse(c, f"/v1/streams/{sid}/events")
    assert result.ids == whole.ids and len(set(result.ids)) == len(result.ids)
    assert [(e.event, e.data) for e in result.events] == [(e.event, e.data) for e in whole.events]
    assert whole.events[-1].event == "done" and whole.events[-1].data["usage"]["completion_tokens"] == 1200
