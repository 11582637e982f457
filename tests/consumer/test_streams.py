"""The core stream scenarios end to end: real redis-server, real `rsb generator` running llama.cpp on the
demo model, real `rsb consumer` under uvicorn, read over HTTP with a strict SSE parser."""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import threading
import time
import uuid
from typing import Any

import httpx
import orjson
import pytest
import redis
from helpers import SSERead, create, eventually, read_sse, wait_readers, wait_status
from servers import SharedStack, Stack, StackFactory

from broker.redis.server import RedisServer

pytestmark = pytest.mark.slow


def _finished(stack: Stack, max_tokens: int = 48, **body: Any) -> tuple[str, SSERead]:
    with stack.client() as c:
        r = create(c, max_tokens=max_tokens, **body)
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        full = read_sse(c, f"/v1/streams/{sid}/events")
    assert full.status == 200
    return sid, full


def test_read_from_scratch_then_resume_from_every_event_gives_the_same_events(shared_stack: SharedStack) -> None:
    sid, full = _finished(shared_stack, max_tokens=40, messages=[{"role": "user", "content": "Tell me a story"}])
    types = [e.event for e in full.events]
    assert types[0] == "queued" and types[1] == "started" and types[-1] == "done"
    assert types.count("done") == 1 and set(types[2:-1]) == {"delta"}
    assert full.headers["content-type"].startswith("text/event-stream")
    assert full.headers["cache-control"] == "no-cache" and full.headers["x-accel-buffering"] == "no"
    ids = full.ids
    assert len(set(ids)) == len(ids) and ids == sorted(ids, key=lambda i: tuple(map(int, i.split("-"))))
    done = full.events[-1].data
    assert done["finish_reason"] == "length" and done["usage"]["completion_tokens"] == 40
    assert {"prompt_tokens", "completion_tokens", "ttft_ms", "tpot_ms"} <= set(done["usage"])

    with shared_stack.client() as c:
        for i, eid in enumerate(ids[:-1]):
            by_header = read_sse(c, f"/v1/streams/{sid}/events", headers={"Last-Event-ID": eid})
            by_query = read_sse(c, f"/v1/streams/{sid}/events", params={"last_event_id": eid})
            expected = [(e.id, e.event, e.data) for e in full.events[i + 1:]]
            assert [(e.id, e.event, e.data) for e in by_header.events] == expected
            assert [(e.id, e.event, e.data) for e in by_query.events] == expected
            # Whatever the resume point, what was read before plus what came after is the whole answer.
            before = "".join(e.data["text"] for e in full.events[: i + 1] if e.event == "delta")
            assert before + by_header.text == full.text
        # The header wins over the query parameter. ids[2] is the first delta: on a busy machine the worker may
        # coalesce the whole answer into that one delta, so ids[3] can be the terminal event (204).
        both = read_sse(c, f"/v1/streams/{sid}/events", headers={"Last-Event-ID": ids[2]},
                        params={"last_event_id": ids[1]})
        assert both.status == 200, (both.status, both.headers)
        assert both.events[0].id == ids[3]
        # Resuming at the terminal event: 204, so EventSource stops reconnecting.
        r = c.get(f"/v1/streams/{sid}/events", headers={"Last-Event-ID": ids[-1]})
        assert r.status_code == 204


def _jobs_enqueued(r: redis.Redis) -> int:
    """How many jobs were ever added to the (one partition's) job backlogs, every model's."""
    return sum(int(r.xinfo_stream(k)["entries-added"]) for k in r.keys("rsb:{p0}:q:*:jobs"))


def test_32_concurrent_identical_creates_make_one_stream_and_one_generation(shared_stack: SharedStack) -> None:
    body = {"id": str(uuid.uuid4()), "prompt": "Once upon a time", "max_tokens": 24}
    enqueued = _jobs_enqueued(shared_stack.redis)

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=shared_stack.base_url, timeout=30) as ac:
            return list(await asyncio.gather(*(ac.post("/v1/streams", json=body) for _ in range(32))))

    responses = asyncio.run(burst())
    codes = sorted(r.status_code for r in responses)
    assert codes == [200] * 31 + [201]
    assert sum(r.json()["created"] for r in responses) == 1
    assert {r.json()["id"] for r in responses} == {body["id"]}
    with shared_stack.client() as c:
        events = read_sse(c, f"/v1/streams/{body['id']}/events").events
        assert [e.event for e in events].count("started") == 1
        assert _jobs_enqueued(shared_stack.redis) == enqueued + 1  # one job enqueued for 32 creates
        assert shared_stack.redis.hget(f"rsb:{{p0}}:s:{body['id']}:meta", "attempts") == b"1"
        again = c.post("/v1/streams", json=body)
        assert again.status_code == 200 and again.json()["status"] == "done" and not again.json()["created"]
        other = c.post("/v1/streams", json={**body, "prompt": "Something else"})
        assert other.status_code == 409 and other.json()["error"]["code"] == "conflict"


def test_generation_goes_on_when_every_reader_left(shared_stack: SharedStack) -> None:
    with shared_stack.client() as c:
        sid = create(c, max_tokens=600).json()["id"]
        first = read_sse(c, f"/v1/streams/{sid}/events", stop_after=3)  # then the reader leaves
        assert len(first.events) == 3
        status = wait_status(c, sid, {"done"})
        assert status["usage"]["completion_tokens"] == 600
        later = read_sse(c, f"/v1/streams/{sid}/events")
        assert [e.id for e in later.events[:3]] == first.ids
        assert later.events[-1].event == "done"
        assert later.events[-1].data["usage"]["completion_tokens"] == 600


def test_two_readers_receive_identical_events(shared_stack: SharedStack) -> None:
    with shared_stack.client() as c:
        sid = create(c, max_tokens=800).json()["id"]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        a, b = pool.map(lambda _: read_sse(httpx.Client(base_url=shared_stack.base_url), f"/v1/streams/{sid}/events"),
                        range(2))
    assert [(e.id, e.event, e.data) for e in a.events] == [(e.id, e.event, e.data) for e in b.events]
    assert a.events[-1].event == "done"


def test_cancel_mid_generation_stops_inference_and_frees_the_worker(shared_stack: SharedStack) -> None:
    max_tokens = 3800
    redis_client = shared_stack.redis
    with shared_stack.client() as c:
        sid = create(c, max_tokens=max_tokens).json()["id"]
        head = read_sse(c, f"/v1/streams/{sid}/events", stop_after=4)
        assert [e.event for e in head.events][:3] == ["queued", "started", "delta"]
        r = c.post(f"/v1/streams/{sid}/cancel")
        assert r.status_code == 202 and r.json()["id"] == sid
        rest = read_sse(c, f"/v1/streams/{sid}/events", headers={"Last-Event-ID": head.ids[-1]})
        last = rest.events[-1]
        assert last.event == "cancelled" and last.data["reason"] == "client"
        assert 0 < last.data["usage"]["completion_tokens"] < max_tokens
        n = redis_client.xlen(f"rsb:{{p0}}:s:{sid}:events")
        # The worker takes the next job at once, and nothing more is appended to the cancelled stream.
        t0 = time.monotonic()
        sid2 = create(c, max_tokens=8).json()["id"]
        nxt = read_sse(c, f"/v1/streams/{sid2}/events")
        assert nxt.events[-1].event == "done" and time.monotonic() - t0 < 5
        assert redis_client.xlen(f"rsb:{{p0}}:s:{sid}:events") == n
        st = c.get(f"/v1/streams/{sid}").json()
        assert st["status"] == "cancelled" and st["usage"]["completion_tokens"] == last.data["usage"]["completion_tokens"]
        # Cancelling again, or cancelling a finished stream, changes nothing.
        again = c.post(f"/v1/streams/{sid}/cancel")
        assert again.status_code == 202 and again.json()["status"] == "cancelled"
        done = c.post(f"/v1/streams/{sid2}/cancel")
        assert done.status_code == 202 and done.json()["status"] == "done"
        assert redis_client.xlen(f"rsb:{{p0}}:s:{sid}:events") == n


def test_cancel_while_queued_ends_the_stream_without_generating(stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis) -> None:
    s = stack_factory(redis_server.url)
    s.consumer()
    with s.client() as c:
        sid = create(c).json()["id"]
        assert c.post(f"/v1/streams/{sid}/cancel").json()["status"] == "cancelled"
        events = read_sse(c, f"/v1/streams/{sid}/events").events
        assert [e.event for e in events] == ["queued", "cancelled"]
        s.generator()
        sid2 = create(c, max_tokens=4).json()["id"]
        wait_status(c, sid2, {"done"})
        assert [e.event for e in read_sse(c, f"/v1/streams/{sid}/events").events] == ["queued", "cancelled"]


def test_heartbeat_comments_fill_every_silence(stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis) -> None:
    s = stack_factory(redis_server.url)
    s.consumer("--heartbeat-s", "0.5")  # no generator: the stream stays queued and silent
    with s.client() as c:
        sid = create(c).json()["id"]
        t0 = time.monotonic()
        with c.stream("GET", f"/v1/streams/{sid}/events") as r:
            stamps = []
            for chunk in r.iter_raw():
                stamps.append((time.monotonic(), chunk))
                if time.monotonic() - t0 > 3:
                    break
    comments = [t for t, ch in stamps if ch.startswith(b":")]
    assert len(comments) >= 4
    times = [t0] + [t for t, _ in stamps]
    assert max(b - a for a, b in itertools.pairwise(times)) < 0.9


def test_500_live_readers_hold_a_small_bounded_number_of_redis_connections(stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis) -> None:
    s = stack_factory(redis_server.url)
    s.consumer("--heartbeat-s", "5")
    with s.client() as c:
        sids = [create(c, max_tokens=12).json()["id"] for _ in range(100)]
    baseline = {cl["id"] for cl in redis_client.client_list()}

    async def readers() -> list[str]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(base_url=s.base_url, limits=limits, timeout=120) as ac:
            async def one(sid: str) -> str:
                buf = b""
                async with ac.stream("GET", f"/v1/streams/{sid}/events") as r:
                    async for chunk in r.aiter_raw():
                        buf += chunk
                return "".join(orjson.loads(block.split(b"data: ", 1)[1])["text"]
                               for block in buf.split(b"\n\n") if b"event: delta" in block)

            tasks = [asyncio.create_task(one(sids[i % 100])) for i in range(500)]
            await wait_readers(ac, 500, 60)
            conns = [cl for cl in redis_client.client_list() if cl["id"] not in baseline]
            # The whole consumer: the command pool (7 at most) plus one pub/sub connection.
            assert len(conns) <= 8, [cl["cmd"] for cl in conns]
            s.generator()  # now the streams go live; every reader must still get its whole answer
            return list(await asyncio.gather(*tasks))

    texts = asyncio.run(readers())
    with s.client() as c:
        answers = {sid: read_sse(c, f"/v1/streams/{sid}/events").text for sid in sids}
    assert all(answers.values())
    assert texts == [answers[sids[i % 100]] for i in range(500)]
    m = httpx.get(f"{s.base_url}/metrics").text
    assert "rsb_connected_readers 0" in m
    # Every reader got queued, started, 12 deltas at most (coalesced) and done: events sent are counted.
    sent = float(next(line.split()[1] for line in m.splitlines() if line.startswith("rsb_events_sent_total ")))
    assert sent >= 500 * 3


def test_redis_unreachable_answers_503_with_retry_after(stack_factory: StackFactory) -> None:
    from broker.redis.server import free_port

    s = stack_factory(f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
    s.consumer()
    with s.client() as c:
        r = create(c)
        assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable"
        assert int(r.headers["retry-after"]) > 0
        assert c.get("/readyz").status_code == 503
        assert c.get("/healthz").status_code == 200


def test_unicode_and_invalid_bytes_survive_every_resume_point(shared_stack: SharedStack) -> None:
    sid, full = _finished(shared_stack, max_tokens=300, prompt="你好，世界 🌍 — naïve café")
    text = full.text
    assert any(ord(ch) > 127 for ch in text), "the demo model's answer should contain non-ASCII text"
    with shared_stack.client() as c:
        for i, eid in enumerate(full.ids[:-1]):
            rest = read_sse(c, f"/v1/streams/{sid}/events", headers={"Last-Event-ID": eid})
            before = "".join(e.data["text"] for e in full.events[: i + 1] if e.event == "delta")
            assert before + rest.text == text


def test_crafted_unicode_deltas_roundtrip_exactly(redis_server: RedisServer, redis_client: redis.Redis, stack_factory: StackFactory) -> None:
    """Texts a model can produce that break naive SSE framing: CR, LF, U+2028, NUL, U+FFFD, emoji, CJK."""
    import asyncio as aio

    from broker.events import EventType, encode_data
    from broker.redis.connection import connect
    from broker.request.generation import GenerationRequest
    from broker.streams.job_store import JobStore
    from broker.streams.records import Claim
    from broker.streams.stream_store import StreamStore

    pieces = ["你好", "世界", "🌍🚀", "\r\n", "line\nbreak", "\u2028sep\u2029", "nul\x00", "\ufffd",
              'quote"\\', "é", " "]
    sid = uuid.uuid4()

    async def write() -> None:
        r = connect(redis_server.url)
        streams, jobs = StreamStore(r), JobStore(r)
        req = GenerationRequest(None, "x", None, 16, 0.8, 0.95, None, (), False)
        await streams.create(sid, req, model="m", max_queue=0, retention_s=60)
        claim = await jobs.claim(sid, "w")
        assert isinstance(claim, Claim)
        for n, p in enumerate(pieces):
            res = await jobs.append(claim, n, n + 1, [(EventType.DELTA, encode_data({"text": p}))])
            assert res.ok
        await jobs.finish(claim, EventType.DONE, {"finish_reason": "stop", "usage": {}}, status="done", usage={})
        await r.aclose()

    aio.run(write())
    s = stack_factory(redis_server.url)
    s.consumer()
    with s.client() as c:
        full = read_sse(c, f"/v1/streams/{sid}/events")
        assert full.text == "".join(pieces)
        for i, eid in enumerate(full.ids[:-1]):
            rest = read_sse(c, f"/v1/streams/{sid}/events", params={"last_event_id": eid})
            before = "".join(e.data["text"] for e in full.events[: i + 1] if e.event == "delta")
            assert before + rest.text == "".join(pieces)



def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return next(float(line.split()[1]) for line in text.splitlines() if line.startswith(name + " "))


def test_a_reader_that_leaves_frees_what_it_held(stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis) -> None:
    s = stack_factory(redis_server.url)
    s.consumer()
    with s.client() as c:
        sids = [create(c).json()["id"] for _ in range(20)]  # no generator: they stay live and silent
    clients = [httpx.Client(base_url=s.base_url, timeout=10) for _ in sids]
    streams = [cl.stream("GET", f"/v1/streams/{sid}/events") for cl, sid in zip(clients, sids, strict=True)]
    iterators = [st.__enter__().iter_raw() for st in streams]  # kept alive: a dropped iterator closes
    for it in iterators:
        assert b"event: queued" in next(it)  # the reader is tailing
    assert _metric(s.base_url, "rsb_connected_readers") == 20
    assert _metric(s.base_url, "rsb_live_channels") == 20
    for st, cl in zip(streams, clients, strict=True):
        st.__exit__(None, None, None)
        cl.close()
    eventually(lambda: not _metric(s.base_url, "rsb_connected_readers") and not _metric(s.base_url, "rsb_live_channels"),
               5, "readers and subscriptions freed after disconnect")
    channels = redis_client.execute_command("PUBSUB", "NUMSUB", *[f"rsb:{{p0}}:s:{sid}:live" for sid in sids])
    assert all(n == 0 for n in channels[1::2])


def test_consumer_shuts_down_promptly_with_readers_connected(stack_factory: StackFactory, redis_server: RedisServer, redis_client: redis.Redis) -> None:
    import signal as sig

    s = stack_factory(redis_server.url)
    proc, url = s.consumer()
    with s.client() as c:
        sid = create(c).json()["id"]
    results: list[SSERead] = []
    # Tailing, not only connected: the readers' gauge counts a reader from its request on, before its replay has
    # sent "queued" (under load, a SIGTERM then met a reader still in replay).
    tailing = threading.Semaphore(0)

    def reader() -> None:
        with httpx.Client(base_url=url) as cl:
            results.append(read_sse(cl, f"/v1/streams/{sid}/events", timeout_s=30,
                                    on_event=lambda _: tailing.release()))

    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        futures = [pool.submit(reader) for _ in range(5)]
        for _ in futures:
            assert tailing.acquire(timeout=30), "5 readers tailing"
        assert _metric(url, "rsb_connected_readers") == 5
        t0 = time.monotonic()
        proc.signal(sig.SIGTERM)
        assert proc.wait(10) == 0
        elapsed = time.monotonic() - t0
        for f in futures:
            f.result()
    assert elapsed < 3, f"shutdown took {elapsed:.1f}s with readers connected"
    for r in results:  # each reader got a clean end at an event boundary and a reconnect hint
        assert [e.event for e in r.events] == ["queued"] and r.retry == [1000]
