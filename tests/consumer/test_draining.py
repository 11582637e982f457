"""Draining a pod (what Kubernetes does on every rollout): on SIGTERM a consumer stops accepting, tells each SSE
reader to reconnect (`retry:` then a clean close at an event boundary) and exits well within its grace period;
through nginx the readers land on the other pod and end with every event exactly once."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from helpers import ResumingRead, create, eventually, read_resuming, read_sse
from servers import NginxFactory, StackFactory

from broker.redis.server import RedisServer, free_port

pytestmark = pytest.mark.slow


def _readers(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return next(float(line.split()[1]) for line in text.splitlines() if line.startswith("rsb_connected_readers "))


def test_sigterm_moves_every_reader_to_the_other_pod_without_loss(stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis,
                                                                  nginx_factory: NginxFactory, slow_model: Path) -> None:
    s = stack_factory(redis_server.url)
    pods = [s.consumer("--heartbeat-s", "1", "--shutdown-grace-s", "5") for _ in range(2)]
    nginx = nginx_factory([int(url.rsplit(":", 1)[1]) for _, url in pods])
    with httpx.Client(base_url=nginx.url, timeout=10) as c:
        # One stream generating, two still queued (their readers hear heartbeats): both kinds must drain.
        sids = [create(c, max_tokens=400).json()["id"] for _ in range(3)]
    s.generator(model=slow_model)
    results = [ResumingRead() for _ in range(12)]
    threads = [threading.Thread(target=read_resuming, args=(nginx.url, sids[i % 3]), kwargs={"into": r})
               for i, r in enumerate(results)]
    for t in threads:
        t.start()
    eventually(lambda: sum(_readers(u) for _, u in pods) >= 12 and all(r.events for r in results), 20,
               "every reader connected and reading")
    (proc, url), (_, other) = pods
    drained = int(_readers(url))
    assert 0 < drained < 12, "least_conn spreads the readers over both pods"

    t0 = time.monotonic()
    proc.signal(signal.SIGTERM)
    # While it drains, the service keeps answering through nginx (the other pod takes the requests).
    with httpx.Client(base_url=nginx.url, timeout=10) as c:
        assert create(c, max_tokens=4).status_code == 201
    assert proc.wait(10) == 0
    took = time.monotonic() - t0
    print(f"\ndrained {drained} readers; the pod exited after {took:.2f}s")
    assert took < 3, "streams end at once on SIGTERM; nothing waits for the grace period"
    try:
        httpx.get(f"{url}/healthz", timeout=2)
        raise AssertionError("the drained pod still accepts connections")
    except httpx.ConnectError:
        pass

    for t in threads:
        t.join(90)
    with httpx.Client(base_url=other, timeout=30) as c:
        whole = {sid: read_sse(c, f"/v1/streams/{sid}/events") for sid in sids}
    moved = [r for r in results if len(r.ends) > 1]
    assert len(moved) == drained, [r.ends for r in results]
    for i, r in enumerate(results):
        expected = whole[sids[i % 3]]
        assert r.done and r.ids == expected.ids, (i, r.ends)
        assert [(e.event, e.data) for e in r.events] == [(e.event, e.data) for e in expected.events]
    for r in moved:  # told to reconnect, and cut only at an event boundary
        # A reconnect can land on the draining pod once more (nginx reuses a keepalive connection to it
        # before the pod closes it): that pod answers with the same hint at once, and nothing is lost.
        assert all(end == "clean" for end in r.ends[:-1]), (r.ends, r.errors)
        assert r.retry and set(r.retry) == {1000}, (r.retry, r.ends)
    assert all(w.events[-1].event == "done" for w in whole.values())


def test_requests_still_in_flight_when_the_grace_period_ends_answer_503_not_500(
        stack_factory: StackFactory, own_redis: RedisServer) -> None:
    """A pod drains while its requests wait on a Redis that does not answer (stopped): past --shutdown-grace-s
    uvicorn cancels them; each answers 503 with a JSON error code and Retry-After (never uvicorn's bare 500),
    and the pod exits cleanly."""
    s = stack_factory(own_redis.url)
    proc, url = s.consumer("--shutdown-grace-s", "1", "--heartbeat-s", "1")
    with s.client() as c:
        sid = create(c, max_tokens=8).json()["id"]  # queued: no generator
    fresh = str(uuid.uuid4())
    requests: list[tuple[str, str, dict[str, Any] | None]] = [
        ("POST", "/v1/streams", {"id": fresh, "prompt": "Hello", "max_tokens": 4}),
        ("GET", f"/v1/streams/{sid}", None),
        ("POST", f"/v1/streams/{sid}/cancel", None),
        ("GET", f"/v1/streams/{sid}/events", None),
        ("GET", "/readyz", None),
        ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
        ("POST", "/api/chat", {"id": fresh, "trigger": "submit-message",
                               "messages": [{"id": "u", "role": "user", "parts": [{"type": "text", "text": "hi"}]}]}),
        ("PUT", f"/v1/stream/drain-{fresh}", None),
    ]

    async def in_flight() -> list[httpx.Response | BaseException]:
        async with httpx.AsyncClient(base_url=url, timeout=30) as ac:
            sent = [asyncio.ensure_future(ac.request(m, path, json=body)) for m, path, body in requests]
            await asyncio.sleep(0.5)  # every request reached the pod and waits on Redis (nothing shows it)
            assert not any(t.done() for t in sent), [t.result().status_code for t in sent if t.done()]
            proc.signal(signal.SIGTERM)
            return list(await asyncio.gather(*sent, return_exceptions=True))

    assert own_redis.proc is not None
    os.kill(own_redis.proc.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        answers = asyncio.run(in_flight())
        took = time.monotonic() - t0
    finally:
        os.kill(own_redis.proc.pid, signal.SIGCONT)
    assert proc.wait(15) == 0
    print(f"\n{len(answers)} requests answered {took:.2f}s after they were sent (grace 1 s):",
          [(path, r.status_code if isinstance(r, httpx.Response) else r) for (_, path, _), r in zip(requests, answers,
                                                                                                   strict=True)])
    for (method, path, _), r in zip(requests, answers, strict=True):
        assert isinstance(r, httpx.Response), (method, path, r)
        assert r.status_code == 503, (method, path, r.status_code, r.text)
        assert r.headers.get("retry-after") == "1", (method, path, r.headers)
        assert r.json()["error"]["code"] == "draining", (method, path, r.text)
    assert "Exception in ASGI application" not in proc.output()


def test_creates_through_nginx_during_a_rolling_deploy_are_never_refused(
        stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis,
        nginx_factory: NginxFactory) -> None:
    """Both pods replaced one after the other (SIGTERM, a new one on its port) under a steady flow of creates through
    nginx: every create is answered 201. A request nginx had just sent on an idle keep-alive connection of a pod that
    drains is served (the pod keeps such a connection DRAIN_IDLE_S), and one the pod could not answer is sent to the
    other (deploy/nginx.conf: creates are idempotent, non_idempotent retries)."""
    s = stack_factory(redis_server.url)
    s.generator()
    ports = [free_port(), free_port()]
    # One client address makes every create here: no per-caller limit in the way of the flow.
    limits = ("--shutdown-grace-s", "3", "--create-burst", "0", "--max-active", "0", "--max-queue", "0",
              "--max-queue-wait-s", "0")
    pods = [s.consumer(*limits, port=p)[0] for p in ports]
    nginx = nginx_factory(ports)
    statuses: list[int] = []
    stop = threading.Event()
    # 8 x 10 a second (under nginx's own 100 r/s per address); as fast as they go while a pod drains (nginx's burst
    # of 1,000 allows it): the more requests nginx sends on idle keep-alive connections as the pod closes them, the
    # more likely one meets the close (without DRAIN_IDLE_S and the retry: 1 to 3 502s in 5 runs of 6).
    burst = threading.Event()

    bursting = threading.Semaphore(0)  # the creates a burst may still send: within nginx's burst of 1,000

    def flow() -> None:
        with httpx.Client(base_url=nginx.url, timeout=30) as c:
            while not stop.wait(0 if burst.is_set() and bursting.acquire(blocking=False) else 0.1):
                statuses.append(create(c, max_tokens=1).status_code)

    def answered(more: int, what: str) -> None:
        n = len(statuses)
        eventually(lambda: len(statuses) >= n + more, 30, what)

    flows = [threading.Thread(target=flow) for _ in range(8)]
    for t in flows:
        t.start()
    try:
        for i, port in enumerate(ports):  # the rollout: one pod at a time
            answered(30, "creates flowing")
            while bursting.acquire(blocking=False):  # what the last burst left
                pass
            bursting.release(600)
            burst.set()
            answered(30, "the burst under way")  # and its next creates in flight
            pods[i].signal(signal.SIGTERM)
            assert pods[i].wait(10) == 0
            burst.clear()
            pods[i] = s.consumer(*limits, port=port)[0]
        answered(30, "creates flowing")
    finally:
        stop.set()
        for t in flows:
            t.join(30)
    refused = {code: statuses.count(code) for code in set(statuses) if code != 201}
    print(f"\nrolling deploy through nginx: {len(statuses)} creates, refused: {refused or 'none'}")
    assert not refused, refused
