"""Redis out of memory (``maxmemory`` with ``noeviction``) in the middle of a real generation: every write route
answers 507 ``storage_full`` with a Retry-After (never a 500), the generation pauses (its readers get heartbeats),
and once memory is freed it goes on and ends exactly once, with the same text for a live, a fresh and a resumed
reader. Real redis-server, real ``rsb generator`` (llama.cpp on the slow demo model), real ``rsb consumer``."""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest
import redis
from helpers import SSERead, create, eventually, metric, read_sse, wait_status
from servers import StackFactory

from broker.redis.server import RedisServer
from broker.streams.keys import StreamKeys
from rsb import Client

pytestmark = pytest.mark.slow

MAXMEMORY = 48 * 1024 * 1024
ANSWER_TOKENS = 3000


def _fill(client: redis.Redis) -> list[str]:
    """Fill Redis to its maxmemory with throwaway keys of 1 MiB (one value of the whole size would be refused
    itself: it sits in the query buffer, counted, before it runs), until one is refused; then set maxmemory a
    little below what is used, so that Redis stays full whatever buffers come and go. The keys made."""
    keys: list[str] = []
    while True:
        try:
            client.set(f"filler:{len(keys)}", b"x" * (1 << 20))
        except redis.exceptions.OutOfMemoryError:
            break
        keys.append(f"filler:{len(keys)}")
    client.config_set("maxmemory", str(int(client.info("memory")["used_memory"]) - (2 << 20)))
    return keys


def _meta(sid: str) -> str:
    return StreamKeys.of(uuid.UUID(sid), 1).meta


@pytest.fixture
def full_redis() -> object:
    server = RedisServer().start()
    client = redis.Redis(port=server.port)
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", str(MAXMEMORY))
    yield server, client
    client.close()
    server.cleanup()


def test_out_of_memory_mid_answer_pauses_and_continues(full_redis: tuple[RedisServer, redis.Redis],
                                                       stack_factory: StackFactory, slow_model: Path) -> None:
    server, r = full_redis
    stack = stack_factory(server.url)
    gen = stack.generator(model=slow_model)
    api, _ = stack.consumer("--heartbeat-s", "1")
    c = stack.client()
    sid = str(uuid.uuid4())
    assert create(c, id=sid, max_tokens=ANSWER_TOKENS).status_code == 201
    queued = str(uuid.uuid4())  # waits behind the first (one worker): its cancel meets the full Redis
    assert create(c, id=queued, max_tokens=4).status_code == 201
    text = {"Content-Type": "text/plain"}
    assert c.put("/v1/stream/kept", content=b"before", headers=text).status_code == 201
    assert c.put("/v1/stream/dropped", content=b"before", headers=text).status_code == 201

    live: list[SSERead] = []
    reader = threading.Thread(target=lambda: live.append(read_sse(stack.client(), f"/v1/streams/{sid}/events",
                                                                  timeout_s=120)))
    reader.start()
    eventually(lambda: int(r.hget(_meta(sid), "seq") or 0) >= 100, 60, "the answer under way")
    fillers = _fill(r)
    filled_at = time.monotonic()
    seq_paused = int(r.hget(_meta(sid), "seq") or 0)
    assert seq_paused < ANSWER_TOKENS, "the answer ended before Redis was full"

    # Every write route: the clear error, never a 500.
    refusals = {
        "create": create(c, max_tokens=4),
        "cancel": c.post(f"/v1/streams/{queued}/cancel"),
        "conversation turn": create(c, max_tokens=4, conversation=str(uuid.uuid4()),
                                    messages=[{"role": "user", "content": "hi"}]),
        "durable put": c.put("/v1/stream/oom-test", content=b"hello", headers=text),
        "durable append": c.post("/v1/stream/kept", content=b"more", headers=text),
        "chat completion": c.post("/v1/chat/completions", json={
            "model": "x", "messages": [{"role": "user", "content": "hi"}], "stream": True}),
        "responses": c.post("/v1/responses", json={"model": "x", "input": "hi"}),
        "openai conversation": c.post("/v1/conversations", json={}),
        "ai sdk chat": c.post("/api/chat", json={"id": str(uuid.uuid4()), "trigger": "submit-message", "messages": [
            {"id": "m1", "role": "user", "parts": [{"type": "text", "text": "hi"}]}]}),
    }
    for route, resp in refusals.items():
        assert resp.status_code == 507, (route, resp.status_code, resp.text)
        assert int(resp.headers["Retry-After"]) >= 1, route
        code = resp.json()["error"]["code"]
        assert code == "storage_full", (route, resp.text)
    # Deleting frees memory, so it is never refused: it is how an operator or a client makes room.
    assert c.delete("/v1/stream/dropped").status_code == 204
    # The public client takes 507 storage_full as a retry-later, like a 503: its create waits for memory.
    later: list[str] = []
    waiting_client = threading.Thread(target=lambda: later.append(
        Client(stack.base_url).create(prompt="Hello", max_tokens=4).status))
    waiting_client.start()
    # Reads still work while Redis is full.
    assert c.get(f"/v1/streams/{sid}").json()["status"] == "running"
    time.sleep(1.5)  # paused: at most the append in flight when Redis filled landed
    held = int(r.hget(_meta(sid), "seq") or 0)
    time.sleep(1.0)  # deliberate: a second in which no append may land
    assert int(r.hget(_meta(sid), "seq") or 0) == held, "appends went on while Redis refused writes"
    assert r.hget(_meta(sid), "status") == b"running"
    r.delete(*fillers)
    r.config_set("maxmemory", str(MAXMEMORY))
    freed_at = time.monotonic()

    waiting_client.join(30)
    assert later == ["queued"], "the client's create did not go through once memory was back"
    done = wait_status(c, sid, {"done", "cancelled", "error"}, 120)
    resumed_in = time.monotonic() - freed_at
    assert done["status"] == "done", done
    assert done["usage"]["completion_tokens"] == ANSWER_TOKENS
    reader.join(120)
    (seen,) = live
    terminal = [e for e in seen.events if e.event in ("done", "cancelled", "error")]
    assert [e.event for e in terminal] == ["done"] and seen.events[-1].event == "done"
    assert len(seen.ids) == len(set(seen.ids)), "an event was repeated"
    paused = [t for t, _ in seen.comments if filled_at <= t <= freed_at]
    assert paused, "the reader got no heartbeat while the generation waited for memory"
    fresh = read_sse(c, f"/v1/streams/{sid}/events")
    assert fresh.text == seen.text and fresh.ids == seen.ids
    middle = seen.ids[len(seen.ids) // 2]
    resumed = read_sse(c, f"/v1/streams/{sid}/events", headers={"Last-Event-ID": middle})
    assert seen.ids[len(seen.ids) // 2 + 1:] == resumed.ids
    assert fresh.text.endswith(resumed.text)

    # The queued stream was never cancelled (its cancel was refused): it runs once memory is back.
    assert wait_status(c, queued, {"done", "cancelled", "error"}, 60)["status"] == "done"
    assert c.get("/v1/stream/kept").content == b"before"  # the refused append left nothing behind
    assert create(c, max_tokens=4).status_code == 201

    # One log line when the pause began and one when it ended, however many retries; the refusals counted.
    starts = [line for line in gen.output().splitlines() if '"storage_full":"start"' in line]
    ends = [line for line in gen.output().splitlines() if '"storage_full":"end"' in line]
    assert len(starts) == 1 and len(ends) == 1, gen.output()[-3000:]
    assert metric(httpx.get(f"{stack.base_url}/metrics").text, "rsb_storage_full_total") >= len(refusals)
    assert api.output().count('"storage_full":"start"') == 1, api.output()[-3000:]
    print(f"paused {freed_at - filled_at:.1f} s at token {seq_paused}; the answer ended {resumed_in:.1f} s after the filler "
          f"was freed; {len(paused)} heartbeats meanwhile; end: {ends[0]}")


async def test_which_steps_a_full_redis_refuses(full_redis: tuple[RedisServer, redis.Redis]) -> None:
    """Step by step against a full Redis: every write that adds data is refused whole (nothing half-written),
    while what a paused generation and its readers need still works: the lease renewal, reads, the readers'
    marks (refused quietly), and deletes."""
    from broker.errors import StoreFull
    from broker.events import EventType, encode_data
    from broker.redis.connection import connect
    from broker.request.generation import GenerationRequest
    from broker.streams.job_store import JobStore
    from broker.streams.records import Claim
    from broker.streams.stream_store import StreamStore

    server, r = full_redis
    client = connect(server.url)
    store = StreamStore(client)
    jobs = JobStore(client)
    req = GenerationRequest(None, "hello", None, 32, 0.8, 0.95, None, (), False)
    sid, waiting = uuid.uuid4(), uuid.uuid4()
    for s in (sid, waiting):
        assert (await store.create(s, req, model="m", max_queue=0, retention_s=60)).created
    claim = await jobs.claim(sid, "w1")
    assert isinstance(claim, Claim)
    delta = (EventType.DELTA, encode_data({"text": "x"}))
    assert (await jobs.append(claim, 0, 1, [delta])).ok
    fillers = _fill(r)
    try:
        before = r.hgetall(_meta(str(sid)))
        for step in (jobs.append(claim, 1, 2, [delta]), store.create(uuid.uuid4(), req, model="m",
                                                                      max_queue=0, retention_s=60),
                     store.cancel(waiting, "client"), jobs.claim(waiting, "w1"),
                     jobs.finish(claim, EventType.DONE, {"finish_reason": "stop"}, status="done", usage={})):
            with pytest.raises(StoreFull):
                await step
        assert r.hgetall(_meta(str(sid))) == before, "a refused script wrote part of its work"
        assert (await jobs.renew(claim, 5.0, 30.0)).ok  # the lease is kept while the generation waits
        await store.touch([sid, waiting])  # a reader's mark: refused, quietly
        assert [e.type for e in await store.read(sid, None)] == ["queued", "delta"]
        assert (await store.status(sid)) is not None
        r.delete(fillers.pop())  # deletes are never refused
    finally:
        r.delete(*fillers)
        r.config_set("maxmemory", str(MAXMEMORY))
    assert (await jobs.append(claim, 1, 2, [delta])).ok
    assert await jobs.finish(claim, EventType.DONE, {"finish_reason": "stop"}, status="done", usage={})
    await client.aclose()
